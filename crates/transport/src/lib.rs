//! The tokio driver of the segment protocol (docs/wire-protocol.md): sockets, clocks,
//! tasks and the store around the sans-IO state machines of `aurora-proto`.
//!
//! - [`spawn_hub`], [`spawn_relay`], [`spawn_actor`] and [`spawn_collector`] start a
//!   node and return a [`NodeHandle`] (publish, commit, status, kill); a relay holds no
//!   weights, and with a snapshot directory keeps the snapshot it starts from in a file
//!   ([`FileSnapshots`]) to serve its region's joins. [`spawn_joining_actor`] starts an actor with none, which takes a snapshot
//!   over the wire from a hub with a store.
//! - [`Engine`] is the boundary to a rollout engine; [`IdleEngine`] is the built-in one.
//! - Each node can run on a runtime of the caller's choosing (one per emulated region:
//!   the benchmark fleet of `aurora wan` lives in the CLI and uses only this API).
//! - Every socket uses [`DEFAULT_CONGESTION`] (BBR) unless told otherwise, and the
//!   system default where the kernel refuses it.
//!
//! The driver stays thin: every protocol decision is made in `aurora-proto`; this crate
//! only moves frames, runs heavy work on blocking threads and keeps time.

mod conn;
mod decode;
mod engine;
mod kept;
mod node;
mod security;

#[cfg(target_os = "linux")]
pub use conn::congestion_of;
pub use conn::{ConnError, DEFAULT_CONGESTION, SocketOptions, read_frame, write_frame};
pub use decode::DecodePool;
pub use engine::{Engine, IdleEngine};
pub use kept::FileSnapshots;
pub use node::{
    BEHIND_TIMEOUT, COMPLETED_SHOWN, MAX_REPORTS, NodeConfig, NodeHandle, NodeStatus, RETURN_AFTER,
    TransportError, spawn_actor, spawn_collector, spawn_hub, spawn_joining_actor, spawn_relay,
};
pub use security::{Limits, NoSegmentRole, Refusal, Refusals, Security};
