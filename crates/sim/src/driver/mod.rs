//! The driver: the simulated actors and trainer around a real [`ControlPlane`], stepped
//! from one scheduled wakeup to the next. This module holds the state and the event
//! loop; the actors, the trainer, the faults and the checker each act on it from their
//! own submodule.

mod actors;
mod checker;
mod faults;
mod trainer;

#[cfg(test)]
mod tests;

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};

use aurora_control::{
    ActorId, Config, ControlPlane, Event, LeaseGrant, LeaseId, Millis, Permille, PromptId, Region,
    Rejection, StepId, Version,
};

use crate::report::{ActorReport, ControlCalls, RunReport, StepRecord, TrainerCrashes, Violation};
use crate::scenario::{ActorSpec, Misbehavior, Scenario};
use crate::world::{FULL_CHECK_BUDGET, MAX_TIMER_LAG_MS, SplitMix64, actor_index, weights_hash};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Wake {
    /// An actor's wakeup; stale unless the generation matches the actor's.
    Actor {
        index: usize,
        generation: u64,
    },
    Hub,
    HubUp,
    Trainer,
    Fault(usize),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Presence {
    NotYetJoined,
    Online,
    /// Left or preempted: gone, but may rejoin.
    Departed,
    /// Dead without a word: the hub must find out by itself.
    Dead,
}

#[derive(Clone, Debug)]
struct Batch {
    grants: Vec<LeaseGrant>,
    tokens: Vec<u64>,
    generated_on: Version,
    misbehavior: Option<Misbehavior>,
    done_at: Millis,
}

#[derive(Clone, Debug)]
struct SimActor {
    spec: ActorSpec,
    region: Region,
    presence: Presence,
    /// Whether the actor believes the hub knows it.
    registered: bool,
    active: Version,
    staged: Option<Version>,
    versions_to_report: bool,
    staging: Option<(Millis, Version)>,
    catch_up: Option<(Millis, Version)>,
    batch: Option<Batch>,
    partitioned_until: Millis,
    slow: Option<(Millis, Permille)>,
    drift_permille: u64,
    misbehavior: Option<Misbehavior>,
    next_heartbeat: Millis,
    /// When it died or left; the hub must have forgotten it a timeout later.
    offline_since: Option<Millis>,
    /// After a preemption notice: when its machine is reclaimed. Until then it
    /// finishes and submits the batch it has, and asks for nothing new.
    leaving_at: Option<Millis>,
    wake_generation: u64,
    busy: Vec<(Millis, Millis)>,
    accepted: u64,
}

impl SimActor {
    fn speed_tokens_per_s(&self, now: Millis) -> u64 {
        let slow = self
            .slow
            .filter(|&(until, _)| now < until)
            .map_or(Permille::ONE, |(_, speed)| speed);
        let drifted = self.spec.tokens_per_s * self.drift_permille / 1000;
        slow.of(drifted).max(1)
    }
}

/// What the checker remembers of a lease it saw granted.
#[derive(Clone, Copy, Debug)]
struct GrantRecord {
    actor: usize,
    incarnation: u64,
    version: Version,
    expires_at: Millis,
}

/// A posted batch, as the trainer knows it.
#[derive(Clone, Debug)]
struct PostedStep {
    version: Version,
    opened_at: Millis,
    prompts: BTreeSet<PromptId>,
    accepted: BTreeMap<PromptId, ActorId>,
    accepted_tokens: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TrainerPhase {
    /// About to open the next step (first one, or after dissemination).
    Opening,
    StepOpen(StepId),
    Training,
    Done,
    /// Crashed with the hub: what it does next is decided when it comes back.
    Down,
}

struct Sim<'a> {
    scenario: &'a Scenario,
    config: Config,
    rng: SplitMix64,
    now: Millis,
    /// `None` while the hub is down; `snapshot` then holds its state.
    hub: Option<ControlPlane>,
    snapshot: Option<String>,
    hub_restarts: u32,
    trainer_crashes: TrainerCrashes,
    last_resume: Millis,
    hub_timer: Option<Millis>,
    agenda: BinaryHeap<Reverse<(Millis, u64, Wake)>>,
    sequence: u64,
    actors: Vec<SimActor>,
    trainer: TrainerPhase,
    version: Version,
    next_prompt: u64,
    // The checker's own model of what the core must have done.
    grants: BTreeMap<LeaseId, GrantRecord>,
    /// The latest lease granted on each prompt (prompt ids are never reused).
    latest_grant: BTreeMap<PromptId, LeaseId>,
    incarnations: Vec<u64>,
    posted: BTreeMap<StepId, PostedStep>,
    steps: Vec<StepRecord>,
    accepted_outcomes: u64,
    rejected_outcomes: BTreeMap<Rejection, u64>,
    calls: ControlCalls,
    reissued_leases: u64,
    returned_leases: u64,
    /// The whole-state check runs after every this many events (see `advance`).
    full_check_every: u64,
    events_handled: u64,
}

/// Runs `scenario` and checks every invariant; see the crate documentation.
pub fn run(scenario: &Scenario) -> Result<RunReport, Violation> {
    Sim::new(scenario)?.run()
}

/// How often the whole-state check runs: after every event while the batch and the
/// pool together are within [`FULL_CHECK_BUDGET`], as every small scenario's; beyond,
/// once per as many events as their size, so that the check, whose cost grows with
/// the prompts and members it reads, costs a bounded amount per event at any scale.
/// After every event of a 1,000-actor run of 64,000 prompts a step it took over 99%
/// of the run's time (a profile of `aurora sim paper`), where the core took under 1%.
fn full_check_every(scenario: &Scenario) -> u64 {
    let size = u64::from(scenario.batch_size) + scenario.actors.len() as u64;
    if size <= FULL_CHECK_BUDGET { 1 } else { size }
}

impl<'a> Sim<'a> {
    fn new(scenario: &'a Scenario) -> Result<Sim<'a>, Violation> {
        let config = scenario.config();
        let fail = |message: String| Violation {
            seed: scenario.seed,
            at: Millis(0),
            message,
        };
        scenario
            .check(&config)
            .map_err(|problem| fail(format!("invalid scenario: {problem}")))?;
        let mut hub =
            ControlPlane::new(config.clone()).map_err(|error| fail(format!("config: {error}")))?;
        hub.publish_version(Version(0), weights_hash(Version(0)))
            .map_err(|error| fail(format!("first publish: {error}")))?;
        let actors = scenario
            .actors
            .iter()
            .map(|spec| {
                let region =
                    Region::new(&spec.region).map_err(|error| fail(format!("region: {error}")))?;
                Ok(SimActor {
                    spec: spec.clone(),
                    region,
                    presence: Presence::NotYetJoined,
                    registered: false,
                    active: Version(0),
                    staged: None,
                    versions_to_report: false,
                    staging: None,
                    catch_up: None,
                    batch: None,
                    partitioned_until: Millis(0),
                    slow: None,
                    drift_permille: 1000,
                    misbehavior: None,
                    next_heartbeat: Millis(0),
                    offline_since: None,
                    leaving_at: None,
                    wake_generation: 0,
                    busy: Vec::new(),
                    accepted: 0,
                })
            })
            .collect::<Result<Vec<_>, Violation>>()?;
        let mut sim = Sim {
            scenario,
            config,
            rng: SplitMix64(scenario.seed ^ 0x5EED),
            now: Millis(0),
            hub: Some(hub),
            snapshot: None,
            hub_restarts: 0,
            trainer_crashes: TrainerCrashes::default(),
            last_resume: Millis(0),
            hub_timer: None,
            agenda: BinaryHeap::new(),
            sequence: 0,
            incarnations: vec![0; actors.len()],
            actors,
            trainer: TrainerPhase::Opening,
            version: Version(0),
            next_prompt: 0,
            grants: BTreeMap::new(),
            latest_grant: BTreeMap::new(),
            posted: BTreeMap::new(),
            steps: Vec::new(),
            accepted_outcomes: 0,
            rejected_outcomes: BTreeMap::new(),
            calls: ControlCalls::default(),
            reissued_leases: 0,
            returned_leases: 0,
            full_check_every: full_check_every(scenario),
            events_handled: 0,
        };
        for (index, spec) in scenario.actors.iter().enumerate() {
            sim.wake_actor_at(index, Millis(spec.joins_at_ms));
        }
        for (index, fault) in scenario.faults.iter().enumerate() {
            sim.schedule(Millis(fault.at_ms), Wake::Fault(index));
        }
        sim.schedule(Millis(200), Wake::Trainer);
        Ok(sim)
    }

    fn run(mut self) -> Result<RunReport, Violation> {
        while self.trainer != TrainerPhase::Done {
            self.advance()?;
        }
        self.finish()
    }

    /// Handles the next scheduled wakeup and checks the invariants after it: the
    /// whole state after every event of a small scenario, and after every
    /// `full_check_every`-th event, every trainer step and every fault of a large one
    /// (see [`full_check_every`]); the checks of each call's answer run at every call.
    fn advance(&mut self) -> Result<(), Violation> {
        {
            let Some(Reverse((at, _, wake))) = self.agenda.pop() else {
                let phase = self.trainer;
                return Err(self.violation(format!("stalled: nothing left to happen in {phase:?}")));
            };
            self.now = at;
            match wake {
                Wake::Actor { index, generation } => {
                    if generation == self.actors[index].wake_generation {
                        self.wake_actor(index)?;
                    }
                }
                Wake::Hub => {
                    if self.hub_timer == Some(at) {
                        self.hub_timer = None;
                    }
                    if let Some(hub) = self.hub.as_mut() {
                        self.calls.tick += 1;
                        hub.tick(at);
                    }
                }
                Wake::HubUp => self.restore_hub()?,
                Wake::Trainer => self.wake_trainer()?,
                Wake::Fault(index) => self.inject(self.scenario.faults[index].fault)?,
            }
            let steps_before = self.steps.len();
            self.drain_events()?;
            self.events_handled += 1;
            let milestone = matches!(wake, Wake::Trainer | Wake::Fault(_) | Wake::HubUp)
                || self.steps.len() != steps_before;
            if milestone || self.events_handled.is_multiple_of(self.full_check_every) {
                self.check_state()?;
            } else {
                self.check_progress()?;
            }
            self.arm_hub_timer();
        }
        Ok(())
    }

    fn schedule(&mut self, at: Millis, wake: Wake) {
        self.sequence += 1;
        self.agenda.push(Reverse((at, self.sequence, wake)));
    }

    /// Replaces the actor's pending wakeup with one at `at`.
    fn wake_actor_at(&mut self, index: usize, at: Millis) {
        let actor = &mut self.actors[index];
        actor.wake_generation += 1;
        let wake = Wake::Actor {
            index,
            generation: actor.wake_generation,
        };
        self.schedule(at, wake);
    }

    fn arm_hub_timer(&mut self) {
        let Some(deadline) = self.hub.as_ref().and_then(ControlPlane::next_deadline) else {
            return;
        };
        let lag_ms = if self.rng.chance(500) {
            self.rng.range(1, MAX_TIMER_LAG_MS)
        } else {
            0
        };
        let at = deadline.max(self.now).saturating_add(lag_ms);
        if self.hub_timer.is_none_or(|armed| at < armed) {
            self.hub_timer = Some(at);
            self.schedule(at, Wake::Hub);
        }
    }

    fn violation(&self, message: String) -> Violation {
        Violation {
            seed: self.scenario.seed,
            at: self.now,
            message,
        }
    }

    fn reachable(&self, index: usize) -> bool {
        self.hub.is_some() && self.now >= self.actors[index].partitioned_until
    }

    fn hub_mut(&mut self) -> Result<&mut ControlPlane, Violation> {
        let violation = self.violation("an actor talked to a hub that is down".into());
        self.hub.as_mut().ok_or(violation)
    }

    fn drain_events(&mut self) -> Result<(), Violation> {
        while let Some(event) = self.hub.as_mut().and_then(ControlPlane::poll_event) {
            match event {
                Event::ActorDeparted {
                    actor,
                    leases_returned,
                    ..
                } => {
                    self.returned_leases += u64::from(leases_returned);
                    let incarnation =
                        actor_index(actor).and_then(|index| self.incarnations.get_mut(index));
                    let Some(incarnation) = incarnation else {
                        return Err(self.violation(format!("{actor} departed but never existed")));
                    };
                    *incarnation += 1;
                }
                Event::StepCompleted { step, partial, .. } => self.complete_step(step, partial)?,
                Event::LeaseExpired { .. } | Event::RelayChanged { .. } => {}
            }
        }
        Ok(())
    }

    fn finish(self) -> Result<RunReport, Violation> {
        let Some(hub) = self.hub.as_ref() else {
            return Err(self.violation("the run ended with the hub down".into()));
        };
        let stats = hub.stats().clone();
        if hub.events_dropped() > 0 {
            return Err(self.violation(format!("{} events dropped", hub.events_dropped())));
        }
        if stats.accepted != self.accepted_outcomes || stats.rejected != self.rejected_outcomes {
            return Err(self.violation(format!(
                "the hub counted {} accepted and {:?} rejected, the actors were told {} and {:?}",
                stats.accepted, stats.rejected, self.accepted_outcomes, self.rejected_outcomes
            )));
        }
        let windows: Vec<(Millis, Millis)> = self
            .steps
            .iter()
            .map(|step| (step.opened_at, step.completed_at))
            .collect();
        let actors = self
            .actors
            .iter()
            .map(|actor| {
                let busy_ms: u64 = windows
                    .iter()
                    .flat_map(|&(open, close)| {
                        actor.busy.iter().map(move |&(start, end)| {
                            close.min(end).saturating_since(open.max(start))
                        })
                    })
                    .sum();
                let window_ms: u64 = windows
                    .iter()
                    .map(|&(open, close)| close.saturating_since(open))
                    .sum();
                ActorReport {
                    label: actor.spec.label.clone(),
                    busy_ms,
                    idle_ms: window_ms.saturating_sub(busy_ms),
                    accepted: actor.accepted,
                }
            })
            .collect();
        Ok(RunReport {
            seed: self.scenario.seed,
            finished_at: self.now,
            steps: self.steps,
            actors,
            stats,
            hub_restarts: self.hub_restarts,
            trainer_crashes: self.trainer_crashes,
            calls: self.calls,
            reissued_leases: self.reissued_leases,
            returned_leases: self.returned_leases,
        })
    }
}
