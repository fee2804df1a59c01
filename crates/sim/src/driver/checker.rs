//! The checker: the invariants the core must keep, tested against the driver's own
//! model of what happened. Separate so the promises are read in one place.

use std::collections::{BTreeMap, BTreeSet};

use aurora_control::{
    Accepted, ActorId, MAX_SAMPLE_GROWTH, MilliTokensPerS, PromptId, RolloutReport, StepOutcome,
    StepReport,
};

use super::{PostedStep, Sim, TrainerPhase};
use crate::report::Violation;
use crate::world::{MAX_TIMER_LAG_MS, STEP_TIME_LIMIT_MS, actor_id, weights_hash};

impl Sim<'_> {
    /// One settlement raises an estimate by at most the average of the old estimate
    /// and [`MAX_SAMPLE_GROWTH`] times it (or the newcomer floor), whatever the actor
    /// reported.
    pub(super) fn check_estimate_growth(
        &self,
        actor: ActorId,
        before: MilliTokensPerS,
        after: MilliTokensPerS,
    ) -> Result<(), Violation> {
        let scheduler = &self.config.scheduler;
        let base = before.max(scheduler.new_actor_estimate.floor());
        let largest_sample = MilliTokensPerS::from_milli_tokens_per_s(
            base.milli_tokens_per_s().saturating_mul(MAX_SAMPLE_GROWTH),
        );
        let bound = before.averaged_with(largest_sample, scheduler.estimate_weight);
        if after > bound {
            return Err(self.violation(format!(
                "one settlement raised the estimate of {actor} from {} to {} tokens/s, above {}",
                before.tokens_per_s(),
                after.tokens_per_s(),
                bound.tokens_per_s()
            )));
        }
        Ok(())
    }

    pub(super) fn check_accepted(
        &mut self,
        index: usize,
        report: &RolloutReport,
        accepted: Accepted,
    ) -> Result<(), Violation> {
        self.accepted_outcomes += 1;
        let now = self.now;
        let lease = report.lease;
        let Some(&grant) = self.grants.get(&lease) else {
            return Err(self.violation(format!("accepted {lease}, which was never granted")));
        };
        let problem = if grant.actor != index {
            Some(format!(
                "accepted {lease} from {} but it was granted to {}",
                actor_id(index),
                actor_id(grant.actor)
            ))
        } else if now >= grant.expires_at {
            Some(format!(
                "accepted {lease} at or after its expiry {}",
                grant.expires_at
            ))
        } else if report.version != grant.version
            || report.weights_hash != weights_hash(grant.version)
        {
            Some(format!(
                "accepted {lease} generated on {} for a job on {}",
                report.version, grant.version
            ))
        } else if grant.incarnation != self.incarnations[index] {
            Some(format!(
                "accepted {lease} from a forgotten incarnation of {}",
                actor_id(index)
            ))
        } else {
            None
        };
        if let Some(problem) = problem {
            return Err(self.violation(problem));
        }
        let Some(posted) = self.posted.get_mut(&lease.step) else {
            return Err(self.violation(format!("accepted {lease} of an unknown step")));
        };
        if !posted.prompts.contains(&accepted.prompt) {
            return Err(self.violation(format!(
                "accepted {} which {} never posted",
                accepted.prompt, lease.step
            )));
        }
        if posted
            .accepted
            .insert(accepted.prompt, actor_id(index))
            .is_some()
        {
            return Err(self.violation(format!(
                "accepted {} of {} twice",
                accepted.prompt, lease.step
            )));
        }
        posted.accepted_tokens += report.tokens;
        self.actors[index].accepted += 1;
        Ok(())
    }

    /// No step stays open past the time limit: cheap, so checked after every event.
    pub(super) fn check_progress(&self) -> Result<(), Violation> {
        if let TrainerPhase::StepOpen(step) = self.trainer
            && let Some(posted) = self.posted.get(&step)
            && self.now.saturating_since(posted.opened_at) > STEP_TIME_LIMIT_MS
        {
            return Err(self.violation(format!(
                "stalled: {step} open for over {STEP_TIME_LIMIT_MS} ms"
            )));
        }
        Ok(())
    }

    /// Invariants that hold between any two events.
    pub(super) fn check_state(&self) -> Result<(), Violation> {
        self.check_progress()?;
        let Some(hub) = self.hub.as_ref() else {
            return Ok(());
        };
        let members = hub.members();
        // The core's own invariants (the checks a restore runs).
        hub.check_invariants()
            .map_err(|error| self.violation(format!("core invariant: {error}")))?;
        if let Some(progress) = hub.step_progress()
            && progress.reserved > progress.pooled
        {
            return Err(self.violation(format!("more reserved than pooled: {progress:?}")));
        }
        // The core's view, prompt by prompt, against what the driver saw: the prompts
        // it posted, the acceptances the actors were told of, the grants they got.
        if let Some(report) = hub.step_report() {
            let Some(posted) = self.posted.get(&report.step) else {
                return Err(self.violation(format!("{} was never opened", report.step)));
            };
            check_step_report(posted, &report, |prompt| {
                let lease = self.latest_grant.get(&prompt)?;
                self.grants.get(lease).map(|grant| actor_id(grant.actor))
            })
            .map_err(|problem| self.violation(problem))?;
            if let Some(&(prompt, holder)) = report
                .leased
                .iter()
                .find(|(_, holder)| !members.contains_key(holder))
            {
                return Err(self.violation(format!("{prompt} is leased to {holder}, who is gone")));
            }
        }
        // A silent actor is forgotten within a timeout of its last message (or of the
        // hub's restart, which forgives the silence of the outage), plus timer lag.
        let grace_ms = self.config.heartbeat_timeout_ms + MAX_TIMER_LAG_MS;
        for (index, actor) in self.actors.iter().enumerate() {
            if let Some(offline_since) = actor.offline_since
                && members.contains_key(&actor_id(index))
                && self.now > offline_since.max(self.last_resume).saturating_add(grace_ms)
            {
                return Err(self.violation(format!(
                    "{} is gone since {offline_since} but still a member",
                    actor_id(index)
                )));
            }
        }
        if members.len() > self.config.limits.max_actors as usize {
            return Err(self.violation(format!("{} members, above the limit", members.len())));
        }
        for (region, relay) in hub.relays() {
            let qualifies = members
                .get(relay)
                .is_some_and(|member| member.region == *region && member.capabilities.can_relay);
            if !qualifies {
                return Err(self.violation(format!("{relay} relays {region} but cannot")));
            }
        }
        for member in members.values() {
            let may_relay = member.capabilities.can_relay && member.leaving_at.is_none();
            if may_relay && !hub.relays().contains_key(&member.region) {
                return Err(self.violation(format!(
                    "{} has a relay-capable member but no relay",
                    member.region
                )));
            }
        }
        Ok(())
    }
}

/// Checks the core's prompt-level view of a step against the driver's: every posted
/// prompt appears exactly once among accepted, leased and pooled, and no other; the
/// accepted ones are exactly those the actors were told were accepted, by the same
/// actor; and each leased one is held by whoever the driver last saw it granted to
/// (`latest_holder`).
pub(super) fn check_step_report(
    posted: &PostedStep,
    report: &StepReport,
    latest_holder: impl Fn(PromptId) -> Option<ActorId>,
) -> Result<(), String> {
    let step = report.step;
    let listed = report
        .accepted
        .iter()
        .chain(&report.leased)
        .map(|&(prompt, _)| prompt)
        .chain(report.pooled.iter().copied());
    let mut seen = BTreeSet::new();
    for prompt in listed {
        if !posted.prompts.contains(&prompt) {
            return Err(format!("{step}: {prompt} was never posted"));
        }
        if !seen.insert(prompt) {
            return Err(format!("{step}: {prompt} is listed twice"));
        }
    }
    if let Some(lost) = posted.prompts.difference(&seen).next() {
        return Err(format!("{step}: {lost} was lost"));
    }
    let accepted: BTreeMap<PromptId, ActorId> = report.accepted.iter().copied().collect();
    if accepted != posted.accepted {
        return Err(format!(
            "{step}: the hub's accepted prompts differ from the actors' acceptances"
        ));
    }
    for &(prompt, holder) in &report.leased {
        if latest_holder(prompt) != Some(holder) {
            return Err(format!(
                "{step}: {prompt} is leased to {holder}, who was not granted it last"
            ));
        }
    }
    Ok(())
}

/// Checks a completed step's outcome against the driver's view: accepted results as
/// the actors were told, and accepted plus unfinished exactly the posted prompts.
pub(super) fn check_outcome(posted: &PostedStep, outcome: &StepOutcome) -> Result<(), String> {
    let step = outcome.step;
    let accepted: BTreeMap<PromptId, ActorId> = outcome.accepted.iter().copied().collect();
    if accepted != posted.accepted || accepted.len() != outcome.accepted.len() {
        return Err(format!(
            "{step}: the outcome's accepted prompts differ from the actors' acceptances"
        ));
    }
    let mut all: BTreeSet<PromptId> = accepted.keys().copied().collect();
    all.extend(outcome.unfinished.iter().copied());
    if all != posted.prompts || accepted.len() + outcome.unfinished.len() != posted.prompts.len() {
        return Err(format!("{step}: prompts lost or invented"));
    }
    Ok(())
}
