//! Past the paper: more regions, more actors, a larger model, spot preemptions. For
//! each scale, how much of its budget each shared resource needs, and at what scale
//! each runs out.
//!
//! With one step of lag, a version must be trained, extracted, shipped and staged
//! while the actors generate the step before: the window left after training is the
//! budget of every resource on that path. Control calls and snapshot joins run all the
//! time and are measured against the whole step. The trainer is assumed to grow with
//! the pool (training takes half a generation, [`TRAIN_SHARE_OF_GENERATION`]): the
//! question is which part of the system does not.

use std::fmt;

use super::calibration::{Encoding, HUB_DURABLE_CALLS_PER_S};
use super::tcp::{CongestionControl, TcpModel};
use super::testbed::{
    A100, ActorKind, DENSE_70B, H100, ModelShape, Network, PAPER_TRAINER, PAPER_WORKLOAD, QWEN3_8B,
    QWEN3_14B, actor_decode_s,
};

/// Assumption: the trainer is sized so that a step's training takes this share of its
/// generation.
const TRAIN_SHARE_OF_GENERATION: f64 = 0.5;
/// Prompt groups per actor and step: the batch grows with the pool.
const PROMPTS_PER_ACTOR: f64 = 64.0;
/// Control calls per actor and step besides heartbeats: claim, submit, version report.
const CALLS_PER_ACTOR_STEP: f64 = 3.0;
/// Heartbeats per actor and second (`crates/node`'s actor: one a second).
const HEARTBEATS_PER_S: f64 = 1.0;
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
}

/// The scales the report walks through, the paper's first.
pub fn scale_steps() -> [ScaleStep; 5] {
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

/// Works out every scale's resources and the thresholds.
pub fn analyse(tcp: &TcpModel, network: &Network) -> Beyond {
    let costs = Costs {
        tcp: *tcp,
        network: *network,
    };
    let steps = scale_steps();
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
    let largest = steps[steps.len() - 1];
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
    let saturating_regions = [QWEN3_8B, QWEN3_14B, DENSE_70B]
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
    Beyond {
        scales,
        saturating_actors,
        saturating_regions,
    }
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
}

impl Costs {
    fn actor(model: &ModelShape) -> ActorKind {
        if model.parameters > 20e9 {
            // A 70B replica does not fit one GPU: four H100s, tensor parallel.
            ActorKind { gpu: H100, gpus: 4 }
        } else {
            ActorKind { gpu: A100, gpus: 1 }
        }
    }

    /// Seconds an actor takes for its share of a step.
    fn generation_s(&self, model: &ModelShape) -> f64 {
        let (shortest, longest) = PAPER_WORKLOAD.group_tokens();
        let tokens = PROMPTS_PER_ACTOR * (shortest + longest) as f64 / 2.0;
        tokens / Self::actor(model).tokens_per_s(model, &PAPER_WORKLOAD)
    }

    /// Seconds a version may take from trained to staged without stalling a step.
    fn window_s(&self, model: &ModelShape) -> f64 {
        self.generation_s(model) * (1.0 - TRAIN_SHARE_OF_GENERATION)
    }

    fn delta_bytes(model: &ModelShape) -> f64 {
        model.delta_bytes(Encoding::Aurora, PAPER_WORKLOAD.density)
    }

    /// The trainer's uplink: a delta to each other region's relay inside the window,
    /// and the snapshots preempted actors rejoin with (relays serve none) all along.
    fn uplink(&self, scale: &ScaleStep) -> f64 {
        let model = &scale.model;
        let usable_bps = self.network.uplink_bps * self.tcp.goodput_efficiency;
        let deltas_s = Self::delta_bytes(model) * f64::from(scale.regions.saturating_sub(1)) * 8.0
            / usable_bps;
        let step_s = self.generation_s(model);
        let joins_per_step = f64::from(scale.actors) * scale.preemptions_per_hour * step_s / 3600.0;
        let snapshots_s = joins_per_step * model.checkpoint_bytes() * 8.0 / usable_bps;
        deltas_s / self.window_s(model) + snapshots_s / step_s
    }

    fn churn_loss(&self, scale: &ScaleStep) -> f64 {
        let model = &scale.model;
        let rejoin_s = self.network.snapshot_join_s(&self.tcp, model);
        let lost_s_per_preemption = self.generation_s(model) / 2.0 + rejoin_s;
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
        let calls_per_s =
            f64::from(scale.actors) * (HEARTBEATS_PER_S + CALLS_PER_ACTOR_STEP / step_s);
        vec![
            ResourceLimit {
                resource: "trainer uplink",
                utilisation: self.uplink(scale),
            },
            ResourceLimit {
                resource: "a relay",
                utilisation: relay_in_s.max(relay_out_s) / window_s,
            },
            ResourceLimit {
                resource: "extraction",
                utilisation: PAPER_TRAINER.extraction_s(model, Encoding::Aurora) / window_s,
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

#[cfg(test)]
mod tests {
    use super::super::testbed::PAPER_NETWORK;
    use super::*;

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
        let costs = Costs {
            tcp: TcpModel::calibrated(),
            network: PAPER_NETWORK,
        };
        let scale = |actors| ScaleStep {
            regions: 16,
            actors,
            model: DENSE_70B,
            preemptions_per_hour: 0.05,
        };
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
        let costs = Costs {
            tcp: TcpModel::calibrated(),
            network: PAPER_NETWORK,
        };
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
}
