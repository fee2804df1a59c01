//! What a run is made of: the actors, the faults and when they strike, and the hub's
//! configuration. Callers build these; the driver only reads them.

use aurora_control::{
    Config, LeaseConfig, Limits, MilliTokensPerS, NewActorEstimate, PartialBatchPolicy, Permille,
    PromptId, SchedulerConfig, SplitPolicy,
};

use crate::world::{HEARTBEAT_MS, PREEMPTION_GRACE_MS, SplitMix64};

/// One simulated actor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ActorSpec {
    /// Name in reports, e.g. "A100-1".
    pub label: String,
    /// True generation speed before drift and slowdowns.
    pub tokens_per_s: u64,
    /// Its region.
    pub region: String,
    /// Whether it can relay.
    pub can_relay: bool,
    /// When it first registers.
    pub joins_at_ms: u64,
    /// How its engine spends time on a batch; without one, every token takes the same
    /// time at [`ActorSpec::tokens_per_s`], whatever the batch.
    pub decode: Option<BatchedDecode>,
}

/// A serving engine's batched decode, memory-bound: every iteration reads the weights
/// once, whatever the batch, and each running sequence's cache once per token it makes.
/// A batch therefore takes as many iterations as its longest sequence (or as its tokens
/// need at the most sequences the engine runs at once), and an actor given few sequences
/// makes fewer tokens per second than one given many.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchedDecode {
    /// Microseconds an iteration spends reading the weights.
    pub iteration_us: u64,
    /// Nanoseconds each generated token adds to its iteration (its cache, or its FLOPs
    /// where those take longer).
    pub token_ns: u64,
    /// Most sequences the engine decodes at once.
    pub max_sequences: u64,
    /// Sequences one prompt's lease holds (a GRPO group), decoded side by side.
    pub sequences_per_prompt: u64,
}

impl BatchedDecode {
    /// Tokens per second with `sequences` running (no more than the engine holds).
    pub fn tokens_per_s(&self, sequences: u64) -> u64 {
        let running = sequences.clamp(1, self.max_sequences.max(1));
        let iteration_ns = self.iteration_us * 1000 + running * self.token_ns;
        running * 1_000_000_000 / iteration_ns.max(1)
    }

    /// Milliseconds to generate prompts of `tokens` each at full speed. A prompt's
    /// sequences are taken to be equally long: the scenario draws a prompt's tokens, not
    /// each sequence's.
    pub fn batch_ms(&self, tokens: &[u64]) -> u64 {
        let total: u64 = tokens.iter().sum();
        let longest = tokens
            .iter()
            .map(|&prompt| prompt.div_ceil(self.sequences_per_prompt.max(1)))
            .max()
            .unwrap_or(0);
        let iterations = longest.max(total.div_ceil(self.max_sequences.max(1)));
        (iterations.saturating_mul(self.iteration_us) + total.saturating_mul(self.token_ns) / 1000)
            / 1000
    }
}

/// Something that happens to the system at a scheduled time. `actor` indexes
/// [`Scenario::actors`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The actor leaves gracefully (if it can reach the hub).
    Leave {
        /// The actor.
        actor: usize,
    },
    /// The actor gets a preemption notice and goes.
    Preempt {
        /// The actor.
        actor: usize,
    },
    /// The actor's process dies without a word.
    Die {
        /// The actor.
        actor: usize,
    },
    /// A departed or dead actor comes back with the versions it had on disk.
    Rejoin {
        /// The actor.
        actor: usize,
    },
    /// The actor cannot reach the hub for a while; it keeps generating.
    Partition {
        /// The actor.
        actor: usize,
        /// How long.
        duration_ms: u64,
    },
    /// The actor runs at `speed` of its usual throughput for a while.
    Slow {
        /// The actor.
        actor: usize,
        /// Fraction of its usual speed.
        speed: Permille,
        /// How long.
        duration_ms: u64,
    },
    /// The actor reports its next batch wrongly.
    Misbehave {
        /// The actor.
        actor: usize,
        /// How.
        misbehavior: Misbehavior,
    },
    /// The hub serializes its state, goes down, and restores it after `downtime_ms`.
    HubRestart {
        /// How long it is down.
        downtime_ms: u64,
    },
    /// The trainer node crashes: the hub goes down as in [`Fault::HubRestart`], and the
    /// trainer forgets where it was. Back after `downtime_ms`, it resumes from what is
    /// durable, as `aurora run`'s trainer does: the restored control plane, the versions
    /// it published and the outcomes it took (stored before the next step opens).
    TrainerCrash {
        /// How long it is down.
        downtime_ms: u64,
    },
}

/// Ways an actor can report a batch wrongly. Each must be rejected, and must not
/// stop the step from completing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Misbehavior {
    /// Every result carries a wrong weights hash (a corrupted delta).
    CorruptHash,
    /// Every result claims the previous version (it skipped a Commit).
    StaleVersion,
    /// One result names a lease that was never issued.
    ForgeLease,
    /// One result names the latest lease granted to another actor.
    StealLease,
    /// One result claims more tokens than any result may have.
    InflateTokens,
    /// Every result claims the most tokens a result may have, far more than it
    /// generated: accepted, but it must not buy the actor the next batch.
    ExaggerateTokens,
    /// The whole batch is submitted twice.
    ResubmitBatch,
}

impl Misbehavior {
    /// Every kind, for random scenarios.
    pub const ALL: [Misbehavior; 7] = [
        Misbehavior::CorruptHash,
        Misbehavior::StaleVersion,
        Misbehavior::ForgeLease,
        Misbehavior::StealLease,
        Misbehavior::InflateTokens,
        Misbehavior::ExaggerateTokens,
        Misbehavior::ResubmitBatch,
    ];
}

/// A fault and when it happens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScheduledFault {
    /// Virtual time of the fault.
    pub at_ms: u64,
    /// The fault.
    pub fault: Fault,
}

/// Everything that determines a run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scenario {
    /// Seeds every random choice of the run.
    pub seed: u64,
    /// The actors; the first is never the target of a fault, so progress is owed.
    pub actors: Vec<ActorSpec>,
    /// Steps to complete.
    pub steps: u32,
    /// Prompts per step.
    pub batch_size: u32,
    /// How batches are split.
    pub split: SplitPolicy,
    /// Partial-batch policy of the hub.
    pub partial_batch: Option<PartialBatchPolicy>,
    /// Largest change of an actor's speed from one batch to the next.
    pub drift: Permille,
    /// Shortest and longest rollout, in tokens, drawn evenly.
    pub tokens_per_prompt: (u64, u64),
    /// The engine's generation limit: a rollout drawn longer is cut here (None: none).
    pub rollout_limit: Option<u64>,
    /// Time the trainer takes between a step's completion and the next version.
    pub train_ms: u64,
    /// What goes wrong, and when.
    pub faults: Vec<ScheduledFault>,
    /// How the hub finds an actor gone without a word.
    pub liveness: Liveness,
}

/// How the hub finds an actor that vanished without a word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Liveness {
    /// aurora's: every message is a heartbeat, and an actor silent for four heartbeats
    /// is removed, its leases back in the pool at once.
    Heartbeats,
    /// The paper's system, which describes no heartbeat: it "applies time-bounded leases
    /// to detect failures implicitly" (section 1), so a vanished actor's prompts come
    /// back only as their leases expire.
    LeaseExpiry,
}

/// Under [`Liveness::LeaseExpiry`], silence long enough that no run sees it.
const NEVER_SILENT_MS: u64 = 1_000_000_000_000;

/// A lease lasts this share of the median completion (the control core's rule), in percent.
const LEASE_MEDIAN_MULTIPLIER_PERCENT: u16 = 250;

impl Scenario {
    /// A random scenario: 3 to 7 actors of 1,000 to 3,000 tokens/s in three regions,
    /// up to two late joiners, and up to a dozen faults of every kind.
    pub fn random(seed: u64) -> Scenario {
        let mut rng = SplitMix64(seed);
        let regions = ["eu-west", "us-east", "ap-south"];
        let actor_count = rng.range(3, 7) as usize;
        let batch_size = rng.range(16, 64) as u32;
        let steps = rng.range(5, 9) as u32;
        let tokens_per_prompt = (50, 600);
        let actors: Vec<ActorSpec> = (0..actor_count)
            .map(|index| ActorSpec {
                label: format!("actor-{index}"),
                tokens_per_s: rng.range(1_000, 3_000),
                region: regions[rng.below(3) as usize].to_owned(),
                can_relay: rng.chance(500),
                joins_at_ms: 0,
                decode: None,
            })
            .collect();
        let pool_tokens_per_s: u64 = actors.iter().map(|actor| actor.tokens_per_s).sum();
        let step_estimate_ms = u64::from(batch_size) * 325 * 1000 / pool_tokens_per_s + 1_600;
        let horizon_ms = step_estimate_ms * u64::from(steps);
        let mut scenario = Scenario {
            seed,
            actors,
            steps,
            batch_size,
            split: SplitPolicy::Proportional,
            partial_batch: rng.chance(300).then(|| PartialBatchPolicy {
                after_ms: rng.range(3_000, 8_000),
                min_accepted: Permille::clamped(rng.range(600, 900) as u16),
            }),
            drift: Permille::clamped(100),
            tokens_per_prompt,
            rollout_limit: None,
            train_ms: 1_000,
            faults: Vec::new(),
            liveness: Liveness::Heartbeats,
        };
        for _ in 0..rng.below(3) {
            let index = scenario.actors.len();
            scenario.actors.push(ActorSpec {
                label: format!("actor-{index}"),
                tokens_per_s: rng.range(1_000, 3_000),
                region: regions[rng.below(3) as usize].to_owned(),
                can_relay: rng.chance(500),
                joins_at_ms: rng.range(1, horizon_ms),
                decode: None,
            });
        }
        for _ in 0..rng.below(13) {
            let at_ms = rng.range(1, horizon_ms);
            // Actor 0 is spared, so some actor is always alive and eligible.
            let actor = rng.range(1, scenario.actors.len() as u64 - 1) as usize;
            let fault = match rng.below(13) {
                0 => Fault::Leave { actor },
                1 => Fault::Preempt { actor },
                2 => Fault::Die { actor },
                3 => Fault::Partition {
                    actor,
                    duration_ms: rng.range(1_000, 15_000),
                },
                4 => Fault::Slow {
                    actor,
                    speed: Permille::clamped(rng.range(100, 400) as u16),
                    duration_ms: rng.range(5_000, 30_000),
                },
                5..=10 => {
                    let misbehavior =
                        Misbehavior::ALL[rng.below(Misbehavior::ALL.len() as u64) as usize];
                    Fault::Misbehave { actor, misbehavior }
                }
                11 => Fault::HubRestart {
                    downtime_ms: rng.below(3_000),
                },
                _ => Fault::TrainerCrash {
                    downtime_ms: rng.below(3_000),
                },
            };
            scenario.faults.push(ScheduledFault { at_ms, fault });
            if matches!(
                fault,
                Fault::Leave { .. } | Fault::Preempt { .. } | Fault::Die { .. }
            ) && rng.chance(500)
            {
                let at_ms = at_ms + rng.range(2_000, 20_000);
                scenario.faults.push(ScheduledFault {
                    at_ms,
                    fault: Fault::Rejoin { actor },
                });
            }
        }
        scenario
    }

    /// Two A100s (2,400 tokens/s) and two L40s (1,000 tokens/s; decoding is bound by
    /// memory bandwidth, where an L40 has well under half an A100's), ten steps of
    /// 256 prompts, no faults.
    pub fn a100_l40_pool(seed: u64, split: SplitPolicy) -> Scenario {
        let actor = |label: &str, tokens_per_s| ActorSpec {
            label: label.to_owned(),
            tokens_per_s,
            region: "eu-west".to_owned(),
            can_relay: true,
            joins_at_ms: 0,
            decode: None,
        };
        Scenario {
            seed,
            actors: vec![
                actor("A100-1", 2_400),
                actor("A100-2", 2_400),
                actor("L40-1", 1_000),
                actor("L40-2", 1_000),
            ],
            steps: 10,
            batch_size: 256,
            split,
            partial_batch: None,
            drift: Permille::clamped(0),
            tokens_per_prompt: (200, 1_000),
            rollout_limit: None,
            train_ms: 2_000,
            faults: Vec::new(),
            liveness: Liveness::Heartbeats,
        }
    }

    /// Two A100s and an L40, 24 steps of 128 prompts (about 13 s each once the
    /// estimates have converged, plus 2.6 s between steps). The second A100 is
    /// preempted at [`Scenario::PREEMPTION_AT_MS`], in the ninth step or so, and
    /// rejoins at [`Scenario::REJOIN_AT_MS`], versions behind.
    pub fn preemption_and_rejoin(seed: u64) -> Scenario {
        let mut scenario = Scenario::a100_l40_pool(seed, SplitPolicy::Proportional);
        scenario.actors.remove(3);
        scenario.steps = 24;
        scenario.batch_size = 128;
        scenario.faults = vec![
            ScheduledFault {
                at_ms: Scenario::PREEMPTION_AT_MS,
                fault: Fault::Preempt { actor: 1 },
            },
            ScheduledFault {
                at_ms: Scenario::REJOIN_AT_MS,
                fault: Fault::Rejoin { actor: 1 },
            },
        ];
        scenario
    }

    /// When [`Scenario::preemption_and_rejoin`] preempts its second A100.
    pub const PREEMPTION_AT_MS: u64 = 150_000;
    /// When [`Scenario::preemption_and_rejoin`] brings it back.
    pub const REJOIN_AT_MS: u64 = 260_000;

    /// Refuses scenarios the simulator cannot run: they come from callers, and a bad
    /// index must be an error, not a panic.
    pub(crate) fn check(&self, config: &Config) -> Result<(), String> {
        if self.actors.is_empty() {
            return Err("no actors".into());
        }
        if self.batch_size == 0 || self.batch_size > config.limits.max_batch_size {
            return Err(format!(
                "batch size {} outside 1..={}",
                self.batch_size, config.limits.max_batch_size
            ));
        }
        let (shortest, longest) = self.tokens_per_prompt;
        if shortest == 0 || shortest > longest || longest > config.limits.max_tokens_per_result {
            return Err(format!(
                "rollout lengths {shortest}..={longest} are not valid"
            ));
        }
        if self.rollout_limit == Some(0) {
            return Err("a rollout limit of 0 tokens".into());
        }
        let mut targets = self
            .faults
            .iter()
            .filter_map(|scheduled| match scheduled.fault {
                Fault::Leave { actor }
                | Fault::Preempt { actor }
                | Fault::Die { actor }
                | Fault::Rejoin { actor }
                | Fault::Partition { actor, .. }
                | Fault::Slow { actor, .. }
                | Fault::Misbehave { actor, .. } => Some(actor),
                Fault::HubRestart { .. } | Fault::TrainerCrash { .. } => None,
            });
        match targets.find(|&actor| actor >= self.actors.len()) {
            Some(actor) => Err(format!(
                "a fault targets actor {actor} of {}",
                self.actors.len()
            )),
            None => Ok(()),
        }
    }

    pub(crate) fn config(&self) -> Config {
        Config {
            // The limits fit the scenario (at least the small pools' 16 actors and 256
            // prompts): a run measures the core at the scale it is given.
            limits: Limits {
                max_actors: u32::try_from(self.actors.len()).unwrap_or(u32::MAX).max(16),
                max_batch_size: self.batch_size.max(256),
                max_leases_per_actor: 256,
                // One sweep may expire every lease of the batch at once, and the
                // driver needs every event (a dropped one is a violation).
                max_pending_events: (self.batch_size
                    + u32::try_from(self.actors.len()).unwrap_or(u32::MAX))
                .max(4096),
                max_tokens_per_result: 100_000,
            },
            lease: LeaseConfig {
                initial_ms: self.first_lease_ms(),
                min_ms: 2_000,
                max_ms: self.first_lease_ms().max(180_000),
                median_multiplier_percent: LEASE_MEDIAN_MULTIPLIER_PERCENT,
                completion_window: 1024,
            },
            scheduler: SchedulerConfig {
                split: self.split,
                estimate_weight: Permille::clamped(700),
                behind_decay: Permille::clamped(700),
                new_actor_estimate: NewActorEstimate::MinimumOfKnown {
                    floor: MilliTokensPerS::from_tokens_per_s(500),
                },
                // Tail re-issues of one short prompt finish in tens of milliseconds;
                // a longer floor would understate honest actors.
                min_sample_ms: 100,
                max_sample_rate: MilliTokensPerS::from_tokens_per_s(20_000),
                expiry_decay: Permille::clamped(800),
            },
            heartbeat_timeout_ms: match self.liveness {
                Liveness::Heartbeats => 4 * HEARTBEAT_MS,
                Liveness::LeaseExpiry => NEVER_SILENT_MS,
            },
            partial_batch: self.partial_batch,
            preemption_grace_ms: PREEMPTION_GRACE_MS,
        }
    }

    /// The first leases' lifetime: 30 s, or longer where this scenario's work is long
    /// (the paper's reasoning answers at B = 512 keep one actor busy for minutes). A lease
    /// must outlast an equal share of the batch at its longest on the slowest actor, with
    /// the margin the control core keeps over completions, or every first lease expires before its work
    /// can be done; after the first step the lifetime follows the completions.
    fn first_lease_ms(&self) -> u64 {
        // The first leases go to the actors there from the start.
        let first: Vec<&ActorSpec> = self
            .actors
            .iter()
            .filter(|actor| actor.joins_at_ms == 0)
            .collect();
        let slowest = first
            .iter()
            .map(|actor| actor.tokens_per_s)
            .min()
            .unwrap_or(1)
            .max(1);
        let actors = u64::try_from(first.len()).unwrap_or(u64::MAX).max(1);
        let share = u64::from(self.batch_size).div_ceil(actors);
        let share_ms = share
            .saturating_mul(self.longest_rollout())
            .saturating_mul(1000)
            / slowest;
        (share_ms.saturating_mul(u64::from(LEASE_MEDIAN_MULTIPLIER_PERCENT)) / 100).max(30_000)
    }

    /// The rollout length of a prompt: a function of the seed and the prompt alone, so
    /// that runs differing only in policy see the same work.
    pub(crate) fn tokens_for(&self, prompt: PromptId) -> u64 {
        let (shortest, longest) = self.tokens_per_prompt;
        SplitMix64(self.seed ^ prompt.0.wrapping_mul(0xA24B_AED4_963E_E407))
            .range(shortest, longest)
            .min(self.longest_rollout())
    }

    /// The longest rollout a prompt can have: the drawn range's end, or the limit.
    fn longest_rollout(&self) -> u64 {
        self.rollout_limit
            .map_or(self.tokens_per_prompt.1, |limit| {
                limit.min(self.tokens_per_prompt.1)
            })
    }
}
