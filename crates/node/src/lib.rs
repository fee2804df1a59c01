//! The trainer, relay and actor nodes of aurora as a library.
//!
//! `aurora run` starts them in its processes, and the Python package runs the same code
//! inside a user's trainer and inference processes: one implementation, thin faces.
//!
//! - [`TrainerNode`]: the control plane (HTTP API), the transport hub and the checkpoint
//!   store; publishes versions (extracted against the previous one and streamed
//!   cut-through), commits them, opens steps and hands back their accepted rollouts;
//!   brings a restarted trainer back to its latest version ([`TrainerNode::recover`]).
//! - [`RelayNode`]: a region's relay, forwarding each verified segment to the region's
//!   actors as it arrives and serving their joins from a snapshot it keeps; its graceful
//!   stop sends them to their next upstream at once.
//! - [`ActorNode`]: a transport actor that joins over the wire (or from local weights),
//!   stages deltas behind generation and activates committed versions at the engine's
//!   safe points, plus the actor's side of the control API (register, heartbeats, version
//!   reports, claims, submissions).
//! - [`Handoff`]: the engine boundary for an engine driven from outside the runtime (a
//!   Python inference loop): it parks activations until the engine's driver reaches a
//!   safe point and takes them.
//!
//! Async methods run on the caller's tokio runtime; [`TrainerNode::publish`],
//! [`TrainerNode::publish_image`] and [`Handoff::at_safe_point`] block their thread and
//! must not be called from an async task.

mod actor;
mod client;
mod error;
mod handoff;
mod recover;
mod relay;
mod trainer;
mod trust;

pub use actor::{ActorNode, ActorSettings};
pub use aurora_hub::{Limits as ControlLimits, StepResults};
pub use aurora_transport::{BEHIND_TIMEOUT, Limits as TransportLimits, RETURN_AFTER};
pub use client::{ControlClient, ControlSecurity};
pub use error::NodeError;
pub use handoff::{Activation, ActivationGuard, Handoff};
pub use recover::{RecoverError, Recovered, Retraining, RetrainingError};
pub use relay::{RelayNode, RelaySettings, Stopped};
pub use trainer::{Published, TrainerNode, TrainerSettings};
pub use trust::NodeTrust;

use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

/// A retry loop's backoff (`aurora_proto::Backoff`), its jitter seeded from the
/// operating system's randomness, so that nodes that failed together retry apart.
pub(crate) fn backoff(base: Duration, max: Duration) -> aurora_proto::Backoff {
    let seed = std::hash::RandomState::new().build_hasher().finish();
    aurora_proto::Backoff::new(base, max, seed)
}
