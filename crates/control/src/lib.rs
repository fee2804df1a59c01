//! The control plane of aurora: job ledger, per-prompt leases, throughput-proportional
//! scheduler and membership, as a pure (sans-IO) core.
//!
//! **Architecture invariant:** nothing in this crate does I/O, reads a clock, spawns a
//! thread or sleeps. Time is an argument ([`Millis`]), every mutation is a method call
//! on [`ControlPlane`] that returns its outcome, and notifications are drained with
//! [`ControlPlane::poll_event`]. The whole state derives serde, so the HTTP shell can
//! persist it and a restarted hub continues where it stopped. [`sim`] drives the same
//! code under virtual time.
//!
//! # One step
//!
//! The trainer publishes version `v` with its weights hash h(v)
//! ([`ControlPlane::publish_version`]) and opens a step of `B` prompts
//! ([`ControlPlane::open_step`]). The scheduler splits `B` over the eligible actors in
//! proportion to their throughput estimates, following Algorithm 1 of the AuroraRL
//! paper ("AuroraRL: fast, fault-tolerant and cost-efficient RL over decentralized
//! networks"), see [`scheduler`]:
//!
//! * **Eligibility rule.** An actor is eligible for a step on `v` if its active version
//!   is `v`, or `v - 1` with `v` staged; the latter receives `Commit(v)` with its work
//!   ([`Assignment::Work::commit`]). Actors further behind get nothing this step.
//! * **Decay.** The estimate `tau` of an actor that is behind when a step opens is
//!   multiplied by `alpha`; at every settlement `tau <- beta * tau + (1 - beta) *
//!   tokens / elapsed`. New actors start from a conservative estimate.
//!
//! Actors claim work ([`ControlPlane::claim`]) and get per-prompt leases (see
//! [`ledger`]):
//!
//! * **Lease lifetime rule.** `2..3 x` the median of recent completion times, clamped
//!   to configured bounds, with an initial value before any result (see [`lease`]).
//!   Leases that run out return their prompts to the pool, at [`ControlPlane::tick`] or
//!   lazily when a claim or a late result comes in.
//! * **Acceptance rule.** A result is accepted iff it arrives strictly before its lease
//!   expires, its version is the job's version and its weights hash is h(version); a
//!   job is accepted at most once. Every other result is rejected with a typed
//!   [`Rejection`], counted per reason in [`Stats`].
//!
//! The step completes when all `B` results are accepted, or earlier under a
//! [`PartialBatchPolicy`]; it never waits on one slow actor, because that actor's
//! leases run out and its prompts go to whoever claims next.
//!
//! Membership ([`ControlPlane::register`], heartbeats, leave, preemption, silent death
//! by heartbeat timeout, rejoin, one relay per region) is in [`membership`].
//!
//! # Limits
//!
//! Every collection is bounded by [`Limits`]: actors, batch size (and so jobs and live
//! leases), leases per actor (and so results per submission), pending events, and the
//! completion-time window. Unknown actors, leases and versions are typed errors, never
//! panics.

pub mod config;
pub mod control;
pub mod events;
pub mod lease;
pub mod ledger;
pub mod membership;
pub mod scheduler;
pub mod sim;
pub mod values;

pub use config::{Config, ConfigError, Limits, PartialBatchPolicy};
pub use control::{Assignment, ControlPlane, Readiness, Stats, SubmitError};
pub use events::{Departure, Event};
pub use lease::LeaseConfig;
pub use ledger::{
    Accepted, Completion, LeaseGrant, OpenStepError, PublishError, Rejection, RolloutReport,
    StepProgress, StepReport,
};
pub use membership::{Member, MembershipError, Registration, UnknownActor};
pub use scheduler::{
    Eligibility, NewActorEstimate, SchedulerConfig, SplitPolicy, Throughput, split_among_eligible,
    split_proportionally,
};
pub use values::{
    ActorId, Capabilities, LeaseId, Millis, Permille, PromptId, Region, RegionError, StepId,
    Version, WeightsHash,
};
