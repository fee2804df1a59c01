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

mod encodings;
mod fan_out;
mod setup;
mod streams;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use aurora_delta::OwnedTensor;
use aurora_proto::frame::MAX_STREAMS;
use aurora_wan::measure::Congestion;
use clap::{Args, Subcommand, ValueEnum};
use serde::Serialize;

use crate::fleet::BenchSecurity;
use encodings::encodings;
use fan_out::fan_out;
use streams::{StreamModes, streams_bench};
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
        /// Each transfer once per value, one right after the other: what TLS costs.
        #[arg(long, value_delimiter = ',', default_value = "plaintext,tls")]
        security: Vec<TransportSecurity>,
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
        /// Each mode once per value, one right after the other: what TLS costs.
        #[arg(long, value_delimiter = ',', default_value = "plaintext,tls")]
        security: Vec<TransportSecurity>,
    },
}

/// How the benchmark's nodes secure their connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum TransportSecurity {
    /// Plain TCP with a token (`--insecure-plaintext`).
    Plaintext,
    /// Mutual TLS 1.3, each node with a certificate of a fleet CA made for the run.
    Tls,
}

impl TransportSecurity {
    fn name(self) -> &'static str {
        match self {
            TransportSecurity::Plaintext => "plaintext",
            TransportSecurity::Tls => "tls",
        }
    }

    fn bench(self) -> Result<BenchSecurity> {
        Ok(match self {
            TransportSecurity::Plaintext => BenchSecurity::InsecurePlaintext,
            TransportSecurity::Tls => BenchSecurity::tls()?,
        })
    }
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
            security,
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
                security,
            };
            streams_bench(&common, &modes)
        }
        TransferCommand::FanOut {
            common,
            actors,
            streams,
            security,
        } => {
            check_streams(&[streams])?;
            fan_out(&common, actors, streams, &security)
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
