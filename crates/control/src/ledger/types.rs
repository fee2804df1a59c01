//! The ledger's public types: leases, results, rejections, errors, step reports, totals.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::values::{ActorId, LeaseId, Millis, PromptId, StepId, Version, WeightsHash};

/// A lease handed to an actor: generate a rollout for `prompt` on `version` and submit
/// it before `expires_at`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseGrant {
    /// The lease to name in the result.
    pub lease: LeaseId,
    /// The prompt to generate for.
    pub prompt: PromptId,
    /// The version to generate with.
    pub version: Version,
    /// Results arriving at or after this time are rejected.
    pub expires_at: Millis,
}

/// What an actor reports for one finished lease. The rollout itself goes to the store
/// through the shell; the core only needs what decides acceptance and throughput.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolloutReport {
    /// The lease the result is for.
    pub lease: LeaseId,
    /// The version the actor generated with.
    pub version: Version,
    /// Hash of the weights the actor generated with.
    pub weights_hash: WeightsHash,
    /// Tokens generated.
    pub tokens: u64,
}

/// A result the ledger accepted: the shell may now persist the rollout for the trainer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Accepted {
    /// The lease it settled.
    pub lease: LeaseId,
    /// Its prompt.
    pub prompt: PromptId,
}

/// Why a result was not accepted.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Error,
)]
pub enum Rejection {
    /// The submitting actor is not a member (never registered, left, or timed out).
    #[error("the actor is not registered")]
    UnknownActor,
    /// No such lease was ever issued.
    #[error("no such lease was issued")]
    UnknownLease,
    /// The lease is live but held by another actor.
    #[error("the lease is held by another actor")]
    NotLeaseHolder,
    /// The lease belongs to a step that has completed.
    #[error("the lease's step has completed")]
    StepClosed,
    /// The lease had ended (expired, or revoked when its holder left or re-registered)
    /// before the result arrived.
    #[error("the lease ended before the result arrived")]
    Late,
    /// The job was already accepted.
    #[error("the job was already accepted")]
    Duplicate,
    /// The result was generated on a version other than the job's.
    #[error("the result was generated on the wrong version")]
    WrongVersion,
    /// The result's weights hash is not h(version).
    #[error("the result's weights hash does not match the version")]
    WrongHash,
    /// The token count is zero or above the configured maximum.
    #[error("the token count is zero or above the limit")]
    TokenCountOutOfRange,
}

/// Why a version could not be published.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum PublishError {
    /// Versions are consecutive; the eligibility rule depends on it.
    #[error("{offered} does not follow the latest published version {latest}")]
    NotNext {
        /// The latest published version.
        latest: Version,
        /// The version offered.
        offered: Version,
    },
}

/// Why a step could not be opened.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum OpenStepError {
    /// No version has been published, so there is nothing to generate with.
    #[error("no version has been published")]
    NothingPublished,
    /// The previous step has not completed.
    #[error("{0} is still open")]
    StepStillOpen(StepId),
    /// The previous step completed but its outcome has not been taken with
    /// [`crate::ControlPlane::take_step_outcome`]; opening now would drop it.
    #[error("the outcome of {0} has not been taken")]
    OutcomeNotTaken(StepId),
    /// A step needs at least one prompt.
    #[error("the batch is empty")]
    EmptyBatch,
    /// The batch is larger than `limits.max_batch_size`.
    #[error("batch of {size} prompts is more than the limit of {max}")]
    BatchTooLarge {
        /// Prompts offered.
        size: usize,
        /// The limit.
        max: u32,
    },
    /// A prompt appears twice, which would let one prompt be accepted twice.
    #[error("{0} appears twice in the batch")]
    DuplicatePrompt(PromptId),
}

/// How a step ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Completion {
    /// When it completed.
    pub at: Millis,
    /// Whether it completed under the partial-batch policy, short of its full batch.
    pub partial: bool,
}

/// Counts describing the current (or last) step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepProgress {
    /// The step.
    pub step: StepId,
    /// The version its jobs are for.
    pub version: Version,
    /// When it opened.
    pub opened_at: Millis,
    /// Prompts posted.
    pub batch_size: u32,
    /// Jobs accepted.
    pub accepted: u32,
    /// Jobs under a live lease.
    pub leased: u32,
    /// Jobs waiting for a holder.
    pub pooled: u32,
    /// Pooled jobs reserved for particular actors; never more than `pooled`.
    pub reserved: u32,
    /// Set once the step has completed.
    pub completion: Option<Completion>,
}

/// The outcome of the current (or last) step, prompt by prompt.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepReport {
    /// The step.
    pub step: StepId,
    /// The version its jobs are for.
    pub version: Version,
    /// Accepted prompts and who generated them, in batch order.
    pub accepted: Vec<(PromptId, ActorId)>,
    /// Prompts under a live lease and their holders, in batch order; empty once the
    /// step has completed.
    pub leased: Vec<(PromptId, ActorId)>,
    /// Prompts waiting for a holder, in batch order; once the step has completed,
    /// every prompt that was not accepted.
    pub pooled: Vec<PromptId>,
    /// Set once the step has completed.
    pub completion: Option<Completion>,
}

/// A completed step's results, handed to the trainer once by
/// [`crate::ControlPlane::take_step_outcome`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepOutcome {
    /// The step.
    pub step: StepId,
    /// The version its results were generated on.
    pub version: Version,
    /// Accepted prompts and who generated them, in batch order.
    pub accepted: Vec<(PromptId, ActorId)>,
    /// Prompts without an accepted result (a partial batch), in batch order: the
    /// trainer decides whether to post them again.
    pub unfinished: Vec<PromptId>,
    /// How the step ended.
    pub completion: Completion,
}

/// Totals since the core was created.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    /// Results accepted.
    pub accepted: u64,
    /// Leases that ran out.
    pub expired: u64,
    /// Results rejected, by reason.
    pub rejected: BTreeMap<Rejection, u64>,
}
