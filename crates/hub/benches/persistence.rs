//! The cost of a durable hub call: `cargo bench -p aurora-hub --bench persistence`.
//!
//! Drives a [`Hub`] in process (no HTTP) on a database in a temporary directory (on
//! the disk that holds `TMPDIR`, so every commit pays a real fsync), with a manual
//! clock. For each (actors, prompts per step) pair: publish v1, register the actors,
//! then run steps: open a step, let every actor claim and submit its leases (one
//! payload of [`PAYLOAD_BYTES`] per result) until the step completes, take the outcome.
//! Only the steps are timed: every call there is a mutating call that commits.
//!
//! Reported per pair: calls made, calls per second, mean and tail latency of one call,
//! CPU time per call (`/proc/thread-self/schedstat`: the work of the call itself,
//! which, unlike the wall time, other processes' disk traffic does not inflate), bytes
//! the process handed to the kernel per call (`wchar` of `/proc/self/io`: redb's page
//! writes), and the size of the core's serialized state at the end, the figure a
//! whole-state write scales with. Everything runs on this one thread. Last, the time
//! to open the hub again on its database (a restart: load and check what is stored).

use std::sync::Arc;
use std::time::{Duration, Instant};

use aurora_api::RolloutResult;
use aurora_control::{
    ActorId, Assignment, Capabilities, Config, Millis, PromptId, Region, Registration,
    RolloutReport, Version, WeightsHash,
};
use aurora_hub::{Hub, HubConfig, ManualClock};
use serde_json::value::RawValue;

/// Bytes of each result's payload (JSON text).
const PAYLOAD_BYTES: usize = 512;
/// Steps timed per pair.
const STEPS: u64 = 10;
/// The pairs measured: (actors, prompts per step).
const PAIRS: [(u64, u64); 4] = [(16, 64), (16, 2048), (256, 64), (256, 2048)];

fn main() {
    println!(
        "hub calls with a durable commit each ({STEPS} steps per row, {PAYLOAD_BYTES} B payloads)"
    );
    println!(
        "  actors  prompts   calls   calls/s   mean us    p50 us    p99 us    max us   \
         cpu us/call   written B/call   state B   reopen ms"
    );
    for (actors, prompts) in PAIRS {
        let run = run(actors, prompts);
        let calls = run.latencies.len() as f64;
        let per_call = |total: Option<u64>, scale: f64, digits: usize| {
            total.map_or_else(
                || "n/a".to_owned(),
                |total| format!("{:.digits$}", total as f64 * scale / calls),
            )
        };
        let cpu = per_call(run.cpu_ns, 1e-3, 1);
        let written = per_call(run.written, 1.0, 0);
        println!(
            "  {actors:>6} {prompts:>8} {calls:>7} {:>9.0} {:>9.1} {:>9.1} {:>9.1} {:>9.1} \
             {cpu:>13} {written:>16} {:>9} {:>11.1}",
            calls / run.elapsed.as_secs_f64(),
            run.elapsed.as_secs_f64() * 1e6 / calls,
            percentile(&run.latencies, 50.0),
            percentile(&run.latencies, 99.0),
            percentile(&run.latencies, 100.0),
            run.state_bytes,
            run.reopen.as_secs_f64() * 1e3,
        );
    }
}

/// What one pair measured.
struct Run {
    /// Latency of every timed call, in microseconds, sorted.
    latencies: Vec<f64>,
    /// Wall time of the timed calls together.
    elapsed: Duration,
    /// CPU time of the timed calls, where the kernel reports it.
    cpu_ns: Option<u64>,
    /// Bytes written during the timed calls, where the kernel reports them.
    written: Option<u64>,
    /// The core's serialized state at the end.
    state_bytes: usize,
    /// Time to open the hub again on its database.
    reopen: Duration,
}

fn run(actors: u64, prompts: u64) -> Run {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let clock = Arc::new(ManualClock::new(Millis(1_700_000_000_000)));
    let config = HubConfig {
        db_path: dir.path().join("hub.redb"),
        control: Config::default(),
        tick_interval_max: Duration::from_millis(200),
        clock: Arc::clone(&clock) as Arc<dyn aurora_hub::Clock>,
    };
    let hub = Hub::open(config.clone()).expect("a fresh hub");
    let hash = WeightsHash([7; 32]);
    hub.publish_version(Version(1), hash).expect("v1");
    let registration = Registration {
        region: Region::new("eu-west").expect("a valid region"),
        capabilities: Capabilities::default(),
        active: Version(1),
        staged: None,
    };
    for actor in 0..actors {
        hub.register(ActorId(actor), registration.clone())
            .expect("registered");
    }
    let payload = RawValue::from_string(format!("\"{}\"", "x".repeat(PAYLOAD_BYTES - 2)))
        .expect("a JSON string");

    let mut latencies = Vec::new();
    let mut timed = |call: &mut dyn FnMut()| {
        let started = Instant::now();
        call();
        latencies.push(started.elapsed().as_secs_f64() * 1e6);
        // Time moves on between calls, as it does for a real hub.
        clock.advance(1);
    };
    let written_before = bytes_written();
    let cpu_before = cpu_ns();
    let started = Instant::now();
    for step in 0..STEPS {
        let batch: Vec<PromptId> = (step * prompts..(step + 1) * prompts)
            .map(PromptId)
            .collect();
        timed(&mut || {
            hub.open_step(&batch).expect("a step opens");
        });
        let mut complete = false;
        while !complete {
            for actor in (0..actors).map(ActorId) {
                let mut leases = Vec::new();
                timed(&mut || {
                    let (assignment, _) = hub.claim(actor).expect("a claim");
                    if let Assignment::Work {
                        leases: granted, ..
                    } = assignment
                    {
                        leases = granted;
                    }
                });
                if leases.is_empty() {
                    continue;
                }
                let results: Vec<RolloutResult> = leases
                    .iter()
                    .map(|lease| RolloutResult {
                        report: RolloutReport {
                            lease: lease.lease,
                            version: lease.version,
                            weights_hash: hash,
                            tokens: 1_000,
                        },
                        payload: payload.clone(),
                    })
                    .collect();
                timed(&mut || {
                    let outcomes = hub.submit(actor, &results).expect("a submission");
                    assert!(outcomes.iter().all(Result::is_ok), "a result was refused");
                });
            }
            timed(&mut || {
                complete = hub.take_step_outcome().expect("the outcome").is_some();
            });
        }
    }
    let elapsed = started.elapsed();
    let cpu_ns = cpu_before
        .zip(cpu_ns())
        .map(|(before, after)| after - before);
    let written = written_before
        .zip(bytes_written())
        .map(|(before, after)| after - before);
    let state_bytes = hub.inspect(|core| serde_json::to_vec(core).expect("a state").len());
    latencies.sort_by(f64::total_cmp);
    drop(hub);
    let reopening = Instant::now();
    Hub::open(config).expect("the hub again");
    let reopen = reopening.elapsed();
    Run {
        latencies,
        elapsed,
        cpu_ns,
        written,
        state_bytes,
        reopen,
    }
}

/// The `p`th percentile of sorted values (nearest rank).
fn percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Bytes this process has handed to `write`-like system calls, if the kernel says.
fn bytes_written() -> Option<u64> {
    let io = std::fs::read_to_string("/proc/self/io").ok()?;
    io.lines()
        .find_map(|line| line.strip_prefix("wchar:"))
        .and_then(|value| value.trim().parse().ok())
}

/// Nanoseconds this thread has run on a CPU, if the kernel says.
fn cpu_ns() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    stat.split_whitespace().next()?.parse().ok()
}
