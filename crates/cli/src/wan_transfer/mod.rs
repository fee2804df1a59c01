//! `aurora wan transfer`: the segment transport (hub, relays, actors, multi-stream
//! sessions) across an emulated WAN, carrying a synthetic checkpoint pair (the same
//! shapes and steps as `aurora bench codec`).
//!
//! Every node runs in this process, on a tokio runtime built inside its region's network
//! namespace (a socket belongs to the namespace of the thread that creates it), so all
//! times come from one clock. Clocks start once every stream is connected.
//!
//! - `encodings`: one step's transfer time, full checkpoint against `leb128` and
//!   `aurora` deltas, at every rate of the scenario's sweep.
//! - `streams`: goodput of a full checkpoint over each stream count and congestion
//!   control, and with the receiver tuning its stream count itself.
//! - `fan-out`: bytes on each cross-region link and time to the first and last actor
//!   staged, relays against direct, and cut-through from a live extraction.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use aurora_delta::{
    Checkpoint, Encoding, ExtractOptions, Extraction, OwnedTensor, owned_checkpoint,
    safetensors_layout,
};
use aurora_proto::Weights;
use aurora_proto::frame::MAX_STREAMS;
use aurora_transport::bench::{
    self, Fleet, FleetRegion, FleetSpec, StagedReport, TransferReport, TransferSpec,
};
use aurora_transport::{DEFAULT_CONGESTION, SocketOptions};
use aurora_wan::measure::Congestion;
use aurora_wan::{Network, Scenario};
use bytes::Bytes;
use clap::{Args, Subcommand};
use serde::Serialize;

use crate::wan_cmd::{endpoints, growth, load_scaled};

#[derive(Subcommand)]
pub enum TransferCommand {
    /// Transfer time of one step from the hub (first region) to the second region: a
    /// full checkpoint, a `leb128` delta and an `aurora` delta, at every rate of the
    /// scenario's sweep.
    Encodings {
        #[command(flatten)]
        common: CommonArgs,
        /// Parallel streams; every encoding is sent once per value.
        #[arg(long, value_delimiter = ',', default_value = "1,4")]
        streams: Vec<u8>,
    },
    /// Goodput of a full checkpoint from the hub (first region) to the second region
    /// over each stream count under each congestion control, then with the receiver
    /// choosing its stream count itself on the transport's default congestion control.
    Streams {
        #[command(flatten)]
        common: CommonArgs,
        #[arg(long, value_delimiter = ',', default_value = "1,4,8,16")]
        streams: Vec<u8>,
        #[arg(long = "cc", value_delimiter = ',', default_value = "cubic,bbr")]
        congestion: Vec<Congestion>,
        /// The tuned stream count's upper bound (it starts at one); one adaptive
        /// transfer per value.
        #[arg(long, value_delimiter = ',', default_value = "4,16")]
        adaptive_max: Vec<u8>,
        /// How often the receiver tunes its stream count.
        #[arg(long, default_value_t = 1000)]
        tune_ms: u64,
        /// Each transfer stops after this long and counts what arrived.
        #[arg(long, default_value_t = 20.0)]
        seconds: f64,
        /// Steady-state goodput leaves out this much of the start (slow start, the
        /// tuner's first probes) and what follows the last byte read (verification and
        /// assembly).
        #[arg(long, default_value_t = 2.0)]
        warmup_seconds: f64,
        /// Time each mode on warm sessions too, next to the cold ones: the streams
        /// first carry the step before (a full checkpoint too), then stay idle this long,
        /// as between the steps of a long session.
        #[arg(long)]
        warm_idle_seconds: Option<f64>,
    },
    /// An `aurora` delta from the hub (first region) to the actors of every other
    /// region: directly, through one relay per region, and through relays cut-through
    /// from a live extraction.
    FanOut {
        #[command(flatten)]
        common: CommonArgs,
        /// Actors per region; with relays, the relay is one of them.
        #[arg(long, default_value_t = 3)]
        actors: usize,
        #[arg(long, default_value_t = 4)]
        streams: u8,
    },
}

#[derive(Args)]
pub struct CommonArgs {
    scenario: PathBuf,
    /// Synthetic model shape: tiny, small, medium, 0.6b, 1.7b, 4b or 8b.
    #[arg(long, default_value = "0.6b")]
    preset: String,
    /// Percent of the BF16 elements the synthetic step changes (sets its learning rate).
    #[arg(long, default_value_t = 1.0)]
    density: f64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Multiply every rate by this, for a machine that cannot sustain the scenario
    /// (see `aurora wan capacity`).
    #[arg(long, default_value_t = 1.0)]
    rate_scale: f64,
    /// Also write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// Worker threads of each region's runtime; every node shares this machine's cores.
const REGION_WORKERS: usize = 2;
/// A transfer or fan-out that takes longer has failed.
const TIMEOUT: Duration = Duration::from_secs(600);
/// The AuroraRL paper's reference, Qwen3-8B over a link of about 1 Gbps, in seconds: a
/// full checkpoint, and its `leb128` delta over 1 and over 4 streams.
const PAPER_FULL_S: f64 = 128.0;
const PAPER_LEB128_1_STREAM_S: f64 = 4.71;
const PAPER_LEB128_4_STREAMS_S: f64 = 2.90;
/// The version every benchmark publishes: the step from the synthetic base (version 0).
const VERSION: u64 = 1;

/// Stream counts a session may have (docs/wire-protocol.md §3.2).
fn check_streams(counts: &[u8]) -> Result<()> {
    for &count in counts {
        ensure!(
            (1..=MAX_STREAMS).contains(&count),
            "{count} streams is not in 1..={MAX_STREAMS}"
        );
    }
    Ok(())
}

pub fn run(command: TransferCommand) -> Result<()> {
    match command {
        TransferCommand::Encodings { common, streams } => {
            check_streams(&streams)?;
            encodings(&common, &streams)
        }
        TransferCommand::Streams {
            common,
            streams,
            congestion,
            adaptive_max,
            tune_ms,
            seconds,
            warmup_seconds,
            warm_idle_seconds,
        } => {
            check_streams(&streams)?;
            check_streams(&adaptive_max)?;
            let duration = |value: f64, flag: &str| {
                Duration::try_from_secs_f64(value)
                    .with_context(|| format!("--{flag} {value} is not a duration"))
            };
            let modes = StreamModes {
                streams,
                congestion,
                adaptive_max,
                tune_interval: Duration::from_millis(tune_ms),
                time_limit: duration(seconds, "seconds")?,
                warmup: duration(warmup_seconds, "warmup-seconds")?,
                warm_idle: warm_idle_seconds
                    .map(|idle| duration(idle, "warm-idle-seconds"))
                    .transpose()?,
            };
            streams_bench(&common, &modes)
        }
        TransferCommand::FanOut {
            common,
            actors,
            streams,
        } => {
            check_streams(&[streams])?;
            fan_out(&common, actors, streams)
        }
    }
}

/// The machine's load averages over 1, 5 and 15 minutes: the nodes share its cores with
/// the emulator and with whatever else runs, so every measurement is printed with them.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|text| {
            text.split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_else(|_| "unknown".into())
}

/// The synthetic base and target checkpoints of one step.
fn checkpoint_pair(common: &CommonArgs) -> Result<(Vec<OwnedTensor>, Vec<OwnedTensor>)> {
    let shape = aurora_synth::preset(&common.preset)
        .with_context(|| format!("unknown preset '{}'", common.preset))?;
    let (base, target, _) = crate::bench::checkpoint_pair(shape, common.density, common.seed);
    Ok((base, target))
}

/// The synthetic step D(0 -> 1) in each of `encodings` (`Encoding::Dense` is the full
/// checkpoint), and the bytes of the target checkpoint.
fn artifacts(common: &CommonArgs, encodings: &[Encoding]) -> Result<(u64, Vec<Bytes>)> {
    let (base, target) = checkpoint_pair(common)?;
    let (base, target) = (owned_checkpoint(&base)?, owned_checkpoint(&target)?);
    let mut artifacts = Vec::new();
    for &encoding in encodings {
        let options = ExtractOptions {
            encoding,
            ..ExtractOptions::default()
        };
        let (_, bytes) = Extraction::new(&base, &target, options)?
            .to_bytes()
            .with_context(|| format!("extracting the {} artifact", encoding_name(encoding)))?;
        artifacts.push(Bytes::from(bytes));
    }
    Ok((target.total_bytes(), artifacts))
}

/// Full-checkpoint steps: D(1 -> 2) from the target back to the base's weights, and
/// when asked the step before it, D(0 -> 1) from the base to the target: a chain any
/// receiver could apply.
fn full_steps(common: &CommonArgs, with_step_before: bool) -> Result<(Option<Bytes>, Bytes)> {
    let (base, target) = checkpoint_pair(common)?;
    let (base, target) = (owned_checkpoint(&base)?, owned_checkpoint(&target)?);
    let step = |from, to, base_version| -> Result<Bytes> {
        let options = ExtractOptions {
            encoding: Encoding::Dense,
            base_version,
            target_version: base_version + 1,
            ..ExtractOptions::default()
        };
        let (_, bytes) = Extraction::new(from, to, options)?
            .to_bytes()
            .with_context(|| format!("extracting the full step to version {}", base_version + 1))?;
        Ok(Bytes::from(bytes))
    };
    let before = with_step_before
        .then(|| step(&base, &target, 0))
        .transpose()?;
    Ok((before, step(&target, &base, 1)?))
}

fn encoding_name(encoding: Encoding) -> &'static str {
    match encoding {
        Encoding::Dense => "full",
        Encoding::Leb128 => "leb128",
        Encoding::Aurora => "aurora",
    }
}

/// A runtime whose threads live in `region`'s network namespace, so the sockets of the
/// nodes started on it belong to that region. Its workers are spawned while it is
/// built, on a thread inside the namespace, and the threads it adds later (blocking
/// work) are spawned by them, so they inherit it.
fn runtime_in(network: &Network, region: &str) -> Result<tokio::runtime::Runtime> {
    network
        .run_in(region, || {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(REGION_WORKERS)
                .enable_all()
                .build()
        })?
        .with_context(|| format!("starting a runtime in region {region}"))
}

/// The rate of the link between two regions, if they share one with a rate limit.
fn link_rate_mbps(scenario: &Scenario, a: &str, b: &str) -> Option<f64> {
    scenario
        .links
        .iter()
        .find(|link| link.between.contains(&a.to_string()) && link.between.contains(&b.to_string()))
        .and_then(|link| link.rate_mbps)
}

fn mbps(bytes: u64, seconds: f64) -> f64 {
    bytes as f64 * 8.0 / seconds / 1e6
}

fn write_json(path: Option<&std::path::Path>, value: &impl Serialize) -> Result<()> {
    if let Some(path) = path {
        std::fs::write(path, serde_json::to_string_pretty(value)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// The hub's region, one receiving region, and a runtime in each: what `encodings` and
/// `streams` run on.
struct PointToPoint {
    network: Network,
    hub: String,
    hub_runtime: tokio::runtime::Runtime,
    remote_runtime: tokio::runtime::Runtime,
    link_mbps: Option<f64>,
}

impl PointToPoint {
    fn up(scenario: &Scenario) -> Result<PointToPoint> {
        let (hub, remote) = endpoints(scenario, None, None)?;
        let network = Network::up(scenario)?;
        Ok(PointToPoint {
            hub_runtime: runtime_in(&network, &hub)?,
            remote_runtime: runtime_in(&network, &remote)?,
            link_mbps: link_rate_mbps(scenario, &hub, &remote),
            hub,
            network,
        })
    }

    fn spec(&self, artifact: &Bytes, streams: u8) -> Result<TransferSpec> {
        let mut spec = TransferSpec::new(artifact.clone(), 1, streams);
        spec.listen = SocketAddr::new(self.network.address(&self.hub)?.into(), 0);
        spec.hub_runtime = Some(self.hub_runtime.handle().clone());
        spec.receiver_runtime = Some(self.remote_runtime.handle().clone());
        spec.timeout = TIMEOUT;
        Ok(spec)
    }

    fn down(self) -> Result<()> {
        // The nodes' sockets close with their runtimes, before the namespaces go.
        drop(self.hub_runtime);
        drop(self.remote_runtime);
        Ok(self.network.down()?)
    }
}

#[derive(Serialize)]
struct EncodingRow {
    scenario: String,
    link_mbps: Option<f64>,
    streams: u8,
    encoding: &'static str,
    bytes: u64,
    seconds: f64,
    goodput_mbps: f64,
}

#[derive(Serialize)]
struct EncodingsOutput {
    preset: String,
    density_percent: f64,
    checkpoint_bytes: u64,
    congestion: &'static str,
    /// Our checkpoint's bytes over the paper's (Qwen3-8B in BF16).
    paper_scale: f64,
    paper_scaled_full_s: f64,
    paper_scaled_leb128_1_stream_s: f64,
    paper_scaled_leb128_4_streams_s: f64,
    load_before: String,
    load_after: String,
    rows: Vec<EncodingRow>,
}

fn encodings(common: &CommonArgs, streams: &[u8]) -> Result<()> {
    let scenario = load_scaled(&common.scenario, common.rate_scale)?;
    let load_before = load_average();
    let encodings = [Encoding::Dense, Encoding::Leb128, Encoding::Aurora];
    let (checkpoint_bytes, bytes) = artifacts(common, &encodings)?;
    let artifacts: Vec<(&str, Bytes)> = encodings
        .map(encoding_name)
        .into_iter()
        .zip(bytes)
        .collect();
    let paper_bytes = 2 * aurora_synth::preset("8b")
        .expect("the 8b preset exists")
        .parameters();
    let scale = checkpoint_bytes as f64 / paper_bytes as f64;
    crate::print_stdout(&format!(
        "{} at {}% density, load average {load_before}; congestion control: the transport's \
         default ({DEFAULT_CONGESTION}); one transfer per row and encoding, hub to the second \
         region\n{}\n",
        common.preset,
        common.density,
        artifacts
            .iter()
            .map(|(name, bytes)| format!("{name} {} bytes", bytes.len()))
            .collect::<Vec<_>>()
            .join(", "),
    ))?;
    let points = match scenario.sweep_points() {
        points if points.is_empty() => vec![scenario],
        points => points,
    };
    let main = crate::runtime(Some(1))?;
    let mut rows = Vec::new();
    for point in &points {
        let net = PointToPoint::up(point)?;
        for &count in streams {
            for (name, artifact) in &artifacts {
                tracing::info!(
                    scenario = point.name,
                    encoding = name,
                    streams = count,
                    "transfer"
                );
                let report = main
                    .block_on(bench::transfer(net.spec(artifact, count)?))
                    .with_context(|| format!("{name} over {count} streams in {}", point.name))?;
                let seconds = report.elapsed.as_secs_f64();
                rows.push(EncodingRow {
                    scenario: point.name.clone(),
                    link_mbps: net.link_mbps,
                    streams: count,
                    encoding: name,
                    bytes: report.artifact_bytes,
                    seconds,
                    goodput_mbps: mbps(report.delivered_bytes(), seconds),
                });
            }
        }
        net.down()?;
    }
    let output = EncodingsOutput {
        preset: common.preset.clone(),
        density_percent: common.density,
        checkpoint_bytes,
        congestion: DEFAULT_CONGESTION,
        paper_scale: scale,
        paper_scaled_full_s: PAPER_FULL_S * scale,
        paper_scaled_leb128_1_stream_s: PAPER_LEB128_1_STREAM_S * scale,
        paper_scaled_leb128_4_streams_s: PAPER_LEB128_4_STREAMS_S * scale,
        load_after: load_average(),
        load_before,
        rows,
    };
    print_encodings(&output)?;
    write_json(common.json.as_deref(), &output)
}

fn print_encodings(output: &EncodingsOutput) -> Result<()> {
    let mut text = format!(
        "{:>10} {:>7} {:>10} {:>10} {:>10} {:>11} {:>11} {:>11}\n",
        "link Mbps",
        "streams",
        "full s",
        "leb128 s",
        "aurora s",
        "full Mbps",
        "leb128 Mbps",
        "aurora Mbps"
    );
    // Rows come in groups of the three encodings, in the order above.
    for group in output.rows.chunks(3) {
        let link = group[0]
            .link_mbps
            .map_or("-".to_string(), |rate| format!("{rate}"));
        text += &format!(
            "{link:>10} {:>7} {:>10.3} {:>10.3} {:>10.3} {:>11.1} {:>11.1} {:>11.1}\n",
            group[0].streams,
            group[0].seconds,
            group[1].seconds,
            group[2].seconds,
            group[0].goodput_mbps,
            group[1].goodput_mbps,
            group[2].goodput_mbps,
        );
    }
    text += &format!(
        "paper (Qwen3-8B, about 1 Gbps) scaled by {:.4} (this checkpoint's {} bytes over \
         Qwen3-8B's BF16): full {:.2} s, leb128 {:.3} s on 1 stream, {:.3} s on 4 streams\n\
         load average after: {}\n",
        output.paper_scale,
        output.checkpoint_bytes,
        output.paper_scaled_full_s,
        output.paper_scaled_leb128_1_stream_s,
        output.paper_scaled_leb128_4_streams_s,
        output.load_after,
    );
    crate::print_stdout(&text)
}

struct StreamModes {
    streams: Vec<u8>,
    congestion: Vec<Congestion>,
    adaptive_max: Vec<u8>,
    tune_interval: Duration,
    time_limit: Duration,
    warmup: Duration,
    /// Idle time after a warm-up transfer on the same sessions, for a second, warm
    /// transfer of every mode; `None`: cold sessions only.
    warm_idle: Option<Duration>,
}

/// One transfer of `streams`: a mode's name, how its congestion control is shown and
/// set (`None`: the transport's default), and the tuning interval if tuned.
struct StreamRun {
    mode: String,
    label: String,
    congestion: Option<String>,
    streams: u8,
    tune_interval: Option<Duration>,
}

#[derive(Serialize)]
struct StreamRow {
    /// A congestion control with a fixed stream count, or `adaptive`.
    mode: String,
    /// `cold`: fresh connections; `warm`: connections that carried the step before.
    session: &'static str,
    congestion: String,
    streams: u8,
    streams_at_end: u8,
    bytes: u64,
    seconds: f64,
    complete: bool,
    goodput_mbps: f64,
    steady_mbps: Option<f64>,
    /// Goodput over the link's rate.
    link_share: Option<f64>,
    /// Packets the loss model dropped and the rate limiter's full queue dropped, both
    /// directions.
    lost: u64,
    queue_dropped: u64,
    load: String,
    /// Bytes read from the hub by then, every 100 ms: slow start, the tuner's steps and
    /// the tail can be read off it.
    progress: Vec<(f64, u64)>,
}

#[derive(Serialize)]
struct StreamsOutput {
    scenario: String,
    link_mbps: Option<f64>,
    artifact_bytes: u64,
    time_limit_s: f64,
    warmup_s: f64,
    /// Idle seconds between the warm-up transfer and the timed one of the warm rows.
    warm_idle_s: Option<f64>,
    tune_interval_ms: u128,
    rows: Vec<StreamRow>,
}

fn streams_bench(common: &CommonArgs, modes: &StreamModes) -> Result<()> {
    let scenario = load_scaled(&common.scenario, common.rate_scale)?;
    let (warm_up, artifact) = full_steps(common, modes.warm_idle.is_some())?;
    let warm_up = warm_up.zip(modes.warm_idle);
    let mut runs: Vec<StreamRun> = Vec::new();
    for congestion in &modes.congestion {
        for &streams in &modes.streams {
            runs.push(StreamRun {
                mode: congestion.name().into(),
                label: congestion.name().into(),
                congestion: Some(congestion.name().into()),
                streams,
                tune_interval: None,
            });
        }
    }
    for &streams in &modes.adaptive_max {
        runs.push(StreamRun {
            mode: "adaptive".into(),
            label: format!("default ({DEFAULT_CONGESTION})"),
            congestion: None,
            streams,
            tune_interval: Some(modes.tune_interval),
        });
    }
    let net = PointToPoint::up(&scenario)?;
    let warm_sessions = match modes.warm_idle {
        Some(idle) => {
            format!("; warm: on sessions that carried a first checkpoint, then {idle:?} idle")
        }
        None => String::new(),
    };
    crate::print_stdout(&format!(
        "{}: a full checkpoint of {} bytes, each transfer stopped after {:?}; steady = from \
         {:?} to the last byte read{warm_sessions}\n{:<9} {:<5} {:<14} {:>7} {:>5} {:>14} {:>5} {:>8} {:>9} {:>10} {:>7} {:>13} {:>14}\n",
        scenario.name,
        artifact.len(),
        modes.time_limit,
        modes.warmup,
        "mode",
        "",
        "congestion",
        "streams",
        "end",
        "bytes",
        "done",
        "seconds",
        "Mbps",
        "steady",
        "link",
        "lost/queue",
        "load",
    ))?;
    let main = crate::runtime(Some(1))?;
    let mut rows = Vec::new();
    let sessions: Vec<(&'static str, Option<(Bytes, Duration)>)> = std::iter::once(("cold", None))
        .chain(warm_up.map(|warm_up| ("warm", Some(warm_up))))
        .collect();
    for (run, (session, warm_up)) in runs
        .iter()
        .flat_map(|run| sessions.iter().map(move |session| (run, session)))
    {
        let mut spec = net.spec(&artifact, run.streams)?;
        spec.socket = SocketOptions {
            congestion: run.congestion.clone(),
        };
        spec.tune_interval = run.tune_interval;
        spec.time_limit = Some(modes.time_limit);
        spec.warm_up = warm_up.clone();
        tracing::info!(mode = run.mode, streams = run.streams, session, "transfer");
        let before = net.network.counters();
        let report = main.block_on(bench::transfer(spec)).with_context(|| {
            format!(
                "{} over {} streams in {}",
                run.mode, run.streams, scenario.name
            )
        })?;
        let after = net.network.counters();
        let drops = (
            growth(&before, &after, |d| d.counters.lost),
            growth(&before, &after, |d| d.counters.queue_full),
        );
        let row = stream_row(run, session, &report, modes.warmup, net.link_mbps, drops);
        print_stream_row(&row)?;
        rows.push(row);
    }
    let link_mbps = net.link_mbps;
    net.down()?;
    print_stream_verdict(&rows, link_mbps)?;
    write_json(
        common.json.as_deref(),
        &StreamsOutput {
            scenario: scenario.name.clone(),
            link_mbps,
            artifact_bytes: artifact.len() as u64,
            time_limit_s: modes.time_limit.as_secs_f64(),
            warmup_s: modes.warmup.as_secs_f64(),
            warm_idle_s: modes.warm_idle.map(|idle| idle.as_secs_f64()),
            tune_interval_ms: modes.tune_interval.as_millis(),
            rows,
        },
    )
}

fn stream_row(
    run: &StreamRun,
    session: &'static str,
    report: &TransferReport,
    warmup: Duration,
    link_mbps: Option<f64>,
    (lost, queue_dropped): (u64, u64),
) -> StreamRow {
    let seconds = report.elapsed.as_secs_f64();
    let goodput_mbps = mbps(report.delivered_bytes(), seconds);
    StreamRow {
        mode: run.mode.clone(),
        session,
        congestion: run.label.clone(),
        streams: run.streams,
        streams_at_end: report
            .receivers
            .iter()
            .map(|r| r.streams)
            .max()
            .unwrap_or(0),
        bytes: report.delivered_bytes(),
        seconds,
        complete: report.complete(),
        goodput_mbps,
        steady_mbps: report.steady_goodput(warmup).map(|rate| rate * 8.0 / 1e6),
        link_share: link_mbps.map(|link| goodput_mbps / link),
        lost,
        queue_dropped,
        load: load_average(),
        progress: report
            .progress
            .iter()
            .map(|&(at, bytes)| (at.as_secs_f64(), bytes))
            .collect(),
    }
}

fn print_stream_row(row: &StreamRow) -> Result<()> {
    crate::print_stdout(&format!(
        "{:<9} {:<5} {:<14} {:>7} {:>5} {:>14} {:>5} {:>8.2} {:>9.1} {:>10} {:>7} {:>13} {:>14}\n",
        row.mode,
        row.session,
        row.congestion,
        row.streams,
        row.streams_at_end,
        row.bytes,
        if row.complete { "yes" } else { "no" },
        row.seconds,
        row.goodput_mbps,
        row.steady_mbps
            .map_or("-".into(), |rate| format!("{rate:.1}")),
        row.link_share
            .map_or("-".into(), |share| format!("{:.1}%", 100.0 * share)),
        format!("{}/{}", row.lost, row.queue_dropped),
        row.load,
    ))
}

/// The target: the transport choosing its stream count itself reaches 90% of the link,
/// next to one CUBIC stream; judged on the whole transfer and on the steady state.
fn print_stream_verdict(rows: &[StreamRow], link_mbps: Option<f64>) -> Result<()> {
    const TARGET: f64 = 0.9;
    let Some(link) = link_mbps else {
        return crate::print_stdout("the link has no rate: no target to judge\n");
    };
    let judge = |mbps: f64| {
        let verdict = if mbps >= TARGET * link {
            "met"
        } else {
            "NOT met"
        };
        format!("{mbps:.1} Mbps = {:.1}% ({verdict})", 100.0 * mbps / link)
    };
    let mut text = String::new();
    for adaptive in rows.iter().filter(|row| row.mode == "adaptive") {
        text += &format!(
            "adaptive, {} ({}, tuned up to {} streams, {} at the end), target >= {:.0}% of \
             {link} Mbps: whole transfer {}, steady state {}\n",
            adaptive.session,
            adaptive.congestion,
            adaptive.streams,
            adaptive.streams_at_end,
            100.0 * TARGET,
            judge(adaptive.goodput_mbps),
            adaptive.steady_mbps.map_or("-".into(), judge),
        );
    }
    if let Some(baseline) = rows.iter().find(|row| {
        row.mode == Congestion::Cubic.name() && row.streams == 1 && row.session == "cold"
    }) {
        text += &format!(
            "baseline, one CUBIC stream: {:.1} Mbps ({:.1}%)\n",
            baseline.goodput_mbps,
            100.0 * baseline.goodput_mbps / link
        );
    }
    crate::print_stdout(&text)
}

#[derive(Serialize)]
struct LinkBytes {
    region: String,
    /// IP bytes the emulator passed from the hub to the region (TCP/IP headers and
    /// retransmissions included; a super-packet's header counted once).
    bytes: u64,
    copies: f64,
}

#[derive(Serialize)]
struct MemberTimes {
    region: String,
    name: String,
    role: String,
    received_s: f64,
    staged_s: f64,
}

#[derive(Serialize)]
struct FanOutRow {
    mode: &'static str,
    links: Vec<LinkBytes>,
    /// From publication (cut-through: from the first segment leaving the encoder).
    first_received_s: f64,
    last_received_s: f64,
    first_staged_s: f64,
    last_staged_s: f64,
    /// Cut-through only: from the extraction's start to its first segment and to its
    /// end, during the run.
    first_segment_s: Option<f64>,
    extraction_s: Option<f64>,
    members: Vec<MemberTimes>,
    load: String,
}

#[derive(Serialize)]
struct FanOutOutput {
    scenario: String,
    preset: String,
    density_percent: f64,
    artifact_bytes: u64,
    actors_per_region: usize,
    streams: u8,
    /// Extraction of the same delta with nothing else running, before the network.
    extraction_alone_s: f64,
    rows: Vec<FanOutRow>,
}

#[derive(Clone, Copy, PartialEq)]
enum Publication {
    /// The complete artifact, published at once.
    Stored,
    /// A live extraction, each segment published as it leaves the encoder.
    Live,
}

fn fan_out(common: &CommonArgs, actors: usize, streams: u8) -> Result<()> {
    ensure!(actors >= 1, "--actors must be at least 1");
    let scenario = load_scaled(&common.scenario, common.rate_scale)?;
    if scenario.regions.len() < 2 {
        bail!(
            "scenario {} needs a hub region and at least one other",
            scenario.name
        );
    }
    let hub = scenario.regions[0].name.clone();
    let remotes: Vec<String> = scenario.regions[1..]
        .iter()
        .map(|r| r.name.clone())
        .collect();
    let (base, target) = checkpoint_pair(common)?;
    let image = aurora_checkpoint::safetensors_bytes(&base).map_err(anyhow::Error::msg)?;
    drop(base);
    let weights = Weights::new(image, VERSION - 1).context("the synthetic base")?;
    let layout = safetensors_layout(weights.image())?;
    let base_view = Checkpoint::from_layout(weights.image(), &layout)?;
    let target_view = owned_checkpoint(&target)?;
    let options = ExtractOptions {
        encoding: Encoding::Aurora,
        base_version: VERSION - 1,
        target_version: VERSION,
        base_hash: Some(weights.active().hash),
        target_hash: Some(target_view.weights_hash()),
        ..ExtractOptions::default()
    };
    let alone = Extraction::new(&base_view, &target_view, options.clone())?;
    let started = Instant::now();
    let (_, artifact) = alone.to_bytes()?;
    let extraction_alone = started.elapsed();
    let artifact = Bytes::from(artifact);
    crate::print_stdout(&format!(
        "{}: {} at {}% density, aurora delta of {} bytes, {actors} actors in each of {}, {} \
         streams; extraction alone {:.3} s\n",
        scenario.name,
        common.preset,
        common.density,
        artifact.len(),
        remotes.join(", "),
        streams,
        extraction_alone.as_secs_f64(),
    ))?;

    let network = Network::up(&scenario)?;
    let mut runtimes = Vec::new();
    for region in std::iter::once(&hub).chain(&remotes) {
        runtimes.push(runtime_in(&network, region)?);
    }
    let regions = remotes
        .iter()
        .zip(&runtimes[1..])
        .map(|(name, runtime)| {
            Ok(FleetRegion {
                name: name.clone(),
                actors,
                address: network.address(name)?.into(),
                runtime: Some(runtime.handle().clone()),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let main = crate::runtime(Some(1))?;
    let mut rows = Vec::new();
    for (mode, relays, publication) in [
        ("direct", false, Publication::Stored),
        ("relays", true, Publication::Stored),
        ("cut-through", true, Publication::Live),
    ] {
        let spec = FleetSpec {
            regions: regions.clone(),
            relays,
            hub_listen: SocketAddr::new(network.address(&hub)?.into(), 0),
            hub_runtime: Some(runtimes[0].handle().clone()),
            streams,
            socket: SocketOptions::default(),
            tune_interval: None,
            timeout: TIMEOUT,
        };
        tracing::info!(mode, "starting the fleet");
        let fleet = main
            .block_on(Fleet::start(&spec, &weights))
            .with_context(|| format!("starting the {mode} fleet"))?;
        let before = network.counters();
        tracing::info!(mode, "publishing");
        let (reports, cut_through) = match publication {
            Publication::Stored => {
                let start = Instant::now();
                let reports = main.block_on(async {
                    fleet.hub.publish(artifact.clone()).await?;
                    fleet.staged(VERSION, start).await
                });
                (reports, None)
            }
            Publication::Live => {
                let live = Extraction::new(&base_view, &target_view, options.clone())?;
                let first = OnceLock::new();
                let start = Instant::now();
                std::thread::scope(|scope| {
                    let publisher = scope.spawn(|| {
                        let published = fleet.hub.publish_extraction_observed(&live, |_| {
                            first.get_or_init(Instant::now);
                        });
                        (published, start.elapsed())
                    });
                    let reports = main.block_on(fleet.staged(VERSION, start));
                    let (published, extraction) = publisher
                        .join()
                        .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
                    published.context("the live extraction")?;
                    let first = first
                        .get()
                        .context("the extraction produced no segment")?
                        .duration_since(start);
                    Ok::<_, anyhow::Error>((reports, Some((first, extraction))))
                })?
            }
        };
        let reports = reports.with_context(|| format!("the {mode} fan-out"))?;
        let after = network.counters();
        main.block_on(fleet.stop());
        let links = remotes
            .iter()
            .map(|region| {
                let bytes = growth(&before, &after, |d| {
                    if d.from == hub && &d.to == region {
                        d.counters.bytes_out
                    } else {
                        0
                    }
                });
                LinkBytes {
                    region: region.clone(),
                    bytes,
                    copies: bytes as f64 / artifact.len() as f64,
                }
            })
            .collect();
        let row = fan_out_row(mode, links, &reports, cut_through);
        print_fan_out_row(&row)?;
        rows.push(row);
    }
    drop(runtimes);
    network.down()?;
    let output = FanOutOutput {
        scenario: scenario.name.clone(),
        preset: common.preset.clone(),
        density_percent: common.density,
        artifact_bytes: artifact.len() as u64,
        actors_per_region: actors,
        streams,
        extraction_alone_s: extraction_alone.as_secs_f64(),
        rows,
    };
    print_fan_out_verdict(&output)?;
    write_json(common.json.as_deref(), &output)
}

/// Times of a fan-out; for a cut-through one they count from the first segment leaving
/// the encoder (`cut_through`: first segment and extraction end, from its start).
fn fan_out_row(
    mode: &'static str,
    links: Vec<LinkBytes>,
    reports: &[StagedReport],
    cut_through: Option<(Duration, Duration)>,
) -> FanOutRow {
    let origin = cut_through.map_or(Duration::ZERO, |(first, _)| first);
    let since = |at: Duration| at.saturating_sub(origin).as_secs_f64();
    let members: Vec<MemberTimes> = reports
        .iter()
        .map(|report| MemberTimes {
            region: report.region.clone(),
            name: report.name.clone(),
            role: report.role.to_string(),
            received_s: since(report.received),
            staged_s: since(report.staged),
        })
        .collect();
    let extreme = |field: fn(&MemberTimes) -> f64, pick: fn(f64, f64) -> f64, start: f64| {
        members.iter().map(field).fold(start, pick)
    };
    FanOutRow {
        mode,
        links,
        first_received_s: extreme(|m| m.received_s, f64::min, f64::INFINITY),
        last_received_s: extreme(|m| m.received_s, f64::max, 0.0),
        first_staged_s: extreme(|m| m.staged_s, f64::min, f64::INFINITY),
        last_staged_s: extreme(|m| m.staged_s, f64::max, 0.0),
        first_segment_s: cut_through.map(|(first, _)| first.as_secs_f64()),
        extraction_s: cut_through.map(|(_, extraction)| extraction.as_secs_f64()),
        members,
        load: load_average(),
    }
}

fn print_fan_out_row(row: &FanOutRow) -> Result<()> {
    let links: Vec<String> = row
        .links
        .iter()
        .map(|link| {
            format!(
                "hub->{} {} B ({:.2} copies)",
                link.region, link.bytes, link.copies
            )
        })
        .collect();
    let mut text = format!(
        "{:<12} {}; received first {:.3} s, last {:.3} s; staged first {:.3} s, last {:.3} s \
         (last/first {:.2}); load {}\n",
        row.mode,
        links.join(", "),
        row.first_received_s,
        row.last_received_s,
        row.first_staged_s,
        row.last_staged_s,
        row.last_staged_s / row.first_staged_s,
        row.load,
    );
    if let (Some(first), Some(extraction)) = (row.first_segment_s, row.extraction_s) {
        text += &format!(
            "{:<12} times from the first segment leaving the encoder, {first:.3} s after the \
             extraction started; the extraction ended at {extraction:.3} s\n",
            ""
        );
    }
    crate::print_stdout(&text)
}

/// The targets: one copy per region on each cross-region link with relays, and the last
/// actor staged within 10% of the first; then cut-through against store-and-forward.
fn print_fan_out_verdict(output: &FanOutOutput) -> Result<()> {
    /// More than this many copies on a link is no longer "one copy" (headers and
    /// retransmissions add a few percent).
    const ONE_COPY: f64 = 1.5;
    const SPREAD: f64 = 1.1;
    let mut text = String::new();
    let met = |ok: bool| if ok { "met" } else { "NOT met" };
    for row in &output.rows {
        let most = row.links.iter().map(|l| l.copies).fold(0.0, f64::max);
        let spread = row.last_staged_s / row.first_staged_s;
        text += &format!(
            "{}: at most {most:.2} copies per cross-region link{}; last staged {:.2}x the \
             first: target <= {SPREAD} {} (last received {:.2}x the first)\n",
            row.mode,
            if row.mode == "direct" {
                String::new()
            } else {
                format!(": target one copy {}", met(most < ONE_COPY))
            },
            spread,
            met(spread <= SPREAD),
            row.last_received_s / row.first_received_s,
        );
    }
    let relays = output.rows.iter().find(|row| row.mode == "relays");
    let cut = output.rows.iter().find(|row| row.mode == "cut-through");
    if let (Some(relays), Some(cut)) = (relays, cut) {
        let alone = output.extraction_alone_s;
        text += &format!(
            "cut-through, from the first segment leaving the encoder: last actor received \
             {:.3} s, staged {:.3} s; store-and-forward, extraction alone ({alone:.3} s) then \
             publication to the last actor: received {:.3} s, staged {:.3} s\n",
            cut.last_received_s,
            cut.last_staged_s,
            alone + relays.last_received_s,
            alone + relays.last_staged_s,
        );
    }
    crate::print_stdout(&text)
}
