//! [`Hub`]: the core behind a mutex, a [`Clock`], the durable store and the tokens.
//!
//! Every mutating call runs the same way ([`Hub::apply_with`]): under the lock, read
//! the clock, run the core method on a *copy* of the core, drain its events into the
//! log, commit the copy together with what the call changed besides the core (accepted
//! payloads, tokens), and only then install it and return. A failed commit therefore
//! leaves the live core equal to the stored one, and the caller (the HTTP handler)
//! reports an error instead of acknowledging anything that a crash could lose.
//! Working on a copy also keeps the live core intact if a core method ever panicked,
//! so a poisoned lock can be taken over safely.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
use std::time::Duration;

use aurora_control::{
    Accepted, ActorId, Assignment, Config, ConfigError, ControlPlane, MembershipError, Millis,
    OpenStepError, PromptId, PublishError, Readiness, Registration, Rejection, RolloutReport,
    StepId, StepOutcome, SubmitError, UnknownActor, Version, WeightsHash,
};
use serde_json::value::RawValue;
use thiserror::Error;

use crate::auth::{ActorToken, AuthError, claimed_actor, hash_token};
use crate::clock::Clock;
use crate::store::{AcceptedRollout, Changes, LoadError, PersistError, StateStore};

/// Settings of a hub.
#[derive(Clone, Debug)]
pub struct HubConfig {
    /// The fleet token: registration, status and metrics require it.
    pub token: String,
    /// The state database; created if missing, restored from if present.
    pub db_path: PathBuf,
    /// The core's settings for a fresh state. A restored state keeps the settings it
    /// was saved with, so a restart cannot change the rules under live leases.
    pub control: Config,
    /// Longest pause of the tick task, so that deadlines created between two ticks
    /// are noticed within this time even though nothing wakes the task early.
    pub tick_interval_max: Duration,
    /// Where the hub reads time ([`crate::SystemClock`] in production).
    pub clock: Arc<dyn Clock>,
}

/// Why a hub could not start.
#[derive(Debug, Error)]
pub enum OpenError {
    /// The configured core settings are invalid.
    #[error("invalid control config: {0}")]
    Config(#[from] ConfigError),
    /// The token is empty, which would let anyone in.
    #[error("the bearer token is empty")]
    EmptyToken,
    /// The stored state could not be loaded.
    #[error(transparent)]
    Load(#[from] LoadError),
}

/// Why a call on the hub failed.
#[derive(Debug, Error)]
pub enum CallError {
    /// The actor is not registered.
    #[error(transparent)]
    UnknownActor(#[from] UnknownActor),
    /// A registration or version report was refused.
    #[error(transparent)]
    Membership(#[from] MembershipError),
    /// A submission was refused as a whole.
    #[error(transparent)]
    Submit(#[from] SubmitError),
    /// A version could not be published.
    #[error(transparent)]
    Publish(#[from] PublishError),
    /// A step could not be opened.
    #[error(transparent)]
    OpenStep(#[from] OpenStepError),
    /// The new state could not be saved, so the call did not happen.
    #[error(transparent)]
    Persist(#[from] PersistError),
    /// Stored payloads could not be read, or disagree with the accepted results.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// The operating system gave no random bytes for a token.
    #[error("no random bytes for a token: {0}")]
    Entropy(getrandom::Error),
}

/// One result as an actor submits it: what the core judges, and the rollout itself.
#[derive(Clone, Debug)]
pub struct RolloutResult {
    /// What decides acceptance and feeds the throughput estimate.
    pub report: RolloutReport,
    /// The rollout, opaque to the hub: any JSON value (binary data as a base64
    /// string). Stored if the result is accepted, dropped otherwise.
    pub payload: Box<RawValue>,
}

/// A completed step, handed to the trainer once by [`Hub::take_step_outcome`].
#[derive(Clone, Debug)]
pub struct StepResults {
    /// The core's outcome: accepted prompts and unfinished ones.
    pub outcome: StepOutcome,
    /// Every accepted result's rollout, by prompt id.
    pub rollouts: Vec<AcceptedRollout>,
}

/// The shared state of a running hub. Methods are synchronous (they write to disk);
/// async callers run them on the blocking pool, except the `authenticate_*` methods,
/// which never wait on the disk.
pub struct Hub {
    core: Mutex<ControlPlane>,
    store: StateStore,
    clock: Arc<dyn Clock>,
    fleet_token: blake3::Hash,
    /// Hashes of the members' current tokens: written under the core's lock right
    /// after each commit, read by authentication without that lock (which a commit
    /// holds through an fsync).
    actor_tokens: RwLock<BTreeMap<ActorId, blake3::Hash>>,
    tick_interval_max: Duration,
    /// Leases handed out by this process. Not part of the core's state, so the metric
    /// restarts at zero with the process, as Prometheus counters may.
    leases_issued: AtomicU64,
}

impl Hub {
    /// Opens the state database, restoring the core saved there or starting a fresh
    /// one from `config.control`.
    ///
    /// The restored core carries on at the clock's current time: leases whose deadline
    /// passed while the hub was down expire now, the others keep their deadlines, and
    /// the actors' silence during the outage is forgiven (they could not reach it).
    pub fn open(config: HubConfig) -> Result<Hub, OpenError> {
        if config.token.is_empty() {
            return Err(OpenError::EmptyToken);
        }
        let (store, stored) = StateStore::open(&config.db_path)?;
        let core = match stored.snapshot {
            Some(snapshot) => ControlPlane::restore(snapshot, config.clock.now())
                .map_err(|error| OpenError::Load(LoadError::Restore(error)))?,
            None => ControlPlane::new(config.control)?,
        };
        Ok(Hub {
            core: Mutex::new(core),
            store,
            clock: config.clock,
            fleet_token: hash_token(config.token.as_bytes()),
            actor_tokens: RwLock::new(stored.tokens),
            tick_interval_max: config.tick_interval_max,
            leases_issued: AtomicU64::new(0),
        })
    }

    /// Publishes the trainer's `version` with h(version).
    pub fn publish_version(
        &self,
        version: Version,
        weights_hash: WeightsHash,
    ) -> Result<(), CallError> {
        self.apply(|core, _| core.publish_version(version, weights_hash))??;
        Ok(())
    }

    /// Opens a step on the latest version. The stored payloads of earlier steps are
    /// dropped in the same transaction: the trainer has consumed them.
    pub fn open_step(&self, prompts: &[PromptId]) -> Result<StepId, CallError> {
        Ok(self.apply_with(|core, now| {
            let opened = core.open_step(prompts, now);
            let changes = Changes {
                drop_rollouts_before: opened.as_ref().ok().copied(),
                ..Changes::default()
            };
            (opened, changes)
        })??)
    }

    /// The completed step's outcome and the payloads of its accepted results, by
    /// prompt id; `Some` once per completed step (see
    /// [`ControlPlane::take_step_outcome`]). Nothing is taken if the payloads cannot
    /// be read or do not match the accepted results.
    pub fn take_step_outcome(&self) -> Result<Option<StepResults>, CallError> {
        let mut core = self.lock();
        let mut next = core.clone();
        let Some(outcome) = next.take_step_outcome() else {
            return Ok(None);
        };
        let rollouts = self.rollouts(outcome.step)?;
        let mut accepted = outcome.accepted.clone();
        accepted.sort_unstable();
        let stored: Vec<(PromptId, ActorId)> = rollouts
            .iter()
            .map(|rollout| (rollout.prompt, rollout.actor))
            .collect();
        if let Some(prompt) = first_difference(&accepted, &stored) {
            return Err(LoadError::RolloutsMismatch {
                step: outcome.step,
                prompt,
            }
            .into());
        }
        self.commit_locked(&mut core, next, Changes::default())?;
        Ok(Some(StepResults { outcome, rollouts }))
    }

    /// The stored payloads of `step`'s accepted results, by prompt id. They stay until
    /// the next step opens, so a trainer that stopped after
    /// [`Hub::take_step_outcome`] can read them again.
    pub fn rollouts(&self, step: StepId) -> Result<Vec<AcceptedRollout>, LoadError> {
        self.store.rollouts(step)
    }

    /// Registers (or re-registers) an actor, and issues it a new token; a previous
    /// token of the actor stops working.
    pub fn register(
        &self,
        actor: ActorId,
        registration: Registration,
    ) -> Result<(Readiness, ActorToken), CallError> {
        let token = ActorToken::generate(actor).map_err(CallError::Entropy)?;
        let readiness = self.apply_with(|core, now| {
            let readiness = core.register(actor, registration, now);
            let changes = Changes {
                issued_token: readiness.is_ok().then(|| (actor, token.hash())),
                ..Changes::default()
            };
            (readiness, changes)
        })??;
        Ok((readiness, token))
    }

    /// Records a heartbeat.
    pub fn heartbeat(&self, actor: ActorId) -> Result<(), CallError> {
        Ok(self.apply(|core, now| core.heartbeat(actor, now))??)
    }

    /// Records the versions an actor has active and staged.
    pub fn report_versions(
        &self,
        actor: ActorId,
        active: Version,
        staged: Option<Version>,
    ) -> Result<Readiness, CallError> {
        Ok(self.apply(|core, now| core.report_versions(actor, active, staged, now))??)
    }

    /// Hands out work, with the time the claim was handled (lease expiries are on the
    /// hub's clock; the wire expresses them relative to this time).
    pub fn claim(&self, actor: ActorId) -> Result<(Assignment, Millis), CallError> {
        let (assignment, now) = self.apply(|core, now| (core.claim(actor, now), now))?;
        let assignment = assignment?;
        if let Assignment::Work { leases, .. } = &assignment {
            let issued = u64::try_from(leases.len()).unwrap_or(u64::MAX);
            self.leases_issued.fetch_add(issued, Ordering::Relaxed);
        }
        Ok((assignment, now))
    }

    /// Settles results; the payloads of accepted ones are committed with the
    /// acceptance, those of rejected ones dropped.
    pub fn submit(
        &self,
        actor: ActorId,
        results: &[RolloutResult],
    ) -> Result<Vec<Result<Accepted, Rejection>>, CallError> {
        let reports: Vec<RolloutReport> = results.iter().map(|result| result.report).collect();
        Ok(self.apply_with(|core, now| {
            let outcomes = core.submit(actor, &reports, now);
            let accepted = match &outcomes {
                Ok(outcomes) => outcomes
                    .iter()
                    .zip(results)
                    .filter_map(|(outcome, result)| {
                        let accepted = outcome.as_ref().ok()?;
                        let payload: &RawValue = &result.payload;
                        Some((accepted.lease.step, accepted.prompt, actor, payload))
                    })
                    .collect(),
                Err(_) => Vec::new(),
            };
            let changes = Changes {
                accepted,
                ..Changes::default()
            };
            (outcomes, changes)
        })??)
    }

    /// A graceful leave.
    pub fn leave(&self, actor: ActorId) -> Result<(), CallError> {
        Ok(self.apply(|core, _| core.leave(actor))??)
    }

    /// A preemption notice.
    pub fn preempt(&self, actor: ActorId) -> Result<(), CallError> {
        Ok(self.apply(|core, now| core.preempt(actor, now))??)
    }

    /// Applies what is due (expired leases, silent actors, ended preemption windows);
    /// returns whether anything was. Nothing is written when nothing is due, so an idle
    /// hub does not rewrite its state on every timer.
    pub fn tick(&self) -> Result<bool, PersistError> {
        let mut core = self.lock();
        let now = self.clock.now();
        if core.next_deadline().is_none_or(|deadline| deadline > now) {
            return Ok(false);
        }
        let mut next = core.clone();
        next.tick(now);
        self.commit_locked(&mut core, next, Changes::default())?;
        Ok(true)
    }

    /// How long until [`Hub::tick`] has something to do, at most the configured
    /// `tick_interval_max`.
    pub fn until_next_tick(&self) -> Duration {
        let core = self.lock();
        let now = self.clock.now();
        core.next_deadline()
            .map_or(self.tick_interval_max, |deadline| {
                Duration::from_millis(deadline.saturating_since(now)).min(self.tick_interval_max)
            })
    }

    /// Reads the core (for status and metrics).
    pub fn inspect<T>(&self, read: impl FnOnce(&ControlPlane) -> T) -> T {
        read(&self.lock())
    }

    /// Leases handed out since this hub process started.
    pub fn leases_issued(&self) -> u64 {
        self.leases_issued.load(Ordering::Relaxed)
    }

    /// Checks the fleet token (`presented` is the bearer token, if any).
    pub fn authenticate_fleet(&self, presented: Option<&[u8]>) -> Result<(), AuthError> {
        let presented = presented.ok_or(AuthError::Missing)?;
        // `blake3::Hash` compares in constant time, and hashing first hides the length.
        if hash_token(presented) == self.fleet_token {
            Ok(())
        } else {
            Err(AuthError::WrongFleetToken)
        }
    }

    /// Checks an actor token and returns the actor it authenticates.
    pub fn authenticate_actor(&self, presented: Option<&[u8]>) -> Result<ActorId, AuthError> {
        let presented = presented.ok_or(AuthError::Missing)?;
        let actor = claimed_actor(presented)?;
        let tokens = self
            .actor_tokens
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        let stored = tokens.get(&actor).ok_or(AuthError::NotIssued(actor))?;
        if hash_token(presented) == *stored {
            Ok(actor)
        } else {
            Err(AuthError::WrongActorToken(actor))
        }
    }

    fn lock(&self) -> MutexGuard<'_, ControlPlane> {
        // See the module documentation: the live core is never left half-mutated.
        self.core.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn apply<T>(
        &self,
        call: impl FnOnce(&mut ControlPlane, Millis) -> T,
    ) -> Result<T, PersistError> {
        self.apply_with(|core, now| (call(core, now), Changes::default()))
    }

    /// Runs `call` on a copy of the core at the clock's time and commits the copy with
    /// the changes `call` returns.
    fn apply_with<'a, T>(
        &self,
        call: impl FnOnce(&mut ControlPlane, Millis) -> (T, Changes<'a>),
    ) -> Result<T, PersistError> {
        let mut core = self.lock();
        // Read under the lock so that calls reach the core in clock order.
        let now = self.clock.now();
        let mut next = core.clone();
        let (value, changes) = call(&mut next, now);
        self.commit_locked(&mut core, next, changes)?;
        Ok(value)
    }

    /// Commits `next` and `changes`, revoking the tokens of actors that are no longer
    /// members, then installs `next` as the live core.
    fn commit_locked(
        &self,
        core: &mut ControlPlane,
        mut next: ControlPlane,
        mut changes: Changes<'_>,
    ) -> Result<(), PersistError> {
        // Events only notify (the state is authoritative), so the log is their sink;
        // draining them before the save keeps the stored queue empty.
        while let Some(event) = next.poll_event() {
            tracing::info!(?event, "control event");
        }
        changes.revoked_tokens = self
            .actor_tokens
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .keys()
            .copied()
            .filter(|actor| next.member(*actor).is_none())
            .collect();
        self.store.commit(&next, &changes)?;
        let mut tokens = self
            .actor_tokens
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        for actor in &changes.revoked_tokens {
            tokens.remove(actor);
        }
        if let Some((actor, hash)) = changes.issued_token {
            tokens.insert(actor, hash);
        }
        *core = next;
        Ok(())
    }
}

/// The smallest prompt on which two lists of (prompt, actor) differ.
fn first_difference(
    expected: &[(PromptId, ActorId)],
    found: &[(PromptId, ActorId)],
) -> Option<PromptId> {
    let expected: BTreeSet<_> = expected.iter().collect();
    let found: BTreeSet<_> = found.iter().collect();
    expected
        .symmetric_difference(&found)
        .map(|(prompt, _)| *prompt)
        .min()
}
