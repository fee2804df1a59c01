//! [`ControlPlane`]: the ledger, the scheduler and membership behind one sans-IO API.
//!
//! A driver (the HTTP shell, the simulator, a test) calls one method per message it
//! receives, passing the time the message arrived, and reads the answer from the
//! return value; it calls [`ControlPlane::tick`] at [`ControlPlane::next_deadline`]
//! and drains [`ControlPlane::poll_event`] after each call. The whole state is plain
//! data: serialize it with serde to persist it, deserialize it as a [`Snapshot`] and
//! call [`ControlPlane::restore`], which checks it, to carry on after a restart.
//!
//! **Time only moves forward.** The core keeps the latest `now` it has been given
//! (its clock, part of the snapshot). A call with an earlier `now`, from a driver
//! restarted on another clock or a message processed out of order, is handled as if
//! it came at the clock: clamping (rather than refusing the call) keeps the core
//! available, and it can only make deadlines come sooner, never later, so a result is
//! never accepted after its lease's expiry as the core has already seen time.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::config::{Config, ConfigError};
use crate::events::{Departure, Event, EventQueue};
use crate::ledger::{
    Accepted, LeaseGrant, Ledger, OpenStepError, PublishError, Rejection, RolloutReport, Stats,
    StepOutcome, StepProgress, StepReport,
};
use crate::membership::{
    Joined, Member, Membership, MembershipError, Registration, UnknownActor, check_versions,
};
use crate::restore::{RestoreError, Snapshot};
use crate::scheduler::{Eligibility, split_among_eligible};
use crate::values::{ActorId, Millis, PromptId, Region, StepId, Version, WeightsHash};

/// What an actor should do after registering or reporting its versions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Readiness {
    /// Eligible for a step on the latest version: claim work (a claim delivers the
    /// Commit if one is needed first).
    Ready,
    /// Too far behind to get work: catch up from the store until active is `target`,
    /// or `target - 1` with `target` staged, then report versions again.
    CatchUp {
        /// The latest published version.
        target: Version,
    },
}

/// The answer to a claim.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Assignment {
    /// Work on the open step. If `commit` is set, the actor must first activate that
    /// (staged) version: every lease is for it. An empty `leases` means nothing is
    /// available now; claim again later.
    Work {
        /// Version to activate before generating.
        commit: Option<Version>,
        /// Jobs to generate.
        leases: Vec<LeaseGrant>,
    },
    /// The actor is in its preemption window: no new work; results for the leases it
    /// holds are accepted until `leaving_at` (and each lease's own expiry).
    Leaving {
        /// When the window ends and the actor is removed.
        leaving_at: Millis,
    },
    /// The actor is too far behind for the open step and gets nothing from it.
    CatchUp {
        /// The open step's version.
        target: Version,
    },
    /// No step is open.
    NoOpenStep,
}

/// Why a submission was refused as a whole.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum SubmitError {
    /// More results than an actor may hold leases, so it cannot be honest.
    #[error("{count} results in one submission, more than the limit of {max}")]
    TooManyResults {
        /// Results submitted.
        count: usize,
        /// `limits.max_leases_per_actor`.
        max: u32,
    },
}

/// The control plane's pure core. See the crate documentation for the rules it
/// enforces.
///
/// It serializes but does not deserialize: state read back from storage is a
/// [`Snapshot`], and only [`ControlPlane::restore`] turns it into a core.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ControlPlane {
    config: Config,
    ledger: Ledger,
    membership: Membership,
    events: EventQueue,
    /// The latest `now` seen (see the module documentation).
    clock: Millis,
}

impl ControlPlane {
    /// An empty control plane: nothing published, no actors, no step.
    pub fn new(config: Config) -> Result<ControlPlane, ConfigError> {
        config.validate()?;
        let events = EventQueue::new(config.limits.max_pending_events);
        Ok(ControlPlane {
            config,
            ledger: Ledger::default(),
            membership: Membership::default(),
            events,
            clock: Millis(0),
        })
    }

    /// Carries on from a snapshot read back from storage. Every invariant is checked
    /// first (the config by the rules of [`ControlPlane::new`], then the ledger and
    /// membership against it), so a corrupt or hostile snapshot is a [`RestoreError`]
    /// rather than a panic or a core breaking its own rules.
    ///
    /// The hub heard nothing while it was down, so that silence says nothing about
    /// the actors: their heartbeat clocks restart at `now`. Leases keep their
    /// deadlines; the acceptance rule is never relaxed, and a `now` earlier than the
    /// snapshot's clock is taken as that clock.
    pub fn restore(snapshot: Snapshot, now: Millis) -> Result<ControlPlane, RestoreError> {
        let mut core = ControlPlane::from_snapshot(snapshot)?;
        core.resume(now);
        Ok(core)
    }

    /// The core exactly as the snapshot holds it, after the checks of
    /// [`ControlPlane::restore`], but without carrying it on to a later time: for a
    /// driver that replays the calls it logged after the snapshot, and must therefore
    /// start from the very state those calls were made on. Call
    /// [`ControlPlane::resume`] once the replay is done.
    pub fn from_snapshot(snapshot: Snapshot) -> Result<ControlPlane, RestoreError> {
        let Snapshot {
            config,
            mut ledger,
            mut membership,
            events,
            clock,
        } = snapshot;
        ledger.rebuild_index();
        membership.rebuild_deadlines();
        let core = ControlPlane {
            config,
            ledger,
            membership,
            events,
            clock,
        };
        core.check_invariants()?;
        Ok(core)
    }

    /// Carries on after an outage that ended at `now`: the actors' silence until then
    /// is forgiven (the core could not hear them), and everything due is applied, so
    /// leases whose deadline passed during the outage expire now and the others keep
    /// their deadlines.
    pub fn resume(&mut self, now: Millis) {
        let now = self.observe(now);
        self.membership.forgive_silence_until(now);
        self.tick(now);
    }

    /// The state to persist; [`ControlPlane::restore`] carries on from it. Serializing
    /// the core itself writes the same text.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            config: self.config.clone(),
            ledger: self.ledger.clone(),
            membership: self.membership.clone(),
            events: self.events.clone(),
            clock: self.clock,
        }
    }

    /// Checks every invariant that [`ControlPlane::restore`] demands of a snapshot.
    /// They hold after every call; tests and the simulator check them.
    pub fn check_invariants(&self) -> Result<(), RestoreError> {
        self.config.validate()?;
        self.events.check(self.config.limits.max_pending_events)?;
        let latest = self.ledger.latest().map(|(version, _)| version);
        self.membership.check(&self.config, latest, self.clock)?;
        let members = self.membership.members();
        self.ledger.check(
            &self.config,
            |actor| members.contains_key(&actor),
            self.clock,
        )
    }

    /// The latest time the core has seen.
    pub fn clock(&self) -> Millis {
        self.clock
    }

    /// The settings in force.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Publishes `version` with weights hash h(version). Versions are consecutive; a
    /// version may be published while a step runs on its predecessor (one-step
    /// asynchrony: actors stage it behind their generation), and that step's results
    /// are still judged by its own version and hash.
    pub fn publish_version(
        &mut self,
        version: Version,
        weights_hash: WeightsHash,
    ) -> Result<(), PublishError> {
        self.ledger.publish(version, weights_hash)
    }

    /// Opens a step: `prompts` become jobs for the latest version, and each eligible
    /// actor gets a reservation in proportion to its estimate (Algorithm 1). Actors
    /// too far behind get nothing and their estimates decay.
    ///
    /// The previous step's outcome must have been taken with
    /// [`ControlPlane::take_step_outcome`] first ([`OpenStepError::OutcomeNotTaken`]),
    /// so that its accepted results and unfinished prompts are never dropped.
    pub fn open_step(
        &mut self,
        prompts: &[PromptId],
        now: Millis,
    ) -> Result<StepId, OpenStepError> {
        let now = self.observe(now);
        let (step, version) = self.ledger.open(prompts, now, &self.config)?;
        self.membership
            .decay_behind(version, self.config.scheduler.behind_decay);
        let (actors, standings) = self.membership.standings(version);
        let batch_size = u32::try_from(prompts.len()).unwrap_or(u32::MAX);
        let shares = split_among_eligible(batch_size, &standings, self.config.scheduler.split);
        self.ledger.reserve(actors.into_iter().zip(shares));
        Ok(step)
    }

    /// Registers an actor, or re-registers one: a re-registration is a new process, so
    /// the leases of the old one are void and go back to the pool at once.
    pub fn register(
        &mut self,
        actor: ActorId,
        registration: Registration,
        now: Millis,
    ) -> Result<Readiness, MembershipError> {
        let now = self.observe(now);
        self.end_preemption_windows(now);
        let latest = check_versions(
            registration.active,
            registration.staged,
            self.ledger.latest().map(|(version, _)| version),
        )?;
        let readiness = readiness(latest, registration.active, registration.staged);
        let joined = self.membership.register(
            actor,
            registration,
            now,
            self.config.limits.max_actors,
            self.config.scheduler.new_actor_estimate,
            &mut self.events,
        )?;
        if joined == Joined::Replaced {
            self.ledger.release(actor);
        }
        Ok(readiness)
    }

    /// Records a heartbeat.
    pub fn heartbeat(&mut self, actor: ActorId, now: Millis) -> Result<(), UnknownActor> {
        let now = self.observe(now);
        self.end_preemption_windows(now);
        self.membership.touch(actor, now).map(|_| ())
    }

    /// Records the versions an actor has active and staged (after staging a delta,
    /// applying a Commit, or catching up).
    pub fn report_versions(
        &mut self,
        actor: ActorId,
        active: Version,
        staged: Option<Version>,
        now: Millis,
    ) -> Result<Readiness, MembershipError> {
        let now = self.observe(now);
        self.end_preemption_windows(now);
        let latest = check_versions(
            active,
            staged,
            self.ledger.latest().map(|(version, _)| version),
        )?;
        let member = self.membership.touch(actor, now)?;
        member.active = active;
        member.staged = staged;
        Ok(readiness(latest, active, staged))
    }

    /// A graceful leave: the actor's leases return to the pool at once.
    pub fn leave(&mut self, actor: ActorId) -> Result<(), UnknownActor> {
        self.remove(actor, Departure::Graceful)
    }

    /// A preemption notice: the actor's warning window starts. It gets no new work
    /// and its reservation goes back to the pool at once; results for the leases it
    /// holds are accepted until the window ends (`preemption_grace_ms`), when it is
    /// removed and its unfinished leases return to the pool. With no grace it is
    /// removed at once. A second notice never extends the window.
    pub fn preempt(&mut self, actor: ActorId, now: Millis) -> Result<(), UnknownActor> {
        let now = self.observe(now);
        self.end_preemption_windows(now);
        let grace_ms = self.config.preemption_grace_ms;
        if grace_ms == 0 {
            return self.remove(actor, Departure::Preempted);
        }
        let leaving_at = now.saturating_add(grace_ms);
        if !self
            .membership
            .mark_leaving(actor, leaving_at, &mut self.events)
        {
            return Err(UnknownActor(actor));
        }
        self.ledger.drop_reservation(actor);
        Ok(())
    }

    /// Hands `actor` work on the open step: its reservation, plus its fair share (by
    /// the same split) of prompts nobody has reserved, such as those returned by
    /// expired leases, up to its live-lease limit.
    pub fn claim(&mut self, actor: ActorId, now: Millis) -> Result<Assignment, UnknownActor> {
        let now = self.observe(now);
        self.end_preemption_windows(now);
        let member = self.membership.touch(actor, now)?;
        let (active, staged, leaving_at) = (member.active, member.staged, member.leaving_at);
        // Lazily bring the pool up to date so that expired prompts can be handed out.
        self.ledger.sweep(now, &self.config, &mut self.events);
        self.penalize_expiries();
        if let Some(leaving_at) = leaving_at {
            return Ok(Assignment::Leaving { leaving_at });
        }
        let Some(version) = self.ledger.open_version() else {
            return Ok(Assignment::NoOpenStep);
        };
        let eligibility = Eligibility::of(version, active, staged);
        if !eligibility.is_eligible() {
            return Ok(Assignment::CatchUp { target: version });
        }
        let unreserved = self.ledger.unreserved();
        // Splitting costs a pass over the members; with nothing unreserved, as when
        // every prompt is still reserved, every share is zero without it.
        let share = if unreserved == 0 {
            0
        } else {
            let (actors, standings) = self.membership.standings(version);
            let shares = split_among_eligible(unreserved, &standings, self.config.scheduler.split);
            actors
                .iter()
                .zip(shares)
                .find(|&(&candidate, _)| candidate == actor)
                .map_or(0, |(_, share)| share)
        };
        // A claimant whose share rounds to zero would otherwise sit idle beside
        // unclaimed work while the actors owed it are dead but not yet detected.
        let share = share.max(u32::from(unreserved > 0));
        let leases = self.ledger.grant(actor, share, now, &self.config);
        let commit = (eligibility == Eligibility::NeedsCommit).then_some(version);
        Ok(Assignment::Work { commit, leases })
    }

    /// Settles results: each is accepted or rejected by the acceptance rule (see the
    /// crate documentation), in order. Accepted tokens update the actor's estimate, and
    /// the step completes if this filled it.
    pub fn submit(
        &mut self,
        actor: ActorId,
        reports: &[RolloutReport],
        now: Millis,
    ) -> Result<Vec<Result<Accepted, Rejection>>, SubmitError> {
        let now = self.observe(now);
        self.end_preemption_windows(now);
        let max = self.config.limits.max_leases_per_actor;
        if reports.len() > usize::try_from(max).unwrap_or(usize::MAX) {
            return Err(SubmitError::TooManyResults {
                count: reports.len(),
                max,
            });
        }
        if self.membership.touch(actor, now).is_err() {
            for _ in reports {
                self.ledger.count_rejection(Rejection::UnknownActor);
            }
            return Ok(vec![Err(Rejection::UnknownActor); reports.len()]);
        }
        let mut accepted_tokens = 0u64;
        let mut earliest_issue: Option<Millis> = None;
        let outcomes = reports
            .iter()
            .map(|report| {
                let settled =
                    self.ledger
                        .judge(actor, report, now, &self.config, &mut self.events)?;
                accepted_tokens = accepted_tokens.saturating_add(report.tokens);
                earliest_issue =
                    Some(earliest_issue.map_or(settled.issued_at, |t| t.min(settled.issued_at)));
                Ok(settled.accepted)
            })
            .collect();
        // Expiries found lazily count against the holder before this settlement's
        // sample: an actor that answers late is slower than its estimate.
        self.penalize_expiries();
        if let Some(earliest_issue) = earliest_issue {
            self.membership.record_throughput(
                actor,
                accepted_tokens,
                earliest_issue,
                now,
                &self.config.scheduler,
            );
        }
        self.ledger
            .complete_if_done(now, &self.config, &mut self.events);
        Ok(outcomes)
    }

    /// Applies everything due by `now`: removes actors silent past the heartbeat
    /// timeout (their leases return to the pool), expires leases, lapses reservations
    /// and completes a step whose partial-batch deadline has come.
    pub fn tick(&mut self, now: Millis) {
        let now = self.observe(now);
        self.end_preemption_windows(now);
        for actor in self
            .membership
            .silent(now, self.config.heartbeat_timeout_ms)
        {
            // The actor was just listed as a member, so removal cannot fail.
            let _ = self.remove(actor, Departure::HeartbeatTimeout);
        }
        self.ledger.sweep(now, &self.config, &mut self.events);
        self.penalize_expiries();
    }

    /// The earliest time at which [`ControlPlane::tick`] would change something.
    pub fn next_deadline(&self) -> Option<Millis> {
        let silence = self
            .membership
            .next_silence(self.config.heartbeat_timeout_ms);
        let ledger = self.ledger.next_deadline(&self.config);
        let leaving = self.membership.next_leaving();
        silence.into_iter().chain(ledger).chain(leaving).min()
    }

    /// The oldest undelivered event.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop()
    }

    /// Counts for the current or last step.
    pub fn step_progress(&self) -> Option<StepProgress> {
        self.ledger.progress()
    }

    /// Prompt-level state of the current or last step, for monitoring.
    pub fn step_report(&self) -> Option<StepReport> {
        self.ledger.report()
    }

    /// The completed step's accepted results and unfinished prompts, for the trainer:
    /// `Some` once per completed step, `None` while a step is open or once taken. The
    /// next step cannot open before it is taken.
    pub fn take_step_outcome(&mut self) -> Option<StepOutcome> {
        self.ledger.take_outcome()
    }

    /// What [`ControlPlane::take_step_outcome`] would return, without taking it: a
    /// driver can check what it must hand over with the outcome (stored rollouts, say)
    /// before the outcome counts as delivered.
    pub fn step_outcome(&self) -> Option<StepOutcome> {
        self.ledger.outcome()
    }

    /// A registered actor.
    pub fn member(&self, actor: ActorId) -> Option<&Member> {
        self.membership.get(actor)
    }

    /// All registered actors, by id.
    pub fn members(&self) -> &BTreeMap<ActorId, Member> {
        self.membership.members()
    }

    /// The relay of each region that has one.
    pub fn relays(&self) -> &BTreeMap<Region, ActorId> {
        self.membership.relays()
    }

    /// The latest published version and h(version).
    pub fn latest_version(&self) -> Option<(Version, WeightsHash)> {
        self.ledger.latest()
    }

    /// The lifetime a lease issued now would get.
    pub fn lease_ms(&self) -> u64 {
        self.ledger.lease_ms(&self.config)
    }

    /// Totals since creation.
    pub fn stats(&self) -> &Stats {
        self.ledger.stats()
    }

    /// Events dropped because the driver did not drain the queue.
    pub fn events_dropped(&self) -> u64 {
        self.events.dropped()
    }

    /// Advances the clock to `now` unless it is already later, and returns the
    /// clock: the time the call is handled at.
    fn observe(&mut self, now: Millis) -> Millis {
        self.clock = self.clock.max(now);
        self.clock
    }

    /// Removes the actors whose preemption window has ended; their unfinished leases
    /// return to the pool. Called before anything else at every call, so a result is
    /// never accepted after its holder's window even if no tick came in between.
    fn end_preemption_windows(&mut self, now: Millis) {
        for actor in self.membership.leaving_due(now) {
            // The actor was just listed as a member, so removal cannot fail.
            let _ = self.remove(actor, Departure::Preempted);
        }
    }

    /// Lowers the estimate of every actor whose leases expired during this call, once
    /// per call however many expired.
    fn penalize_expiries(&mut self) {
        let decay = self.config.scheduler.expiry_decay;
        for actor in self.ledger.take_expired_holders() {
            self.membership.decay_estimate(actor, decay);
        }
    }

    fn remove(&mut self, actor: ActorId, reason: Departure) -> Result<(), UnknownActor> {
        self.membership
            .remove(actor, &mut self.events)
            .ok_or(UnknownActor(actor))?;
        let leases_returned = self.ledger.release(actor);
        self.events.push(Event::ActorDeparted {
            actor,
            reason,
            leases_returned,
        });
        Ok(())
    }
}

fn readiness(latest: Version, active: Version, staged: Option<Version>) -> Readiness {
    if Eligibility::of(latest, active, staged).is_eligible() {
        Readiness::Ready
    } else {
        Readiness::CatchUp { target: latest }
    }
}

#[cfg(test)]
mod bounds_tests;
#[cfg(test)]
mod tests;
