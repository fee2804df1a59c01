//! The paper's evaluation (section 7 of `../shared/paper/`, AuroraRL), reproduced by
//! simulation on the paper's own testbed, and carried past it.
//!
//! The testbed is section 7.1's ([`testbed`]): a Qwen3-4B, 8B or 14B trainer on 2, 4 or
//! 6 H100s in the US, 4, 8 or 12 A100 PCIe actors in Canada across a commodity link of
//! 0.5 to 1 Gbps, B = 512 rollouts per step on GSM8K, MATH and DeepScaleR. Each step's
//! generation is scheduled by the real control core: the driver of this crate runs the
//! actor pool under virtual time (Algorithm 1's split, leases, membership, preemptions
//! and joins; a vanished actor found only as its leases expire, as the paper's system
//! does), each actor's engine decoding the sequences it holds, memory-bound. The pipeline
//! around generation (training, extraction, the transfer, staging and activation, one
//! or more steps of lag) is [`timeline`], fed with transfer times from the TCP model
//! ([`tcp`]) and update sizes from the codec's measured bytes per changed element
//! ([`calibration`]). Nothing is fitted to the paper's results: they appear only as the
//! column each figure is compared against. What the paper leaves unstated (completion
//! lengths, round trips, loss, decode efficiency) is a named assumption; a figure more
//! than 20% off is followed by a what-if row that changes one named input.
//!
//! Pure and deterministic: a fixed seed, virtual time, no I/O.

mod baselines;
mod beyond;
mod calibration;
mod end_to_end;
pub mod fleet;
mod membership;
mod placement;
mod report;
mod tcp;
mod testbed;
mod timeline;
mod transfer;

use std::cell::RefCell;
use std::collections::HashMap;

use aurora_control::SplitPolicy;

pub use baselines::{Deployment, MULTI_STREAMS, RemoteRegion, System};
pub use beyond::{Beyond, CoreAtScale, Reclaimed, ResourceLimit, ScaleOutcome, ScaleStep};
pub use calibration::Encoding;
pub use report::{FLAG_THRESHOLD, PaperFigure, PaperReport, Row, Section, Tally};
pub use tcp::{CongestionControl, Link, TcpModel};

use self::calibration::TRANSPORT_TRANSFERS;
use self::report::PaperFigure::{AtLeast, Range, Value};
use self::testbed::{
    A100, AUSTRALIA, ActorKind, CANADA, DATASETS, DECODE_ROOFLINE_RANGE, DECODE_ROOFLINE_SHARE,
    DEEPSCALER, DEEPSCALER_SHORT, Dataset, GSM8K, GSM8K_LONG, Gpu, ICELAND, JAPAN, JoinFrom, L40,
    LINK_LOW_SHARE, MATH, MATH_SHORT, ModelShape, NETHERLANDS, Network, PAPER_DEPLOYMENTS,
    PAPER_NETWORK, PaperDeployment, QWEN3_4B, QWEN3_8B, QWEN3_14B, Region, SEQUENCE_LIMIT_RANGE,
    TRAINER_MFU, Trainer, US, WAN_LOSS, WAN_LOSS_RANGE, Workload, paper_trainer_mfu, rate_shares,
    wan_path,
};
use self::timeline::{GeneratedStep, mean_step_s, simulate, substitute_sync, throughput};
use crate::report::Violation;
use crate::scenario::{ActorSpec, Fault, Liveness, Scenario, ScheduledFault};
use crate::world::SplitMix64;

/// The seed of every control-core run and of the links' fluctuation.
const SEED: u64 = 260_211_456;
/// Steps per simulated run.
const STEPS: u32 = 30;
/// Steps left out of throughputs while estimates and the pipeline settle.
const WARM_UP: usize = 4;
/// Assumption: the dataset of the runs whose dataset the paper does not name (the
/// datacenters, fault and scalability runs, and the step times of section 7.3): MATH,
/// the middle of the three in answer length.
const UNNAMED_DATASET: Dataset = MATH;
/// The tolerance of a figure the model cannot bring near the paper (a sync it hides
/// entirely gives 0 where the paper measured a few percent): no bound of its own; the
/// tally's ratchet holds it.
const UNBOUNDED: f64 = f64::INFINITY;
/// Why absolute rates may differ, and the what-ifs that test it.
const DECODE_WHY: &str = "absolute rates follow the decode model's assumed share of the \
    memory roofline (0.5, plausible 0.3 to 0.7) and the assumed answer lengths where \
    generation sets the pace, the trainer's MFU (from section 2's 40 s of training against \
    45 s of generation for 8B) where training does; the what-ifs decode at either end of \
    the roofline's range, or run the trainer at the 40% MFU assumed before";

/// Runs the whole comparison.
pub fn paper_evaluation() -> Result<PaperReport, Violation> {
    let tcp = TcpModel::calibrated();
    let bench = Bench {
        tcp,
        network: PAPER_NETWORK,
        runs: PAPER_RUNS,
        generations: RefCell::default(),
    };
    let sections = vec![
        bench.encodings(),
        bench.bandwidth_sweep(),
        bench.against_baselines()?,
        bench.datacenters()?,
        bench.heterogeneity()?,
        bench.relays()?,
        bench.fault_and_scale()?,
        bench.cost()?,
    ];
    Ok(PaperReport {
        tcp,
        wan_loss: WAN_LOSS,
        transport_check: transport_check(&tcp),
        sections,
        beyond: beyond::analyse(&tcp, &PAPER_NETWORK)?,
    })
}

fn transport_check(tcp: &TcpModel) -> Vec<(String, f64, f64)> {
    TRANSPORT_TRANSFERS
        .iter()
        .map(|&(bytes, rate_mbps, rtt_ms, streams, measured_s)| {
            let link = Link {
                rate_bps: rate_mbps * 1e6,
                rtt_s: rtt_ms / 1e3,
                loss: 0.0,
            };
            let what = format!(
                "{:.1} MB, {rate_mbps:.0} Mbps, {rtt_ms:.0} ms, {streams} BBR",
                bytes / 1e6
            );
            let model_s = tcp.transfer_s(bytes, link, CongestionControl::Bbr, streams);
            (what, measured_s, model_s)
        })
        .collect()
}

/// An actor of a simulated pool.
#[derive(Clone, Debug)]
struct PoolActor {
    kind: ActorKind,
    /// The share of its decode model's rate it runs at (1 but in what-if rows).
    speed: f64,
    region: Region,
    /// When it registers, seconds of the control core's clock.
    joins_at_s: f64,
}

fn actor(gpu: Gpu, region: Region) -> PoolActor {
    PoolActor {
        kind: ActorKind { gpu, gpus: 1 },
        speed: 1.0,
        region,
        joins_at_s: 0.0,
    }
}

/// `pool` with every actor at `share` of the memory roofline instead of
/// [`DECODE_ROOFLINE_SHARE`].
fn decoding_at(pool: &[PoolActor], share: f64) -> Vec<PoolActor> {
    pool.iter()
        .map(|actor| PoolActor {
            speed: actor.speed * share / DECODE_ROOFLINE_SHARE,
            ..actor.clone()
        })
        .collect()
}

/// A what-if at each end of the decode model's plausible range
/// ([`DECODE_ROOFLINE_RANGE`]): the figure `value` makes of `pool` decoding at that share
/// of the roofline, labelled `{what}decode at {share} of the roofline: {figure}`.
fn decode_what_ifs(
    pool: &[PoolActor],
    what: &str,
    figure: &str,
    paper: PaperFigure,
    unit: &'static str,
    mut value: impl FnMut(&[PoolActor]) -> Result<f64, Violation>,
) -> Result<Vec<Row>, Violation> {
    DECODE_ROOFLINE_RANGE
        .into_iter()
        .map(|share| {
            Ok(Row::what_if(
                format!("{what}decode at {share} of the roofline: {figure}"),
                paper,
                value(&decoding_at(pool, share))?,
                unit,
            ))
        })
        .collect()
}

/// The what-if of the trainer at the MFU assumed before section 2's measurement
/// ([`TRAINER_MFU`]): the figure `value` makes, labelled as [`decode_what_ifs`] labels.
fn assumed_mfu_what_if(
    what: &str,
    figure: &str,
    paper: PaperFigure,
    value: f64,
    unit: &'static str,
) -> Row {
    Row::what_if(
        format!("{what}trainer at {:.0}% MFU: {figure}", 100.0 * TRAINER_MFU),
        paper,
        value,
        unit,
    )
}

/// `row`, and where it is beyond [`FLAG_THRESHOLD`] the reason (`why`, with the
/// difference the documentation accepts) and the what-if rows that test it.
fn checked(
    row: Row,
    why: &'static str,
    tolerance: f64,
    what_if: impl FnOnce() -> Result<Vec<Row>, Violation>,
) -> Result<Vec<Row>, Violation> {
    if !row.flagged() {
        return Ok(vec![row]);
    }
    let mut rows = vec![row.explained(why, tolerance)];
    rows.extend(what_if()?);
    Ok(rows)
}

/// The seed of the `region`-th remote region's fluctuation in a run seeded `seed`: mixed
/// so that no two (seed, region) pairs share a sequence, nor any with the control core's
/// own streams (`Scenario::tokens_for` uses the seed with the prompt).
fn fluctuation_seed(seed: u64, region: usize) -> u64 {
    let mut mixed = SplitMix64(seed ^ 0xF1C7_0A7E_5EED_0000);
    for _ in 0..=region {
        mixed.next_u64();
    }
    mixed.next_u64()
}

/// `count` A100 actors in `region`.
fn a100s(count: usize, region: Region) -> Vec<PoolActor> {
    vec![actor(A100, region); count]
}

/// Section 7.1's actor pool: its A100s in Canada.
fn paper_pool(deployment: &PaperDeployment) -> Vec<PoolActor> {
    a100s(deployment.actors, CANADA)
}

/// What decides a run besides its pool and the system.
#[derive(Clone, Copy, Debug)]
struct Setup {
    model: ModelShape,
    trainer: Trainer,
    workload: Workload,
}

impl Setup {
    /// This setup with the trainer at the assumed [`TRAINER_MFU`] rather than the MFU
    /// section 2's measurement gives.
    fn assumed_mfu_trainer(&self) -> Setup {
        Setup {
            trainer: Trainer {
                mfu: TRAINER_MFU,
                ..self.trainer
            },
            ..*self
        }
    }

    /// Section 7.1's trainer for its model, on `dataset`.
    fn paper(deployment: &PaperDeployment, dataset: Dataset) -> Setup {
        Setup {
            model: deployment.model,
            trainer: Trainer::paper(deployment.trainer_gpus),
            workload: Workload::of(&deployment.model, dataset),
        }
    }
}

/// How long each control-core run is, and its seed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Runs {
    /// Seeds the control core (rollout lengths, drift) and the links' fluctuation.
    seed: u64,
    /// Steps per run.
    steps: u32,
    /// Steps left out of throughputs while estimates and the pipeline settle.
    warm_up: usize,
}

/// The paper's evaluation's runs.
const PAPER_RUNS: Runs = Runs {
    seed: SEED,
    steps: STEPS,
    warm_up: WARM_UP,
};

struct Bench {
    tcp: TcpModel,
    network: Network,
    runs: Runs,
    /// Control-core runs already made, by their inputs: sections and what-ifs share
    /// many, and the runs are most of the evaluation's time.
    generations: RefCell<HashMap<String, Generation>>,
}

impl Bench {
    fn deployment(&self, setup: &Setup, pool: &[PoolActor]) -> Deployment {
        let mut remote: Vec<(&Region, u32)> = Vec::new();
        let mut local_actors = 0;
        for actor in pool {
            if actor.region.local {
                local_actors += 1;
                continue;
            }
            match remote
                .iter_mut()
                .find(|(region, _)| region.name == actor.region.name)
            {
                Some((_, actors)) => *actors += 1,
                None => remote.push((&actor.region, 1)),
            }
        }
        Deployment {
            model: setup.model,
            workload: setup.workload,
            trainer: setup.trainer,
            network: self.network,
            local_actors,
            remote: remote
                .into_iter()
                .enumerate()
                .map(|(index, (region, actors))| RemoteRegion {
                    path: region.path,
                    actors,
                    rate_shares: rate_shares(
                        fluctuation_seed(self.runs.seed, index),
                        self.runs.steps as usize,
                        self.network.link_low_share,
                    ),
                    absent: Vec::new(),
                })
                .collect(),
            tcp: self.tcp,
            delta_streams: MULTI_STREAMS,
            delta_encoding: Encoding::Aurora,
        }
    }

    /// The control core schedules each step's prompts over `pool`; what comes back is
    /// each step's generation time and accepted tokens.
    fn generate(
        &self,
        setup: &Setup,
        pool: &[PoolActor],
        split: SplitPolicy,
        faults: Vec<ScheduledFault>,
    ) -> Result<Generation, Violation> {
        self.generate_finding_the_gone(setup, pool, split, faults, Liveness::LeaseExpiry)
    }

    /// [`Bench::generate`], the hub finding a vanished actor by `liveness` (the paper's
    /// system, [`Liveness::LeaseExpiry`], in every run of its evaluation).
    fn generate_finding_the_gone(
        &self,
        setup: &Setup,
        pool: &[PoolActor],
        split: SplitPolicy,
        faults: Vec<ScheduledFault>,
        liveness: Liveness,
    ) -> Result<Generation, Violation> {
        // What the run depends on: the trainer's speed is not among it.
        let key = format!(
            "{:?} {:?} {:?} {pool:?} {split:?} {faults:?} {liveness:?}",
            self.runs, setup.model, setup.workload
        );
        if let Some(generation) = self.generations.borrow().get(&key) {
            return Ok(generation.clone());
        }
        // An even share of the step's sequences over the actors there from the start:
        // what each actor's engine runs at once.
        let rollouts = setup.workload.prompts_per_step * setup.workload.samples_per_prompt;
        let founders = pool.iter().filter(|actor| actor.joins_at_s == 0.0).count();
        let share = u64::from(rollouts).div_ceil(founders.max(1) as u64);
        let actors = pool
            .iter()
            .enumerate()
            .map(|(index, actor)| {
                let decode = actor
                    .kind
                    .batched_decode(&setup.model, &setup.workload, actor.speed);
                ActorSpec {
                    label: format!("{}-{index}", actor.kind.gpu.name),
                    tokens_per_s: decode.tokens_per_s(share),
                    region: actor.region.name.to_string(),
                    can_relay: true,
                    joins_at_ms: (actor.joins_at_s * 1e3) as u64,
                    decode: Some(decode),
                }
            })
            .collect();
        let scenario = Scenario {
            seed: self.runs.seed,
            actors,
            steps: self.runs.steps,
            batch_size: setup.workload.prompts_per_step,
            split,
            partial_batch: None,
            drift: aurora_control::Permille::clamped(0),
            tokens_per_prompt: setup.workload.group_tokens(),
            rollout_limit: Some(setup.workload.group_limit()),
            // The pipeline (`timeline`) overlaps training with generation, so the control
            // core's clock advances by generation alone between steps, plus the driver's
            // dissemination allowance, which stands in for activation.
            train_ms: 0,
            faults,
            liveness,
        };
        let report = crate::run(&scenario)?;
        let steps = report
            .steps
            .iter()
            .map(|step| GeneratedStep {
                generation_s: step.step_ms() as f64 / 1e3,
                tokens: step.accepted_tokens as f64,
            })
            .collect();
        let opened_at_s = report
            .steps
            .iter()
            .map(|step| step.opened_at.0 as f64 / 1e3)
            .collect();
        let generation = Generation { steps, opened_at_s };
        self.generations
            .borrow_mut()
            .insert(key, generation.clone());
        Ok(generation)
    }

    /// Tokens per second and mean step of `system` on `generation`.
    fn run(&self, deployment: &Deployment, system: System, generation: &Generation) -> Outcome {
        self.outcome(&self.timings(deployment, system, generation))
    }

    /// Tokens per second and mean step of `timings` after the warm-up.
    fn outcome(&self, timings: &[timeline::StepTiming]) -> Outcome {
        let measured = self.runs.warm_up..timings.len();
        Outcome {
            tokens_per_s: throughput(timings, measured.clone()),
            step_s: mean_step_s(timings, measured),
        }
    }

    fn timings(
        &self,
        deployment: &Deployment,
        system: System,
        generation: &Generation,
    ) -> Vec<timeline::StepTiming> {
        if system == System::IdealSingleDc {
            // Section 7.1 builds Ideal-SingleDC "by replacing only the cross-cloud weight
            // transfer cost in AuroraRL's measured execution traces with the corresponding
            // RDMA transfer cost, keeping training and rollout execution unchanged": a
            // substitution in AuroraRL's trace, not a rerun of the pipeline, so every step
            // gives back the whole sync it recorded, hidden or not. An interpretation (a
            // rerun would hide it wherever AuroraRL does), which section 7.2's account of
            // the gap supports: "the small residual gap comes from WAN latency and
            // CPU-side delta extraction (neither exists on RDMA)".
            let saved_s = deployment.sync_plan(System::AuroraRl).mean_sync_s()
                - deployment.sync_plan(System::IdealSingleDc).mean_sync_s();
            return substitute_sync(
                &self.timings(deployment, System::AuroraRl, generation),
                saved_s,
            );
        }
        let plan = deployment.sync_plan(system);
        let train_s = deployment
            .trainer
            .step_s(&deployment.model, &deployment.workload);
        simulate(&plan, train_s, &generation.steps)
    }

    /// `system`'s tokens per second on `deployment`, generating with `pool` under `split`.
    fn tokens_per_s(
        &self,
        deployment: &Deployment,
        setup: &Setup,
        pool: &[PoolActor],
        split: SplitPolicy,
        system: System,
    ) -> Result<f64, Violation> {
        let generation = self.generate(setup, pool, split, Vec::new())?;
        Ok(self.run(deployment, system, &generation).tokens_per_s)
    }

    /// The paper's system's tokens per second with `pool` on `setup`.
    fn aurora_rl_tokens_per_s(&self, setup: &Setup, pool: &[PoolActor]) -> Result<f64, Violation> {
        let deployment = self.deployment(setup, pool);
        self.tokens_per_s(
            &deployment,
            setup,
            pool,
            SplitPolicy::Proportional,
            System::AuroraRl,
        )
    }
}

/// What the control core made of a pool.
#[derive(Clone, Debug)]
struct Generation {
    steps: Vec<GeneratedStep>,
    opened_at_s: Vec<f64>,
}

impl Generation {
    /// The first step the control core opened at or after `time_s` (the last step if
    /// none did).
    fn first_step_opened_after(&self, time_s: f64) -> usize {
        self.opened_at_s
            .iter()
            .position(|&opened| opened >= time_s)
            .unwrap_or(self.opened_at_s.len().saturating_sub(1))
    }
}

#[derive(Clone, Copy, Debug)]
struct Outcome {
    tokens_per_s: f64,
    step_s: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_evaluation_is_deterministic() {
        let first = paper_evaluation().unwrap();
        let second = paper_evaluation().unwrap();
        assert_eq!(first.to_string(), second.to_string());
    }

    /// The paper's figures within 20%, and those beyond it that a what-if explains, as
    /// docs/paper-eval.md reports them (the issue asks 90% within 20%): a ratchet, so a
    /// change that moves a figure away from the paper fails here unless another comes
    /// closer.
    const WITHIN_AT_LEAST: usize = 112;
    const WITHIN_OR_EXPLAINED_AT_LEAST: usize = 143;

    #[test]
    fn every_figure_stays_within_its_documented_tolerance_of_the_paper() {
        let report = paper_evaluation().unwrap();
        let tally = report.tally();
        assert!(tally.within >= WITHIN_AT_LEAST, "{tally:?}");
        assert!(
            tally.within + tally.explained_by_what_if >= WITHIN_OR_EXPLAINED_AT_LEAST,
            "{tally:?}"
        );
        for row in report.rows() {
            let Some(difference) = row.difference() else {
                continue;
            };
            assert!(
                difference.abs() <= row.tolerance,
                "{}: {:+.1}% from the paper, tolerance {:.0}%",
                row.label,
                100.0 * difference,
                100.0 * row.tolerance
            );
            assert!(
                !row.flagged() || row.what_if || row.explanation.is_some(),
                "{} differs by {:+.1}% without an explanation",
                row.label,
                100.0 * difference
            );
        }
        // The same figures as data: a JSON object and a CSV line for every row.
        let rows: Vec<&Row> = report.rows().collect();
        let json = report.figures_json();
        let json_rows: Vec<&serde_json::Value> = json["sections"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|section| section["rows"].as_array().unwrap())
            .collect();
        assert_eq!(json_rows.len(), rows.len());
        for (row, data) in rows.iter().zip(&json_rows) {
            assert_eq!(data["label"], row.label.as_str());
            assert_eq!(data["simulated"].as_f64(), Some(row.simulated));
            assert_eq!(data["difference"].as_f64(), row.difference());
        }
        let csv = report.figures_csv();
        assert_eq!(csv.lines().count(), rows.len() + 1);
        assert!(
            csv.lines()
                .skip(1)
                .zip(&rows)
                .all(|(line, row)| line.contains(&row.label))
        );
    }
}
