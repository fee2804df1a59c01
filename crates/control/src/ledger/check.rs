//! The ledger's invariant check, which a restored snapshot must pass, and its helpers.

use std::collections::{BTreeMap, BTreeSet};

use crate::config::Config;
use crate::restore::RestoreError;
use crate::values::{ActorId, Millis};

use super::{Job, JobIndex, JobState, Ledger};

impl Ledger {
    /// Checks the ledger's invariants against `config`, the members and the clock:
    /// what [`crate::ControlPlane::restore`] demands of a snapshot.
    pub(crate) fn check(
        &self,
        config: &Config,
        is_member: impl Fn(ActorId) -> bool,
        clock: Millis,
    ) -> Result<(), RestoreError> {
        let window = usize::from(config.lease.completion_window);
        if self.lease_timer.len() > window {
            return Err(RestoreError::CompletionWindow {
                len: self.lease_timer.len(),
                max: config.lease.completion_window,
            });
        }
        let Some(step) = &self.step else {
            return Ok(());
        };
        let published = self.published.ok_or(RestoreError::NothingPublished)?;
        if step.id >= self.next_step {
            return Err(RestoreError::StepId {
                step: step.id,
                next: self.next_step,
            });
        }
        let open = step.completion.is_none();
        // A step is on the latest version or, once its successor has been published
        // while it runs (one-step asynchrony), on the one before.
        if step.version > published.version
            || (step.version == published.version && step.weights_hash != published.weights_hash)
        {
            return Err(RestoreError::StepVersion(step.id));
        }
        let max = config.limits.max_batch_size;
        if step.jobs.is_empty() || step.jobs.len() > usize::try_from(max).unwrap_or(usize::MAX) {
            return Err(RestoreError::BatchSize {
                step: step.id,
                size: step.jobs.len(),
                max,
            });
        }
        check_time("step opening", step.opened_at, clock)?;
        if let Some(completion) = step.completion {
            check_time("step completion", completion.at, clock)?;
        }
        let mut prompts = BTreeSet::new();
        let mut held: BTreeMap<ActorId, u32> = BTreeMap::new();
        for (index, job) in (0u32..).zip(&step.jobs) {
            if !prompts.insert(job.prompt) {
                return Err(RestoreError::DuplicatePrompt(job.prompt));
            }
            match job.state {
                JobState::Pooled => {}
                JobState::Accepted { .. } if job.attempts > 0 => {}
                JobState::Accepted { .. } => {
                    return Err(RestoreError::LeaseAttempt {
                        job: index,
                        attempt: 0,
                        attempts: 0,
                    });
                }
                JobState::Leased(live) => {
                    if !open {
                        return Err(RestoreError::LiveAfterCompletion(step.id));
                    }
                    if live.attempt.checked_add(1) != Some(job.attempts) {
                        return Err(RestoreError::LeaseAttempt {
                            job: index,
                            attempt: live.attempt,
                            attempts: job.attempts,
                        });
                    }
                    let lifetime_ms = live.expires_at.0.checked_sub(live.issued_at.0);
                    if !lifetime_ms
                        .is_some_and(|ms| (config.lease.min_ms..=config.lease.max_ms).contains(&ms))
                    {
                        return Err(RestoreError::LeaseLifetime {
                            job: index,
                            issued_at: live.issued_at,
                            expires_at: live.expires_at,
                        });
                    }
                    check_time("lease issue", live.issued_at, clock)?;
                    if !is_member(live.holder) {
                        return Err(RestoreError::UnknownHolder {
                            job: index,
                            holder: live.holder,
                        });
                    }
                    let count = held.entry(live.holder).or_insert(0);
                    *count += 1;
                    if *count > config.limits.max_leases_per_actor {
                        return Err(RestoreError::TooManyLeases {
                            actor: live.holder,
                            held: *count,
                            max: config.limits.max_leases_per_actor,
                        });
                    }
                }
            }
        }
        if !step.index.agrees_with(&JobIndex::of(&step.jobs)) {
            return Err(RestoreError::JobIndex(step.id));
        }
        if !open && !step.reservations.is_empty() {
            return Err(RestoreError::LiveAfterCompletion(step.id));
        }
        if let Some(&actor) = step.reservations.keys().find(|&&actor| !is_member(actor)) {
            return Err(RestoreError::UnknownReservation(actor));
        }
        let pooled = count_jobs(&step.jobs, |state| matches!(state, JobState::Pooled));
        let reserved: u64 = step.reservations.values().map(|&n| u64::from(n)).sum();
        if reserved > u64::from(pooled) {
            return Err(RestoreError::OverReserved { reserved, pooled });
        }
        if step
            .completion
            .is_some_and(|completion| !completion.partial)
        {
            let accepted = count_jobs(&step.jobs, |state| {
                matches!(state, JobState::Accepted { .. })
            });
            if usize::try_from(accepted).ok() != Some(step.jobs.len()) {
                return Err(RestoreError::IncompleteCompletion(step.id));
            }
        }
        Ok(())
    }

    /// Rebuilds the step's job index from its jobs: a deserialized ledger has none.
    pub(crate) fn rebuild_index(&mut self) {
        if let Some(step) = &mut self.step {
            step.index = JobIndex::of(&step.jobs);
        }
    }
}

/// Refuses a stored time later than the clock.
pub(crate) fn check_time(
    what: &'static str,
    at: Millis,
    clock: Millis,
) -> Result<(), RestoreError> {
    if at > clock {
        return Err(RestoreError::TimeAfterClock { what, at, clock });
    }
    Ok(())
}

fn count_jobs(jobs: &[Job], wanted: impl Fn(&JobState) -> bool) -> u32 {
    let count = jobs.iter().filter(|job| wanted(&job.state)).count();
    // Jobs are bounded by `max_batch_size`, a u32.
    u32::try_from(count).unwrap_or(u32::MAX)
}
