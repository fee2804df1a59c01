//! The segment protocol of aurora, version 4: frames, messages and I/O-free state
//! machines. Specified in `docs/wire-protocol.md`; section numbers in comments refer to
//! it.
//!
//! Nothing here opens a socket, reads a clock or spawns a task (quinn-proto style):
//! every state machine takes connections, frames and `now` as inputs and returns frames
//! to write, events and its next deadline. `aurora-transport` drives them over TCP;
//! `tests/sim.rs` drives them under virtual time with injected faults.
//!
//! - [`frame`]: the byte layout of every frame, with limits ([`frame::MAX_FRAME_BYTES`]
//!   and the other `MAX_*` constants).
//! - [`Sender`]: an upstream (hub or relay) serving artifacts to sessions of S streams,
//!   striping segments, resuming from what a receiver reports, resending nacked ones.
//! - [`Receiver`]: a downstream session verifying every segment, nacking bad ones and
//!   delivering complete, verified artifacts in version order.
//! - [`ActorCore`]: staging and activation rules; [`Weights`] does the heavy work.
//! - `snapshot`: a whole checkpoint as an artifact, for a peer that joins with no
//!   weights.
//! - [`Node`]: hub, relay or actor: the parts wired together (a relay forwards each
//!   verified segment as it arrives, and may keep a snapshot for its region's joins in
//!   a [`SnapshotSpace`]).
//! - [`StreamTuner`]: chooses how many streams a session uses from measured goodput.
//! - [`Backoff`]: the wait before a retry, exponential with jitter, for every retry loop.
//!
//! Only [`frame`], the wire format, is a public module; the state machines' modules are
//! private and what other crates use is re-exported here.

mod actor;
mod backoff;
mod effect;
pub mod frame;
mod keep;
mod node;
mod ranges;
mod receiver;
mod sender;
mod snapshot;
#[cfg(test)]
mod testutil;
mod tuner;
mod upstreams;
mod weights;

pub use actor::{ActorAction, ActorCore, ActorStatus, MAX_REFUSALS};
pub use backoff::Backoff;
pub use effect::{EffectError, PatchState};
pub use frame::{ArtifactKind, Commit, Frame, FrameError, Role, Side, VersionRef};
pub use keep::{
    HeapSnapshots, KEPT_TAIL_SNAPSHOTS, KeptSegments, SnapshotSpace, snapshot_capacity,
};
pub use node::{Node, Notice, Output, RelayOptions};
pub use receiver::{
    Artifact, BEHIND_PROGRESS_BYTES, BEHIND_TIMEOUT, JoinFloor, Receiver, ReceiverConfig,
    ReceiverEvent, ReceiverStats, SessionEnd, Violation,
};
pub use sender::{
    ArtifactKey, Auth, AuthRefusal, KeptSnapshot, Sender, SenderConfig, SenderError, SenderEvent,
    SenderStats, StoredArtifact, offer_signature,
};
pub use tuner::StreamTuner;
pub use upstreams::Upstreams;
pub use weights::{Staged, Weights};

/// A connection, named by the driver; unique among a node's connections for its
/// lifetime.
pub type ConnId = u64;

/// A frame for the driver to write on `conn`, from a sender, a receiver or a node; after
/// writing it, the driver closes the connection if `close_after` is set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transmit {
    pub conn: ConnId,
    pub frame: Frame,
    pub close_after: bool,
}

/// Who a peer is, as told in its handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub role: Role,
    pub peer_id: String,
    pub region: String,
}
