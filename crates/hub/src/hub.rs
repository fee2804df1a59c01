//! [`Hub`]: the core behind a mutex, a [`Clock`], the durable store and the tokens.
//!
//! Every mutating call is a [`Command`] and runs the same way ([`Hub::execute`]):
//! under the lock, read the clock, apply the command to the live core, drain its
//! events into the log, and commit one transaction holding the command's journal
//! record and what the call changed besides the core (accepted payloads, tokens);
//! only then does the caller get the answer, and do waiters on the core
//! ([`Hub::wait_for`]) look again. The commit is synced to disk unless the call
//! promised nothing a restart must keep (module `journal` says which). The cost of a
//! call is therefore what it changed, not the size of the state (module `store`
//! explains the checkpoints).
//!
//! # A failed commit stops the hub
//!
//! The command runs on the live core itself, not on a copy, so that no call pays for
//! copying the state. If the commit then fails, memory is ahead of disk, and the hub
//! stops: it answers that call with the error and every later call with
//! [`CallError::Stopped`], until it is restarted, which rebuilds the core from the
//! database (checkpoint and journal) as it does after a crash; [`crate::serve`] (so
//! `aurora hub`) returns at that point, so the process exits for its supervisor to
//! restart. Nothing unsaved is ever acknowledged. The alternatives were worse: undoing the call needs a copy made
//! before it (the O(state) cost this design removes), and rebuilding in place needs
//! the database, which redb refuses to use after an I/O error until it is reopened
//! ("Previous I/O error occurred"), so a hub that carried on would fail every later
//! commit anyway. A panic while the lock is held (a core method's, which would be a
//! bug) poisons the lock and stops the hub the same way.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
use std::time::Duration;

use aurora_api::RolloutResult;
use aurora_control::{
    Accepted, ActorId, Assignment, Config, ConfigError, ControlPlane, MembershipError, Millis,
    OpenStepError, PromptId, PublishError, Readiness, Registration, Rejection, Snapshot, StepId,
    StepOutcome, SubmitError, UnknownActor, Version, WeightsHash,
};
use serde_json::value::RawValue;
use thiserror::Error;

use crate::auth::{ActorToken, AuthError, claimed_actor, hash_token};
use crate::clock::Clock;
use crate::journal::{
    Claim, Command, Heartbeat, Leave, OpenStep, Preempt, PublishVersion, Record, Register,
    ReportVersions, Resume, Submit, TakeStepOutcome, Tick,
};
use crate::refusals::Refusals;
use crate::store::{
    AcceptedRollout, Changes, Journal, LoadError, PersistError, StateStore, Stored,
};

/// Settings of a hub.
#[derive(Clone, Debug)]
pub struct HubConfig {
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
    /// The stored state could not be loaded.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// The restart itself (a journaled call) could not be saved.
    #[error("saving the restart: {0}")]
    Resume(#[source] PersistError),
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
    /// The call could not be saved, so it was not acknowledged; the hub has stopped
    /// (see [`CallError::Stopped`]).
    #[error("{0}; the hub has stopped: restart it to carry on from its database")]
    Persist(#[from] PersistError),
    /// An earlier call could not be saved, so memory may be ahead of the database: the
    /// hub refuses every call until it is restarted, which carries on from the
    /// database.
    #[error(
        "the hub stopped after failing to save a call; restart it to carry on from its database"
    )]
    Stopped,
    /// Stored payloads could not be read, or disagree with the accepted results.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// The operating system gave no random bytes for a token.
    #[error("no random bytes for a token: {0}")]
    Entropy(getrandom::Error),
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
/// async callers run them on the blocking pool, except `authenticate_actor` and
/// `refusals`, which never wait on the disk.
pub struct Hub {
    live: Mutex<Live>,
    store: StateStore,
    clock: Arc<dyn Clock>,
    /// Hashes of the members' current tokens: written under the core's lock right
    /// after each commit, read by authentication without that lock (which a commit
    /// holds through an fsync).
    actor_tokens: RwLock<BTreeMap<ActorId, blake3::Hash>>,
    tick_interval_max: Duration,
    /// Leases handed out by this process. Not part of the core's state, so the metric
    /// restarts at zero with the process, as Prometheus counters may.
    leases_issued: AtomicU64,
    /// Connections and requests turned away by this process.
    refusals: Refusals,
    /// Becomes true once the hub has stopped, for whoever serves it to exit on.
    stopped: tokio::sync::watch::Sender<bool>,
    /// Counts the calls saved, so that [`Hub::wait_for`] wakes on each change of the
    /// core instead of polling it.
    changes: tokio::sync::watch::Sender<u64>,
    /// What a joining node pins (`GET /v1/join`): the trainer node's, not the core's,
    /// set as it starts and at every commit.
    join_point: RwLock<Option<JoinPoint>>,
}

/// What a node that takes weights over the wire must know first, from the trainer
/// (docs/control-api.md, `/v1/join`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JoinPoint {
    /// The run every signed statement names.
    pub run: aurora_delta::RunId,
    /// The newest committed version.
    pub committed: Option<u64>,
    /// The snapshot the trainer's hub offers a joiner now.
    pub snapshot: Option<u64>,
}

/// What changes with every call, under one lock.
struct Live {
    core: ControlPlane,
    /// Where the journal stands: it advances with the core.
    journal: Journal,
    /// Set when a call could not be saved (see the module documentation).
    stopped: bool,
}

impl Hub {
    /// Opens the state database, restoring the core saved there or starting a fresh
    /// one from `config.control`.
    ///
    /// The core is rebuilt from the checkpoint and the journal, and then carries on at
    /// the clock's current time: leases whose deadline passed while the hub was down
    /// expire now, the others keep their deadlines, and the actors' silence during the
    /// outage is forgiven (they could not reach it).
    pub fn open(config: HubConfig) -> Result<Hub, OpenError> {
        let (store, stored) = StateStore::open(&config.db_path)?;
        let Stored {
            snapshot,
            records,
            journal,
            tokens,
        } = stored;
        let core = match snapshot {
            Some(snapshot) => replay(snapshot, &records)?,
            None => ControlPlane::new(config.control)?,
        };
        let hub = Hub {
            live: Mutex::new(Live {
                core,
                journal,
                stopped: false,
            }),
            store,
            clock: config.clock,
            actor_tokens: RwLock::new(tokens),
            tick_interval_max: config.tick_interval_max,
            leases_issued: AtomicU64::new(0),
            refusals: Refusals::default(),
            stopped: tokio::sync::watch::Sender::new(false),
            changes: tokio::sync::watch::Sender::new(0),
            join_point: RwLock::new(None),
        };
        // Resuming changes the state, so it is journaled like any call: a later replay
        // must repeat it to reach the state the following calls were made on.
        {
            // Nobody else holds the new hub, so the lock is free and unpoisoned.
            let mut live = hub.live.lock().unwrap_or_else(PoisonError::into_inner);
            hub.execute_locked(&mut live, Resume, no_changes)
                .map_err(OpenError::Resume)?;
        }
        Ok(hub)
    }

    /// What `GET /v1/join` answers from now on.
    pub fn set_join_point(&self, point: JoinPoint) {
        *self
            .join_point
            .write()
            .unwrap_or_else(PoisonError::into_inner) = Some(point);
    }

    /// What `GET /v1/join` answers, once the trainer node has said.
    pub fn join_point(&self) -> Option<JoinPoint> {
        *self
            .join_point
            .read()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Publishes the trainer's `version` with h(version).
    pub fn publish_version(
        &self,
        version: Version,
        weights_hash: WeightsHash,
    ) -> Result<(), CallError> {
        let command = PublishVersion {
            version,
            weights_hash,
        };
        Ok(self.execute(command, no_changes)??)
    }

    /// Opens a step on the latest version. The stored payloads of earlier steps are
    /// dropped in the same transaction: the trainer has consumed them.
    pub fn open_step(&self, prompts: &[PromptId]) -> Result<StepId, CallError> {
        let command = OpenStep {
            prompts: prompts.to_vec(),
        };
        Ok(self.execute(command, |opened| Changes {
            drop_rollouts_before: opened.as_ref().ok().copied(),
            ..Changes::default()
        })??)
    }

    /// The completed step's outcome and the payloads of its accepted results, by
    /// prompt id; `Some` once per completed step (see
    /// [`ControlPlane::take_step_outcome`]). Nothing is taken if the payloads cannot
    /// be read or do not match the accepted results.
    pub fn take_step_outcome(&self) -> Result<Option<StepResults>, CallError> {
        let mut live = self.live()?;
        let Some(outcome) = live.core.step_outcome() else {
            return Ok(None);
        };
        let results = self.with_rollouts(outcome)?;
        self.execute_locked(&mut live, TakeStepOutcome, no_changes)?;
        Ok(Some(results))
    }

    /// The last completed step's results once its outcome was taken, read again (its
    /// payloads stay until the next step opens): what a trainer that stopped between
    /// taking an outcome and keeping what it needs of it takes up after its restart.
    /// `None` while the step is open or its outcome untaken.
    pub fn taken_step_results(&self) -> Result<Option<StepResults>, CallError> {
        let live = self.live()?;
        if live.core.step_outcome().is_some() {
            return Ok(None);
        }
        let Some(report) = live.core.step_report() else {
            return Ok(None);
        };
        let Some(completion) = report.completion else {
            return Ok(None);
        };
        let outcome = StepOutcome {
            step: report.step,
            version: report.version,
            accepted: report.accepted,
            // Once a step has completed, its pool holds every prompt not accepted.
            unfinished: report.pooled,
            completion,
        };
        Ok(Some(self.with_rollouts(outcome)?))
    }

    /// `outcome` with the stored payloads of its accepted results, which must be
    /// exactly those results.
    fn with_rollouts(&self, outcome: StepOutcome) -> Result<StepResults, CallError> {
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
        Ok(StepResults { outcome, rollouts })
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
        let command = Register {
            actor,
            registration,
        };
        let readiness = self.execute(command, |readiness| Changes {
            issued_token: readiness.is_ok().then(|| (actor, token.hash())),
            ..Changes::default()
        })??;
        Ok((readiness, token))
    }

    /// Records a heartbeat.
    pub fn heartbeat(&self, actor: ActorId) -> Result<(), CallError> {
        Ok(self.execute(Heartbeat { actor }, no_changes)??)
    }

    /// Records the versions an actor has active and staged.
    pub fn report_versions(
        &self,
        actor: ActorId,
        active: Version,
        staged: Option<Version>,
    ) -> Result<Readiness, CallError> {
        let command = ReportVersions {
            actor,
            active,
            staged,
        };
        Ok(self.execute(command, no_changes)??)
    }

    /// Hands out work, with the time the claim was handled (lease expiries are on the
    /// hub's clock; the wire expresses them relative to this time).
    pub fn claim(&self, actor: ActorId) -> Result<(Assignment, Millis), CallError> {
        let (assignment, now) = self.execute(Claim { actor }, no_changes)?;
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
        let reports = results.iter().map(|result| result.report).collect();
        Ok(self.execute(Submit { actor, reports }, |outcomes| {
            let accepted = match outcomes {
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
            Changes {
                accepted,
                ..Changes::default()
            }
        })??)
    }

    /// A graceful leave.
    pub fn leave(&self, actor: ActorId) -> Result<(), CallError> {
        Ok(self.execute(Leave { actor }, no_changes)??)
    }

    /// A preemption notice.
    pub fn preempt(&self, actor: ActorId) -> Result<(), CallError> {
        Ok(self.execute(Preempt { actor }, no_changes)??)
    }

    /// Applies what is due (expired leases, silent actors, ended preemption windows);
    /// returns whether anything was. Nothing is written when nothing is due, so an idle
    /// hub does not write on every timer.
    pub fn tick(&self) -> Result<bool, CallError> {
        let mut live = self.live()?;
        let now = self.clock.now();
        if live
            .core
            .next_deadline()
            .is_none_or(|deadline| deadline > now)
        {
            return Ok(false);
        }
        self.execute_locked(&mut live, Tick, no_changes)?;
        Ok(true)
    }

    /// How long until [`Hub::tick`] has something to do, at most the configured
    /// `tick_interval_max`.
    pub fn until_next_tick(&self) -> Duration {
        let now = self.clock.now();
        self.inspect(ControlPlane::next_deadline)
            .map_or(self.tick_interval_max, |deadline| {
                Duration::from_millis(deadline.saturating_since(now)).min(self.tick_interval_max)
            })
    }

    /// Reads the core as it is in memory, also after the hub stopped (see
    /// [`CallError::Stopped`]), when it may show a call that was not saved: for the
    /// in-process trainer and tests. The API serves [`Hub::read`] instead.
    pub fn inspect<T>(&self, read: impl FnOnce(&ControlPlane) -> T) -> T {
        // A poisoned lock has stopped the hub, but reading plain data stays safe.
        read(
            &self
                .live
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .core,
        )
    }

    /// Waits until `ready` finds what it looks for in the core (as [`Hub::inspect`]
    /// shows it), looking again after every call that changed it: the trainer learns
    /// that every actor staged a version, or that a step completed, as the call that
    /// made it so returns, not at its next poll. Never resolves if the core never gets
    /// there: callers bound the wait.
    pub async fn wait_for<T>(&self, mut ready: impl FnMut(&ControlPlane) -> Option<T>) -> T {
        let mut changes = self.changes.subscribe();
        loop {
            // Marked seen before the look, so that a call saved after the look wakes
            // the wait below.
            changes.borrow_and_update();
            if let Some(found) = self.inspect(&mut ready) {
                return found;
            }
            // The sender lives in `self`, so the channel cannot close while this waits.
            let _ = changes.changed().await;
        }
    }

    /// Reads the core unless the hub has stopped, so that what it shows is on disk
    /// (for status and metrics).
    pub fn read<T>(&self, read: impl FnOnce(&ControlPlane) -> T) -> Result<T, CallError> {
        Ok(read(&self.live()?.core))
    }

    /// Leases handed out since this hub process started.
    pub fn leases_issued(&self) -> u64 {
        self.leases_issued.load(Ordering::Relaxed)
    }

    /// The connections and requests turned away by this process, by reason.
    pub fn refusals(&self) -> &Refusals {
        &self.refusals
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

    /// The live state, unless the hub has stopped.
    fn live(&self) -> Result<MutexGuard<'_, Live>, CallError> {
        let stopped = |_| {
            // A poisoned lock stops the hub too; the first call to find it says so.
            self.stopped.send_replace(true);
            CallError::Stopped
        };
        let live = self.live.lock().map_err(stopped)?;
        if live.stopped {
            return Err(CallError::Stopped);
        }
        Ok(live)
    }

    /// Resolves once the hub has stopped (see [`CallError::Stopped`]): a process serving
    /// it should then exit, so that its supervisor restarts it from the database.
    pub async fn wait_stopped(&self) {
        let mut stopped = self.stopped.subscribe();
        // The sender lives in `self`, so the channel cannot close while this waits.
        let _ = stopped.wait_for(|&stopped| stopped).await;
    }

    /// Runs `command` on the live core at the clock's time and saves it with the
    /// changes `changes` derives from its answer.
    fn execute<'a, C: Command>(
        &self,
        command: C,
        changes: impl FnOnce(&C::Output) -> Changes<'a>,
    ) -> Result<C::Output, CallError> {
        Ok(self.execute_locked(&mut *self.live()?, command, changes)?)
    }

    /// [`Hub::execute`] with the lock held: applies the command, then commits its
    /// record and `changes`, revoking the tokens of actors that are no longer members.
    /// A failed commit stops the hub (see the module documentation).
    fn execute_locked<'a, C: Command>(
        &self,
        live: &mut Live,
        command: C,
        changes: impl FnOnce(&C::Output) -> Changes<'a>,
    ) -> Result<C::Output, PersistError> {
        // Read under the lock so that calls reach the core, and the journal, in clock
        // order.
        let now = self.clock.now();
        let output = command.apply(&mut live.core, now);
        // Events only notify (the state is authoritative), so the log is their sink;
        // draining them after every call keeps the queue empty between calls, in the
        // checkpoints and in a replay alike.
        while let Some(event) = live.core.poll_event() {
            tracing::info!(?event, "control event");
        }
        let mut changes = changes(&output);
        changes.revoked_tokens = self
            .actor_tokens
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .keys()
            .copied()
            .filter(|actor| live.core.member(*actor).is_none())
            .collect();
        let record = Record {
            at: now,
            call: command.into(),
        };
        let durable = C::durable(&output);
        if let Err(error) =
            self.store
                .commit(&mut live.journal, &live.core, &record, &changes, durable)
        {
            live.stopped = true;
            self.stopped.send_replace(true);
            tracing::error!(%error, "a call could not be saved; the hub has stopped");
            return Err(error);
        }
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
        self.changes
            .send_modify(|saved| *saved = saved.wrapping_add(1));
        Ok(output)
    }
}

/// For commands that change nothing besides the core.
fn no_changes<'a, T>(_: &T) -> Changes<'a> {
    Changes::default()
}

/// Rebuilds the core from a checkpoint and the records saved after it, checking the
/// checkpoint and the result against every invariant of the core.
fn replay(snapshot: Snapshot, records: &[Record]) -> Result<ControlPlane, LoadError> {
    let mut core = ControlPlane::from_snapshot(snapshot)?;
    for record in records {
        record.replay(&mut core);
    }
    core.check_invariants()?;
    Ok(core)
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
