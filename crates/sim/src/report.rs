//! What a run hands back: its steps and actors when every invariant held, or the
//! violation with the seed that replays it.

use std::fmt;

use aurora_control::{Millis, Stats, StepId, Version};

/// How one step went.
#[derive(Clone, Debug, PartialEq)]
pub struct StepRecord {
    /// The step.
    pub step: StepId,
    /// Its version.
    pub version: Version,
    /// When it opened.
    pub opened_at: Millis,
    /// When it completed.
    pub completed_at: Millis,
    /// Results accepted.
    pub accepted: u32,
    /// Tokens in the accepted results.
    pub accepted_tokens: u64,
    /// Whether it completed under the partial-batch policy.
    pub partial: bool,
    /// Registered actors at completion.
    pub live_actors: u32,
    /// MilliTokensPerS estimates at completion, by actor label, in tokens per second.
    pub estimates: Vec<(String, f64)>,
}

impl StepRecord {
    /// Time from opening to completion.
    pub fn step_ms(&self) -> u64 {
        self.completed_at.saturating_since(self.opened_at)
    }

    /// Accepted tokens per second of the step's duration: the pool's useful output.
    pub fn goodput_tokens_per_s(&self) -> f64 {
        // Virtual durations are far below 2^53 ms.
        self.accepted_tokens as f64 * 1000.0 / self.step_ms().max(1) as f64
    }
}

/// How one actor spent a run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ActorReport {
    /// Its label.
    pub label: String,
    /// Time spent generating while a step was open.
    pub busy_ms: u64,
    /// Time a step was open and it was not generating.
    pub idle_ms: u64,
    /// Its results that were accepted.
    pub accepted: u64,
}

/// The outcome of a run that kept every invariant.
#[derive(Clone, Debug, PartialEq)]
pub struct RunReport {
    /// The scenario's seed.
    pub seed: u64,
    /// Virtual time at the end.
    pub finished_at: Millis,
    /// Every step, in order.
    pub steps: Vec<StepRecord>,
    /// Every actor, in scenario order.
    pub actors: Vec<ActorReport>,
    /// The core's totals at the end.
    pub stats: Stats,
    /// Hub restarts that happened (a trainer crash restarts the hub too).
    pub hub_restarts: u32,
    /// Trainer crashes, by what the trainer was doing: opening a step, waiting for one,
    /// or training on one.
    pub trainer_crashes: TrainerCrashes,
    /// The calls the actors made to the control plane, and its timer's ticks.
    pub calls: ControlCalls,
    /// Leases granted on a prompt that had been leased before in its step (after an
    /// expiry, a departure or a rejected result): the work the core handed out again.
    pub reissued_leases: u64,
    /// Live leases the core took back from departing actors.
    pub returned_leases: u64,
}

/// Control-plane calls of a run, by kind: what a hub would journal.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ControlCalls {
    pub register: u64,
    pub heartbeat: u64,
    pub report_versions: u64,
    pub claim: u64,
    pub submit: u64,
    /// Graceful leaves and preemption notices.
    pub leave_or_preempt: u64,
    /// The hub's own timer: ticks that reached the core.
    pub tick: u64,
}

impl ControlCalls {
    /// Every call an actor made (ticks are the hub's own, not requests).
    pub fn requests(&self) -> u64 {
        self.register
            + self.heartbeat
            + self.report_versions
            + self.claim
            + self.submit
            + self.leave_or_preempt
    }
}

/// Trainer crashes that happened, by the trainer's phase when it crashed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TrainerCrashes {
    pub opening: u32,
    pub step_open: u32,
    pub training: u32,
}

/// A broken invariant, with what is needed to replay it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// The scenario's seed.
    pub seed: u64,
    /// Virtual time of the failure.
    pub at: Millis,
    /// What went wrong.
    pub message: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "seed {} at {}: {} (replay: AURORA_SIM_SEEDS={} cargo test -p aurora-sim)",
            self.seed, self.at, self.message, self.seed
        )
    }
}

impl std::error::Error for Violation {}
