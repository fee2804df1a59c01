//! A researcher's own runs of the paper's model: a topology (the regions and links of a
//! `wan/scenarios/*.toml` file) and a fleet (a fleet file: the model, the trainer, the
//! dataset, the actors of each region, whole regions reclaimed at once) over several
//! seeds and, optionally, a sweep of one input, every system compared. The fleet file's
//! format is docs/paper-eval.md, "Fleet files" (version [`FLEET_FORMAT`]); the command
//! that reads both files is `aurora sim fleet`.

use std::borrow::Cow;
use std::cell::RefCell;
use std::fmt;

use aurora_control::SplitPolicy;

use super::baselines::{Deployment, System};
use super::tcp::{Link, TcpModel};
use super::testbed::{
    DECODE_ROOFLINE_SHARE, DEEPSCALER, GSM8K, MATH, ModelShape, PAPER_NETWORK, Region, Trainer,
    Workload,
};
use super::timeline::StepTiming;
use super::{Bench, PoolActor, Runs, Setup, actor};
use crate::report::Violation;
use crate::scenario::{Fault, ScheduledFault};
use crate::world::STEP_TIME_LIMIT_MS;

mod spec;

pub use spec::{
    ActorGroup, DatasetChoice, FleetSpec, FleetSweep, GpuChoice, ModelChoice, Reclaim,
    SweepParameter, SystemChoice,
};

/// The version of the fleet file format this build reads.
pub const FLEET_FORMAT: u32 = 1;
/// Most actors a fleet may have, replacements included.
pub const MAX_FLEET_ACTORS: u32 = 4_096;
/// Most steps a run may have.
pub const MAX_FLEET_STEPS: u32 = 1_000;
/// Most seeds.
pub const MAX_FLEET_SEEDS: usize = 64;
/// Most values a sweep may take.
pub const MAX_SWEEP_VALUES: usize = 64;

/// The regions of a topology and the links between them, as a `wan/scenarios` file
/// gives them.
#[derive(Clone, Debug, PartialEq)]
pub struct Topology {
    /// Its regions' names.
    pub regions: Vec<String>,
    /// Its links: the two regions they join, and the link.
    pub links: Vec<(String, String, Link)>,
}

impl Topology {
    /// The path from `from` to `to` along the least round trip: the slowest link's
    /// rate, the round trips added, the losses compounded. None when no links join
    /// them.
    pub fn path(&self, from: &str, to: &str) -> Option<Link> {
        let index = |name: &str| self.regions.iter().position(|region| region == name);
        let (start, goal) = (index(from)?, index(to)?);
        // Dijkstra over at most a few dozen regions: a plain scan is enough.
        let mut best: Vec<Option<Link>> = vec![None; self.regions.len()];
        let mut settled = vec![false; self.regions.len()];
        best[start] = Some(Link {
            rate_bps: f64::INFINITY,
            rtt_s: 0.0,
            loss: 0.0,
        });
        loop {
            let next = (0..self.regions.len())
                .filter(|&region| !settled[region])
                .filter_map(|region| best[region].map(|link| (region, link)))
                .min_by(|a, b| a.1.rtt_s.total_cmp(&b.1.rtt_s));
            let (region, path) = next?;
            if region == goal {
                return Some(path);
            }
            settled[region] = true;
            for (a, b, link) in &self.links {
                let other = match (index(a), index(b)) {
                    (Some(a), Some(b)) if a == region => b,
                    (Some(a), Some(b)) if b == region => a,
                    _ => continue,
                };
                let extended = Link {
                    rate_bps: path.rate_bps.min(link.rate_bps),
                    rtt_s: path.rtt_s + link.rtt_s,
                    loss: 1.0 - (1.0 - path.loss) * (1.0 - link.loss),
                };
                if !settled[other] && best[other].is_none_or(|known| extended.rtt_s < known.rtt_s) {
                    best[other] = Some(extended);
                }
            }
        }
    }
}

/// Why a fleet cannot run.
#[derive(Debug, Clone, PartialEq)]
pub enum FleetError {
    /// The file is of another format version.
    Format {
        /// The version it names.
        found: u32,
    },
    /// A field's value is out of its range.
    Invalid {
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        problem: String,
    },
    /// A region the fleet names is not in the topology, or no link reaches it.
    Region {
        /// The region.
        region: String,
        /// What is wrong.
        problem: &'static str,
    },
    /// A link of the topology, or a path a sweep makes, cannot carry a transfer.
    Link {
        /// The regions it joins.
        between: String,
        /// What is wrong.
        problem: String,
    },
    /// The control core broke an invariant (a defect of the core or the driver).
    Simulation(Violation),
}

impl fmt::Display for FleetError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FleetError::Format { found } => write!(
                f,
                "fleet format {found}: this build reads format {FLEET_FORMAT}"
            ),
            FleetError::Invalid { field, problem } => write!(f, "fleet field {field}: {problem}"),
            FleetError::Region { region, problem } => write!(f, "region {region:?}: {problem}"),
            FleetError::Link { between, problem } => write!(f, "link {between}: {problem}"),
            FleetError::Simulation(violation) => {
                write!(f, "the simulation broke an invariant: {violation}")
            }
        }
    }
}

impl std::error::Error for FleetError {}

impl From<Violation> for FleetError {
    fn from(violation: Violation) -> FleetError {
        FleetError::Simulation(violation)
    }
}

/// Mean and range of a figure over seeds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Spread {
    /// Mean.
    pub mean: f64,
    /// Least.
    pub min: f64,
    /// Most.
    pub max: f64,
}

impl Spread {
    fn of(values: &[f64]) -> Spread {
        let mean = values.iter().sum::<f64>() / values.len().max(1) as f64;
        let min = values.iter().copied().fold(f64::INFINITY, f64::min);
        let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        Spread { mean, min, max }
    }
}

/// What one system made at one point of the sweep, over the seeds.
#[derive(Clone, Debug, PartialEq)]
pub struct SystemOutcome {
    /// The system.
    pub system: System,
    /// Accepted tokens per second after the warm-up.
    pub tokens_per_s: Spread,
    /// Mean step after the warm-up, seconds.
    pub step_s: Spread,
}

/// One point of the sweep (the only one without a sweep).
#[derive(Clone, Debug, PartialEq)]
pub struct FleetPoint {
    /// The swept input's value, if there is a sweep.
    pub value: Option<f64>,
    /// Every system compared.
    pub systems: Vec<SystemOutcome>,
}

/// One step of one run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepRecord {
    /// The swept input's value, if there is a sweep.
    pub value: Option<f64>,
    /// The run's seed.
    pub seed: u64,
    /// The system.
    pub system: System,
    /// The step.
    pub step: usize,
    /// When its generation ended, seconds from the run's start.
    pub end_s: f64,
    /// Its accepted tokens.
    pub tokens: f64,
}

/// Everything `aurora sim fleet` prints and writes.
#[derive(Clone, Debug, PartialEq)]
pub struct FleetReport {
    /// The fleet's name.
    pub name: String,
    /// The swept input, if any.
    pub swept: Option<SweepParameter>,
    /// Every point.
    pub points: Vec<FleetPoint>,
    /// Every step of every run.
    pub steps: Vec<StepRecord>,
}

/// Checks `spec` against `topology` and runs it: for every point of its sweep and every
/// seed, the control core schedules each step over the fleet and every system's
/// pipeline runs on the result.
pub fn run_fleet(spec: &FleetSpec, topology: &Topology) -> Result<FleetReport, FleetError> {
    validate(spec, topology)?;
    let values: Vec<Option<f64>> = match &spec.sweep {
        None => vec![None],
        Some(sweep) => sweep.values.iter().map(|&value| Some(value)).collect(),
    };
    let systems: Vec<System> = if spec.systems.is_empty() {
        System::COMPARED.to_vec()
    } else {
        spec.systems.iter().map(|choice| choice.system()).collect()
    };
    let mut report = FleetReport {
        name: spec.name.clone(),
        swept: spec.sweep.as_ref().map(|sweep| sweep.parameter),
        points: Vec::new(),
        steps: Vec::new(),
    };
    for value in values {
        let point = match (value, &spec.sweep) {
            (Some(value), Some(sweep)) => swept(spec, sweep.parameter, value),
            _ => spec.clone(),
        };
        validate(&point, topology)?;
        let mut tokens_per_s = vec![Vec::new(); systems.len()];
        let mut step_s = vec![Vec::new(); systems.len()];
        for &seed in &spec.seeds {
            let run = FleetRun::new(&point, topology, seed)?;
            let generation = run.generation()?;
            for (index, &system) in systems.iter().enumerate() {
                let timings = run.bench.timings(&run.deployment, system, &generation);
                let measured = run.bench.outcome(&timings);
                tokens_per_s[index].push(measured.tokens_per_s);
                step_s[index].push(measured.step_s);
                report.steps.extend(timings.iter().enumerate().map(
                    |(step, timing): (usize, &StepTiming)| StepRecord {
                        value,
                        seed,
                        system,
                        step,
                        end_s: timing.end_s,
                        tokens: timing.tokens,
                    },
                ));
            }
        }
        report.points.push(FleetPoint {
            value,
            systems: systems
                .iter()
                .enumerate()
                .map(|(index, &system)| SystemOutcome {
                    system,
                    tokens_per_s: Spread::of(&tokens_per_s[index]),
                    step_s: Spread::of(&step_s[index]),
                })
                .collect(),
        });
    }
    Ok(report)
}

/// `spec` with its swept input at `value`.
fn swept(spec: &FleetSpec, parameter: SweepParameter, value: f64) -> FleetSpec {
    let mut point = spec.clone();
    match parameter {
        SweepParameter::LinkLowShare => point.link_low_share = value,
        SweepParameter::TrainerUplinkMbps => point.trainer_uplink_mbps = value,
        SweepParameter::TrainerGpus => point.trainer_gpus = value as u32,
        SweepParameter::TrainerMfu => point.trainer_mfu = value,
        SweepParameter::DecodeShare => point.decode_share = value,
        SweepParameter::ActorsPerGroup => {
            for group in &mut point.actors {
                group.count = value as u32;
            }
        }
        // Path inputs apply where the topology is read: see `fleet_path`.
        SweepParameter::RateMbps | SweepParameter::RttMs | SweepParameter::Loss => {}
    }
    point.sweep = spec.sweep.clone().map(|sweep| FleetSweep {
        values: vec![value],
        ..sweep
    });
    point
}

fn validate(spec: &FleetSpec, topology: &Topology) -> Result<(), FleetError> {
    let invalid = |field, problem: String| Err(FleetError::Invalid { field, problem });
    if spec.format != FLEET_FORMAT {
        return Err(FleetError::Format { found: spec.format });
    }
    if !(1..=MAX_FLEET_STEPS).contains(&spec.steps) {
        return invalid(
            "steps",
            format!("{} is not in 1..={MAX_FLEET_STEPS}", spec.steps),
        );
    }
    if spec.warm_up == 0 {
        return invalid(
            "warm_up",
            "0: the figures are measured from the end of the step before them, so at least \
             one step is left out"
                .into(),
        );
    }
    if spec.warm_up >= spec.steps {
        return invalid(
            "warm_up",
            format!(
                "{} leaves no step of {} to measure",
                spec.warm_up, spec.steps
            ),
        );
    }
    if spec.seeds.is_empty() || spec.seeds.len() > MAX_FLEET_SEEDS {
        return invalid(
            "seeds",
            format!("{} seeds, not 1 to {MAX_FLEET_SEEDS}", spec.seeds.len()),
        );
    }
    if !(1..=64).contains(&spec.trainer_gpus) {
        return invalid(
            "trainer_gpus",
            format!("{} is not in 1..=64", spec.trainer_gpus),
        );
    }
    for (field, value, low, high) in [
        ("trainer_mfu", spec.trainer_mfu, 0.0, 1.0),
        ("decode_share", spec.decode_share, 0.0, 1.0),
        ("link_low_share", spec.link_low_share, 0.0, 1.0),
    ] {
        if !(value > low && value <= high) {
            return invalid(field, format!("{value} is not in ({low}, {high}]"));
        }
    }
    if !(spec.trainer_uplink_mbps > 0.0 && spec.trainer_uplink_mbps.is_finite()) {
        return invalid(
            "trainer_uplink_mbps",
            format!("{} is not a rate", spec.trainer_uplink_mbps),
        );
    }
    if let Some(sweep) = &spec.sweep {
        if sweep.values.is_empty() || sweep.values.len() > MAX_SWEEP_VALUES {
            return invalid(
                "sweep.values",
                format!("{} values, not 1 to {MAX_SWEEP_VALUES}", sweep.values.len()),
            );
        }
        let whole = matches!(
            sweep.parameter,
            SweepParameter::TrainerGpus | SweepParameter::ActorsPerGroup
        );
        if let Some(bad) = sweep.values.iter().find(|value| {
            !value.is_finite()
                || **value < 0.0
                || (whole && (value.fract() != 0.0 || **value < 1.0))
        }) {
            return invalid(
                "sweep.values",
                format!("{bad} is not a value of {}", sweep.parameter.name()),
            );
        }
    }
    let known = |region: &str| topology.regions.iter().any(|name| name == region);
    if !known(&spec.trainer_region) {
        return Err(FleetError::Region {
            region: spec.trainer_region.clone(),
            problem: "the trainer's region is not in the topology",
        });
    }
    if spec.actors.is_empty() {
        return invalid("actors", "the fleet has no actors".into());
    }
    let mut actors: u32 = 0;
    for group in &spec.actors {
        if !known(&group.region) {
            return Err(FleetError::Region {
                region: group.region.clone(),
                problem: "not in the topology",
            });
        }
        if group.region != spec.trainer_region
            && topology.path(&spec.trainer_region, &group.region).is_none()
        {
            return Err(FleetError::Region {
                region: group.region.clone(),
                problem: "no link reaches it from the trainer's region",
            });
        }
        if group.count == 0 {
            return invalid(
                "actors.count",
                format!("a group in {} has no actors", group.region),
            );
        }
        actors = actors.saturating_add(group.count);
    }
    // Reclaims and replacements in step order: the fleet must keep an actor throughout,
    // and a region is reclaimed once.
    let mut changes: Vec<(u32, i64)> = Vec::new();
    for (index, reclaim) in spec.reclaims.iter().enumerate() {
        if spec.reclaims[..index]
            .iter()
            .any(|earlier| earlier.region == reclaim.region)
        {
            return Err(FleetError::Region {
                region: reclaim.region.clone(),
                problem: "reclaimed twice",
            });
        }
        let actors = i64::from(region_actors(spec, &reclaim.region));
        changes.push((reclaim.at_step, -actors));
        if let Some(step) = reclaim.replaced_at_step {
            changes.push((step, actors));
        }
    }
    changes.sort_unstable();
    let mut present: i64 = spec.actors.iter().map(|group| i64::from(group.count)).sum();
    for (step, change) in changes {
        present += change;
        if present <= 0 {
            return invalid(
                "reclaims",
                format!("from step {step} the fleet has no actor left to generate"),
            );
        }
    }
    for reclaim in &spec.reclaims {
        if !spec
            .actors
            .iter()
            .any(|group| group.region == reclaim.region)
        {
            return Err(FleetError::Region {
                region: reclaim.region.clone(),
                problem: "reclaimed, but the fleet has no actors there",
            });
        }
        if reclaim.region == spec.trainer_region {
            return Err(FleetError::Region {
                region: reclaim.region.clone(),
                problem: "the trainer's region cannot be reclaimed (its pool is not spot)",
            });
        }
        if reclaim.at_step >= spec.steps {
            return invalid(
                "reclaims.at_step",
                format!("{} is past the run's {} steps", reclaim.at_step, spec.steps),
            );
        }
        if let Some(replaced) = reclaim.replaced_at_step {
            if replaced <= reclaim.at_step || replaced >= spec.steps {
                return invalid(
                    "reclaims.replaced_at_step",
                    format!(
                        "{replaced} is not after step {} and within the run",
                        reclaim.at_step
                    ),
                );
            }
            actors = actors.saturating_add(region_actors(spec, &reclaim.region));
        }
    }
    if actors > MAX_FLEET_ACTORS {
        return invalid(
            "actors",
            format!("{actors} actors, more than {MAX_FLEET_ACTORS}"),
        );
    }
    for (a, b, link) in &topology.links {
        check_link(&format!("{a}-{b}"), link)?;
    }
    // A sweep of a path input makes paths of its own: each actor region's, as it will run.
    for group in &spec.actors {
        if group.region != spec.trainer_region {
            check_link(
                &format!("{}-{}", spec.trainer_region, group.region),
                &fleet_path(spec, topology, &group.region),
            )?;
        }
    }
    Ok(())
}

fn check_link(between: &str, link: &Link) -> Result<(), FleetError> {
    let (rate, rtt, loss) = (link.rate_bps, link.rtt_s, link.loss);
    if rate > 0.0 && rate.is_finite() && (0.0..=60.0).contains(&rtt) && (0.0..1.0).contains(&loss) {
        return Ok(());
    }
    Err(FleetError::Link {
        between: between.to_owned(),
        problem: format!(
            "{:.6} Mbps, {:.3} s round trip, loss {loss}: a link needs a rate above 0, a round \
             trip of at most a minute and a loss below 1",
            rate / 1e6,
            rtt
        ),
    })
}

fn region_actors(spec: &FleetSpec, region: &str) -> u32 {
    spec.actors
        .iter()
        .filter(|group| group.region == region)
        .map(|group| group.count)
        .sum()
}

/// One seed of one point of the sweep.
struct FleetRun<'a> {
    spec: &'a FleetSpec,
    topology: &'a Topology,
    bench: Bench,
    setup: Setup,
    pool: Vec<PoolActor>,
    deployment: Deployment,
}

impl<'a> FleetRun<'a> {
    fn new(
        spec: &'a FleetSpec,
        topology: &'a Topology,
        seed: u64,
    ) -> Result<FleetRun<'a>, FleetError> {
        let bench = Bench {
            tcp: TcpModel::calibrated(),
            network: super::Network {
                uplink_bps: spec.trainer_uplink_mbps * 1e6,
                link_low_share: spec.link_low_share,
                ..PAPER_NETWORK
            },
            runs: Runs {
                seed,
                steps: spec.steps,
                warm_up: spec.warm_up as usize,
            },
            generations: RefCell::default(),
        };
        let model = spec.model.shape();
        let dataset = match spec.dataset {
            DatasetChoice::Gsm8k => GSM8K,
            DatasetChoice::Math => MATH,
            DatasetChoice::Deepscaler => DEEPSCALER,
        };
        let setup = Setup {
            model,
            trainer: Trainer {
                mfu: spec.trainer_mfu,
                ..Trainer::of(spec.trainer_gpus)
            },
            workload: Workload::of(&model, dataset),
        };
        let pool: Vec<PoolActor> = spec
            .actors
            .iter()
            .flat_map(|group| {
                let member = member(spec, topology, &model, group.gpu, &group.region);
                std::iter::repeat_n(member, group.count as usize)
            })
            .collect();
        // The driver takes a step open this long for a stall: refuse a fleet whose
        // batch it could not generate in that time, naming why.
        let pool_rate: f64 = pool
            .iter()
            .map(|member| member.speed * member.kind.tokens_per_s(&model, &setup.workload))
            .sum();
        let longest = setup
            .workload
            .group_tokens()
            .1
            .min(setup.workload.group_limit());
        // A batch also lasts as many of its engine's iterations as its longest answer.
        let longest_answer_s = pool
            .iter()
            .map(|member| {
                let decode = member
                    .kind
                    .batched_decode(&model, &setup.workload, member.speed);
                decode.iteration_us as f64 / 1e6 * setup.workload.longest_answer() as f64
            })
            .fold(0.0, f64::max);
        let longest_step_s = (f64::from(setup.workload.prompts_per_step) * longest as f64
            / pool_rate)
            .max(longest_answer_s);
        let limit_s = STEP_TIME_LIMIT_MS as f64 / 1e3;
        if longest_step_s.is_nan() || longest_step_s >= 0.8 * limit_s {
            return Err(FleetError::Invalid {
                field: "actors",
                problem: format!(
                    "the pool generates {pool_rate:.0} tokens/s, so a step of {} could take \
                     {longest_step_s:.0} s, too close to the {limit_s:.0} s the simulator \
                     takes for a stall: more actors, faster GPUs or a higher decode_share",
                    dataset.name
                ),
            });
        }
        let mut deployment = bench.deployment(&setup, &pool);
        // A reclaimed region gets nothing from its reclaim until its replacements come.
        let remote_regions: Vec<&str> = remote_region_names(spec);
        for reclaim in &spec.reclaims {
            if let Some(index) = remote_regions
                .iter()
                .position(|name| *name == reclaim.region)
            {
                let until = reclaim.replaced_at_step.unwrap_or(u32::MAX);
                deployment.remote[index]
                    .absent
                    .push(reclaim.at_step as usize..until as usize);
            }
        }
        Ok(FleetRun {
            spec,
            topology,
            bench,
            setup,
            pool,
            deployment,
        })
    }

    /// The control core's run with each reclaim's notices and replacements, in the
    /// order of their steps: each is timed on the run the ones before it changed.
    fn generation(&self) -> Result<super::Generation, FleetError> {
        let bench = &self.bench;
        let mut events: Vec<(u32, &Reclaim, bool)> = Vec::new();
        for reclaim in &self.spec.reclaims {
            events.push((reclaim.at_step, reclaim, false));
            if let Some(step) = reclaim.replaced_at_step {
                events.push((step, reclaim, true));
            }
        }
        events.sort_by_key(|&(step, _, replacement)| (step, replacement));
        let mut faults: Vec<ScheduledFault> = Vec::new();
        let mut pool = self.pool.clone();
        let mut current =
            bench.generate(&self.setup, &pool, SplitPolicy::Proportional, Vec::new())?;
        for (step, reclaim, replacement) in events {
            let opened_s = current
                .opened_at_s
                .get(step as usize)
                .copied()
                .unwrap_or(0.0);
            let region: Vec<usize> = self
                .pool
                .iter()
                .enumerate()
                .filter(|(_, member)| member.region.name == reclaim.region)
                .map(|(index, _)| index)
                .collect();
            if replacement {
                let path = fleet_path(self.spec, self.topology, &reclaim.region);
                let refetch_s =
                    bench
                        .network
                        .refetch_s(&bench.tcp, &self.setup.model, path, region.len());
                pool.extend(region.iter().map(|&index| PoolActor {
                    joins_at_s: opened_s + refetch_s,
                    ..self.pool[index].clone()
                }));
            } else {
                let at_ms = ((opened_s + 1.0) * 1e3) as u64;
                faults.extend(region.iter().map(|&actor| ScheduledFault {
                    at_ms,
                    fault: Fault::Preempt { actor },
                }));
            }
            current = bench.generate(
                &self.setup,
                &pool,
                SplitPolicy::Proportional,
                faults.clone(),
            )?;
        }
        Ok(current)
    }
}

/// The fleet's regions away from the trainer's, in the order the deployment lists them
/// (as their actors first appear).
fn remote_region_names(spec: &FleetSpec) -> Vec<&str> {
    let mut names: Vec<&str> = Vec::new();
    for group in &spec.actors {
        if group.region != spec.trainer_region && !names.contains(&group.region.as_str()) {
            names.push(&group.region);
        }
    }
    names
}

/// An actor of `gpu` in `region`, decoding at the fleet's share of the roofline.
fn member(
    spec: &FleetSpec,
    topology: &Topology,
    model: &ModelShape,
    gpu: GpuChoice,
    region: &str,
) -> PoolActor {
    let gpu = gpu.gpu();
    PoolActor {
        speed: spec.decode_share / DECODE_ROOFLINE_SHARE,
        kind: super::ActorKind {
            gpu,
            // A replica too large for one GPU is split over four.
            gpus: if model.checkpoint_bytes() > 0.8 * gpu.memory_bytes {
                4
            } else {
                1
            },
        },
        ..actor(
            gpu,
            Region {
                name: Cow::Owned(region.to_owned()),
                path: fleet_path(spec, topology, region),
                local: region == spec.trainer_region,
            },
        )
    }
}

/// The path from the trainer's region to `region`, with a path input of the sweep
/// applied; the trainer's own region's is its datacenter network.
fn fleet_path(spec: &FleetSpec, topology: &Topology, region: &str) -> Link {
    if region == spec.trainer_region {
        return PAPER_NETWORK.lan;
    }
    let mut path = topology
        .path(&spec.trainer_region, region)
        .unwrap_or(PAPER_NETWORK.wan);
    if let Some(sweep) = &spec.sweep {
        let value = sweep.values[0];
        match sweep.parameter {
            SweepParameter::RateMbps => path.rate_bps = value * 1e6,
            SweepParameter::RttMs => path.rtt_s = value / 1e3,
            SweepParameter::Loss => path.loss = value,
            _ => {}
        }
    }
    path
}

impl FleetReport {
    /// Every point and system as JSON.
    pub fn figures_json(&self) -> serde_json::Value {
        let spread = |spread: &Spread| serde_json::json!({ "mean": spread.mean, "min": spread.min, "max": spread.max });
        serde_json::json!({
            "fleet": self.name,
            "swept": self.swept.map(SweepParameter::name),
            "points": self.points.iter().map(|point| serde_json::json!({
                "value": point.value,
                "systems": point.systems.iter().map(|outcome| serde_json::json!({
                    "system": outcome.system.name(),
                    "tokens_per_s": spread(&outcome.tokens_per_s),
                    "step_s": spread(&outcome.step_s),
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
        })
    }

    /// Every point and system as CSV, a row each.
    pub fn figures_csv(&self) -> String {
        let mut out = String::from(
            "value,system,tokens_per_s_mean,tokens_per_s_min,tokens_per_s_max,step_s_mean,step_s_min,step_s_max\n",
        );
        for point in &self.points {
            for outcome in &point.systems {
                out.push_str(&format!(
                    "{},\"{}\",{},{},{},{},{},{}\n",
                    point.value.map_or(String::new(), |value| value.to_string()),
                    outcome.system.name(),
                    outcome.tokens_per_s.mean,
                    outcome.tokens_per_s.min,
                    outcome.tokens_per_s.max,
                    outcome.step_s.mean,
                    outcome.step_s.min,
                    outcome.step_s.max,
                ));
            }
        }
        out
    }

    /// Every step of every run as CSV, a row each.
    pub fn steps_csv(&self) -> String {
        let mut out = String::from("value,seed,system,step,end_s,tokens\n");
        for record in &self.steps {
            out.push_str(&format!(
                "{},{},\"{}\",{},{},{}\n",
                record
                    .value
                    .map_or(String::new(), |value| value.to_string()),
                record.seed,
                record.system.name(),
                record.step,
                record.end_s,
                record.tokens,
            ));
        }
        out
    }
}

impl fmt::Display for FleetReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "Fleet {:?}: tokens/s and step time after the warm-up, mean (min-max) over the seeds",
            self.name
        )?;
        for point in &self.points {
            if let (Some(parameter), Some(value)) = (self.swept, point.value) {
                writeln!(f, "\n{} = {value}", parameter.name())?;
            }
            for outcome in &point.systems {
                let (rate, step) = (&outcome.tokens_per_s, &outcome.step_s);
                writeln!(
                    f,
                    "  {:<22} {:>9.0} tokens/s ({:.0}-{:.0})   step {:>8.2} s ({:.2}-{:.2})",
                    outcome.system.name(),
                    rate.mean,
                    rate.min,
                    rate.max,
                    step.mean,
                    step.min,
                    step.max
                )?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
