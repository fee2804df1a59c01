//! The job ledger: the published version, one step's batch of jobs, their leases, and
//! the acceptance rule.
//!
//! **Jobs.** Opening a step turns its `B` prompts into jobs for the step's version.
//! A job is always in exactly one state: pooled (waiting for a holder), leased (one
//! live lease), or accepted (final). A job never has two live leases, so it cannot be
//! accepted twice; a prompt is never lost, because every way a lease ends (expiry,
//! revocation, departure of its holder) puts the job back in the pool.
//!
//! **Acceptance rule.** A result is accepted iff, at the moment it is submitted, it
//! names the live lease of an open step's job, comes from that lease's holder, arrives
//! strictly before the lease expires, carries the step's version and that version's
//! weights hash h(v), and claims a plausible token count. Everything else is rejected
//! with a [`Rejection`] and counted per reason. A result that fails the version, hash
//! or token checks also revokes its lease at once: that holder will not produce a good
//! result for it, so waiting for the lease to run out would only delay the step.
//!
//! **Reservations.** Opening a step reserves each eligible actor its share of the
//! batch (computed by [`crate::scheduler`]); a claim draws on the claimant's
//! reservation first and then on its fair share of the unreserved jobs (returned
//! prompts, lapsed reservations). Reservations lapse one lease lifetime after the step
//! opened: an actor that has not started its share by then would not finish it in time
//! either, and its share must not block the step.
//!
//! **Completion.** A step completes when all `B` jobs are accepted or, under a
//! [`crate::PartialBatchPolicy`], when its deadline has passed and enough are accepted. On
//! completion every live lease is void and later results are rejected as
//! [`Rejection::StepClosed`].

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::config::Config;
use crate::events::{Event, EventQueue};
use crate::lease::LeaseTimer;
use crate::values::{ActorId, LeaseId, Millis, PromptId, StepId, Version, WeightsHash};

mod check;
mod types;
mod views;

pub(crate) use check::check_time;
pub use types::{
    Accepted, Completion, LeaseGrant, OpenStepError, PublishError, Rejection, RolloutReport, Stats,
    StepOutcome, StepProgress, StepReport,
};

/// A job the ledger just accepted, with what the throughput estimate needs.
pub(crate) struct SettledJob {
    pub(crate) accepted: Accepted,
    pub(crate) issued_at: Millis,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct PublishedVersion {
    version: Version,
    weights_hash: WeightsHash,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct LiveLease {
    attempt: u64,
    holder: ActorId,
    issued_at: Millis,
    expires_at: Millis,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
enum JobState {
    Pooled,
    Leased(LiveLease),
    Accepted { by: ActorId },
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Job {
    prompt: PromptId,
    /// Leases issued so far; the next lease's attempt number.
    attempts: u64,
    state: JobState,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Step {
    id: StepId,
    version: Version,
    weights_hash: WeightsHash,
    opened_at: Millis,
    jobs: Vec<Job>,
    /// Jobs set aside for each eligible actor at opening and not yet claimed.
    reservations: BTreeMap<ActorId, u32>,
    reservations_lapse_at: Millis,
    /// Whether a sweep has run at or after the partial-batch deadline. From then on
    /// the completion check that follows every accept is enough, and the deadline is
    /// no longer reported as a timer.
    partial_deadline_swept: bool,
    completion: Option<Completion>,
    /// Whether the trainer has taken the completed step's outcome; the next step
    /// cannot open before, so no accepted result or unfinished prompt is dropped.
    outcome_taken: bool,
    /// Where the jobs stand, derived from `jobs`: not stored, rebuilt on restore.
    #[serde(skip)]
    index: JobIndex,
}

/// The jobs of a step by state, kept beside them so that no call scans the batch:
/// at 1,000 actors and 64,000 prompts a scan per claim, submit and deadline made the
/// core's cost per step grow with actors times prompts (`cargo bench -p
/// aurora-control --bench calls`). Every change of a job's state goes through
/// [`Step::set_state`], which keeps it; [`Ledger::check`] compares it with a rebuild.
#[derive(Clone, Debug, Default)]
struct JobIndex {
    /// Pooled jobs: grants take the lowest, as a scan of the batch would.
    pooled: BTreeSet<u32>,
    /// Live leases by expiry: the sweep and the next deadline read the front.
    expiries: BTreeSet<(Millis, u32)>,
    /// Live leases per holder.
    held: BTreeMap<ActorId, u32>,
    /// Accepted jobs.
    accepted: u32,
}

impl JobIndex {
    fn of(jobs: &[Job]) -> JobIndex {
        let mut index = JobIndex::default();
        for (position, job) in (0u32..).zip(jobs) {
            index.add(position, job.state);
        }
        index
    }

    fn add(&mut self, position: u32, state: JobState) {
        match state {
            JobState::Pooled => {
                self.pooled.insert(position);
            }
            JobState::Leased(live) => {
                self.expiries.insert((live.expires_at, position));
                *self.held.entry(live.holder).or_insert(0) += 1;
            }
            JobState::Accepted { .. } => self.accepted += 1,
        }
    }

    fn remove(&mut self, position: u32, state: JobState) {
        match state {
            JobState::Pooled => {
                self.pooled.remove(&position);
            }
            JobState::Leased(live) => {
                self.expiries.remove(&(live.expires_at, position));
                if let Some(count) = self.held.get_mut(&live.holder) {
                    *count -= 1;
                    if *count == 0 {
                        self.held.remove(&live.holder);
                    }
                }
            }
            JobState::Accepted { .. } => self.accepted -= 1,
        }
    }

    fn pooled(&self) -> u32 {
        // Jobs are bounded by `max_batch_size`, a u32.
        u32::try_from(self.pooled.len()).unwrap_or(u32::MAX)
    }

    fn leased(&self) -> u32 {
        u32::try_from(self.expiries.len()).unwrap_or(u32::MAX)
    }

    /// Whether two indexes list the same jobs the same way.
    fn agrees_with(&self, other: &JobIndex) -> bool {
        self.pooled == other.pooled
            && self.expiries == other.expiries
            && self.held == other.held
            && self.accepted == other.accepted
    }
}

/// The index is derived from the jobs, which `Step` compares already: two steps with
/// the same jobs are equal whether or not one's index has been rebuilt yet (a
/// deserialized snapshot's has not).
impl PartialEq for JobIndex {
    fn eq(&self, _: &JobIndex) -> bool {
        true
    }
}

impl Eq for JobIndex {}

impl Step {
    /// Moves job `position` to `state`, keeping the index.
    fn set_state(&mut self, position: u32, state: JobState) {
        let job = &mut self.jobs[position as usize];
        self.index.remove(position, job.state);
        job.state = state;
        self.index.add(position, state);
    }

    /// The live lease on job `position`, if it has one.
    fn live_lease(&self, position: u32) -> Option<LiveLease> {
        match self.jobs[position as usize].state {
            JobState::Leased(live) => Some(live),
            JobState::Pooled | JobState::Accepted { .. } => None,
        }
    }
}

/// The ledger's whole state.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Ledger {
    published: Option<PublishedVersion>,
    step: Option<Step>,
    next_step: StepId,
    lease_timer: LeaseTimer,
    stats: Stats,
    /// Holders of leases that expired during the current call, drained by
    /// [`Ledger::take_expired_holders`] before the call returns, so it is always
    /// empty between calls and never part of a snapshot.
    #[serde(skip)]
    expired_holders: BTreeSet<ActorId>,
}

impl Ledger {
    /// The latest published version and its hash.
    pub(crate) fn latest(&self) -> Option<(Version, WeightsHash)> {
        self.published
            .map(|published| (published.version, published.weights_hash))
    }

    /// Records h(version) for a new version.
    pub(crate) fn publish(
        &mut self,
        version: Version,
        weights_hash: WeightsHash,
    ) -> Result<(), PublishError> {
        if let Some(latest) = self.published
            && latest.version.next() != Some(version)
        {
            return Err(PublishError::NotNext {
                latest: latest.version,
                offered: version,
            });
        }
        self.published = Some(PublishedVersion {
            version,
            weights_hash,
        });
        Ok(())
    }

    /// Opens a step on the latest version with no reservations yet; the caller reserves
    /// shares with [`Ledger::reserve`] once it knows who is eligible.
    pub(crate) fn open(
        &mut self,
        prompts: &[PromptId],
        now: Millis,
        config: &Config,
    ) -> Result<(StepId, Version), OpenStepError> {
        let published = self.published.ok_or(OpenStepError::NothingPublished)?;
        if let Some(step) = self.open_step() {
            return Err(OpenStepError::StepStillOpen(step.id));
        }
        if let Some(step) = self.step.as_ref().filter(|step| !step.outcome_taken) {
            return Err(OpenStepError::OutcomeNotTaken(step.id));
        }
        if prompts.is_empty() {
            return Err(OpenStepError::EmptyBatch);
        }
        let max = config.limits.max_batch_size;
        if prompts.len() > usize::try_from(max).unwrap_or(usize::MAX) {
            return Err(OpenStepError::BatchTooLarge {
                size: prompts.len(),
                max,
            });
        }
        let mut seen = BTreeSet::new();
        if let Some(&duplicate) = prompts.iter().find(|&&prompt| !seen.insert(prompt)) {
            return Err(OpenStepError::DuplicatePrompt(duplicate));
        }
        let id = self.next_step;
        self.next_step = StepId(id.0.saturating_add(1));
        let jobs: Vec<Job> = prompts
            .iter()
            .map(|&prompt| Job {
                prompt,
                attempts: 0,
                state: JobState::Pooled,
            })
            .collect();
        let index = JobIndex::of(&jobs);
        self.step = Some(Step {
            id,
            version: published.version,
            weights_hash: published.weights_hash,
            opened_at: now,
            jobs,
            reservations: BTreeMap::new(),
            reservations_lapse_at: now.saturating_add(self.lease_timer.lease_ms(&config.lease)),
            partial_deadline_swept: false,
            completion: None,
            outcome_taken: false,
            index,
        });
        Ok((id, published.version))
    }

    /// Sets aside jobs of the open step for particular actors. The shares come from a
    /// split of the batch, so they never add up to more than the pool.
    pub(crate) fn reserve(&mut self, shares: impl IntoIterator<Item = (ActorId, u32)>) {
        let Some(step) = self.open_step_mut() else {
            return;
        };
        let mut unreserved = step.index.pooled();
        for (actor, share) in shares {
            let share = share.min(unreserved);
            if share > 0 {
                unreserved -= share;
                step.reservations.insert(actor, share);
            }
        }
    }

    /// The open step's version, if a step is open.
    pub(crate) fn open_version(&self) -> Option<Version> {
        self.open_step().map(|step| step.version)
    }

    /// Pooled jobs of the open step that nobody has a reservation on.
    pub(crate) fn unreserved(&self) -> u32 {
        self.open_step().map_or(0, |step| {
            step.index
                .pooled()
                .saturating_sub(step.reservations.values().sum())
        })
    }

    /// Leases pooled jobs to `actor`: its reservation plus `unreserved_share` more, up
    /// to its live-lease limit.
    pub(crate) fn grant(
        &mut self,
        actor: ActorId,
        unreserved_share: u32,
        now: Millis,
        config: &Config,
    ) -> Vec<LeaseGrant> {
        // The lifetime sorts the completion window: worked out only for a claim that
        // gets something, not for an idle actor's poll.
        let lease_timer = &self.lease_timer;
        let Some(step) = self.step.as_mut().filter(|step| step.completion.is_none()) else {
            return Vec::new();
        };
        let held = step.index.held.get(&actor).copied().unwrap_or(0);
        let capacity = config.limits.max_leases_per_actor.saturating_sub(held);
        let reserved = step.reservations.get(&actor).copied().unwrap_or(0);
        let wanted = reserved.saturating_add(unreserved_share).min(capacity);
        let positions: Vec<u32> = step
            .index
            .pooled
            .iter()
            .take(usize::try_from(wanted).unwrap_or(usize::MAX))
            .copied()
            .collect();
        if positions.is_empty() {
            return Vec::new();
        }
        let expires_at = now.saturating_add(lease_timer.lease_ms(&config.lease));
        let mut grants = Vec::with_capacity(positions.len());
        for index in positions {
            let job = &mut step.jobs[index as usize];
            let lease = LeaseId {
                step: step.id,
                job: index,
                attempt: job.attempts,
            };
            job.attempts += 1;
            let prompt = job.prompt;
            step.set_state(
                index,
                JobState::Leased(LiveLease {
                    attempt: lease.attempt,
                    holder: actor,
                    issued_at: now,
                    expires_at,
                }),
            );
            grants.push(LeaseGrant {
                lease,
                prompt,
                version: step.version,
                expires_at,
            });
        }
        // The reservation is drawn on first: what it does not cover came from the
        // unreserved pool.
        let granted = u32::try_from(grants.len()).unwrap_or(u32::MAX);
        let left = reserved.saturating_sub(granted);
        if left == 0 {
            step.reservations.remove(&actor);
        } else {
            step.reservations.insert(actor, left);
        }
        grants
    }

    /// Applies the acceptance rule to one result and counts a rejection.
    pub(crate) fn judge(
        &mut self,
        actor: ActorId,
        report: &RolloutReport,
        now: Millis,
        config: &Config,
        events: &mut EventQueue,
    ) -> Result<SettledJob, Rejection> {
        let outcome = self.accept(actor, report, now, config, events);
        if let Err(rejection) = outcome {
            self.count_rejection(rejection);
        }
        outcome
    }

    /// Counts a rejection decided outside the ledger (an unknown actor).
    pub(crate) fn count_rejection(&mut self, rejection: Rejection) {
        *self.stats.rejected.entry(rejection).or_insert(0) += 1;
    }

    /// Drops `actor`'s reservation (it will take no new work); its leases stay live.
    pub(crate) fn drop_reservation(&mut self, actor: ActorId) {
        if let Some(step) = self.open_step_mut() {
            step.reservations.remove(&actor);
        }
    }

    /// Returns every live lease of `actor` to the pool and drops its reservation;
    /// returns how many leases it held.
    pub(crate) fn release(&mut self, actor: ActorId) -> u32 {
        let Some(step) = self.open_step_mut() else {
            return 0;
        };
        step.reservations.remove(&actor);
        // Only live leases can be the actor's: look at those, not the whole batch.
        let held: Vec<u32> = step
            .index
            .expiries
            .iter()
            .map(|&(_, index)| index)
            .filter(|&index| {
                step.live_lease(index)
                    .is_some_and(|live| live.holder == actor)
            })
            .collect();
        for &index in &held {
            step.set_state(index, JobState::Pooled);
        }
        u32::try_from(held.len()).unwrap_or(u32::MAX)
    }

    /// Applies everything due by `now`: expired leases return to the pool, lapsed
    /// reservations are dropped, and the step completes if its partial-batch deadline
    /// has come with enough accepted.
    pub(crate) fn sweep(&mut self, now: Millis, config: &Config, events: &mut EventQueue) {
        let Some(step) = self.open_step_mut() else {
            return;
        };
        let due: Vec<u32> = step
            .index
            .expiries
            .iter()
            .take_while(|&&(expires_at, _)| now >= expires_at)
            .map(|&(_, index)| index)
            .collect();
        let expiries: Vec<Expiry> = due
            .into_iter()
            .filter_map(|index| expire(step, index))
            .collect();
        if now >= step.reservations_lapse_at {
            step.reservations.clear();
        }
        if let Some(policy) = config.partial_batch
            && now >= policy.deadline(step.opened_at)
        {
            step.partial_deadline_swept = true;
        }
        for expiry in expiries {
            self.record_expiry(expiry, config, events);
        }
        self.complete_if_done(now, config, events);
    }

    /// Completes the open step if all its jobs are accepted, or if the partial-batch
    /// deadline has passed and enough are.
    pub(crate) fn complete_if_done(
        &mut self,
        now: Millis,
        config: &Config,
        events: &mut EventQueue,
    ) {
        let Some(step) = self.open_step_mut() else {
            return;
        };
        let batch_size = u32::try_from(step.jobs.len()).unwrap_or(u32::MAX);
        let accepted = step.index.accepted;
        let enough_for_partial = config.partial_batch.is_some_and(|policy| {
            now >= policy.deadline(step.opened_at)
                && accepted >= policy.minimum_accepted(batch_size)
        });
        if accepted < batch_size && !enough_for_partial {
            return;
        }
        let leased: Vec<u32> = step
            .index
            .expiries
            .iter()
            .map(|&(_, index)| index)
            .collect();
        for index in leased {
            step.set_state(index, JobState::Pooled);
        }
        step.reservations.clear();
        let partial = accepted < batch_size;
        step.completion = Some(Completion { at: now, partial });
        events.push(Event::StepCompleted {
            step: step.id,
            version: step.version,
            accepted,
            batch_size,
            partial,
        });
    }

    /// The earliest time at which [`Ledger::sweep`] would change something.
    pub(crate) fn next_deadline(&self, config: &Config) -> Option<Millis> {
        let step = self.open_step()?;
        let lease_expiries = step
            .index
            .expiries
            .first()
            .map(|&(expires_at, _)| expires_at);
        let lapse = (!step.reservations.is_empty()).then_some(step.reservations_lapse_at);
        let partial = config
            .partial_batch
            .filter(|_| !step.partial_deadline_swept)
            .map(|policy| policy.deadline(step.opened_at));
        lease_expiries.into_iter().chain(lapse).chain(partial).min()
    }

    fn accept(
        &mut self,
        actor: ActorId,
        report: &RolloutReport,
        now: Millis,
        config: &Config,
        events: &mut EventQueue,
    ) -> Result<SettledJob, Rejection> {
        // No step at all means no lease was ever issued.
        let step = self.step.as_mut().ok_or(Rejection::UnknownLease)?;
        let id = report.lease;
        if id.step != step.id {
            return Err(if id.step < step.id {
                Rejection::StepClosed
            } else {
                Rejection::UnknownLease
            });
        }
        if step.completion.is_some() {
            return Err(Rejection::StepClosed);
        }
        let job = usize::try_from(id.job)
            .ok()
            .and_then(|index| step.jobs.get(index))
            .ok_or(Rejection::UnknownLease)?;
        if id.attempt >= job.attempts {
            return Err(Rejection::UnknownLease);
        }
        let live = match job.state {
            JobState::Accepted { .. } => return Err(Rejection::Duplicate),
            JobState::Leased(live) if live.attempt == id.attempt => live,
            // An earlier attempt that expired or was revoked; the job moved on without it.
            JobState::Pooled | JobState::Leased(_) => return Err(Rejection::Late),
        };
        if live.holder != actor {
            return Err(Rejection::NotLeaseHolder);
        }
        let prompt = job.prompt;
        if now >= live.expires_at {
            if let Some(expiry) = expire(step, id.job) {
                self.record_expiry(expiry, config, events);
            }
            return Err(Rejection::Late);
        }
        let defect = if report.version != step.version {
            Some(Rejection::WrongVersion)
        } else if report.weights_hash != step.weights_hash {
            Some(Rejection::WrongHash)
        } else if report.tokens == 0 || report.tokens > config.limits.max_tokens_per_result {
            Some(Rejection::TokenCountOutOfRange)
        } else {
            None
        };
        if let Some(defect) = defect {
            step.set_state(id.job, JobState::Pooled);
            return Err(defect);
        }
        step.set_state(id.job, JobState::Accepted { by: actor });
        self.stats.accepted += 1;
        // Only a job's first lease samples the lifetime: one issued again (after an
        // expiry, a departure or a rejected result) goes out alone or in a small claim
        // at the step's tail and finishes in a fraction of a batch's time. At 1,000
        // actors one actor's expired claim became 64 such samples, filled the window
        // and cut the next step's leases to the minimum, which then all expired
        // (`aurora sim paper`'s run at scale). Expiries still count, whatever the
        // attempt, so a pool that slows down still lengthens its leases.
        if live.attempt == 0 {
            self.lease_timer
                .record_completion(now.saturating_since(live.issued_at), &config.lease);
        }
        Ok(SettledJob {
            accepted: Accepted { lease: id, prompt },
            issued_at: live.issued_at,
        })
    }

    /// Counts an expiry, and feeds it to the lease timer as a completion that took at
    /// least the lease's lifetime. Without that, a pool that slowed down (a survivor
    /// taking over a dead actor's share) could have every lease expire, no result
    /// accepted, and the lifetime never grow: a livelock. With it, when most leases
    /// expire the median rises to the lifetime and the next lease is 2-3x longer.
    fn record_expiry(&mut self, expiry: Expiry, config: &Config, events: &mut EventQueue) {
        self.stats.expired += 1;
        self.expired_holders.insert(expiry.holder);
        self.lease_timer
            .record_completion(expiry.lifetime_ms, &config.lease);
        events.push(Event::LeaseExpired {
            lease: expiry.lease,
            holder: expiry.holder,
        });
    }

    fn open_step(&self) -> Option<&Step> {
        self.step.as_ref().filter(|step| step.completion.is_none())
    }

    fn open_step_mut(&mut self) -> Option<&mut Step> {
        self.step.as_mut().filter(|step| step.completion.is_none())
    }
}

/// A lease that ran out, as recorded by [`Ledger::record_expiry`].
struct Expiry {
    lease: LeaseId,
    holder: ActorId,
    lifetime_ms: u64,
}

/// Returns the job at `index` to the pool if it is leased, and describes the lease
/// that ran out.
fn expire(step: &mut Step, index: u32) -> Option<Expiry> {
    let live = step.live_lease(index)?;
    step.set_state(index, JobState::Pooled);
    Some(Expiry {
        lease: LeaseId {
            step: step.id,
            job: index,
            attempt: live.attempt,
        },
        holder: live.holder,
        lifetime_ms: live.expires_at.saturating_since(live.issued_at),
    })
}
