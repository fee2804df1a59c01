//! Read-outs of the ledger: its step's progress, report and outcome, and its totals.

use std::collections::BTreeSet;

use crate::config::Config;
use crate::values::ActorId;

use super::{JobState, Ledger, Stats, StepOutcome, StepProgress, StepReport};

impl Ledger {
    /// Counts for the current or last step.
    pub(crate) fn progress(&self) -> Option<StepProgress> {
        let step = self.step.as_ref()?;
        Some(StepProgress {
            step: step.id,
            version: step.version,
            opened_at: step.opened_at,
            batch_size: u32::try_from(step.jobs.len()).unwrap_or(u32::MAX),
            accepted: step.index.accepted,
            leased: step.index.leased(),
            pooled: step.index.pooled(),
            reserved: step.reservations.values().sum(),
            completion: step.completion,
        })
    }

    /// Prompt-level outcome of the current or last step.
    pub(crate) fn report(&self) -> Option<StepReport> {
        let step = self.step.as_ref()?;
        let mut accepted = Vec::new();
        let mut leased = Vec::new();
        let mut pooled = Vec::new();
        for job in &step.jobs {
            match job.state {
                JobState::Accepted { by } => accepted.push((job.prompt, by)),
                JobState::Leased(live) => leased.push((job.prompt, live.holder)),
                JobState::Pooled => pooled.push(job.prompt),
            }
        }
        Some(StepReport {
            step: step.id,
            version: step.version,
            accepted,
            leased,
            pooled,
            completion: step.completion,
        })
    }

    /// The holders of leases that expired since the last call, each once.
    pub(crate) fn take_expired_holders(&mut self) -> BTreeSet<ActorId> {
        std::mem::take(&mut self.expired_holders)
    }

    /// The completed step's outcome, once; `None` while the step is open, or if it was
    /// taken already, or before the first step.
    pub(crate) fn take_outcome(&mut self) -> Option<StepOutcome> {
        let outcome = self.outcome()?;
        if let Some(step) = &mut self.step {
            step.outcome_taken = true;
        }
        Some(outcome)
    }

    /// The completed step's outcome if it has not been taken, leaving it untaken.
    pub(crate) fn outcome(&self) -> Option<StepOutcome> {
        let step = self.step.as_ref().filter(|step| !step.outcome_taken)?;
        let completion = step.completion?;
        let mut accepted = Vec::new();
        let mut unfinished = Vec::new();
        for job in &step.jobs {
            match job.state {
                JobState::Accepted { by } => accepted.push((job.prompt, by)),
                JobState::Leased(_) | JobState::Pooled => unfinished.push(job.prompt),
            }
        }
        Some(StepOutcome {
            step: step.id,
            version: step.version,
            accepted,
            unfinished,
            completion,
        })
    }

    /// Totals since creation.
    pub(crate) fn stats(&self) -> &Stats {
        &self.stats
    }

    /// The lifetime a lease issued now would get.
    pub(crate) fn lease_ms(&self, config: &Config) -> u64 {
        self.lease_timer.lease_ms(&config.lease)
    }
}
