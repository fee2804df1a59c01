//! `streams`: goodput of a full checkpoint per stream count and congestion control,
//! fixed or tuned by the receiver, cold and warm, judged against the link's rate.

use std::time::Duration;

use crate::fleet::{self, TransferReport};
use anyhow::{Context, Result};
use aurora_delta::{Encoding, ExtractOptions, Extraction, owned_checkpoint};
use aurora_transport::{DEFAULT_CONGESTION, SocketOptions};
use aurora_wan::measure::Congestion;
use bytes::Bytes;
use serde::Serialize;

use super::setup::PointToPoint;
use super::{CommonArgs, TransportSecurity, checkpoint_pair, load_average, mbps, write_json};
use crate::wan_cmd::{growth, load_scaled};

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

pub(super) struct StreamModes {
    pub(super) streams: Vec<u8>,
    pub(super) congestion: Vec<Congestion>,
    pub(super) adaptive_max: Vec<u8>,
    pub(super) tune_interval: Duration,
    pub(super) time_limit: Duration,
    pub(super) warmup: Duration,
    /// Idle time after a warm-up transfer on the same sessions, for a second, warm
    /// transfer of every mode; `None`: cold sessions only.
    pub(super) warm_idle: Option<Duration>,
    /// Every transfer once per security, one right after the other.
    pub(super) security: Vec<TransportSecurity>,
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
    security: TransportSecurity,
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
    /// Segments the hub sent again (nacked, or lost with a stream) and segments the
    /// receivers got twice: what loss cost beyond the retransmissions TCP does itself.
    resent_segments: u64,
    duplicate_segments: u64,
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

pub(super) fn streams_bench(common: &CommonArgs, modes: &StreamModes) -> Result<()> {
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
         {:?} to the last byte read{warm_sessions}\n{:<9} {:<9} {:<5} {:<14} {:>7} {:>5} {:>14} {:>5} {:>8} {:>9} {:>10} {:>7} {:>13} {:>14}\n",
        scenario.name,
        artifact.len(),
        modes.time_limit,
        modes.warmup,
        "mode",
        "security",
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
    for (run, (session, warm_up), &security) in runs.iter().flat_map(|run| {
        sessions.iter().flat_map(move |session| {
            modes
                .security
                .iter()
                .map(move |security| (run, session, security))
        })
    }) {
        let mut spec = net.spec(&artifact, run.streams)?;
        spec.security = security.bench()?;
        spec.socket = SocketOptions {
            congestion: run.congestion.clone(),
        };
        spec.tune_interval = run.tune_interval;
        spec.time_limit = Some(modes.time_limit);
        spec.warm_up = warm_up.clone();
        tracing::info!(
            mode = run.mode,
            streams = run.streams,
            session,
            ?security,
            "transfer"
        );
        let before = net.network.counters();
        let report = main.block_on(fleet::transfer(spec)).with_context(|| {
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
        let row = stream_row(
            (run, security),
            session,
            &report,
            modes.warmup,
            net.link_mbps,
            drops,
        );
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
    (run, security): (&StreamRun, TransportSecurity),
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
        security,
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
        resent_segments: report.sender.segments_resent,
        duplicate_segments: report.receivers.iter().map(|r| r.stats.duplicates).sum(),
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
        "{:<9} {:<9} {:<5} {:<14} {:>7} {:>5} {:>14} {:>5} {:>8.2} {:>9.1} {:>10} {:>7} {:>13} {:>14}\n",
        row.mode,
        row.security.name(),
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
            "adaptive, {}, {} ({}, tuned up to {} streams, {} at the end), target >= {:.0}% of \
             {link} Mbps: whole transfer {}, steady state {}\n",
            adaptive.security.name(),
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
    text += &tls_cost(rows);
    crate::print_stdout(&text)
}

/// The target: TLS at most 5% slower than plaintext, each mode's TLS row against the
/// plaintext row timed right before it (steady state where known: the whole transfer
/// also holds the handshakes and slow start).
fn tls_cost(rows: &[StreamRow]) -> String {
    const TARGET: f64 = 0.05;
    let rate = |row: &StreamRow| row.steady_mbps.unwrap_or(row.goodput_mbps);
    let mut text = String::new();
    for tls in rows
        .iter()
        .filter(|row| row.security == TransportSecurity::Tls)
    {
        let Some(plain) = rows.iter().find(|row| {
            row.security == TransportSecurity::Plaintext
                && (row.mode.as_str(), row.session, row.streams)
                    == (tls.mode.as_str(), tls.session, tls.streams)
        }) else {
            continue;
        };
        let slower = 1.0 - rate(tls) / rate(plain);
        let verdict = if slower <= TARGET { "met" } else { "NOT met" };
        text += &format!(
            "TLS cost, {} {} on {} streams: {:.1} against {:.1} Mbps plaintext, {:+.1}% \
             (target <= {:.0}% slower: {verdict})\n",
            tls.mode,
            tls.session,
            tls.streams,
            rate(tls),
            rate(plain),
            -100.0 * slower,
            100.0 * TARGET,
        );
    }
    text
}
