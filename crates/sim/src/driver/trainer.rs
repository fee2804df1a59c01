//! The trainer's side: opening steps, publishing each next version to the actors, and
//! taking a completed step's outcome.

use std::collections::BTreeMap;

use aurora_control::{PromptId, StepId};

use super::checker::check_outcome;
use super::{PostedStep, Presence, Sim, TrainerPhase, Wake};
use crate::report::{StepRecord, Violation};
use crate::world::{DISSEMINATION_ALLOWANCE_MS, actor_index, weights_hash};

impl Sim<'_> {
    pub(super) fn wake_trainer(&mut self) -> Result<(), Violation> {
        if self.hub.is_none() {
            self.schedule(self.now.saturating_add(100), Wake::Trainer);
            return Ok(());
        }
        match self.trainer {
            TrainerPhase::Opening => self.open_step(),
            TrainerPhase::Training => self.publish_next_version(),
            TrainerPhase::StepOpen(_) | TrainerPhase::Done | TrainerPhase::Down => Ok(()),
        }
    }

    /// The trainer back after a crash: where it stands follows from what is durable
    /// alone. The control plane must hold the last version it published; a step still
    /// open, or whose outcome is untaken, is waited for; one whose outcome it took is
    /// trained into the next version unless that is published already.
    pub(super) fn resume_trainer(&mut self) -> Result<(), Violation> {
        let hub = self.hub_mut()?;
        let latest = hub.latest_version().map(|(version, _)| version);
        let progress = hub.step_progress();
        let untaken = hub.step_outcome().is_some();
        if latest != Some(self.version) {
            return Err(self.violation(format!(
                "the restored control plane's latest version is {latest:?}, the trainer published {}",
                self.version
            )));
        }
        let completed = self.steps.len() as u64;
        match progress {
            // A step that completed as the control plane came back is handed over by its
            // completion event, as any other.
            Some(p) if p.completion.is_none() || untaken => {
                self.trainer = TrainerPhase::StepOpen(p.step)
            }
            _ if completed >= u64::from(self.scenario.steps) => self.trainer = TrainerPhase::Done,
            _ => {
                self.trainer = if completed > self.version.0 {
                    TrainerPhase::Training
                } else {
                    TrainerPhase::Opening
                };
                self.schedule(self.now, Wake::Trainer);
            }
        }
        Ok(())
    }

    fn open_step(&mut self) -> Result<(), Violation> {
        let batch_size = u64::from(self.scenario.batch_size);
        let prompts: Vec<PromptId> = (self.next_prompt..self.next_prompt + batch_size)
            .map(PromptId)
            .collect();
        self.next_prompt += batch_size;
        let now = self.now;
        let step = self
            .hub_mut()?
            .open_step(&prompts, now)
            .map_err(|error| Violation {
                seed: self.scenario.seed,
                at: now,
                message: format!("open step: {error}"),
            })?;
        let posted = PostedStep {
            version: self.version,
            opened_at: now,
            prompts: prompts.into_iter().collect(),
            accepted: BTreeMap::new(),
            accepted_tokens: 0,
        };
        self.posted.insert(step, posted);
        self.trainer = TrainerPhase::StepOpen(step);
        Ok(())
    }

    fn publish_next_version(&mut self) -> Result<(), Violation> {
        let base = self.version;
        let Some(next) = base.next() else {
            return Err(self.violation("ran out of versions".into()));
        };
        let now = self.now;
        self.hub_mut()?
            .publish_version(next, weights_hash(next))
            .map_err(|error| Violation {
                seed: self.scenario.seed,
                at: now,
                message: format!("publish: {error}"),
            })?;
        self.version = next;
        for index in 0..self.actors.len() {
            let actor = &self.actors[index];
            if actor.presence != Presence::Online {
                continue;
            }
            // The delta reaches a partitioned actor once the partition heals.
            let arrives = now
                .max(actor.partitioned_until)
                .saturating_add(self.rng.range(50, 400));
            self.actors[index].staging = Some((arrives, next));
            self.wake_actor_at(index, arrives);
        }
        self.trainer = TrainerPhase::Opening;
        self.schedule(
            now.saturating_add(DISSEMINATION_ALLOWANCE_MS),
            Wake::Trainer,
        );
        Ok(())
    }

    pub(super) fn complete_step(&mut self, step: StepId, partial: bool) -> Result<(), Violation> {
        let now = self.now;
        let Some(hub) = self.hub.as_mut() else {
            return Ok(());
        };
        let outcome = hub.take_step_outcome();
        if hub.take_step_outcome().is_some() {
            return Err(self.violation(format!("{step}: outcome handed out twice")));
        }
        let Some(hub) = self.hub.as_ref() else {
            return Ok(());
        };
        let live_actors = hub.members().len() as u32;
        let estimates = hub
            .members()
            .iter()
            .map(|(&id, member)| {
                let actor = actor_index(id).and_then(|index| self.actors.get(index));
                let label = actor.map_or_else(|| id.to_string(), |actor| actor.spec.label.clone());
                (label, member.estimate.tokens_per_s())
            })
            .collect();
        let Some(outcome) = outcome.filter(|outcome| outcome.step == step) else {
            return Err(self.violation(format!(
                "{step} completed but the hub has no outcome for it"
            )));
        };
        let Some(posted) = self.posted.get(&step) else {
            return Err(self.violation(format!("{step} completed but was never opened")));
        };
        check_outcome(posted, &outcome).map_err(|problem| self.violation(problem))?;
        let accepted = &posted.accepted;
        let batch_size = posted.prompts.len();
        match (partial, self.config.partial_batch) {
            (false, _) if accepted.len() != batch_size => {
                return Err(self.violation(format!(
                    "{step} completed with {} of {batch_size}",
                    accepted.len()
                )));
            }
            (true, None) => {
                return Err(self.violation(format!("{step} completed partially without a policy")));
            }
            (true, Some(policy)) => {
                let minimum = policy.minimum_accepted(batch_size as u32);
                if (accepted.len() as u64) < u64::from(minimum)
                    || now < policy.deadline(posted.opened_at)
                {
                    return Err(self.violation(format!("{step} completed partially too early")));
                }
            }
            (false, _) => {}
        }
        self.steps.push(StepRecord {
            step,
            version: posted.version,
            opened_at: posted.opened_at,
            completed_at: now,
            accepted: accepted.len() as u32,
            accepted_tokens: posted.accepted_tokens,
            partial,
            live_actors,
            estimates,
        });
        if self.steps.len() >= self.scenario.steps as usize {
            self.trainer = TrainerPhase::Done;
        } else {
            self.trainer = TrainerPhase::Training;
            self.schedule(now.saturating_add(self.scenario.train_ms), Wake::Trainer);
        }
        Ok(())
    }
}
