//! Why a receiver's session with its upstream ends, typed so that a driver can tell a
//! hostile or broken upstream (a protocol violation, corrupted data) from a lost link
//! or an upstream that simply cannot serve, and count each.

use std::time::Duration;

use aurora_delta::{DeltaError, Hash, RunId, SignatureError};

use crate::frame::{ArtifactKind, PROTOCOL_VERSION, RejectCode, Role};
use crate::snapshot::NotASnapshot;

/// Why a session ended: reported with [`super::ReceiverEvent::UpstreamLost`] and, where
/// the upstream can still hear it, in the Goodbye.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SessionEnd {
    /// The driver gave the upstream up (it served something the actor refused).
    #[error("{0}")]
    Abandoned(String),
    #[error("cannot connect: {0}")]
    CannotConnect(String),
    #[error("every stream is closed")]
    StreamsClosed,
    #[error("nothing heard for {0:?}")]
    Silent(Duration),
    /// Version `version` is committed (the driver heard so elsewhere, from the control
    /// plane), this receiver lacks it or its Commit, and this relay brought too little
    /// for `waited` (fewer new segment bytes than `behind_progress_bytes`, and nothing
    /// else new): stuck behind, withholding it, or trickling it.
    #[error(
        "version {version} is committed and this relay brought too little of it for \
         {waited:?}"
    )]
    Behind { version: u64, waited: Duration },
    #[error("refused ({code:?}): {reason}")]
    Refused { code: RejectCode, reason: String },
    #[error("said goodbye: {0}")]
    Goodbye(String),
    #[error("version {version} is unavailable there: {reason}")]
    Unavailable { version: u64, reason: String },
    #[error("upstream speaks protocol version {0}, this peer {PROTOCOL_VERSION}")]
    Version(u16),
    #[error("an actor cannot be an upstream")]
    ActorUpstream,
    #[error("{role} {peer_id} offers no snapshot to join from")]
    NoSnapshot { role: Role, peer_id: String },
    #[error("{role} {peer_id} offers the snapshot of version {offered}, not one from {wanted} on")]
    OldSnapshot {
        role: Role,
        peer_id: String,
        offered: u64,
        wanted: u64,
    },
    #[error(
        "{role} {peer_id} serves run {offered}, and this node serves run {pinned}: another \
         run's versions, even signed by the same key, are not this run's"
    )]
    OtherRun {
        role: Role,
        peer_id: String,
        offered: RunId,
        pinned: RunId,
    },
    #[error(
        "{role} {peer_id} does not know its run yet, and this node takes only signed \
         versions of a known run"
    )]
    RunUnknown { role: Role, peer_id: String },
    #[error(
        "{role} {peer_id} is not the trainer, and this node learns its run only from the \
         trainer's own hub (or its settings: --run-id, run_id=...): a relay's word for it \
         could name another run signed with the same key"
    )]
    RunNotLearned { role: Role, peer_id: String },
    #[error(
        "{role} {peer_id} has committed {}, but the control plane has committed version \
         {told}: it is behind (or replaying an old snapshot), and a joiner takes nothing \
         older",
        match committed { Some(v) => format!("version {v}"), None => "nothing".into() }
    )]
    StaleUpstream {
        role: Role,
        peer_id: String,
        committed: Option<u64>,
        told: u64,
    },
    #[error(
        "{role} {peer_id} names version {offered} to start from, too close to the last version number"
    )]
    StartTooLate {
        role: Role,
        peer_id: String,
        offered: u64,
    },
    /// The upstream broke the protocol: never a lost link, always its fault.
    #[error("protocol violation: {0}")]
    Violation(#[from] Violation),
    #[error("offer of version {version}: {source}")]
    BadDescriptor {
        version: u64,
        #[source]
        source: DescriptorFault,
    },
    #[error("version {version} is now offered as {kind}: dropped what was held of it")]
    KindChanged { version: u64, kind: ArtifactKind },
    #[error("segment {index} of version {version} arrived corrupted {failures} times")]
    Corrupted {
        version: u64,
        index: u32,
        failures: u32,
    },
    #[error("the table of version {version} does not hash to its artifact id {id}")]
    WrongTable { version: u64, id: Hash },
    #[error("holding more than {limit} bytes of incomplete artifacts (the limit `max_held_bytes`)")]
    OverBudget { limit: u64 },
}

/// What an upstream sent that the protocol does not allow.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Violation {
    #[error("{0} before Welcome")]
    BeforeWelcome(&'static str),
    #[error("an upstream sent {0}")]
    Unexpected(&'static str),
    #[error("version {version} is beyond the window (next {next}, {ahead} ahead)")]
    BeyondWindow { version: u64, next: u64, ahead: u64 },
    #[error("version {version} offered as {offered}, wanted as {wanted}")]
    WrongKind {
        version: u64,
        offered: ArtifactKind,
        wanted: ArtifactKind,
    },
    #[error("version {0} offered as a composed delta, which this receiver did not accept")]
    ComposedNotAccepted(u64),
    #[error(
        "composed delta to {version} offered, but the weights of version {base} are not known here"
    )]
    ComposedBaseUnknown { version: u64, base: u64 },
    #[error("composed delta to version {version} does not go past the next version {next}")]
    ComposedTooShort { version: u64, next: u64 },
    #[error(
        "composed delta to version {version} starts from version {base} with weights {base_hash}, but this receiver is at version {held} with {held_hash}"
    )]
    ComposedWrongBase {
        version: u64,
        base: u64,
        base_hash: Hash,
        held: u64,
        held_hash: Hash,
    },
    #[error("two different offers for version {0}")]
    ConflictingOffers(u64),
    #[error("segment {index} of version {version} is beyond its table of {len}")]
    BeyondTable {
        version: u64,
        index: u32,
        len: usize,
    },
    /// The upstream's Welcome names another peer than its certificate.
    #[error("the upstream says it is {claimed}, but its certificate is {certified}'s")]
    NotItsCertificate { claimed: String, certified: String },
    /// An Offer, a Seal or a Commit without the pinned trainer key's valid signature:
    /// altered, stripped, or made by someone else (docs/security.md).
    #[error("{0}")]
    Signature(#[from] SignatureError),
}

/// What is wrong with an Offer's descriptor.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DescriptorFault {
    #[error("{0}")]
    Header(String),
    #[error("it carries the header of version {header_version} ({stray} stray bytes)")]
    Mismatch { header_version: u64, stray: usize },
    #[error("it names a target hash, which an Offer leaves pending (all zero) for the Seal")]
    TargetHashOffered,
    #[error(transparent)]
    NotASnapshot(#[from] NotASnapshot),
}

impl From<DeltaError> for DescriptorFault {
    /// `DeltaError` holds I/O sources and cannot be cloned; its message says it all.
    fn from(error: DeltaError) -> Self {
        DescriptorFault::Header(error.to_string())
    }
}
