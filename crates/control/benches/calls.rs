//! The pure core's CPU time per call as the pool and the batch grow:
//! `cargo bench -p aurora-control --bench calls`.
//!
//! The simulator (`aurora sim paper`) counts the calls a 1,000-actor pool makes under
//! virtual time; this measures what each kind of call costs the core itself, in memory,
//! without the hub's journal and fsync (BENCHMARKS.md, "Control plane persistence",
//! measures those). For each (actors, prompts per step) pair: publish a version,
//! register the actors over 16 regions, then run steps as a pool does: every actor
//! heartbeats and claims its reservation, the driver asks for the next deadline after
//! every call (as the hub's tick loop and the simulator do), every actor submits its
//! leases in one batch, an idle actor polls with a claim that finds nothing left, a
//! tick runs, and the trainer takes the outcome. Each call is timed alone on this one
//! thread; the table gives the mean per kind of call.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use aurora_control::{
    ActorId, Assignment, Capabilities, Config, ControlPlane, Millis, PromptId, Region,
    Registration, RolloutReport, Version, WeightsHash,
};

/// Steps timed per pair.
const STEPS: u64 = 3;
/// The pairs measured: (actors, prompts per step). The last is the beyond-the-paper
/// scale of `aurora sim paper` (1,000 actors, 64 prompt groups each).
const PAIRS: [(u64, u64); 3] = [(16, 1_024), (256, 16_384), (1_000, 64_000)];
/// Regions the actors are spread over.
const REGIONS: u64 = 16;

fn main() {
    println!("control core calls, in memory ({STEPS} steps per row; mean CPU time per call)");
    println!(
        "{:>7} {:>8} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12}",
        "actors",
        "prompts",
        "heartbeat us",
        "claim us",
        "idle claim",
        "submit us",
        "deadline us",
        "tick us",
        "open us"
    );
    for (actors, prompts) in PAIRS {
        let timings = run(actors, prompts);
        let mean = |kind: &str| {
            timings
                .get(kind)
                .map_or(0.0, |&(total, count): &(Duration, u64)| {
                    total.as_secs_f64() * 1e6 / count.max(1) as f64
                })
        };
        println!(
            "{actors:>7} {prompts:>8} {:>12.2} {:>12.2} {:>12.2} {:>12.2} {:>12.2} {:>12.2} {:>12.0}",
            mean("heartbeat"),
            mean("claim"),
            mean("idle claim"),
            mean("submit"),
            mean("deadline"),
            mean("tick"),
            mean("open"),
        );
    }
}

/// Runs [`STEPS`] steps of `prompts` over `actors` and returns the total time and count
/// of each kind of call.
fn run(actors: u64, prompts: u64) -> BTreeMap<&'static str, (Duration, u64)> {
    let mut config = Config::default();
    config.limits.max_actors = u32::try_from(actors).expect("actors fit a u32");
    config.limits.max_batch_size = u32::try_from(prompts).expect("prompts fit a u32");
    let mut core = ControlPlane::new(config).expect("the bench's config is valid");
    let mut timings: BTreeMap<&'static str, (Duration, u64)> = BTreeMap::new();
    let mut timed = |kind: &'static str, started: Instant| {
        let entry = timings.entry(kind).or_default();
        entry.0 += started.elapsed();
        entry.1 += 1;
    };
    let hash = |version: u64| WeightsHash([version as u8; 32]);
    core.publish_version(Version(0), hash(0))
        .expect("the first version publishes");
    let ids: Vec<ActorId> = (1..=actors).map(ActorId).collect();
    let mut now = Millis(1);
    for &id in &ids {
        let registration = Registration {
            region: Region::new(&format!("region-{}", id.0 % REGIONS)).expect("a valid region"),
            capabilities: Capabilities { can_relay: true },
            active: Version(0),
            staged: None,
        };
        core.register(id, registration, now)
            .expect("the pool fits the limit");
    }
    let mut next_prompt = 0;
    for _ in 0..STEPS {
        now = now.saturating_add(1_000);
        let batch: Vec<PromptId> = (next_prompt..next_prompt + prompts).map(PromptId).collect();
        next_prompt += prompts;
        let started = Instant::now();
        core.open_step(&batch, now).expect("the step opens");
        timed("open", started);
        let mut held = Vec::new();
        for &id in &ids {
            now = now.saturating_add(1);
            let started = Instant::now();
            core.heartbeat(id, now).expect("a member");
            timed("heartbeat", started);
            let started = Instant::now();
            let assignment = core.claim(id, now).expect("a member");
            timed("claim", started);
            let started = Instant::now();
            std::hint::black_box(core.next_deadline());
            timed("deadline", started);
            let Assignment::Work { leases, .. } = assignment else {
                panic!("{id} got no work: {assignment:?}");
            };
            held.push((id, leases));
        }
        for (id, leases) in held {
            now = now.saturating_add(1);
            let reports: Vec<RolloutReport> = leases
                .iter()
                .map(|grant| RolloutReport {
                    lease: grant.lease,
                    version: grant.version,
                    weights_hash: hash(grant.version.0),
                    tokens: 1_000,
                })
                .collect();
            let started = Instant::now();
            let outcomes = core.submit(id, &reports, now).expect("within the limit");
            timed("submit", started);
            assert!(outcomes.iter().all(Result::is_ok), "every result accepted");
            let started = Instant::now();
            std::hint::black_box(core.claim(id, now).expect("a member"));
            timed("idle claim", started);
            let started = Instant::now();
            std::hint::black_box(core.next_deadline());
            timed("deadline", started);
        }
        let started = Instant::now();
        core.tick(now);
        timed("tick", started);
        while core.poll_event().is_some() {}
        let outcome = core.take_step_outcome().expect("the step completed");
        assert_eq!(
            outcome.accepted.len() as u64,
            prompts,
            "every prompt accepted"
        );
    }
    timings
}
