//! WAN emulation for honest network numbers on one machine: regions as Linux network
//! namespaces, links between them with a rate limit, delay and loss, and measurements
//! across them.
//!
//! * [`Scenario`]: the regions and links, from a TOML file ([`Scenario::load`]).
//! * [`Network::up`] builds a scenario and returns the guard that tears it all down
//!   when dropped. [`Network::address`] gives each region's address,
//!   [`Network::spawn_in`]/[`Network::run_in`] run code inside a region (sockets
//!   created there belong to it), and [`Network::command`] runs a program there.
//! * [`measure`]: multi-stream TCP transfers under a chosen congestion control, TCP
//!   round trips and datagram delivery.
//!
//! # How a link is built
//!
//! Each link is a veth pair between the two regions' namespaces; a rate limit is a
//! tbf queue on each end, so it is the link's bottleneck queue. Delay and loss come
//! from a userspace emulator (this kernel has no netem): routes send the link's
//! traffic into a TUN device, a thread per direction (`emulator`) loses packets by a
//! seeded model (`loss`) and holds the rest in a byte-bounded delay line (`delay`),
//! then sends each one out of the veth, through the tbf, to the peer. TCP super-packets
//! pass whole (segmentation offload, `gso`) and are cut only where the loss model
//! drops some of their segments. The packet logic ([`impair`], `gso`, `packet`) is
//! sans-IO and unit-tested; the driver only moves bytes.
//!
//! **Invariants:** every namespace carries the creating process id in its name, so a
//! run killed before its teardown is cleaned by the next [`Network::up`]; nothing a
//! process writes into a TUN device can stop or crash an emulator; every length and
//! count read from a scenario or given to a measurement is bounded by a `MAX_*`
//! constant.

mod delay;
mod emulator;
mod gso;
pub mod impair;
mod loss;
pub mod measure;
mod netns;
mod network;
mod packet;
mod plan;
mod scenario;
mod sys;

pub use netns::{NETNS_PREFIX, NetnsThread, remove_leftovers};
pub use network::{DirectionCounters, Network, unavailable_reason};
pub use scenario::{Link, Region, Scenario, ScenarioError, Sweep};

/// Failures to bring up, use or tear down an emulated network. Underlying errors are
/// sources, printed by the error chain (`{:#}`), not repeated in the messages.
#[derive(Debug, thiserror::Error)]
pub enum WanError {
    #[error(transparent)]
    Scenario(#[from] ScenarioError),
    #[error("network emulation needs root (effective uid 0)")]
    NotRoot,
    #[error("`{command}` could not start")]
    Spawn {
        command: String,
        source: std::io::Error,
    },
    #[error("`{command}` failed ({status}): {stderr}")]
    Command {
        command: String,
        status: std::process::ExitStatus,
        stderr: String,
    },
    #[error("network namespace {netns}")]
    Netns {
        netns: String,
        source: std::io::Error,
    },
    #[error("emulator of {label}")]
    Emulator {
        label: String,
        source: std::io::Error,
    },
    #[error("no region {0:?} in this network")]
    UnknownRegion(String),
    #[error("{what}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error("invalid measurement: {0}")]
    InvalidMeasurement(String),
    #[error("thread {0} panicked")]
    Panicked(String),
}
