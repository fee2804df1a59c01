//! The calls that change the core, as the journal records and replays them.
//!
//! Every mutating [`crate::Hub`] call is a [`Command`]: plain data saying what was
//! asked, which [`Command::apply`] runs on the core at a given time. The hub runs a
//! command on the live core and then saves it as a [`Record`] (the command and the
//! clock time it ran at); on start it replays the records saved since the last
//! checkpoint through the same `apply`. The core is deterministic (the same calls at
//! the same times give the same state), so the replay rebuilds exactly the state the
//! live calls left, while each record holds only what its call was given.
//!
//! # Which calls wait for the disk
//!
//! Every call is journaled, in the order it ran, but not every call is synced to disk
//! before its answer ([`Command::durable`]). A call whose answer promises nothing the
//! caller relies on after a crash is committed without an fsync: a heartbeat, and a
//! claim that granted no lease ("no work", "no open step", "catch up", "leaving").
//! All they change is when an actor was last heard from, and what was due by then
//! (expired leases, ended preemption windows), which the restart's [`Resume`] does
//! again at its own time and whose silence it forgives. redb makes such a commit
//! durable with the next synced one, so what a crash can lose is always a suffix of the
//! journal made of these calls only: the state after a restart is one the live hub
//! passed through, followed by `Resume`, as if those calls had never arrived.
//!
//! Everything else is synced before it is answered: a lease granted (only its holder's
//! results are accepted), an acceptance (the trainer gets it once), a registration (its
//! token), a published version, an opened or taken step, a leave or preemption, a tick
//! that applied something due, and a version report. The last is on the path from a
//! staged delta to the trainer's next step, but an actor reports its versions once per
//! change (`aurora_node::ActorNode`), and one whose report was lost would be answered
//! `catch_up` for a version it holds, which it does not report again: a lost report
//! would leave it idle.

use aurora_control::{
    Accepted, ActorId, Assignment, ControlPlane, MembershipError, Millis, OpenStepError, PromptId,
    PublishError, Readiness, Registration, Rejection, RolloutReport, StepId, StepOutcome,
    SubmitError, UnknownActor, Version, WeightsHash,
};
use serde::{Deserialize, Serialize};

/// A call that changes the core.
pub(crate) trait Command: Into<Call> {
    /// What the call answers.
    type Output;

    /// Runs the call on `core` at `now`. The only place that maps a command to the
    /// core's methods, for live calls and replays alike, so the two cannot differ.
    fn apply(&self, core: &mut ControlPlane, now: Millis) -> Self::Output;

    /// Whether the call, having answered `output`, must be on disk before the answer
    /// is sent (see the module documentation); most must.
    fn durable(_output: &Self::Output) -> bool {
        true
    }
}

/// One journal record: a command and the time it ran at.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Record {
    /// The hub's clock when the call ran.
    pub(crate) at: Millis,
    /// The call.
    pub(crate) call: Call,
}

impl Record {
    /// Runs the recorded call again. Its answer went to the caller when it first ran,
    /// and its events were logged then; they are drained as after every live call, so
    /// that the queue is empty between calls in the replay too.
    pub(crate) fn replay(&self, core: &mut ControlPlane) {
        self.call.replay(core, self.at);
        while core.poll_event().is_some() {}
    }
}

/// Declares [`Call`], with one variant per command named after it, the conversion of
/// each command into it, and [`Call::replay`].
macro_rules! calls {
    ($($command:ident),* $(,)?) => {
        /// Any command, as the journal stores it.
        #[derive(Debug, Serialize, Deserialize)]
        pub(crate) enum Call {
            $($command($command),)*
        }

        $(
            impl From<$command> for Call {
                fn from(command: $command) -> Call {
                    Call::$command(command)
                }
            }
        )*

        impl Call {
            /// Runs the call on `core` at `now`, dropping its answer.
            fn replay(&self, core: &mut ControlPlane, now: Millis) {
                match self {
                    $(Call::$command(command) => {
                        let _answered = command.apply(core, now);
                    })*
                }
            }
        }
    };
}

calls!(
    PublishVersion,
    OpenStep,
    TakeStepOutcome,
    Register,
    Heartbeat,
    ReportVersions,
    Claim,
    Submit,
    Leave,
    Preempt,
    Tick,
    Resume,
);

/// [`ControlPlane::publish_version`].
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct PublishVersion {
    pub(crate) version: Version,
    pub(crate) weights_hash: WeightsHash,
}

impl Command for PublishVersion {
    type Output = Result<(), PublishError>;

    fn apply(&self, core: &mut ControlPlane, _: Millis) -> Self::Output {
        core.publish_version(self.version, self.weights_hash)
    }
}

/// [`ControlPlane::open_step`].
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct OpenStep {
    pub(crate) prompts: Vec<PromptId>,
}

impl Command for OpenStep {
    type Output = Result<StepId, OpenStepError>;

    fn apply(&self, core: &mut ControlPlane, now: Millis) -> Self::Output {
        core.open_step(&self.prompts, now)
    }
}

/// [`ControlPlane::take_step_outcome`].
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct TakeStepOutcome;

impl Command for TakeStepOutcome {
    type Output = Option<StepOutcome>;

    fn apply(&self, core: &mut ControlPlane, _: Millis) -> Self::Output {
        core.take_step_outcome()
    }
}

/// [`ControlPlane::register`].
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Register {
    pub(crate) actor: ActorId,
    pub(crate) registration: Registration,
}

impl Command for Register {
    type Output = Result<Readiness, MembershipError>;

    fn apply(&self, core: &mut ControlPlane, now: Millis) -> Self::Output {
        core.register(self.actor, self.registration.clone(), now)
    }
}

/// [`ControlPlane::heartbeat`].
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Heartbeat {
    pub(crate) actor: ActorId,
}

impl Command for Heartbeat {
    type Output = Result<(), UnknownActor>;

    fn apply(&self, core: &mut ControlPlane, now: Millis) -> Self::Output {
        core.heartbeat(self.actor, now)
    }

    /// A heartbeat only says the actor was heard from, which a restart forgives.
    fn durable(_: &Self::Output) -> bool {
        false
    }
}

/// [`ControlPlane::report_versions`].
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct ReportVersions {
    pub(crate) actor: ActorId,
    pub(crate) active: Version,
    pub(crate) staged: Option<Version>,
}

impl Command for ReportVersions {
    type Output = Result<Readiness, MembershipError>;

    fn apply(&self, core: &mut ControlPlane, now: Millis) -> Self::Output {
        core.report_versions(self.actor, self.active, self.staged, now)
    }
}

/// [`ControlPlane::claim`]; the answer carries the time it was handled at, from
/// which the wire expresses lease expiries.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Claim {
    pub(crate) actor: ActorId,
}

impl Command for Claim {
    type Output = (Result<Assignment, UnknownActor>, Millis);

    fn apply(&self, core: &mut ControlPlane, now: Millis) -> Self::Output {
        (core.claim(self.actor, now), now)
    }

    /// Only a granted lease is a promise: the idle actors' claims, many a second
    /// between steps, change nothing a restart needs.
    fn durable((assignment, _): &Self::Output) -> bool {
        matches!(assignment, Ok(Assignment::Work { leases, .. }) if !leases.is_empty())
    }
}

/// [`ControlPlane::submit`]. The payloads are not part of the record: those of
/// accepted results are saved in the rollouts table in the same transaction.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Submit {
    pub(crate) actor: ActorId,
    pub(crate) reports: Vec<RolloutReport>,
}

impl Command for Submit {
    type Output = Result<Vec<Result<Accepted, Rejection>>, SubmitError>;

    fn apply(&self, core: &mut ControlPlane, now: Millis) -> Self::Output {
        core.submit(self.actor, &self.reports, now)
    }
}

/// [`ControlPlane::leave`].
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Leave {
    pub(crate) actor: ActorId,
}

impl Command for Leave {
    type Output = Result<(), UnknownActor>;

    fn apply(&self, core: &mut ControlPlane, _: Millis) -> Self::Output {
        core.leave(self.actor)
    }
}

/// [`ControlPlane::preempt`].
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Preempt {
    pub(crate) actor: ActorId,
}

impl Command for Preempt {
    type Output = Result<(), UnknownActor>;

    fn apply(&self, core: &mut ControlPlane, now: Millis) -> Self::Output {
        core.preempt(self.actor, now)
    }
}

/// [`ControlPlane::tick`].
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Tick;

impl Command for Tick {
    type Output = ();

    fn apply(&self, core: &mut ControlPlane, now: Millis) {
        core.tick(now);
    }
}

/// [`ControlPlane::resume`]: the hub starting again after an outage. It changes the
/// state (leases expire, silence is forgiven), so it is journaled like any call.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Resume;

impl Command for Resume {
    type Output = ();

    fn apply(&self, core: &mut ControlPlane, now: Millis) {
        core.resume(now);
    }
}
