//! The paper's evaluation (arXiv 2602.11456, "SparrowRL"), reproduced by simulation at
//! its scale, and carried past it.
//!
//! Each step's generation is scheduled by the real control core: the driver of this
//! crate runs the paper's actor pool under virtual time (Algorithm 1's split, leases,
//! membership, preemptions and joins), with each actor's speed from a decode model of
//! its GPU ([`testbed`]). The pipeline around generation (training on the H100 node,
//! extraction, the transfer, staging and activation, one or more steps of lag) is
//! [`timeline`], fed with transfer times from the calibrated TCP model ([`tcp`]) and
//! update sizes from the codec's measured bytes per changed element ([`calibration`]).
//! Every figure printed comes from those; nothing is pinned to the paper's numbers,
//! which appear only as the column they are compared against, and as the one transfer
//! the WAN's unknown loss rate is inferred from ([`calibrate_wan_loss`]).
//!
//! Pure and deterministic: a fixed seed, virtual time, no I/O.

mod baselines;
mod beyond;
mod calibration;
mod report;
mod tcp;
mod testbed;
mod timeline;

use aurora_control::SplitPolicy;

pub use baselines::{Deployment, System};
pub use beyond::{Beyond, CoreAtScale, ResourceLimit, ScaleOutcome, ScaleStep};
pub use calibration::Encoding;
pub use report::{FLAG_THRESHOLD, PaperFigure, PaperReport, Row, Section};
pub use tcp::{CongestionControl, Link, TcpModel};

use self::calibration::TRANSPORT_TRANSFERS;
use self::report::PaperFigure::{Range, Value};
use self::testbed::{
    A100, ActorKind, JoinFrom, L40, ModelShape, Network, PAPER_NETWORK, PAPER_TRAINER,
    PAPER_WORKLOAD, QWEN3_4B, QWEN3_8B, QWEN3_14B,
};
use self::timeline::{GeneratedStep, mean_step_s, simulate, throughput};
use crate::report::Violation;
use crate::scenario::{ActorSpec, Fault, Scenario, ScheduledFault};

/// The seed of every control-core run.
const SEED: u64 = 260_211_456;
/// Steps per simulated run.
const STEPS: u32 = 30;
/// Steps left out of throughputs while estimates and the pipeline settle.
const WARM_UP: usize = 4;

/// The paper's int32 step of Qwen3-8B (414 MB) took 9.22 s on one stream: the one
/// transfer the WAN's loss rate is inferred from.
const PAPER_INT32_BYTES: f64 = 414e6;
const PAPER_INT32_ONE_STREAM_S: f64 = 9.22;

/// Runs the whole comparison.
pub fn paper_evaluation() -> Result<PaperReport, Violation> {
    let tcp = TcpModel::calibrated();
    let wan_loss = calibrate_wan_loss(&tcp);
    let network = Network {
        wan: Link {
            loss: wan_loss,
            ..PAPER_NETWORK.wan
        },
        ..PAPER_NETWORK
    };
    let bench = Bench { tcp, network };
    let sections = vec![
        bench.encodings(),
        bench.bandwidth_sweep(),
        bench.against_baselines()?,
        bench.datacenters()?,
        bench.heterogeneity()?,
        bench.relays()?,
        bench.membership()?,
    ];
    Ok(PaperReport {
        tcp,
        wan_loss,
        transport_check: transport_check(&tcp),
        sections,
        beyond: beyond::analyse(&tcp, &network)?,
    })
}

/// The loss rate at which one CUBIC stream on the paper's WAN path moves the paper's
/// int32 step in the paper's time (bisection on the logarithm; the time grows with
/// the loss).
pub fn calibrate_wan_loss(tcp: &TcpModel) -> f64 {
    let time = |loss: f64| {
        let link = Link {
            loss,
            ..PAPER_NETWORK.wan
        };
        tcp.transfer_s(PAPER_INT32_BYTES, link, CongestionControl::Cubic, 1)
    };
    let (mut low, mut high) = (1e-9_f64.ln(), 1e-1_f64.ln());
    for _ in 0..100 {
        let middle = (low + high) / 2.0;
        if time(middle.exp()) < PAPER_INT32_ONE_STREAM_S {
            low = middle;
        } else {
            high = middle;
        }
    }
    ((low + high) / 2.0).exp()
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
#[derive(Clone, Copy, Debug)]
struct PoolActor {
    kind: ActorKind,
    /// The share of its decode model's rate it runs at (1 but in what-if rows).
    speed: f64,
    region: usize,
    /// When it registers, seconds of the control core's clock.
    joins_at_s: f64,
}

impl PoolActor {
    fn tokens_per_s(&self, model: &ModelShape) -> f64 {
        self.speed * self.kind.tokens_per_s(model, &PAPER_WORKLOAD)
    }
}

fn a100_in(region: usize) -> PoolActor {
    PoolActor {
        kind: ActorKind { gpu: A100, gpus: 1 },
        speed: 1.0,
        region,
        joins_at_s: 0.0,
    }
}

/// One actor per region, the trainer's first.
fn one_a100_per_region(regions: usize) -> Vec<PoolActor> {
    (0..regions).map(a100_in).collect()
}

struct Bench {
    tcp: TcpModel,
    network: Network,
}

impl Bench {
    fn deployment(&self, model: ModelShape, pool: &[PoolActor]) -> Deployment {
        let regions = pool.iter().map(|actor| actor.region + 1).max().unwrap_or(1);
        let mut actors_per_region = vec![0; regions];
        for actor in pool {
            actors_per_region[actor.region] += 1;
        }
        Deployment {
            model,
            workload: PAPER_WORKLOAD,
            trainer: PAPER_TRAINER,
            network: self.network,
            actors_per_region,
            tcp: self.tcp,
            delta_encoding: Encoding::Aurora,
        }
    }

    /// The control core schedules each step's prompts over `pool`; what comes back is
    /// each step's generation time and accepted tokens.
    fn generate(
        &self,
        model: &ModelShape,
        pool: &[PoolActor],
        split: SplitPolicy,
        faults: Vec<ScheduledFault>,
    ) -> Result<Generation, Violation> {
        let workload = PAPER_WORKLOAD;
        let actors = pool
            .iter()
            .enumerate()
            .map(|(index, actor)| ActorSpec {
                label: format!("{}-{index}", actor.kind.gpu.name),
                tokens_per_s: actor.tokens_per_s(model).round() as u64,
                region: format!("region-{}", actor.region),
                can_relay: true,
                joins_at_ms: (actor.joins_at_s * 1e3) as u64,
            })
            .collect();
        let scenario = Scenario {
            seed: SEED,
            actors,
            steps: STEPS,
            batch_size: workload.prompts_per_step,
            split,
            partial_batch: None,
            drift: aurora_control::Permille::clamped(0),
            tokens_per_prompt: workload.group_tokens(),
            // The pipeline (`timeline`) overlaps training with generation, so the control
            // core's clock advances by generation alone between steps, plus the driver's
            // dissemination allowance, which stands in for activation.
            train_ms: 0,
            faults,
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
        Ok(Generation { steps, opened_at_s })
    }

    /// Tokens per second and mean step of `system` on `generation`.
    fn run(&self, deployment: &Deployment, system: System, generation: &Generation) -> Outcome {
        let plan = deployment.sync_plan(system);
        let train_s = deployment
            .trainer
            .step_s(&deployment.model, &deployment.workload);
        let timings = simulate(&plan, train_s, &generation.steps);
        Outcome {
            tokens_per_s: throughput(&timings, WARM_UP..timings.len()),
            step_s: mean_step_s(&timings, WARM_UP..timings.len()),
        }
    }

    fn encodings(&self) -> Section {
        let model = QWEN3_8B;
        let density = PAPER_WORKLOAD.density;
        let wan = self.network.wan;
        let megabytes = |encoding| model.delta_bytes(encoding, density) / 1e6;
        let paper_density =
            PAPER_INT32_BYTES / (Encoding::Int32.bytes_per_change(density) * model.parameters);
        let time = |encoding, streams, cc| {
            self.tcp
                .transfer_s(model.delta_bytes(encoding, density), wan, cc, streams)
        };
        const DENSITY_WHY: &str = "the paper's 414 MB is 6 bytes per change at 0.84% of \
            Qwen3-8B's elements, not the 1% simulated (the row below, at 0.84%, comes \
            within 20%); the rest is LEB128 coding real weights' gaps in fewer bytes than the \
            synthetic checkpoint's (2.93 against 3.23 bytes per change)";
        let cubic = CongestionControl::Cubic;
        Section {
            title: "1. Per-step transfer cost by encoding and streams".into(),
            setting: format!(
                "Qwen3-8B at {:.0}% density; sizes from the codec's bytes per changed element; \
                 the paper's WAN path: 1 Gbps, {:.0} ms, CUBIC",
                100.0 * density,
                1e3 * wan.rtt_s
            ),
            rows: vec![
                Row::compared("int32 size", Value(414.0), megabytes(Encoding::Int32), "MB"),
                Row::compared(
                    "LEB128 size",
                    Value(202.0),
                    megabytes(Encoding::Leb128),
                    "MB",
                )
                .explained(DENSITY_WHY, 0.40),
                // The explanation, tested: the density the paper's int32 size implies.
                Row::compared(
                    format!(
                        "LEB128 size at {:.2}%, the density of the paper's int32 size",
                        100.0 * paper_density
                    ),
                    Value(202.0),
                    model.delta_bytes(Encoding::Leb128, paper_density) / 1e6,
                    "MB",
                ),
                Row::simulated("aurora size", megabytes(Encoding::Aurora), "MB"),
                Row::compared(
                    "int32, 1 stream",
                    Value(9.22),
                    time(Encoding::Int32, 1, cubic),
                    "s",
                ),
                Row::compared(
                    "LEB128, 1 stream",
                    Value(4.71),
                    time(Encoding::Leb128, 1, cubic),
                    "s",
                )
                .explained(DENSITY_WHY, 0.40),
                Row::compared(
                    "LEB128, 4 streams",
                    Value(2.90),
                    time(Encoding::Leb128, 4, cubic),
                    "s",
                ),
                Row::simulated("aurora, 1 stream", time(Encoding::Aurora, 1, cubic), "s"),
                Row::simulated("aurora, 4 streams", time(Encoding::Aurora, 4, cubic), "s"),
                Row::simulated(
                    "aurora, 4 streams, BBR (its default)",
                    time(Encoding::Aurora, 4, CongestionControl::Bbr),
                    "s",
                ),
            ],
        }
    }

    fn bandwidth_sweep(&self) -> Section {
        let model = QWEN3_8B;
        let density = PAPER_WORKLOAD.density;
        let clean = |rate_bps| Link {
            rate_bps,
            rtt_s: 0.03,
            loss: 0.0,
        };
        const SLOW_START_WHY: &str = "at 10 Gbps a 200 MB delta is slow-start bound: the \
            model counts fresh connections doubling from 10 segments each round trip \
            (14 rounds at 30 ms); on connections kept warm from the step before (the next \
            row) it gives the paper's figure";
        let mut rows = Vec::new();
        for rate_bps in [250e6, 500e6, 1e9, 2.5e9, 5e9, 10e9] {
            let link = clean(rate_bps);
            let label = |what: &str| format!("{what} at {:.2} Gbps", rate_bps / 1e9);
            let full_s =
                self.tcp
                    .transfer_s(model.checkpoint_bytes(), link, CongestionControl::Cubic, 1);
            let delta_s = |encoding, cc| {
                self.tcp
                    .transfer_s(model.delta_bytes(encoding, density), link, cc, 4)
            };
            let leb128_s = delta_s(Encoding::Leb128, CongestionControl::Cubic);
            rows.push(match rate_bps {
                250e6 => Row::compared(label("Full"), Value(566.0), full_s, "s"),
                10e9 => Row::compared(label("Full"), Value(17.3), full_s, "s"),
                _ => Row::simulated(label("Full"), full_s, "s"),
            });
            if rate_bps == 10e9 {
                rows.push(
                    Row::compared(
                        label("Delta (LEB128, 4 streams)"),
                        Value(0.25),
                        leb128_s,
                        "s",
                    )
                    .explained(SLOW_START_WHY, 1.0),
                );
                // The explanation, tested: the same transfer on warm connections.
                let warm_s = self.tcp.warm_transfer_s(
                    model.delta_bytes(Encoding::Leb128, density),
                    link,
                    CongestionControl::Cubic,
                    4,
                );
                rows.push(Row::compared(
                    label("Delta (LEB128, 4 streams), warm connections"),
                    Value(0.25),
                    warm_s,
                    "s",
                ));
            } else {
                rows.push(Row::simulated(
                    label("Delta (LEB128, 4 streams)"),
                    leb128_s,
                    "s",
                ));
            }
            rows.push(Row::simulated(
                label("aurora delta (4 streams, BBR)"),
                delta_s(Encoding::Aurora, CongestionControl::Bbr),
                "s",
            ));
        }
        Section {
            title: "2. Transfer time against bandwidth".into(),
            setting: "Qwen3-8B; a clean 30 ms path (the paper's sweep is emulated; its round \
                      trip is not in what this simulation could read)"
                .into(),
            rows,
        }
    }

    fn against_baselines(&self) -> Result<Section, Violation> {
        const FULL_STREAM_WHY: &str = "the simulated PrimeRL-Full sends the checkpoint on one \
            CUBIC stream per actor, which the loss inferred from the paper's own one-stream \
            transfer holds to about 375 Mbps; the paper's full sync of Qwen3-8B takes about \
            128 s on 1 Gbps, the link's rate, as the model's MultiStream does, and aurora over \
            MultiStream falls in or near the paper's range (the row above)";
        let mut rows = Vec::new();
        let pool = one_a100_per_region(4);
        for (model, over_full) in [
            (QWEN3_4B, Some(Range(2.4, 3.7))),
            (QWEN3_8B, None),
            (QWEN3_14B, Some(Range(7.7, 9.5))),
        ] {
            let deployment = self.deployment(model, &pool);
            let generation = self.generate(&model, &pool, SplitPolicy::Proportional, Vec::new())?;
            let outcomes: Vec<(System, Outcome)> = System::COMPARED
                .iter()
                .map(|&system| (system, self.run(&deployment, system, &generation)))
                .collect();
            let aurora = outcomes
                .iter()
                .find(|(system, _)| *system == System::Aurora)
                .map_or(0.0, |(_, outcome)| outcome.tokens_per_s);
            for (system, outcome) in &outcomes {
                let name = format!("{} {}", model.name, system.name());
                rows.push(Row::simulated(
                    format!("{name}: throughput"),
                    outcome.tokens_per_s,
                    "tokens/s",
                ));
                rows.push(Row::simulated(format!("{name}: step"), outcome.step_s, "s"));
            }
            for (system, outcome) in outcomes.iter().rev() {
                let label = format!("{}: aurora over {}", model.name, system.name());
                let speedup = aurora / outcome.tokens_per_s;
                rows.push(match (system, over_full) {
                    (System::PrimeRlFull, Some(range)) => {
                        Row::compared(label, range, speedup, "x").explained(FULL_STREAM_WHY, 3.5)
                    }
                    (System::IdealSingleDc, _) => Row::compared(
                        format!("{}: aurora below Ideal-SingleDC", model.name),
                        Range(1.31, 8.91),
                        100.0 * (1.0 - speedup),
                        "%",
                    ),
                    (System::Aurora, _) => continue,
                    _ => Row::simulated(label, speedup, "x"),
                });
            }
        }
        Ok(Section {
            title: "3. Throughput and step time against every baseline".into(),
            setting: "four regions, one A100 actor each, the H100 trainer in the first; \
                      generation scheduled by the control core"
                .into(),
            rows,
        })
    }

    fn datacenters(&self) -> Result<Section, Violation> {
        const ABSOLUTE_WHY: &str = "the simulated A100 decodes at half its memory roofline \
            with 256 sequences (the first row); the paper's whole pool makes 7,137 tokens/s, \
            so its actors are slower or fewer (its Table 2 would say which): ratios carry \
            over, absolute rates do not";
        const FULL_DROP_WHY: &str = "two effects the same way: the simulated actors \
            generate faster than the paper's (above), and the simulated full sync crosses \
            each region on one loss-bound stream (about 375 Mbps, the paper's own \
            one-stream rate) where the paper's full sync runs at about the link's rate; \
            both make the full broadcast a larger share of the step";
        const AURORA_DROP_WHY: &str = "the model hides aurora's whole sync behind \
            generation in every placement (training plus shipping the delta of section 1 \
            take less than a generation), so spreading actors costs nothing; the paper's 13.7% comes from \
            what the model leaves out: cross-region stragglers, control round trips, \
            the relays' own hops on real machines";
        let model = QWEN3_8B;
        let placements: [&[usize]; 4] =
            [&[0, 0, 0, 0], &[0, 0, 1, 1], &[0, 0, 1, 2], &[0, 1, 2, 3]];
        let mut rows = vec![Row::simulated(
            "an A100's decode of Qwen3-8B",
            a100_in(0).tokens_per_s(&model),
            "tokens/s",
        )];
        let (mut full_first, mut aurora_first) = (0.0, 0.0);
        for (index, regions) in placements.iter().enumerate() {
            let pool: Vec<PoolActor> = regions.iter().map(|&region| a100_in(region)).collect();
            let deployment = self.deployment(model, &pool);
            let generation = self.generate(&model, &pool, SplitPolicy::Proportional, Vec::new())?;
            let full = self
                .run(&deployment, System::PrimeRlFull, &generation)
                .tokens_per_s;
            let aurora = self
                .run(&deployment, System::Aurora, &generation)
                .tokens_per_s;
            let count = index + 1;
            let full_label = format!("PrimeRL-Full, {count} datacenter(s)");
            rows.push(match count {
                1 => Row::compared(full_label, Value(7_137.0), full, "tokens/s")
                    .explained(ABSOLUTE_WHY, 2.5),
                4 => Row::compared(full_label, Value(1_219.0), full, "tokens/s")
                    .explained(ABSOLUTE_WHY, 2.5),
                _ => Row::simulated(full_label, full, "tokens/s"),
            });
            rows.push(Row::simulated(
                format!("aurora, {count} datacenter(s)"),
                aurora,
                "tokens/s",
            ));
            if count == 1 {
                (full_first, aurora_first) = (full, aurora);
            } else if count == 4 {
                rows.push(
                    Row::compared(
                        "PrimeRL-Full, 1 over 4 datacenters",
                        Value(7_137.0 / 1_219.0),
                        full_first / full,
                        "x",
                    )
                    .explained(FULL_DROP_WHY, 1.5),
                );
                rows.push(
                    Row::compared(
                        "aurora, 1 to 4 datacenters",
                        Value(-13.7),
                        100.0 * (aurora / aurora_first - 1.0),
                        "%",
                    )
                    .explained(AURORA_DROP_WHY, 1.0),
                );
            }
        }
        Ok(Section {
            title: "4. 1 to 4 datacenters".into(),
            setting: "Qwen3-8B, four A100 actors spread over 1 to 4 regions".into(),
            rows,
        })
    }

    fn heterogeneity(&self) -> Result<Section, Violation> {
        const MEMORY_BOUND_WHY: &str = "the decode model is memory-bound, so an L40 \
            (864 GB/s, 48 GB) makes well under half an A100's tokens (the share rows) and \
            an equal split waits for it far longer; the paper's gains imply an L40 near \
            the FLOPs ratio (181 against 312 TFLOPS), its engines compute-bound: the \
            section's last row runs the L40s at that share and lands in the paper's range";
        let pool = [a100_in(0), a100_in(1), l40_in(2), l40_in(3)];
        let mut rows = Vec::new();
        for model in [QWEN3_4B, QWEN3_8B, QWEN3_14B] {
            let rate = |actor: &PoolActor| actor.tokens_per_s(&model);
            rows.push(Row::simulated(
                format!("{}: an L40's share of an A100's tokens", model.name),
                rate(&pool[2]) / rate(&pool[0]),
                "x",
            ));
            rows.push(
                Row::compared(
                    format!("{}: proportional over uniform", model.name),
                    Range(26.4, 35.5),
                    self.proportional_gain_percent(&model, &pool)?,
                    "%",
                )
                .explained(MEMORY_BOUND_WHY, 5.0),
            );
        }
        // The explanation, tested: L40s at the share of an A100 their FLOPs give.
        let model = QWEN3_8B;
        let flops_share = L40.bf16_flops / A100.bf16_flops;
        let compute_bound_l40 = |region| PoolActor {
            speed: flops_share * pool[0].tokens_per_s(&model) / pool[2].tokens_per_s(&model),
            ..l40_in(region)
        };
        let what_if = [
            a100_in(0),
            a100_in(1),
            compute_bound_l40(2),
            compute_bound_l40(3),
        ];
        rows.push(Row::compared(
            format!(
                "{}, an L40 at {flops_share:.2} of an A100 (FLOPs): proportional over uniform",
                model.name
            ),
            Range(26.4, 35.5),
            self.proportional_gain_percent(&model, &what_if)?,
            "%",
        ));
        Ok(Section {
            title: "5. Heterogeneous A100 + L40, uniform against proportional".into(),
            setting: "two A100 and two L40 actors in four regions, aurora; each split run \
                      through the control core"
                .into(),
            rows,
        })
    }

    /// How much more aurora makes of `pool` under Algorithm 1 than under an equal split.
    fn proportional_gain_percent(
        &self,
        model: &ModelShape,
        pool: &[PoolActor],
    ) -> Result<f64, Violation> {
        let deployment = self.deployment(*model, pool);
        let mut rates = Vec::new();
        for split in [SplitPolicy::Proportional, SplitPolicy::Uniform] {
            let generation = self.generate(model, pool, split, Vec::new())?;
            rates.push(
                self.run(&deployment, System::Aurora, &generation)
                    .tokens_per_s,
            );
        }
        Ok(100.0 * (rates[0] / rates[1] - 1.0))
    }

    fn relays(&self) -> Result<Section, Violation> {
        const HIDDEN_WHY: &str = "without relays a region's 1 Gbps path carries one copy \
            of the delta per actor (section 1's size for 8B), but training plus two copies \
            still fit inside one generation, or the trainer sets the pace, so hardly a step \
            waits; with the paper's LEB128 deltas over a 1 Gbps trainer uplink (the last \
            row) the sync is exposed and relays gain more than the paper's range: the \
            paper's runs lie between the two";
        let pool: Vec<PoolActor> = (0..4)
            .flat_map(|region| [a100_in(region), a100_in(region)])
            .collect();
        let mut rows = Vec::new();
        for model in [QWEN3_4B, QWEN3_8B, QWEN3_14B] {
            let deployment = self.deployment(model, &pool);
            rows.push(
                Row::compared(
                    format!("{}: relays over direct", model.name),
                    Range(4.4, 13.9),
                    self.relay_gain_percent(&deployment, &pool)?,
                    "%",
                )
                .explained(HIDDEN_WHY, 1.05),
            );
        }
        // The explanation, tried: the paper's larger LEB128 deltas, and a trainer whose
        // uplink is as commodity as the paths.
        let model = QWEN3_8B;
        let mut exposed = self.deployment(model, &pool);
        exposed.delta_encoding = Encoding::Leb128;
        exposed.network.uplink_bps = exposed.network.wan.rate_bps;
        rows.push(Row::simulated(
            format!(
                "{}, LEB128 deltas, 1 Gbps trainer uplink: relays over direct",
                model.name
            ),
            self.relay_gain_percent(&exposed, &pool)?,
            "%",
        ));
        Ok(Section {
            title: "6. Relays against none".into(),
            setting: "four regions, two A100 actors each, aurora".into(),
            rows,
        })
    }

    /// How much more aurora makes of `pool` through relays than with every actor
    /// fetching from the trainer.
    fn relay_gain_percent(
        &self,
        deployment: &Deployment,
        pool: &[PoolActor],
    ) -> Result<f64, Violation> {
        let model = &deployment.model;
        let generation = self.generate(model, pool, SplitPolicy::Proportional, Vec::new())?;
        let with = self
            .run(deployment, System::Aurora, &generation)
            .tokens_per_s;
        let without = self
            .run(deployment, System::AuroraWithoutRelays, &generation)
            .tokens_per_s;
        Ok(100.0 * (with / without - 1.0))
    }

    fn membership(&self) -> Result<Section, Violation> {
        let model = QWEN3_8B;
        let base = one_a100_per_region(4);
        let deployment = self.deployment(model, &base);
        let reference = self.generate(&model, &base, SplitPolicy::Proportional, Vec::new())?;
        // Each region's relay took the snapshot of version 0 as the run began, and keeps
        // the deltas after it: a newcomer takes both from it, over its datacenter's network.
        let join_s = |steps| {
            let from = JoinFrom::aurora(&model, PAPER_WORKLOAD.density, steps);
            self.network.snapshot_join_s(&self.tcp, &model, from)
        };
        let snapshot_s = join_s(14);
        let from_hub_s = self
            .network
            .snapshot_join_s(&self.tcp, &model, JoinFrom::Hub);
        let step_opened = |step: usize| reference.opened_at_s.get(step).copied().unwrap_or(0.0);
        let faults = vec![ScheduledFault {
            at_ms: ((step_opened(6) + 1.0) * 1e3) as u64,
            fault: Fault::Preempt { actor: 1 },
        }];
        // The newcomer comes as step 14 opens, on the timeline the preemption slowed: a
        // run without it tells when that is, since nothing changes before it registers.
        let preempted = self.generate(&model, &base, SplitPolicy::Proportional, faults.clone())?;
        let arrives_at_s = preempted.opened_at_s.get(14).copied().unwrap_or(0.0);
        let mut pool = base.clone();
        pool.push(PoolActor {
            joins_at_s: arrives_at_s + snapshot_s,
            ..a100_in(1)
        });
        let churn = self.generate(&model, &pool, SplitPolicy::Proportional, faults)?;
        let plan = deployment.sync_plan(System::Aurora);
        let train_s = PAPER_TRAINER.step_s(&model, &PAPER_WORKLOAD);
        let timings = simulate(&plan, train_s, &churn.steps);
        let joined = churn
            .first_step_opened_after(arrives_at_s + snapshot_s)
            .max(15);
        let mut rows = vec![
            Row::simulated(
                "newcomer's snapshot from its relay (16.4 GB, 14 deltas)",
                snapshot_s,
                "s",
            ),
            Row::simulated(
                "the same from the hub over 1 Gbps (a relay that keeps none)",
                from_hub_s,
                "s",
            ),
            Row::simulated(
                "steps 2-5, four actors",
                throughput(&timings, 2..6),
                "tokens/s",
            ),
            Row::simulated(
                "steps 7-13, one preempted at step 6",
                throughput(&timings, 7..14),
                "tokens/s",
            ),
            Row::simulated(
                format!("steps 14-{}, the newcomer taking its snapshot", joined - 1),
                throughput(&timings, 14..joined),
                "tokens/s",
            ),
            Row::simulated(
                format!("steps {joined}-{}, the newcomer working", STEPS - 1),
                throughput(&timings, joined..STEPS as usize),
                "tokens/s",
            ),
        ];
        let undisturbed = simulate(&plan, train_s, &reference.steps);
        let before = throughput(&undisturbed, WARM_UP..undisturbed.len());
        for added in 1..=4 {
            let mut grown = base.clone();
            let joins_at_s = step_opened(8) + join_s(8);
            grown.extend((0..added).map(|index| PoolActor {
                joins_at_s,
                ..a100_in(index % 4)
            }));
            let generation =
                self.generate(&model, &grown, SplitPolicy::Proportional, Vec::new())?;
            let timings = simulate(&plan, train_s, &generation.steps);
            // The step that opened as they joined may have been split without them.
            let working = generation.first_step_opened_after(joins_at_s) + 1;
            rows.push(Row::simulated(
                format!(
                    "+{added} at step 8: steps {working}-{} over before (ideal {:.2})",
                    STEPS - 1,
                    (4 + added) as f64 / 4.0
                ),
                throughput(&timings, working..STEPS as usize) / before,
                "x",
            ));
        }
        Ok(Section {
            title: "7. A preemption at step 6, a new actor at step 14, 1 to 4 actors added \
                    mid-run (no paper figure is cited for these)"
                .into(),
            setting: "Qwen3-8B, four A100 actors in four regions, aurora; preemptions and \
                      joins through the control core's membership"
                .into(),
            rows,
        })
    }
}

fn l40_in(region: usize) -> PoolActor {
    PoolActor {
        kind: ActorKind { gpu: L40, gpus: 1 },
        ..a100_in(region)
    }
}

/// What the control core made of a pool.
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

    #[test]
    fn every_figure_stays_within_its_documented_tolerance_of_the_paper() {
        let report = paper_evaluation().unwrap();
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
                !row.flagged() || row.explanation.is_some(),
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

    #[test]
    fn the_calibrated_wan_reproduces_the_transfer_it_was_inferred_from() {
        let tcp = TcpModel::calibrated();
        let link = Link {
            loss: calibrate_wan_loss(&tcp),
            ..PAPER_NETWORK.wan
        };
        let time = tcp.transfer_s(PAPER_INT32_BYTES, link, CongestionControl::Cubic, 1);
        assert!((time - PAPER_INT32_ONE_STREAM_S).abs() < 1e-6, "{time}");
    }
}
