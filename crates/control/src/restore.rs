//! Restoring the core from a snapshot, with every invariant checked.
//!
//! A snapshot comes from disk, so it is untrusted input like any message: a truncated
//! write, a hand edit or a hostile file must yield a [`RestoreError`] naming the
//! problem, never a panic later (for example in a clamp with inverted bounds) and
//! never a core that silently breaks its own rules (a prompt leased twice, a lease
//! held by nobody). [`crate::ControlPlane::restore`] is the only way from a [`Snapshot`] to a
//! [`crate::ControlPlane`]; the same checks are available on a live core as
//! [`crate::ControlPlane::check_invariants`], which the tests and the simulator run after
//! every call.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::config::{Config, ConfigError};
use crate::events::EventQueue;
use crate::ledger::Ledger;
use crate::membership::{Membership, MembershipError};
use crate::values::{ActorId, Millis, PromptId, Region, StepId};

/// A control plane's state as read back from storage, not yet trusted. Serializing a
/// [`crate::ControlPlane`] and deserializing the text as a `Snapshot` round-trips exactly.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    pub(crate) config: Config,
    pub(crate) ledger: Ledger,
    pub(crate) membership: Membership,
    pub(crate) events: EventQueue,
    pub(crate) clock: Millis,
}

/// Why a snapshot was refused.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum RestoreError {
    /// The stored configuration breaks a rule [`crate::ControlPlane::new`] enforces.
    #[error("invalid config: {0}")]
    Config(#[from] ConfigError),
    /// A stored time lies after the core's own clock (the latest time it had seen).
    #[error("{what} at {at} is after the clock {clock}")]
    TimeAfterClock {
        /// Which time.
        what: &'static str,
        /// The stored time.
        at: Millis,
        /// The stored clock.
        clock: Millis,
    },
    /// The event queue holds more than `limits.max_pending_events`, or its bound
    /// differs from it.
    #[error("event queue of {pending} with bound {bound}, limit {max}")]
    EventQueue {
        /// Events held.
        pending: usize,
        /// The queue's own bound.
        bound: u32,
        /// `limits.max_pending_events`.
        max: u32,
    },
    /// More members than `limits.max_actors`.
    #[error("{count} members, more than the limit of {max}")]
    TooManyMembers {
        /// Members stored.
        count: usize,
        /// The limit.
        max: u32,
    },
    /// A member's versions could not have been accepted by a registration.
    #[error("{actor}: {source}")]
    MemberVersions {
        /// The member.
        actor: ActorId,
        /// What is wrong with its versions.
        source: MembershipError,
    },
    /// A member's estimate is above anything the scheduler could have measured.
    #[error("{0} has an estimate above the plausible maximum")]
    ImplausibleEstimate(ActorId),
    /// A member's preemption window ends later than the configured grace allows.
    #[error("{actor} leaves at {leaving_at}, beyond the preemption grace")]
    LeavingTooLate {
        /// The member.
        actor: ActorId,
        /// When it is due to leave.
        leaving_at: Millis,
    },
    /// A relay is not a relay-capable member of its region.
    #[error("{relay} relays {region} but is not a relay-capable member of it")]
    InvalidRelay {
        /// The region.
        region: Region,
        /// Its relay.
        relay: ActorId,
    },
    /// A region has a relay-capable member but no relay.
    #[error("{0} has a relay-capable member but no relay")]
    MissingRelay(Region),
    /// The completion-time window holds more samples than configured.
    #[error("{len} completion samples, more than the window of {max}")]
    CompletionWindow {
        /// Samples stored.
        len: usize,
        /// `lease.completion_window`.
        max: u16,
    },
    /// A step exists but no version was published.
    #[error("a step exists but no version was published")]
    NothingPublished,
    /// The step's id is not below the next step id.
    #[error("{step} is not below the next step id {next}")]
    StepId {
        /// The stored step.
        step: StepId,
        /// The next id the ledger would assign.
        next: StepId,
    },
    /// The step's version or hash disagrees with the published ones.
    #[error("{0} is for a version or hash other than the published one")]
    StepVersion(StepId),
    /// The batch is empty or larger than `limits.max_batch_size`.
    #[error("{step} has {size} jobs, outside 1..={max}")]
    BatchSize {
        /// The step.
        step: StepId,
        /// Jobs stored.
        size: usize,
        /// The limit.
        max: u32,
    },
    /// A prompt appears twice in the batch.
    #[error("{0} appears twice in the batch")]
    DuplicatePrompt(PromptId),
    /// A job's live lease is not its latest attempt, or an accepted job has no attempt.
    #[error("job {job}: attempt {attempt} is inconsistent with {attempts} issued")]
    LeaseAttempt {
        /// The job's index.
        job: u32,
        /// The lease's attempt number (0 for an accepted job).
        attempt: u64,
        /// Attempts issued on the job.
        attempts: u64,
    },
    /// A lease's lifetime is outside the configured bounds, or it ends before it began.
    #[error("job {job}: lease from {issued_at} to {expires_at} is outside the lease bounds")]
    LeaseLifetime {
        /// The job's index.
        job: u32,
        /// When the lease was issued.
        issued_at: Millis,
        /// When it expires.
        expires_at: Millis,
    },
    /// A lease is held by an actor that is not a member.
    #[error("job {job} is leased to {holder}, who is not a member")]
    UnknownHolder {
        /// The job's index.
        job: u32,
        /// The holder.
        holder: ActorId,
    },
    /// A completed step still has live leases or reservations.
    #[error("{0} has completed but still has live leases or reservations")]
    LiveAfterCompletion(StepId),
    /// The members' index by deadline disagrees with the members: a bug in the core,
    /// never a property of stored data (the index is rebuilt on restore).
    #[error("the members' deadlines disagree with the members")]
    MemberDeadlines,
    /// A step's index of its jobs by state disagrees with the jobs: a bug in the
    /// core, never a property of stored data (the index is rebuilt on restore).
    #[error("the job index of {0} disagrees with its jobs")]
    JobIndex(StepId),
    /// A step marked complete with its full batch has jobs not accepted.
    #[error("{0} completed in full without all its jobs accepted")]
    IncompleteCompletion(StepId),
    /// An actor holds more leases than `limits.max_leases_per_actor`.
    #[error("{actor} holds {held} leases, more than the limit of {max}")]
    TooManyLeases {
        /// The actor.
        actor: ActorId,
        /// Leases held.
        held: u32,
        /// The limit.
        max: u32,
    },
    /// A reservation names an actor that is not a member.
    #[error("a reservation names {0}, who is not a member")]
    UnknownReservation(ActorId),
    /// Reservations add up to more than the pooled jobs.
    #[error("{reserved} jobs reserved but only {pooled} pooled")]
    OverReserved {
        /// Sum of reservations.
        reserved: u64,
        /// Pooled jobs.
        pooled: u32,
    },
}
