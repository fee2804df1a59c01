//! The control plane of aurora: job ledger, per-prompt leases, throughput-proportional
//! scheduler and membership, as a pure (sans-IO) core.
//!
//! **Architecture invariant:** nothing in this crate does I/O, reads a clock, spawns a
//! thread or sleeps. Time is an argument ([`Millis`]), every mutation is a method call
//! on [`ControlPlane`] that returns its outcome, and notifications are drained with
//! [`ControlPlane::poll_event`]. The whole state derives serde, so the HTTP shell can
//! persist it and a restarted hub continues where it stopped. The `aurora-sim` crate
//! drives the same code under virtual time.
//!
//! # One step
//!
//! The trainer publishes version `v` with its weights hash h(v)
//! ([`ControlPlane::publish_version`]) and opens a step of `B` prompts
//! ([`ControlPlane::open_step`]). Each eligible actor gets a reservation of `B_a =
//! floor(B * tau_a / T)` jobs, the remainder going to the largest fractional parts so
//! that exactly `B` are reserved: Algorithm 1 of the AuroraRL paper ("AuroraRL: fast,
//! fault-tolerant and cost-efficient RL over decentralized networks"), computed in
//! exact integer arithmetic (see [`split_proportionally`]).
//!
//! * **Eligibility rule.** An actor is eligible for a step on `v` if its active version
//!   is `v`, or `v - 1` with `v` staged; the latter receives `Commit(v)` with its work
//!   (the `commit` of [`Assignment::Work`]). Actors further behind get nothing this
//!   step and are told to catch up ([`Readiness::CatchUp`]).
//! * **Estimates and decay.** At every settlement `tau <- beta * tau + (1 - beta) *
//!   tokens / elapsed`, with `elapsed` floored at `min_sample_ms` and the sample capped
//!   at `max_sample_rate` ([`SchedulerConfig`]) and at [`MAX_SAMPLE_GROWTH`] times the
//!   current estimate: token counts are the actor's word, and an inflated one must not
//!   buy it the next batch. Each step an actor is behind when
//!   the step opens, its `tau` is multiplied by `alpha`; each call that finds leases
//!   of an actor expired multiplies its `tau` by `gamma` (an expiry is evidence of
//!   slowness). New actors start from a conservative estimate (the slowest known, or
//!   a floor).
//!
//! Actors claim work ([`ControlPlane::claim`]): their reservation, plus their share by
//! the same proportions of the prompts nobody has reserved (returned by expired or
//! released leases, or reserved for actors that did not claim within one lease
//! lifetime). Each job is handed out under a per-prompt lease (module `ledger`):
//!
//! * **Lease lifetime rule.** `2..3 x` the median of recent completion times (of
//!   jobs' first leases: a re-issued job finishes fast at a step's tail), clamped
//!   to configured bounds, with an initial value before anything is known; an expired
//!   lease counts as a completion that took its whole lifetime, so the lifetime grows
//!   when the pool slows down (module `lease`). Leases that run out return their
//!   prompts to the pool at [`ControlPlane::tick`], or lazily when a claim or a late
//!   result comes in first.
//! * **Acceptance rule.** A result is accepted iff it arrives strictly before its lease
//!   expires, from the lease's holder, with the job's version and that version's
//!   weights hash h(version); a job is accepted at most once. Every other result is
//!   rejected with a typed [`Rejection`], counted per reason in [`Stats`].
//!
//! The step completes when all `B` results are accepted, or earlier under a
//! [`PartialBatchPolicy`]; it never waits on one slow actor, because that actor's
//! leases run out and its prompts go to whoever claims next. The trainer then takes
//! the step's [`StepOutcome`] (accepted results and unfinished prompts) with
//! [`ControlPlane::take_step_outcome`]; the next step cannot open before, so nothing
//! of a partial step is dropped.
//!
//! **Time** is the latest `now` the core has seen: an earlier `now` (a driver
//! restarted on another clock) is taken as that high-water mark, so it can never
//! relax the acceptance rule.
//!
//! Membership ([`ControlPlane::register`], heartbeats, leave, preemption with a
//! warning window ([`ControlPlane::preempt`]), silent death
//! by heartbeat timeout, rejoin, one relay per region) is in the module `membership`. A
//! membership change touches only the actor that changed: survivors keep their leases
//! and reservations and never pause.
//!
//! # Restarts
//!
//! Serialize the [`ControlPlane`] after each call (or periodically), deserialize it on
//! start as a [`Snapshot`], and call [`ControlPlane::restore`]: it checks the config and
//! every invariant of the ledger and membership (a corrupt file is a [`RestoreError`],
//! never a panic), then everything, including leases, reservations, estimates and
//! counters, continues where it stopped.
//!
//! The core is deterministic: the same calls with the same times, from the same state,
//! give the same state (no randomness, no hash-ordered collections). A driver that
//! logs its calls rather than saving the whole state after each (the hub) loads its
//! last snapshot with [`ControlPlane::from_snapshot`], which checks it exactly as
//! `restore` does, replays the calls logged since at their recorded times, and then
//! calls [`ControlPlane::resume`], the second half of `restore`.
//!
//! # Limits
//!
//! Every collection is bounded by [`Limits`] or a constant: actors, batch size (and so
//! jobs and live leases), leases per actor (and so results per submission), pending
//! events, the completion-time window ([`MAX_COMPLETION_WINDOW`]) and region
//! names ([`MAX_REGION_LEN`]). Unknown actors, leases and versions are typed
//! errors, never panics.

mod config;
mod control;
mod events;
mod lease;
mod ledger;
mod membership;
mod restore;
mod scheduler;
mod values;

pub use config::{Config, ConfigError, Limits, PartialBatchPolicy};
pub use control::{Assignment, ControlPlane, Readiness, SubmitError};
pub use events::{Departure, Event};
pub use lease::{LeaseConfig, MAX_COMPLETION_WINDOW};
pub use ledger::{
    Accepted, Completion, LeaseGrant, OpenStepError, PublishError, Rejection, RolloutReport, Stats,
    StepOutcome, StepProgress, StepReport,
};
pub use membership::{Member, MembershipError, Registration, UnknownActor};
pub use restore::{RestoreError, Snapshot};
pub use scheduler::{
    Eligibility, MAX_SAMPLE_GROWTH, MilliTokensPerS, NewActorEstimate, SchedulerConfig,
    SplitPolicy, split_among_eligible, split_proportionally,
};
pub use values::{
    ActorId, Capabilities, LeaseId, MAX_REGION_LEN, Millis, Permille, PermilleOutOfRange, PromptId,
    Region, RegionError, StepId, Version, WeightsHash,
};
