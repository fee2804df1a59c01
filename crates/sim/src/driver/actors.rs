//! The simulated actors' side of the conversation with the hub: registering, reporting
//! versions, claiming and generating batches, and submitting them (wrongly, when a
//! fault says so).

use aurora_control::{
    Assignment, Capabilities, LeaseGrant, MembershipError, Millis, Readiness, Registration,
    Rejection, RolloutReport, Version,
};

use super::{Batch, GrantRecord, Presence, Sim};
use crate::report::Violation;
use crate::scenario::{Liveness, Misbehavior};
use crate::world::{HEARTBEAT_MS, POLL_MS, actor_id, weights_hash};

impl Sim<'_> {
    pub(super) fn wake_actor(&mut self, index: usize) -> Result<(), Violation> {
        let now = self.now;
        let actor = &mut self.actors[index];
        match actor.presence {
            Presence::NotYetJoined => {
                actor.presence = Presence::Online;
                actor.next_heartbeat = now;
            }
            Presence::Online => {}
            Presence::Departed | Presence::Dead => return Ok(()),
        }
        if actor.leaving_at.is_some_and(|at| now >= at) {
            self.take_offline(index, Presence::Departed);
            return Ok(());
        }
        if let Some((at, version)) = actor.staging
            && now >= at
        {
            actor.staging = None;
            // A delta applies only on top of its base.
            if actor.active.next() == Some(version) {
                actor.staged = Some(version);
                actor.versions_to_report = true;
            }
        }
        if let Some((at, target)) = actor.catch_up
            && now >= at
        {
            actor.catch_up = None;
            actor.active = target;
            actor.staged = None;
            actor.versions_to_report = true;
        }
        if self.reachable(index) {
            self.talk_to_hub(index)?;
        }
        self.schedule_next_wake(index);
        Ok(())
    }

    /// One round of an actor's conversation with the hub.
    fn talk_to_hub(&mut self, index: usize) -> Result<(), Violation> {
        let now = self.now;
        if !self.actors[index].registered {
            self.register(index)?;
            if !self.actors[index].registered {
                return Ok(());
            }
        }
        // Finished work goes first: it is what a lease is waiting for. An actor back
        // from a partition learns here that the hub has forgotten it.
        if self.actors[index]
            .batch
            .as_ref()
            .is_some_and(|batch| now >= batch.done_at)
        {
            self.submit(index)?;
        }
        if !self.actors[index].registered {
            self.register(index)?;
        }
        if self.actors[index].versions_to_report {
            self.report_versions(index)?;
        }
        if self.scenario.liveness == Liveness::Heartbeats
            && now >= self.actors[index].next_heartbeat
        {
            self.actors[index].next_heartbeat = now.saturating_add(HEARTBEAT_MS);
            let id = actor_id(index);
            self.calls.heartbeat += 1;
            if self.hub_mut()?.heartbeat(id, now).is_err() {
                self.register(index)?;
            }
        }
        let actor = &self.actors[index];
        if actor.batch.is_none() && actor.catch_up.is_none() && actor.leaving_at.is_none() {
            self.claim(index)?;
        }
        Ok(())
    }

    fn register(&mut self, index: usize) -> Result<(), Violation> {
        let actor = &self.actors[index];
        // A machine about to be reclaimed does not start a new process.
        if actor.leaving_at.is_some() {
            return Ok(());
        }
        let registration = Registration {
            region: actor.region.clone(),
            capabilities: Capabilities {
                can_relay: actor.spec.can_relay,
            },
            active: actor.active,
            staged: actor.staged,
        };
        let now = self.now;
        self.calls.register += 1;
        match self.hub_mut()?.register(actor_id(index), registration, now) {
            Ok(readiness) => {
                self.incarnations[index] += 1;
                let actor = &mut self.actors[index];
                actor.registered = true;
                actor.versions_to_report = false;
                self.follow(index, readiness);
                Ok(())
            }
            // The pool is full: try again at the next wakeup.
            Err(MembershipError::ActorLimit { .. }) => Ok(()),
            Err(error) => Err(self.violation(format!("register {}: {error}", actor_id(index)))),
        }
    }

    fn report_versions(&mut self, index: usize) -> Result<(), Violation> {
        let (active, staged, now) = (
            self.actors[index].active,
            self.actors[index].staged,
            self.now,
        );
        self.actors[index].versions_to_report = false;
        self.calls.report_versions += 1;
        match self
            .hub_mut()?
            .report_versions(actor_id(index), active, staged, now)
        {
            Ok(readiness) => {
                self.follow(index, readiness);
                Ok(())
            }
            Err(MembershipError::UnknownActor(_)) => self.register(index),
            Err(error) => {
                Err(self.violation(format!("report versions of {}: {error}", actor_id(index))))
            }
        }
    }

    /// Acts on a readiness: an actor told to catch up fetches from the store, unless
    /// the delta it needs is already on its way.
    fn follow(&mut self, index: usize, readiness: Readiness) {
        let Readiness::CatchUp { target } = readiness else {
            return;
        };
        let actor = &mut self.actors[index];
        let delta_on_its_way = actor.active.next() == Some(target)
            && actor.staging.is_some_and(|(_, version)| version == target);
        if actor.catch_up.is_none() && !delta_on_its_way {
            let missed = target.0.saturating_sub(actor.active.0);
            let done_at = self.now.saturating_add(500 + 200 * missed);
            actor.catch_up = Some((done_at, target));
        }
    }

    fn claim(&mut self, index: usize) -> Result<(), Violation> {
        let now = self.now;
        self.calls.claim += 1;
        let assignment = match self.hub_mut()?.claim(actor_id(index), now) {
            Ok(assignment) => assignment,
            Err(_) => return self.register(index),
        };
        match assignment {
            Assignment::Work { commit, leases } => {
                if let Some(version) = commit {
                    let actor = &mut self.actors[index];
                    if actor.staged != Some(version) {
                        return Err(self.violation(format!(
                            "Commit({version}) to an actor without it staged"
                        )));
                    }
                    actor.active = version;
                    actor.staged = None;
                    self.report_versions(index)?;
                }
                if !leases.is_empty() {
                    self.start_batch(index, leases)?;
                }
            }
            Assignment::CatchUp { target } => self.follow(index, Readiness::CatchUp { target }),
            Assignment::Leaving { .. } => {
                return Err(self.violation(format!(
                    "{} claimed work after its preemption notice",
                    actor_id(index)
                )));
            }
            Assignment::NoOpenStep => {}
        }
        Ok(())
    }

    fn start_batch(&mut self, index: usize, grants: Vec<LeaseGrant>) -> Result<(), Violation> {
        let now = self.now;
        for grant in &grants {
            let actor = &self.actors[index];
            if grant.version != actor.active {
                return Err(self.violation(format!(
                    "{} leased for {} while active on {}",
                    grant.lease, grant.version, actor.active
                )));
            }
            let record = GrantRecord {
                actor: index,
                incarnation: self.incarnations[index],
                version: grant.version,
                expires_at: grant.expires_at,
            };
            if self.grants.insert(grant.lease, record).is_some() {
                return Err(self.violation(format!("{} granted twice", grant.lease)));
            }
            if grant.lease.attempt > 0 {
                self.reissued_leases += 1;
            }
            self.latest_grant.insert(grant.prompt, grant.lease);
        }
        let drift = u64::from(self.scenario.drift.get());
        let change = self.rng.range(1000 - drift, 1000 + drift);
        let actor = &mut self.actors[index];
        actor.drift_permille = (actor.drift_permille * change / 1000).clamp(700, 1300);
        let tokens: Vec<u64> = grants
            .iter()
            .map(|grant| self.scenario.tokens_for(grant.prompt))
            .collect();
        let speed = actor.speed_tokens_per_s(now);
        let duration_ms = match actor.spec.decode {
            // Drift and slowdowns scale the engine's time as they scale its speed.
            Some(decode) => {
                decode
                    .batch_ms(&tokens)
                    .saturating_mul(actor.spec.tokens_per_s.max(1))
                    / speed
            }
            None => tokens.iter().sum::<u64>() * 1000 / speed,
        }
        .max(1);
        let done_at = now.saturating_add(duration_ms);
        actor.busy.push((now, done_at));
        actor.batch = Some(Batch {
            grants,
            tokens,
            generated_on: actor.active,
            misbehavior: actor.misbehavior.take(),
            done_at,
        });
        Ok(())
    }

    fn submit(&mut self, index: usize) -> Result<(), Violation> {
        let Some(batch) = self.actors[index].batch.take() else {
            return Ok(());
        };
        let mut reports: Vec<RolloutReport> = batch
            .grants
            .iter()
            .zip(&batch.tokens)
            .map(|(grant, &tokens)| RolloutReport {
                lease: grant.lease,
                version: batch.generated_on,
                weights_hash: weights_hash(batch.generated_on),
                tokens,
            })
            .collect();
        match batch.misbehavior {
            Some(Misbehavior::CorruptHash) => {
                for report in &mut reports {
                    report.weights_hash.0[0] ^= 0xFF;
                }
            }
            Some(Misbehavior::StaleVersion) => {
                let stale = Version(batch.generated_on.0.saturating_sub(1));
                for report in &mut reports {
                    report.version = stale;
                    report.weights_hash = weights_hash(stale);
                }
            }
            Some(Misbehavior::ForgeLease) => reports[0].lease.attempt += 1_000,
            Some(Misbehavior::StealLease) => {
                let someone_elses = self
                    .grants
                    .iter()
                    .rev()
                    .find(|(_, grant)| grant.actor != index);
                if let Some((&lease, _)) = someone_elses {
                    reports[0].lease = lease;
                }
            }
            Some(Misbehavior::InflateTokens) => {
                reports[0].tokens = self.config.limits.max_tokens_per_result + 1;
            }
            Some(Misbehavior::ExaggerateTokens) => {
                for report in &mut reports {
                    report.tokens = self.config.limits.max_tokens_per_result;
                }
            }
            Some(Misbehavior::ResubmitBatch) | None => {}
        }
        self.submit_reports(index, &reports)?;
        if batch.misbehavior == Some(Misbehavior::ResubmitBatch) {
            self.submit_reports(index, &reports)?;
        }
        Ok(())
    }

    fn submit_reports(&mut self, index: usize, reports: &[RolloutReport]) -> Result<(), Violation> {
        let now = self.now;
        let id = actor_id(index);
        let estimate_before = self.hub_mut()?.member(id).map(|member| member.estimate);
        self.calls.submit += 1;
        let outcomes = match self.hub_mut()?.submit(id, reports, now) {
            Ok(outcomes) => outcomes,
            Err(error) => return Err(self.violation(format!("submit: {error}"))),
        };
        let estimate_after = self.hub_mut()?.member(id).map(|member| member.estimate);
        if let (Some(before), Some(after)) = (estimate_before, estimate_after) {
            self.check_estimate_growth(id, before, after)?;
        }
        for (report, outcome) in reports.iter().zip(outcomes) {
            match outcome {
                Ok(accepted) => self.check_accepted(index, report, accepted)?,
                Err(rejection) => {
                    *self.rejected_outcomes.entry(rejection).or_insert(0) += 1;
                    if rejection == Rejection::UnknownActor {
                        self.actors[index].registered = false;
                    }
                }
            }
        }
        Ok(())
    }

    fn schedule_next_wake(&mut self, index: usize) {
        let now = self.now;
        let actor = &self.actors[index];
        if actor.presence != Presence::Online {
            return;
        }
        let mut next = match self.scenario.liveness {
            Liveness::Heartbeats => actor.next_heartbeat.max(now.saturating_add(1)),
            // Nothing to say between calls: the actor wakes for its own work alone.
            Liveness::LeaseExpiry => Millis(u64::MAX),
        };
        let mut consider = |at: Millis| next = next.min(at.max(now.saturating_add(1)));
        if let Some(batch) = &actor.batch {
            consider(batch.done_at);
        } else {
            consider(now.saturating_add(POLL_MS));
        }
        if let Some((at, _)) = actor.staging {
            consider(at);
        }
        if let Some((at, _)) = actor.catch_up {
            consider(at);
        }
        if now < actor.partitioned_until {
            consider(actor.partitioned_until);
        }
        if let Some(at) = actor.leaving_at {
            consider(at);
        }
        self.wake_actor_at(index, next);
    }

    /// The process is gone: its work in flight and its staged delta with it; what it
    /// has on disk (the active version) survives.
    pub(super) fn take_offline(&mut self, index: usize, presence: Presence) {
        let actor = &mut self.actors[index];
        actor.presence = presence;
        actor.offline_since = Some(self.now);
        actor.leaving_at = None;
        actor.registered = false;
        actor.batch = None;
        actor.staged = None;
        actor.staging = None;
        actor.catch_up = None;
        actor.misbehavior = None;
        actor.wake_generation += 1;
        if let Some(last) = actor.busy.last_mut() {
            last.1 = last.1.min(self.now);
        }
    }
}
