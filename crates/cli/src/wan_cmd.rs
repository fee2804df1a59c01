//! `aurora wan`: WAN emulation in network namespaces (needs root). `check` validates
//! scenario files; `capacity` measures what this machine sustains through a plain veth
//! and through the emulator; `bench` runs multi-stream TCP transfers across a scenario;
//! `probe` measures its RTT and loss; `transfer` runs the segment transport across it
//! (`crate::wan_transfer`); `exec` runs a program while a scenario is up, for benchmarks
//! written outside this binary; `cleanup` removes namespaces of dead runs.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use aurora_wan::impair::Counters;
use aurora_wan::measure::{self, Congestion, TransferConfig, TransferReport};
use aurora_wan::{DirectionCounters, Link, Network, Scenario};
use clap::{Args, Subcommand};
use serde::Serialize;

#[derive(Subcommand)]
pub enum WanCommand {
    /// Validate scenario files and show their regions and links.
    Check { scenarios: Vec<PathBuf> },
    /// TCP goodput through a plain veth pair and through the emulator (no delay, loss
    /// or rate limit): the ceiling every scenario's rates must stay under.
    Capacity {
        #[command(flatten)]
        transfer: TransferArgs,
    },
    /// Multi-stream TCP transfers across a scenario (every point of its sweep).
    Bench {
        scenario: PathBuf,
        /// Sending region; default: the first.
        #[arg(long)]
        from: Option<String>,
        /// Receiving region; default: the second.
        #[arg(long)]
        to: Option<String>,
        /// Multiply every rate by this, for a machine that cannot sustain the
        /// scenario (see `aurora wan capacity`).
        #[arg(long, default_value_t = 1.0)]
        rate_scale: f64,
        #[command(flatten)]
        transfer: TransferArgs,
    },
    /// TCP round-trip times and datagram loss between two regions of a scenario.
    Probe {
        scenario: PathBuf,
        #[arg(long)]
        from: Option<String>,
        #[arg(long)]
        to: Option<String>,
        #[arg(long, default_value_t = 20)]
        round_trips: usize,
        #[arg(long, default_value_t = 10_000)]
        datagrams: usize,
    },
    /// The segment transport (hub, relays, actors) across a scenario, on a synthetic
    /// checkpoint pair: step time by encoding, stream counts, fan-out, cut-through.
    #[command(subcommand)]
    Transfer(crate::wan_transfer::TransferCommand),
    /// Bring a scenario up, run a program while it is up (in the host's namespace), then
    /// tear it down; exits with the program's status. The program finds each region as
    /// `AURORA_WAN_<REGION>_NETNS` (for `ip netns exec`) and `AURORA_WAN_<REGION>_ADDRESS`,
    /// the region's name upper-cased with every other character than a letter or digit
    /// as `_`.
    Exec {
        scenario: PathBuf,
        /// The program and its arguments (after `--`).
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<String>,
    },
    /// Remove the namespaces of runs whose process died.
    Cleanup,
}

#[derive(Args)]
pub struct TransferArgs {
    /// Parallel TCP streams; one transfer per value.
    #[arg(long, value_delimiter = ',', default_value = "1,4,8,16")]
    streams: Vec<usize>,
    /// Congestion controls; one transfer per value.
    #[arg(long = "cc", value_delimiter = ',', default_value = "cubic,bbr")]
    congestion: Vec<Congestion>,
    /// Length of each transfer.
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Also write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

pub fn run(command: WanCommand) -> Result<()> {
    match command {
        WanCommand::Check { scenarios } => check(&scenarios),
        WanCommand::Capacity { transfer } => capacity(&transfer),
        WanCommand::Bench {
            scenario,
            from,
            to,
            rate_scale,
            transfer,
        } => bench(&scenario, from, to, rate_scale, &transfer),
        WanCommand::Probe {
            scenario,
            from,
            to,
            round_trips,
            datagrams,
        } => probe(&scenario, from, to, round_trips, datagrams),
        WanCommand::Transfer(command) => crate::wan_transfer::run(command),
        WanCommand::Exec { scenario, command } => exec(&scenario, &command),
        WanCommand::Cleanup => {
            let removed = aurora_wan::remove_leftovers()?;
            crate::print_stdout(&format!("removed {} namespaces\n", removed.len()))
        }
    }
}

fn check(paths: &[PathBuf]) -> Result<()> {
    if paths.is_empty() {
        bail!("name at least one scenario file");
    }
    let mut text = String::new();
    for path in paths {
        let scenario = Scenario::load(path)?;
        text += &format!("{}: {}\n", scenario.name, scenario.description);
        for link in &scenario.links {
            let rate = link
                .rate_mbps
                .map_or("unlimited".to_string(), |rate| format!("{rate} Mbps"));
            text += &format!(
                "  {} <-> {}: {rate}, RTT {:?}, loss {}{}{}\n",
                link.between[0],
                link.between[1],
                2 * link.one_way_delay(),
                link.loss,
                link.loss_burst_packets
                    .map_or(String::new(), |burst| format!(" in bursts of {burst}")),
                if link.emulate { "" } else { ", plain veth" },
            );
        }
        if let Some(sweep) = &scenario.sweep {
            text += &format!("  sweep over {:?} Mbps\n", sweep.rates_mbps);
        }
    }
    crate::print_stdout(&text)
}

/// One transfer's figures, as printed and as written to JSON.
#[derive(Serialize)]
struct Row {
    scenario: String,
    from: String,
    to: String,
    congestion: Congestion,
    streams: usize,
    seconds: f64,
    goodput_mbps: f64,
    stream_mbps_min: f64,
    stream_mbps_max: f64,
    smoothed_rtt_ms_mean: f64,
    min_rtt_ms: Option<f64>,
    retransmitted_segments: u64,
    /// Packets the emulators lost on purpose, the rate limiters dropped at a full
    /// queue, and the emulators dropped at a full delay line or failed to send,
    /// during this transfer, all directions together.
    lost: u64,
    queue_dropped: u64,
    emulator_dropped: u64,
    report: TransferReport,
}

fn row(
    network: &Network,
    from: &str,
    to: &str,
    config: &TransferConfig,
    before: &[DirectionCounters],
    report: TransferReport,
) -> Row {
    let after = network.counters();
    let delta = |field: fn(&Counters) -> u64| growth(before, &after, |d| field(&d.counters));
    let rates: Vec<f64> = report.streams.iter().map(|s| s.goodput_mbps).collect();
    let rtts: Vec<f64> = report
        .streams
        .iter()
        .map(|s| f64::from(s.sender.smoothed_rtt_us) / 1000.0)
        .collect();
    Row {
        scenario: network.scenario().name.clone(),
        from: from.to_string(),
        to: to.to_string(),
        congestion: config.congestion,
        streams: config.streams,
        seconds: config.duration.as_secs_f64(),
        goodput_mbps: report.goodput_mbps(),
        stream_mbps_min: rates.iter().copied().fold(f64::INFINITY, f64::min),
        stream_mbps_max: rates.iter().copied().fold(0.0, f64::max),
        smoothed_rtt_ms_mean: rtts.iter().sum::<f64>() / rtts.len() as f64,
        min_rtt_ms: report
            .streams
            .iter()
            .filter_map(|s| s.sender.min_rtt_us)
            .min()
            .map(|us| f64::from(us) / 1000.0),
        retransmitted_segments: report.retransmitted_segments(),
        lost: delta(|c| c.lost),
        queue_dropped: delta(|c| c.queue_full),
        emulator_dropped: delta(|c| c.overflowed + c.send_failed),
        report,
    }
}

/// How much `field` grew between two readings of a network's counters, summed over
/// every direction.
pub(crate) fn growth(
    before: &[DirectionCounters],
    after: &[DirectionCounters],
    field: impl Fn(&DirectionCounters) -> u64,
) -> u64 {
    let total = |all: &[DirectionCounters]| -> u64 { all.iter().map(&field).sum() };
    total(after) - total(before)
}

fn print_header() -> Result<()> {
    crate::print_stdout(&format!(
        "{:<24} {:<5} {:>7} {:>10} {:>19} {:>9} {:>8} {:>8} {:>17}\n",
        "scenario",
        "cc",
        "streams",
        "Mbps",
        "per stream min-max",
        "srtt ms",
        "min ms",
        "retrans",
        "lost/queue/emu"
    ))
}

fn print_row(row: &Row) -> Result<()> {
    crate::print_stdout(&format!(
        "{:<24} {:<5} {:>7} {:>10.1} {:>19} {:>9.1} {:>8} {:>8} {:>17}\n",
        row.scenario,
        row.congestion.name(),
        row.streams,
        row.goodput_mbps,
        format!("{:.1}-{:.1}", row.stream_mbps_min, row.stream_mbps_max),
        row.smoothed_rtt_ms_mean,
        row.min_rtt_ms.map_or("-".into(), |ms| format!("{ms:.1}")),
        row.retransmitted_segments,
        format!(
            "{}/{}/{}",
            row.lost, row.queue_dropped, row.emulator_dropped
        ),
    ))
}

/// Runs every (congestion, streams) transfer from `from` to `to` on one network.
fn matrix(
    network: &Network,
    from: &str,
    to: &str,
    args: &TransferArgs,
    rows: &mut Vec<Row>,
) -> Result<()> {
    let duration = Duration::try_from_secs_f64(args.seconds)
        .with_context(|| format!("--seconds {} is not a duration", args.seconds))?;
    for &congestion in &args.congestion {
        for &streams in &args.streams {
            let config = TransferConfig {
                streams,
                congestion,
                duration,
            };
            let before = network.counters();
            let report = measure::transfer(network, from, to, &config).with_context(|| {
                format!(
                    "{congestion} transfer over {streams} streams in {}",
                    network.scenario().name
                )
            })?;
            let row = row(network, from, to, &config, &before, report);
            print_row(&row)?;
            rows.push(row);
        }
    }
    Ok(())
}

fn write_json(path: Option<&Path>, rows: &[Row]) -> Result<()> {
    if let Some(path) = path {
        let json = serde_json::to_string_pretty(rows)?;
        std::fs::write(path, json).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn capacity(args: &TransferArgs) -> Result<()> {
    let mut plain = Link::new("a", "b");
    plain.emulate = false;
    let scenarios = [
        Scenario::point_to_point("plain-veth", plain),
        Scenario::point_to_point("emulator", Link::new("a", "b")),
    ];
    print_header()?;
    let mut rows = Vec::new();
    for scenario in &scenarios {
        let network = Network::up(scenario)?;
        matrix(&network, "a", "b", args, &mut rows)?;
        network.down()?;
    }
    write_json(args.json.as_deref(), &rows)
}

fn exec(path: &Path, command: &[String]) -> Result<()> {
    let scenario = Scenario::load(path)?;
    let network = Network::up(&scenario)?;
    let mut child = std::process::Command::new(&command[0]);
    child.args(&command[1..]);
    for region in &scenario.regions {
        let key = region_variable(&region.name);
        child.env(
            format!("AURORA_WAN_{key}_NETNS"),
            network.netns(&region.name)?,
        );
        child.env(
            format!("AURORA_WAN_{key}_ADDRESS"),
            network.address(&region.name)?.to_string(),
        );
    }
    let status = child
        .status()
        .with_context(|| format!("`{}` could not start", command[0]))?;
    network.down()?;
    if !status.success() {
        bail!("`{}` ended with {status}", command.join(" "));
    }
    Ok(())
}

/// A region's name as it appears in `aurora wan exec`'s environment variables.
fn region_variable(region: &str) -> String {
    region
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect()
}

/// Loads a scenario with every rate multiplied by `rate_scale`.
pub(crate) fn load_scaled(path: &Path, rate_scale: f64) -> Result<Scenario> {
    let scenario = Scenario::load(path)?;
    if rate_scale == 1.0 {
        return Ok(scenario);
    }
    tracing::warn!(rate_scale, "every rate of the scenario is scaled");
    Ok(scenario.scale_rates(rate_scale)?)
}

/// The regions to measure between: as given, else the first and second.
pub(crate) fn endpoints(
    scenario: &Scenario,
    from: Option<String>,
    to: Option<String>,
) -> Result<(String, String)> {
    let region = |given: Option<String>, index: usize| -> Result<String> {
        let name = match given {
            Some(name) => name,
            None => scenario
                .regions
                .get(index)
                .map(|region| region.name.clone())
                .with_context(|| format!("scenario {} has one region", scenario.name))?,
        };
        if scenario.region_index(&name).is_none() {
            bail!("scenario {} has no region {name:?}", scenario.name);
        }
        Ok(name)
    };
    let (from, to) = (region(from, 0)?, region(to, 1)?);
    if from == to {
        bail!("--from and --to are both {from}");
    }
    Ok((from, to))
}

fn bench(
    path: &Path,
    from: Option<String>,
    to: Option<String>,
    rate_scale: f64,
    args: &TransferArgs,
) -> Result<()> {
    let scenario = load_scaled(path, rate_scale)?;
    let (from, to) = endpoints(&scenario, from, to)?;
    let points = match scenario.sweep_points() {
        points if points.is_empty() => vec![scenario],
        points => points,
    };
    print_header()?;
    let mut rows = Vec::new();
    for point in &points {
        let network = Network::up(point)?;
        matrix(&network, &from, &to, args, &mut rows)?;
        network.down()?;
    }
    write_json(args.json.as_deref(), &rows)
}

fn probe(
    path: &Path,
    from: Option<String>,
    to: Option<String>,
    round_trips: usize,
    datagrams: usize,
) -> Result<()> {
    let scenario = Scenario::load(path)?;
    let (from, to) = endpoints(&scenario, from, to)?;
    let network = Network::up(&scenario)?;
    let mut samples = measure::round_trips(&network, &from, &to, round_trips)?;
    samples.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let delivery = measure::datagram_delivery(&network, &from, &to, datagrams)?;
    network.down()?;
    crate::print_stdout(&format!(
        "{from} -> {to}: TCP round trip min {:.2} ms, median {:.2} ms, max {:.2} ms \
         ({round_trips} exchanges); {} of {} datagrams lost ({:.3}%)\n",
        ms(samples[0]),
        ms(samples[samples.len() / 2]),
        ms(samples[samples.len() - 1]),
        delivery.sent - delivery.received,
        delivery.sent,
        100.0 * delivery.loss(),
    ))
}
