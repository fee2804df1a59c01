//! [`Hub`]: the core behind a mutex, a monotonic clock and the durable store.
//!
//! Every mutating call runs the same way ([`Hub::apply`]): under the lock, read the
//! clock, run the core method on a *copy* of the core, drain its events into the log,
//! save the copy, and only then install it and return. A failed save therefore leaves
//! the live core equal to the stored one, and the caller (the HTTP handler) reports an
//! error instead of acknowledging anything that a crash could lose. Working on a copy
//! also keeps the live core intact if a core method ever panicked, so a poisoned lock
//! can be taken over safely.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use aurora_control::{
    Accepted, ActorId, Assignment, Config, ConfigError, ControlPlane, MembershipError, Millis,
    OpenStepError, PromptId, PublishError, Readiness, Registration, Rejection, RolloutReport,
    StepId, StepOutcome, SubmitError, UnknownActor, Version, WeightsHash,
};
use thiserror::Error;

use crate::store::{LoadError, PersistError, StateStore};

/// Settings of a hub.
#[derive(Clone, Debug)]
pub struct HubConfig {
    /// The bearer token every request must present.
    pub token: String,
    /// The state database; created if missing, restored from if present.
    pub db_path: PathBuf,
    /// The core's settings for a fresh state. A restored state keeps the settings it
    /// was saved with, so a restart cannot change the rules under live leases.
    pub control: Config,
    /// Longest pause of the tick task, so that deadlines created between two ticks
    /// are noticed within this time even though nothing wakes the task early.
    pub tick_interval_max: Duration,
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
    /// A registration was refused.
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
}

/// The shared state of a running hub. Methods are synchronous (they write to disk);
/// async callers run them on the blocking pool.
pub struct Hub {
    core: Mutex<ControlPlane>,
    store: StateStore,
    clock: Clock,
    token: Vec<u8>,
    tick_interval_max: Duration,
    /// Leases handed out by this process. Not part of the core's state, so the metric
    /// restarts at zero with the process, as Prometheus counters may.
    leases_issued: AtomicU64,
}

impl Hub {
    /// Opens the state database, restoring the core saved there or starting a fresh
    /// one from `config.control`.
    pub fn open(config: HubConfig) -> Result<Hub, OpenError> {
        if config.token.is_empty() {
            return Err(OpenError::EmptyToken);
        }
        let (store, restored) = StateStore::open(&config.db_path)?;
        let core = match restored {
            Some(core) => core,
            None => ControlPlane::new(config.control)?,
        };
        // Continue the stored clock rather than starting again at zero: the core treats
        // an earlier time as its high-water mark, so a clock restarting at zero would
        // freeze time (and every lease deadline) for as long as the hub had run.
        let clock = Clock {
            start: Instant::now(),
            base: core.clock(),
        };
        Ok(Hub {
            core: Mutex::new(core),
            store,
            clock,
            token: config.token.into_bytes(),
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

    /// Opens a step on the latest version.
    pub fn open_step(&self, prompts: &[PromptId]) -> Result<StepId, CallError> {
        Ok(self.apply(|core, now| core.open_step(prompts, now))??)
    }

    /// The completed step's outcome, once (see [`ControlPlane::take_step_outcome`]).
    pub fn take_step_outcome(&self) -> Result<Option<StepOutcome>, CallError> {
        Ok(self.apply(|core, _| core.take_step_outcome())?)
    }

    /// Registers (or re-registers) an actor.
    pub fn register(
        &self,
        actor: ActorId,
        registration: Registration,
    ) -> Result<Readiness, CallError> {
        Ok(self.apply(|core, now| core.register(actor, registration, now))??)
    }

    /// Records a heartbeat.
    pub fn heartbeat(&self, actor: ActorId) -> Result<(), CallError> {
        Ok(self.apply(|core, now| core.heartbeat(actor, now))??)
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

    /// Settles results.
    pub fn submit(
        &self,
        actor: ActorId,
        reports: &[RolloutReport],
    ) -> Result<Vec<Result<Accepted, Rejection>>, CallError> {
        Ok(self.apply(|core, now| core.submit(actor, reports, now))??)
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
        self.apply_locked(&mut core, now, |core, now| core.tick(now))?;
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

    /// Whether `presented` is the configured token, in time independent of where they
    /// differ (the length is not secret: it is checked first).
    pub(crate) fn token_matches(&self, presented: &[u8]) -> bool {
        presented.len() == self.token.len()
            && presented
                .iter()
                .zip(&self.token)
                .fold(0u8, |difference, (a, b)| difference | (a ^ b))
                == 0
    }

    fn lock(&self) -> MutexGuard<'_, ControlPlane> {
        // See the module documentation: the live core is never left half-mutated.
        self.core.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn apply<T>(
        &self,
        call: impl FnOnce(&mut ControlPlane, Millis) -> T,
    ) -> Result<T, PersistError> {
        let mut core = self.lock();
        // Read under the lock so that calls reach the core in clock order.
        let now = self.clock.now();
        self.apply_locked(&mut core, now, call)
    }

    fn apply_locked<T>(
        &self,
        core: &mut ControlPlane,
        now: Millis,
        call: impl FnOnce(&mut ControlPlane, Millis) -> T,
    ) -> Result<T, PersistError> {
        let mut next = core.clone();
        let value = call(&mut next, now);
        // Events only notify (the state is authoritative), so the log is their sink;
        // draining them before the save keeps the stored queue empty.
        while let Some(event) = next.poll_event() {
            tracing::info!(?event, "control event");
        }
        self.store.save(&next)?;
        *core = next;
        Ok(value)
    }
}

/// Monotonic milliseconds, continuing from the restored core's clock.
struct Clock {
    start: Instant,
    base: Millis,
}

impl Clock {
    fn now(&self) -> Millis {
        let elapsed_ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.base.saturating_add(elapsed_ms)
    }
}
