//! Past the paper: more regions, more actors, a larger model, spot preemptions. For
//! each scale, how much of its budget each shared resource needs, and at what scale
//! each runs out.
//!
//! The control plane is not modelled but run: the real core schedules 1,000 actors
//! over 16 regions with a 70B model's step times and spot preemptions through the
//! crate's driver ([`CoreAtScale`]), and the calls it counts there are what the
//! control plane's budget is charged with at every scale.
//!
//! With one step of lag, a version must be trained, extracted, shipped and staged
//! while the actors generate the step before: the window left after training is the
//! budget of every resource on that path. Control calls and snapshot joins run all the
//! time and are measured against the whole step. The trainer is assumed to grow with
//! the pool (training takes half a generation, [`TRAIN_SHARE_OF_GENERATION`]): the
//! question is which part of the system does not.

use std::fmt;

use aurora_control::{Permille, SplitPolicy};

use super::calibration::{Encoding, HUB_DURABLE_CALLS_PER_S};
use super::tcp::{CongestionControl, TcpModel};
use super::testbed::{
    A100, ActorKind, DENSE_70B, Dataset, H100, JoinFrom, KEPT_TAIL_SNAPSHOTS, ModelShape, Network,
    QWEN3_8B, QWEN3_14B, QWEN3_30B_A3B, SEQUENCE_LIMIT, Trainer, Workload, actor_decode_s,
};
use crate::report::{RunReport, Violation};
use crate::scenario::{ActorSpec, Fault, Liveness, Scenario, ScheduledFault};
use crate::world::SplitMix64;

/// Assumption: beyond the paper extraction runs on the host of one eight-H100 node (the
/// training itself is sized by [`TRAIN_SHARE_OF_GENERATION`], however many GPUs that
/// takes).
const TRAINER: Trainer = Trainer::of(8);
/// Assumption: beyond the paper, answers of 256 to 768 tokens after 256-token prompts
/// (short, so that a step's generation takes tens of seconds and the sync is a large
/// share of it: the harder case for the shared resources).
const SHORT_ANSWERS: Dataset = Dataset {
    name: "short answers",
    prompt_tokens: 256.0,
    completion_tokens: (256, 768),
};
/// Assumption: beyond the paper, groups of 8 short answers, [`PROMPTS_PER_ACTOR`] of
/// them per actor (the batch grows with the pool); each model's deltas at its own
/// density ([`ModelShape::density`]).
const WORKLOAD: Workload = Workload {
    dataset: SHORT_ANSWERS,
    prompts_per_step: PROMPTS_PER_ACTOR as u32,
    samples_per_prompt: 8,
    density: 0.01,
    sequence_limit: SEQUENCE_LIMIT,
};
/// Assumption: the trainer is sized so that a step's training takes this share of its
/// generation.
const TRAIN_SHARE_OF_GENERATION: f64 = 0.5;
/// Prompt groups per actor and step: the batch grows with the pool.
const PROMPTS_PER_ACTOR: f64 = 64.0;
/// Steps of the control core's run at scale: enough for the estimates and the lease
/// lifetime to settle and for several preemptions at 5% an hour, few enough to keep
/// `aurora sim paper` within seconds.
const CORE_STEPS: u32 = 12;
/// Steps of that run its step times leave out: every actor starts from the newcomer
/// estimate, far below its rate, and the estimates need about this many steps to
/// converge (the run's own per-step line shows it). Preemptions come after that many
/// steps of generation as [`Costs::generation_s`] times them.
const CORE_WARM_UP: usize = 5;
/// The seed of the run at scale.
const CORE_SEED: u64 = 70_001_000;
/// Largest pool the thresholds are searched to.
const MAX_ACTORS: u32 = 1_000_000;
/// Largest number of regions the thresholds are searched to.
const MAX_REGIONS: u32 = 4_096;

/// One scale of deployment.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScaleStep {
    /// Regions, the trainer's included.
    pub regions: u32,
    /// Actors, spread evenly.
    pub actors: u32,
    /// The model.
    pub model: ModelShape,
    /// Share of actors preempted per hour.
    pub preemptions_per_hour: f64,
}

/// A shared resource and the share of its budget one scale needs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ResourceLimit {
    /// The resource.
    pub resource: &'static str,
    /// Needed over available; above 1 it saturates.
    pub utilisation: f64,
}

/// One scale worked out.
#[derive(Clone, Debug, PartialEq)]
pub struct ScaleOutcome {
    /// The scale.
    pub scale: ScaleStep,
    /// Seconds per step.
    pub step_s: f64,
    /// Each shared resource, busiest first.
    pub limits: Vec<ResourceLimit>,
    /// Share of the pool's generation lost to preemptions: a preempted actor's work
    /// in flight (half a step on average) and the time its replacement spends taking
    /// the snapshot over its region's path before it works again.
    pub churn_loss: f64,
}

/// A region's spot pool reclaimed at once during the run at scale.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Reclaimed {
    /// Its actors, all preempted together.
    pub actors: usize,
    /// When, seconds of virtual time.
    pub at_s: f64,
    /// Seconds until their replacements all have the checkpoint from the hub.
    pub refetch_s: f64,
}

/// The control core run at the largest scale, under virtual time.
#[derive(Clone, Debug, PartialEq)]
pub struct CoreAtScale {
    /// The scale run.
    pub scale: ScaleStep,
    /// Prompt groups per step.
    pub batch_size: u32,
    /// Steps the run asked for.
    pub steps_asked: u32,
    /// When each preemption notice came, seconds of virtual time.
    pub preempted_at_s: Vec<f64>,
    /// The actors preempted, by index (the reclaimed region's among them).
    pub preempted: Vec<usize>,
    /// The region reclaimed at once.
    pub reclaimed: Reclaimed,
    /// What the driver reported (every invariant held, or there would be none).
    pub report: RunReport,
}

impl CoreAtScale {
    /// Seconds of virtual time the run took.
    pub fn virtual_s(&self) -> f64 {
        self.report.finished_at.0 as f64 / 1e3
    }

    /// Each step's opening-to-completion time, seconds, and whether a preemption
    /// notice came while it was open (its holder's work in flight is then lost).
    pub fn steps(&self) -> Vec<(f64, bool)> {
        self.report
            .steps
            .iter()
            .map(|step| {
                let (open, close) = (
                    step.opened_at.0 as f64 / 1e3,
                    step.completed_at.0 as f64 / 1e3,
                );
                let preempted = self
                    .preempted_at_s
                    .iter()
                    .any(|&at| open <= at && at < close);
                (step.step_ms() as f64 / 1e3, preempted)
            })
            .collect()
    }

    /// Mean step, seconds, of the steps with (`true`) or without a preemption, the
    /// warm-up left out (estimates and lease lifetimes start from defaults).
    pub fn mean_step_s(&self, preempted: bool) -> Option<f64> {
        let chosen: Vec<f64> = self
            .steps()
            .into_iter()
            .skip(CORE_WARM_UP)
            .filter(|&(_, with)| with == preempted)
            .map(|(seconds, _)| seconds)
            .collect();
        (!chosen.is_empty()).then(|| chosen.iter().sum::<f64>() / chosen.len() as f64)
    }

    /// Share of the step-open time the actors that were never preempted spent idle:
    /// the scheduler's balance (zero if every actor finished its share together).
    pub fn idle_share(&self) -> f64 {
        let (busy, idle) = self
            .report
            .actors
            .iter()
            .enumerate()
            .filter(|(index, _)| !self.preempted.contains(index))
            .fold((0u64, 0u64), |(busy, idle), (_, actor)| {
                (busy + actor.busy_ms, idle + actor.idle_ms)
            });
        idle as f64 / (busy + idle).max(1) as f64
    }

    /// Calls an actor makes per second besides heartbeats, and heartbeats per second.
    fn rates_per_actor(&self) -> ControlRates {
        let actor_s = f64::from(self.scale.actors) * self.virtual_s();
        let calls = &self.report.calls;
        let steps = self.report.steps.len().max(1) as f64;
        ControlRates {
            heartbeats_per_s: calls.heartbeat as f64 / actor_s,
            calls_per_step: (calls.requests() - calls.heartbeat) as f64
                / (steps * f64::from(self.scale.actors)),
        }
    }
}

/// What each actor costs the control plane, as the run at scale measured it.
#[derive(Clone, Copy, Debug, PartialEq)]
struct ControlRates {
    /// Heartbeats per actor and second.
    heartbeats_per_s: f64,
    /// Every other call per actor and step: claims (polls while idle included),
    /// submissions, version reports, registrations, preemption notices.
    calls_per_step: f64,
}

/// The beyond-the-paper answers.
#[derive(Clone, Debug, PartialEq)]
pub struct Beyond {
    /// Each scale, what it costs, busiest resource first.
    pub scales: Vec<ScaleOutcome>,
    /// At the largest scale's model, regions and churn: the pool size at which each
    /// resource saturates (`None`: not up to [`MAX_ACTORS`]; 0: at any size).
    pub saturating_actors: Vec<(&'static str, Option<u32>)>,
    /// The regions at which the trainer's uplink saturates with deltas alone, per model.
    pub saturating_regions: Vec<(&'static str, Option<u32>)>,
    /// The control core run at the largest scale.
    pub core: CoreAtScale,
}

/// The scales the report walks through, the paper's first.
pub fn scale_steps() -> [ScaleStep; 6] {
    [
        ScaleStep {
            regions: 4,
            actors: 4,
            model: QWEN3_8B,
            preemptions_per_hour: 0.0,
        },
        ScaleStep {
            regions: 16,
            actors: 64,
            model: QWEN3_14B,
            preemptions_per_hour: 0.02,
        },
        ScaleStep {
            regions: 16,
            actors: 256,
            model: DENSE_70B,
            preemptions_per_hour: 0.05,
        },
        ScaleStep {
            regions: 16,
            actors: 1_000,
            model: QWEN3_30B_A3B,
            preemptions_per_hour: 0.05,
        },
        ScaleStep {
            regions: 16,
            actors: 1_000,
            model: DENSE_70B,
            preemptions_per_hour: 0.0,
        },
        ScaleStep {
            regions: 16,
            actors: 1_000,
            model: DENSE_70B,
            preemptions_per_hour: 0.05,
        },
    ]
}

/// Runs the control core at the largest scale, then works out every scale's resources
/// and the thresholds, the control plane's with the calls the run counted.
pub fn analyse(tcp: &TcpModel, network: &Network) -> Result<Beyond, Violation> {
    let steps = scale_steps();
    let largest = steps[steps.len() - 1];
    let mut costs = Costs {
        tcp: *tcp,
        network: *network,
        // Replaced by the run's rates below; the run itself does not read them.
        rates: ControlRates {
            heartbeats_per_s: 0.0,
            calls_per_step: 0.0,
        },
    };
    let core = costs.run_core(largest)?;
    costs.rates = core.rates_per_actor();
    let scales: Vec<ScaleOutcome> = steps
        .iter()
        .map(|&scale| {
            let mut limits = costs.limits(&scale);
            limits.sort_by(|a, b| b.utilisation.total_cmp(&a.utilisation));
            ScaleOutcome {
                scale,
                step_s: costs.generation_s(&scale.model),
                limits,
                churn_loss: costs.churn_loss(&scale),
            }
        })
        .collect();
    let names: Vec<&'static str> = costs.limits(&largest).iter().map(|l| l.resource).collect();
    let saturating_actors = names
        .iter()
        .map(|&name| {
            let utilisation = |actors| {
                costs
                    .limits(&ScaleStep { actors, ..largest })
                    .iter()
                    .find(|limit| limit.resource == name)
                    .map_or(0.0, |limit| limit.utilisation)
            };
            (
                name,
                first_saturating(utilisation, largest.regions, MAX_ACTORS),
            )
        })
        .collect();
    let saturating_regions = [QWEN3_8B, QWEN3_14B, QWEN3_30B_A3B, DENSE_70B]
        .iter()
        .map(|&model| {
            let utilisation = |regions| {
                let scale = ScaleStep {
                    regions,
                    actors: regions,
                    model,
                    preemptions_per_hour: 0.0,
                };
                costs.uplink(&scale)
            };
            (model.name, first_saturating(utilisation, 1, MAX_REGIONS))
        })
        .collect();
    Ok(Beyond {
        scales,
        saturating_actors,
        saturating_regions,
        core,
    })
}

/// The smallest value in `from..=to` at which `utilisation` passes 1 (it grows with
/// its argument), by bisection.
fn first_saturating(utilisation: impl Fn(u32) -> f64, from: u32, to: u32) -> Option<u32> {
    if utilisation(to) <= 1.0 {
        return None;
    }
    if utilisation(from) > 1.0 {
        return Some(from);
    }
    let (mut below, mut above) = (from, to);
    while above - below > 1 {
        let middle = below + (above - below) / 2;
        if utilisation(middle) > 1.0 {
            above = middle;
        } else {
            below = middle;
        }
    }
    Some(above)
}

struct Costs {
    tcp: TcpModel,
    network: Network,
    rates: ControlRates,
}

impl Costs {
    fn actor(model: &ModelShape) -> ActorKind {
        if model.checkpoint_bytes() > 0.8 * A100.memory_bytes {
            // A 70B replica does not fit one GPU: four H100s, tensor parallel.
            ActorKind { gpu: H100, gpus: 4 }
        } else {
            ActorKind { gpu: A100, gpus: 1 }
        }
    }

    /// Seconds an actor takes for its share of a step.
    fn generation_s(&self, model: &ModelShape) -> f64 {
        let tokens =
            PROMPTS_PER_ACTOR * f64::from(WORKLOAD.samples_per_prompt) * WORKLOAD.mean_answer();
        tokens / Self::actor(model).tokens_per_s(model, &WORKLOAD)
    }

    /// Runs the real control core at `scale` through the driver: its actors spread
    /// evenly over the regions, each at the decode rate of its replica, [`PROMPTS_PER_ACTOR`]
    /// groups a step each, and preemption notices at `scale`'s rate per hour at
    /// seeded times and actors (never actor 0, whom the driver keeps alive). Each
    /// preempted actor's replacement joins in its region once it has its snapshot
    /// ([`Costs::rejoin_s`]).
    fn run_core(&self, scale: ScaleStep) -> Result<CoreAtScale, Violation> {
        let model = &scale.model;
        let tokens_per_s = Self::actor(model).tokens_per_s(model, &WORKLOAD).round() as u64;
        let mut actors: Vec<ActorSpec> = (0..scale.actors)
            .map(|index| ActorSpec {
                label: format!("70B-{index}"),
                tokens_per_s,
                region: format!("region-{}", index % scale.regions),
                can_relay: true,
                joins_at_ms: 0,
                decode: None,
            })
            .collect();
        let batch_size = (PROMPTS_PER_ACTOR * f64::from(scale.actors)) as u32;
        // Preemptions fall after the warm-up as generation alone would time it,
        // uniformly over the rest of the run.
        let step_s = self.generation_s(model);
        let (from_s, horizon_s) = (step_s * CORE_WARM_UP as f64, step_s * f64::from(CORE_STEPS));
        let expected =
            f64::from(scale.actors) * scale.preemptions_per_hour * (horizon_s - from_s) / 3600.0;
        let mut rng = SplitMix64(CORE_SEED);
        let mut preempted = Vec::new();
        let mut faults = Vec::new();
        while (preempted.len() as f64) < expected.round() {
            let actor = rng.range(1, u64::from(scale.actors) - 1) as usize;
            if preempted.contains(&actor) {
                continue;
            }
            let at_ms = rng.range((from_s * 1e3) as u64, (horizon_s * 1e3) as u64);
            preempted.push(actor);
            faults.push(ScheduledFault {
                at_ms,
                fault: Fault::Preempt { actor },
            });
        }
        faults.sort_by_key(|fault| fault.at_ms);
        let rejoin_ms = (self.rejoin_s(&scale) * 1e3) as u64;
        for fault in &faults {
            let Fault::Preempt { actor } = fault.fault else {
                continue;
            };
            actors.push(ActorSpec {
                label: format!("70B-{actor}-replacement"),
                joins_at_ms: fault.at_ms + rejoin_ms,
                ..actors[actor].clone()
            });
        }
        // Correlated churn: one region's spot pool reclaimed at once, midway through the
        // run. Its relay goes with it, so the replacements take the whole checkpoint
        // from the hub across the region's path, all at once.
        let reclaim_at_ms = ((from_s + horizon_s) / 2.0 * 1e3) as u64;
        let reclaimed: Vec<usize> = (1..scale.actors as usize)
            .filter(|&actor| actor % scale.regions as usize == 1 && !preempted.contains(&actor))
            .collect();
        let refetch_ms =
            (self
                .network
                .refetch_s(&self.tcp, model, self.network.path(1), reclaimed.len())
                * 1e3) as u64;
        for &actor in &reclaimed {
            faults.push(ScheduledFault {
                at_ms: reclaim_at_ms,
                fault: Fault::Preempt { actor },
            });
            actors.push(ActorSpec {
                label: format!("70B-{actor}-replacement"),
                joins_at_ms: reclaim_at_ms + refetch_ms,
                ..actors[actor].clone()
            });
        }
        preempted.extend(&reclaimed);
        faults.sort_by_key(|fault| fault.at_ms);
        let scenario = Scenario {
            seed: CORE_SEED,
            actors,
            steps: CORE_STEPS,
            batch_size,
            split: SplitPolicy::Proportional,
            partial_batch: None,
            drift: Permille::clamped(0),
            tokens_per_prompt: WORKLOAD.group_tokens(),
            rollout_limit: Some(WORKLOAD.group_limit()),
            // Training overlaps generation (one step of lag), as in the paper's rows.
            train_ms: 0,
            faults: faults.clone(),
            liveness: Liveness::Heartbeats,
        };
        let report = crate::run(&scenario)?;
        Ok(CoreAtScale {
            scale,
            batch_size,
            steps_asked: CORE_STEPS,
            preempted_at_s: faults
                .iter()
                .map(|fault| fault.at_ms as f64 / 1e3)
                .collect(),
            preempted,
            reclaimed: Reclaimed {
                actors: reclaimed.len(),
                at_s: reclaim_at_ms as f64 / 1e3,
                refetch_s: refetch_ms as f64 / 1e3,
            },
            report,
        })
    }

    /// Seconds a version may take from trained to staged without stalling a step.
    fn window_s(&self, model: &ModelShape) -> f64 {
        self.generation_s(model) * (1.0 - TRAIN_SHARE_OF_GENERATION)
    }

    fn delta_bytes(model: &ModelShape) -> f64 {
        model.delta_bytes(Encoding::Aurora, model.density)
    }

    /// Replacements of preempted actors that join a region each step.
    fn joins_per_region_step(&self, scale: &ScaleStep) -> f64 {
        let step_s = self.generation_s(&scale.model);
        f64::from(scale.actors) * scale.preemptions_per_hour * step_s
            / 3600.0
            / f64::from(scale.regions)
    }

    /// Snapshot bytes a step a relay takes to keep its snapshot fresh where its region's
    /// peers join: it keeps a snapshot and the deltas after it (wire-protocol §8) and
    /// takes a newer one whenever those come to half of what it keeps, if a joiner has
    /// wanted it, a snapshot each time that many halves of one have crossed as deltas.
    fn refresh_bytes_per_step(model: &ModelShape) -> f64 {
        2.0 * Self::delta_bytes(model) / KEPT_TAIL_SNAPSHOTS
    }

    /// Snapshot bytes a step that cross the WAN into a region for its joiners: the
    /// relay's refreshes where peers join often enough, and where they join less often
    /// two snapshots per join: the joiner comes after the relay has withdrawn its
    /// snapshot and takes one from the hub, and the relay, asked for one, takes a newer
    /// one for the joiners after it (wire-protocol §8), which it may withdraw again
    /// before the next comes.
    fn snapshot_bytes_per_region_step(&self, scale: &ScaleStep) -> f64 {
        let by_joins = self.joins_per_region_step(scale) * scale.model.checkpoint_bytes();
        (2.0 * by_joins).min(Self::refresh_bytes_per_step(&scale.model))
    }

    /// Where a replacement takes its snapshot from: its region's relay where peers join
    /// often enough for the relay to keep one fresh (on average with a quarter of what
    /// it keeps of deltas after it), the hub otherwise.
    fn rejoin_from(&self, scale: &ScaleStep) -> JoinFrom {
        let checkpoint = scale.model.checkpoint_bytes();
        let by_joins = self.joins_per_region_step(scale) * checkpoint;
        if by_joins >= Self::refresh_bytes_per_step(&scale.model) {
            JoinFrom::Relay {
                tail_bytes: KEPT_TAIL_SNAPSHOTS * checkpoint / 4.0,
            }
        } else {
            JoinFrom::Hub
        }
    }

    /// Seconds a replacement takes to fetch its snapshot ([`Costs::rejoin_from`]).
    fn rejoin_s(&self, scale: &ScaleStep) -> f64 {
        self.network
            .snapshot_join_s(&self.tcp, &scale.model, self.rejoin_from(scale))
    }

    /// The trainer's uplink: a delta to each other region's relay inside the window,
    /// and the snapshots its joiners need all along
    /// ([`Costs::snapshot_bytes_per_region_step`]).
    fn uplink(&self, scale: &ScaleStep) -> f64 {
        let model = &scale.model;
        let usable_bps = self.network.uplink_bps * self.tcp.goodput_efficiency;
        let other_regions = f64::from(scale.regions.saturating_sub(1));
        let deltas_s = Self::delta_bytes(model) * other_regions * 8.0 / usable_bps;
        let step_s = self.generation_s(model);
        let snapshots_s =
            self.snapshot_bytes_per_region_step(scale) * other_regions * 8.0 / usable_bps;
        deltas_s / self.window_s(model) + snapshots_s / step_s
    }

    fn churn_loss(&self, scale: &ScaleStep) -> f64 {
        let lost_s_per_preemption = self.generation_s(&scale.model) / 2.0 + self.rejoin_s(scale);
        scale.preemptions_per_hour * lost_s_per_preemption / 3600.0
    }

    fn limits(&self, scale: &ScaleStep) -> Vec<ResourceLimit> {
        let model = &scale.model;
        let window_s = self.window_s(model);
        let step_s = self.generation_s(model);
        let delta = Self::delta_bytes(model);
        let actors_per_region = (f64::from(scale.actors) / f64::from(scale.regions)).ceil();
        let relay_in_s =
            self.tcp
                .transfer_s(delta, self.network.path(1), CongestionControl::Bbr, 4);
        let relay_out_s = delta * actors_per_region * 8.0
            / (self.network.lan.rate_bps * self.tcp.goodput_efficiency);
        // Besides each version inside the window: the snapshots it takes in for its
        // joiners and serves out to them, over the step.
        let (snapshots_in_s, snapshots_out_s) = match self.rejoin_from(scale) {
            JoinFrom::Relay { tail_bytes } => {
                let lan_bps = self.network.lan.rate_bps * self.tcp.goodput_efficiency;
                let taken = self.snapshot_bytes_per_region_step(scale);
                let served =
                    self.joins_per_region_step(scale) * (model.checkpoint_bytes() + tail_bytes);
                (
                    self.tcp
                        .transfer_s(taken, self.network.path(1), CongestionControl::Bbr, 4),
                    served * 8.0 / lan_bps,
                )
            }
            JoinFrom::Hub => (0.0, 0.0),
        };
        let calls_per_s = f64::from(scale.actors)
            * (self.rates.heartbeats_per_s + self.rates.calls_per_step / step_s);
        vec![
            ResourceLimit {
                resource: "trainer uplink",
                utilisation: self.uplink(scale),
            },
            ResourceLimit {
                resource: "a relay",
                utilisation: (relay_in_s / window_s + snapshots_in_s / step_s)
                    .max(relay_out_s / window_s + snapshots_out_s / step_s),
            },
            ResourceLimit {
                resource: "extraction",
                utilisation: TRAINER.extraction_s(model, Encoding::Aurora) / window_s,
            },
            ResourceLimit {
                resource: "an actor's decode",
                utilisation: actor_decode_s(model) / window_s,
            },
            ResourceLimit {
                resource: "control plane",
                utilisation: calls_per_s / HUB_DURABLE_CALLS_PER_S,
            },
        ]
    }
}

impl fmt::Display for Beyond {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "Beyond the paper: share of each resource's budget per step (above 100% it saturates)"
        )?;
        writeln!(
            f,
            "  (budget: generation minus training for the version's path; the whole step for \
             control calls and snapshot joins)"
        )?;
        for outcome in &self.scales {
            let (scale, limits) = (&outcome.scale, &outcome.limits);
            let shares: Vec<String> = limits
                .iter()
                .map(|limit| format!("{} {:.0}%", limit.resource, 100.0 * limit.utilisation))
                .collect();
            writeln!(
                f,
                "  {} regions, {} actors, {}, {:.0}%/h preempted, step {:.1} s, {:.2}% of \
                 generation lost to churn: {}",
                scale.regions,
                scale.actors,
                scale.model.name,
                100.0 * scale.preemptions_per_hour,
                outcome.step_s,
                100.0 * outcome.churn_loss,
                shares.join(", ")
            )?;
            if let Some(first) = limits.first().filter(|limit| limit.utilisation > 1.0) {
                writeln!(f, "    saturated first: {}", first.resource)?;
            }
        }
        write!(f, "{}", self.core)?;
        let describe = |found: &Option<u32>, unit: &str| match found {
            None => "not within the search".to_owned(),
            Some(value) => format!("{value} {unit}"),
        };
        let largest = self.scales.last().map(|outcome| outcome.scale);
        if let Some(scale) = largest {
            writeln!(
                f,
                "  pool size at which each saturates ({} regions, {}, {:.0}%/h):",
                scale.regions,
                scale.model.name,
                100.0 * scale.preemptions_per_hour
            )?;
        }
        for (resource, actors) in &self.saturating_actors {
            writeln!(f, "    {resource:<18} {}", describe(actors, "actors"))?;
        }
        writeln!(
            f,
            "  regions at which the trainer's uplink saturates with deltas alone (one relay each):"
        )?;
        for (model, regions) in &self.saturating_regions {
            writeln!(f, "    {model:<18} {}", describe(regions, "regions"))?;
        }
        Ok(())
    }
}

impl fmt::Display for CoreAtScale {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (scale, report) = (&self.scale, &self.report);
        let calls = &report.calls;
        let steps = report.steps.len();
        let virtual_s = self.virtual_s();
        writeln!(
            f,
            "  the control core itself at {} regions, {} actors, {}, {:.0}%/h preempted \
             ({} prompt groups a step, {} steps under virtual time, {:.0} s):",
            scale.regions,
            scale.actors,
            scale.model.name,
            100.0 * scale.preemptions_per_hour,
            self.batch_size,
            self.steps_asked,
            virtual_s
        )?;
        let stalled = report.steps.iter().filter(|step| step.partial).count();
        writeln!(
            f,
            "    steps completed                {steps} of {}, {stalled} partial; {} preemption notices",
            self.steps_asked,
            self.preempted.len()
        )?;
        let seconds = |mean: Option<f64>| mean.map_or("none".to_owned(), |s| format!("{s:.1} s"));
        let hit = self
            .steps()
            .iter()
            .skip(CORE_WARM_UP)
            .filter(|&&(_, with)| with)
            .count();
        writeln!(
            f,
            "    mean step after step {CORE_WARM_UP}         {} without a preemption, {} with one ({hit} steps)",
            seconds(self.mean_step_s(false)),
            seconds(self.mean_step_s(true))
        )?;
        writeln!(
            f,
            "    leases re-issued               {} of {} granted ({} expired, {} returned by \
             preempted actors)",
            report.reissued_leases,
            u64::from(self.batch_size) * steps as u64 + report.reissued_leases,
            report.stats.expired,
            report.returned_leases
        )?;
        let times: Vec<String> = self
            .steps()
            .iter()
            .map(|&(seconds, preempted)| {
                format!("{seconds:.1}{}", if preempted { "*" } else { "" })
            })
            .collect();
        writeln!(f, "    each step, s (* a preemption)  {}", times.join(" "))?;
        writeln!(
            f,
            "    a region reclaimed at once     {} actors at {:.0} s; their replacements take the \
             checkpoint from the hub in {:.0} s",
            self.reclaimed.actors, self.reclaimed.at_s, self.reclaimed.refetch_s
        )?;
        writeln!(
            f,
            "    idle while a step is open      {:.1}% of the never-preempted actors' time",
            100.0 * self.idle_share()
        )?;
        let per_step = |count: u64| count as f64 / steps.max(1) as f64;
        writeln!(
            f,
            "    control calls per step         {:.0}: heartbeats {:.0}, claims {:.0}, submits {:.0}, \
             version reports {:.0}, registrations {:.0}, leaves and notices {:.1}",
            per_step(calls.requests()),
            per_step(calls.heartbeat),
            per_step(calls.claim),
            per_step(calls.submit),
            per_step(calls.report_versions),
            per_step(calls.register),
            per_step(calls.leave_or_preempt)
        )?;
        let per_s = calls.requests() as f64 / virtual_s.max(1e-9);
        writeln!(
            f,
            "    control calls per second       {per_s:.0} ({:.2} an actor; and {:.1} timer ticks), \
             {:.0}% of the hub's {HUB_DURABLE_CALLS_PER_S:.0} durable calls/s",
            per_s / f64::from(scale.actors),
            calls.tick as f64 / virtual_s.max(1e-9),
            100.0 * per_s / HUB_DURABLE_CALLS_PER_S
        )
    }
}

#[cfg(test)]
mod tests {
    use aurora_control::Rejection;

    use super::super::testbed::PAPER_NETWORK;
    use super::*;

    /// The control core at 1,000 actors, 64,000 prompts a step and spot preemptions:
    /// what must hold of it beyond the driver's own checks (which it passed, or there
    /// would be no report).
    #[test]
    fn the_core_at_scale_completes_every_step_and_accounts_for_every_lease() {
        let beyond = analyse(&TcpModel::calibrated(), &PAPER_NETWORK).unwrap();
        let core = &beyond.core;
        let report = &core.report;
        let steps = report.steps.len() as u64;
        assert_eq!(steps, u64::from(core.steps_asked));
        assert!(report.steps.iter().all(|step| !step.partial));
        assert!(!core.preempted.is_empty(), "the run preempts no one");
        // One region's whole pool goes at once: a sixteenth of the actors, every one
        // with a notice at the same moment.
        let region_pool = (core.scale.actors / core.scale.regions) as usize;
        assert!(
            core.reclaimed.actors >= region_pool - 3 && core.reclaimed.actors <= region_pool + 1
        );
        assert!(core.preempted.len() > core.reclaimed.actors);
        // Every prompt accepted once; every lease granted again follows exactly one
        // lease that ended without a result: an expiry or a departure (no actor
        // misbehaves here, so no result is rejected for its content).
        assert_eq!(report.stats.accepted, u64::from(core.batch_size) * steps);
        assert_eq!(
            report.reissued_leases,
            report.stats.expired + report.returned_leases
        );
        for reason in [
            Rejection::WrongVersion,
            Rejection::WrongHash,
            Rejection::TokenCountOutOfRange,
        ] {
            assert!(!report.stats.rejected.contains_key(&reason), "{reason:?}");
        }
        // A preempted actor loses at most the leases it held: its share of a step,
        // which its estimate may make up to twice the even share.
        let share = u64::from(core.batch_size) / u64::from(core.scale.actors);
        assert!(report.returned_leases <= 2 * share * core.preempted.len() as u64);
        // After the warm-up no step stalls, preempted or not: within a quarter of the
        // analytical generation (the slowest actor's draw of long groups, and the
        // tail of re-issued prompts, are the difference).
        let costs = Costs {
            tcp: TcpModel::calibrated(),
            network: PAPER_NETWORK,
            rates: core.rates_per_actor(),
        };
        let generation_s = costs.generation_s(&core.scale.model);
        for (index, (seconds, _)) in core.steps().into_iter().enumerate().skip(CORE_WARM_UP) {
            assert!(
                seconds < 1.25 * generation_s,
                "step {index}: {seconds:.1} s against {generation_s:.1} s of generation"
            );
        }
        // One heartbeat a second per actor, and every other call counted.
        let rates = core.rates_per_actor();
        assert!((0.9..=1.1).contains(&rates.heartbeats_per_s), "{rates:?}");
        let calls = &report.calls;
        assert!(
            calls.claim >= calls.submit && calls.submit >= steps * 900,
            "{calls:?}"
        );
        assert!(core.idle_share() < 0.3, "idle {:.3}", core.idle_share());
        // The control plane's budget is charged with what the run counted.
        let control = |scale: &ScaleOutcome| {
            scale
                .limits
                .iter()
                .find(|limit| limit.resource == "control plane")
                .map(|l| l.utilisation)
        };
        let measured = calls.requests() as f64 / core.virtual_s() / HUB_DURABLE_CALLS_PER_S;
        let modelled = beyond.scales.last().and_then(control).unwrap();
        assert!(
            (modelled / measured - 1.0).abs() < 0.25,
            "{modelled} against {measured}"
        );
    }

    /// The paper's network, with the calls of an actor the estimate of three a step.
    fn paper_costs() -> Costs {
        Costs {
            tcp: TcpModel::calibrated(),
            network: PAPER_NETWORK,
            rates: ControlRates {
                heartbeats_per_s: 1.0,
                calls_per_step: 3.0,
            },
        }
    }

    /// `actors` replicas of the 70B model over 16 regions, 5% preempted an hour.
    fn spot_70b(actors: u32) -> ScaleStep {
        ScaleStep {
            regions: 16,
            actors,
            model: DENSE_70B,
            preemptions_per_hour: 0.05,
        }
    }

    #[test]
    fn the_threshold_search_finds_the_first_saturating_value() {
        assert_eq!(
            first_saturating(|x| f64::from(x) / 100.0, 1, 1_000),
            Some(101)
        );
        assert_eq!(first_saturating(|_| 2.0, 5, 1_000), Some(5));
        assert_eq!(first_saturating(|_| 0.5, 5, 1_000), None);
    }

    #[test]
    fn shared_resources_grow_with_the_pool_and_the_model_resources_do_not() {
        let costs = paper_costs();
        let scale = spot_70b;
        let (small, large) = (costs.limits(&scale(64)), costs.limits(&scale(4_096)));
        for (small, large) in small.iter().zip(&large) {
            match small.resource {
                "extraction" | "an actor's decode" => {
                    assert_eq!(small.utilisation, large.utilisation, "{}", small.resource)
                }
                _ => assert!(large.utilisation > small.utilisation, "{}", small.resource),
            }
        }
    }

    #[test]
    fn without_churn_the_uplink_carries_one_delta_per_other_region() {
        let costs = paper_costs();
        let scale = ScaleStep {
            regions: 5,
            actors: 1_000,
            model: QWEN3_8B,
            preemptions_per_hour: 0.0,
        };
        let expected_s = 4.0 * Costs::delta_bytes(&QWEN3_8B) * 8.0
            / (PAPER_NETWORK.uplink_bps * costs.tcp.goodput_efficiency);
        let utilisation = costs.uplink(&scale);
        assert!((utilisation - expected_s / costs.window_s(&QWEN3_8B)).abs() < 1e-12);
    }

    #[test]
    fn a_region_whose_peers_join_often_takes_snapshots_through_its_relay() {
        let costs = paper_costs();
        let scale = spot_70b;
        // Rarely: each joiner takes a snapshot from the hub, across the WAN, and its
        // relay one for the joiners after it.
        let rare = scale(64);
        assert_eq!(costs.rejoin_from(&rare), JoinFrom::Hub);
        let per_join = costs.joins_per_region_step(&rare) * DENSE_70B.checkpoint_bytes();
        assert_eq!(costs.snapshot_bytes_per_region_step(&rare), 2.0 * per_join);
        // Often: the relay keeps its snapshot fresh, a snapshot each time the deltas it
        // keeps come to half of what it keeps, and serves it over the datacenter's
        // network, in a fraction of the time.
        let often = scale(4_096);
        assert!(matches!(costs.rejoin_from(&often), JoinFrom::Relay { .. }));
        assert_eq!(
            costs.snapshot_bytes_per_region_step(&often),
            2.0 * Costs::delta_bytes(&DENSE_70B) / KEPT_TAIL_SNAPSHOTS
        );
        assert!(costs.rejoin_s(&often) < costs.rejoin_s(&rare) / 5.0);
    }
}
