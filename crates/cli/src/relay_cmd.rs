//! `aurora relay`: a region's relay, a node of the segment protocol (docs/wire-protocol.md
//! §8) that forwards each verified segment to the region's actors as it arrives. It holds
//! no weights: it needs neither the model's memory nor, unless told to keep a snapshot
//! for its region's joins (`--snapshot-dir`), its disk.

use std::io::Write;
use std::net::SocketAddr;
use std::num::NonZeroU8;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use aurora_checkpoint::{FileImages, MappedFile};
use aurora_node::{RelayNode, RelaySettings};
use aurora_proto::{Role, Weights};
use aurora_transport::{NodeConfig, NodeHandle, NodeStatus, SocketOptions};
use clap::Args;
use serde::Deserialize;

use crate::limits_file::NodeLimits;
use crate::signals::StopSignals;
use crate::trust_args::TrustArgs;

/// Settings of a relay or an actor, from flags or a TOML file with the same keys (flags
/// win).
#[derive(Args, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct NodeArgs {
    /// A TOML file with any of these settings.
    #[arg(long)]
    #[serde(skip)]
    config: Option<PathBuf>,
    /// This node's id, unique in the run.
    #[arg(long)]
    id: Option<String>,
    #[arg(long)]
    region: Option<String>,
    /// Upstreams in order of preference (repeat the flag): the region's relay first,
    /// then the hub or a peer relay to fall back to.
    #[arg(long = "upstream")]
    #[serde(default)]
    upstreams: Vec<SocketAddr>,
    /// The weights an actor starts from (a safetensors file) ...
    #[arg(long)]
    weights: Option<PathBuf>,
    /// ... and their version.
    #[arg(long)]
    version: Option<u64>,
    /// Start an actor with no weights: take the newest snapshot an upstream (a hub with
    /// a store) offers over the wire, then follow the deltas after it. Instead of
    /// --weights and --version.
    #[arg(long)]
    #[serde(default)]
    join: bool,
    /// Parallel TCP streams per upstream session (the upper bound when tuned); at least 1.
    #[arg(long)]
    streams: Option<NonZeroU8>,
    /// Tune the stream count from measured goodput every this many milliseconds.
    #[arg(long)]
    tune_ms: Option<u64>,
    /// Go back to the first upstream this many milliseconds (a quarter more or less)
    /// after settling on another, between versions; 0: never (default 30000).
    #[arg(long)]
    return_after_ms: Option<u64>,
    /// A relay: send the actors away (to their next upstream) after this many
    /// milliseconds without a working upstream, until it has one again; 0: never
    /// (default 30000).
    #[arg(long)]
    suspend_after_ms: Option<u64>,
    /// TCP congestion control for every socket (cubic, bbr, ...; Linux).
    #[arg(long)]
    congestion: Option<String>,
    /// The trainer's public key (PEM): every version and commit must carry its
    /// signature. Required with certificates (--ca, --cert, --key), unless
    /// --insecure-unsigned.
    #[arg(long)]
    trainer_key: Option<PathBuf>,
    /// INSECURE: with certificates but no --trainer-key, take versions nobody signed; a
    /// compromised relay upstream can then hand this node any weights.
    #[arg(long, conflicts_with = "trainer_key")]
    #[serde(default)]
    insecure_unsigned: bool,
    /// The run to serve (32 hex digits, as `aurora hub` prints it): upstreams of another
    /// run are refused. Without it the run is learned from the trainer's own hub (its
    /// certificate says it is the trainer), never from a relay.
    #[arg(long)]
    run_id: Option<aurora_delta::RunId>,
    /// A TOML file of limits beyond the defaults (its `[transport]` table: connection
    /// caps, the handshake timeout, `max_held_bytes`; see docs/security.md).
    #[arg(long)]
    limits: Option<PathBuf>,
    /// Where an actor keeps the model's image: an unnamed file in this directory,
    /// mapped into memory, so the node's own memory stays flat whatever the model's
    /// size (the file's space goes back when the node ends). Default: the system's
    /// temporary directory.
    #[arg(long)]
    image_dir: Option<PathBuf>,
    /// A relay: keep the snapshot it starts from in an unnamed file in this directory
    /// (the model's size on disk, none of it in memory) and serve it to the region's
    /// actors that join with no weights, so that the region's joins cross the upstream
    /// link once. Without it, each joiner fetches its own snapshot from the hub.
    #[arg(long)]
    snapshot_dir: Option<PathBuf>,
    #[command(flatten)]
    #[serde(skip)]
    trust: TrustArgs,
}

/// How a transport actor (`aurora actor`) starts: its settings, and the weights it starts from.
pub(crate) struct ActorStart {
    pub config: NodeConfig,
    /// None: the node joins over the wire (--join).
    pub weights: Option<Weights>,
}

impl NodeArgs {
    /// The settings of a relay listening on `transport_listen`.
    pub(crate) fn relay(self, transport_listen: SocketAddr) -> Result<RelaySettings> {
        let args = self.merged()?;
        if args.weights.is_some() || args.version.is_some() || args.join || args.image_dir.is_some()
        {
            bail!("a relay holds no weights: drop --weights, --version, --join and --image-dir");
        }
        // Files are checked before the node's secrets are read.
        let limits = NodeLimits::load(args.limits.as_deref())?.transport;
        let trust = args.trust.load()?;
        let mut settings = RelaySettings::new(transport_listen, args.upstreams, trust);
        settings.id = args.id;
        settings.region = args.region;
        if let Some(streams) = args.streams {
            settings.streams = streams.get();
        }
        settings.tune_interval = args.tune_ms.map(Duration::from_millis);
        if let Some(ms) = args.return_after_ms {
            settings.return_after = never_if_zero(ms);
        }
        if let Some(ms) = args.suspend_after_ms {
            settings.suspend_after = never_if_zero(ms);
        }
        settings.socket = SocketOptions {
            congestion: args.congestion,
        };
        settings.transport_limits = limits;
        settings.snapshot_dir = args.snapshot_dir;
        settings.run = args.run_id;
        settings.insecure_unsigned = args.insecure_unsigned;
        settings.trainer_key = trainer_key(args.trainer_key, args.insecure_unsigned)?;
        Ok(settings)
    }

    /// The settings of a transport actor, and the weights it starts from.
    pub(crate) fn actor(self) -> Result<ActorStart> {
        let mut args = self.merged()?;
        if args.upstreams.is_empty() {
            bail!("at least one --upstream is required");
        }
        if args.suspend_after_ms.is_some() {
            bail!("--suspend-after-ms is a relay's setting: an actor has no subscribers");
        }
        if args.snapshot_dir.is_some() {
            bail!("--snapshot-dir is a relay's setting: an actor serves no joiners");
        }
        let start = if args.join {
            if args.weights.is_some() || args.version.is_some() {
                bail!("--join takes the weights from an upstream: drop --weights and --version");
            }
            None
        } else {
            let path = args.weights.take().context(
                "--weights is required (or --join, to take a snapshot from an upstream)",
            )?;
            Some((path, args.version.context("--version is required")?))
        };
        // Files are checked before the node's secrets are read.
        let limits = NodeLimits::load(args.limits.as_deref())?.transport;
        let image_dir = args.image_dir.take().unwrap_or_else(std::env::temp_dir);
        // Checked now: the first image is made only when a snapshot arrives.
        if !image_dir.is_dir() {
            bail!("--image-dir {} is not a directory", image_dir.display());
        }
        let trust = args.trust.load()?;
        let identity = trust.identity_as(Role::Actor, args.id, args.region)?;
        let mut config = NodeConfig::new(identity, trust.transport());
        config.upstreams = args.upstreams;
        if let Some(streams) = args.streams {
            config.streams = streams.get();
        }
        config.tune_interval = args.tune_ms.map(Duration::from_millis);
        if let Some(ms) = args.return_after_ms {
            config.return_after = never_if_zero(ms);
        }
        config.socket = SocketOptions {
            congestion: args.congestion,
        };
        config.limits = limits;
        config.insecure_unsigned = args.insecure_unsigned;
        config.run = args.run_id;
        config.trainer_key = trainer_key(args.trainer_key, args.insecure_unsigned)?;
        tracing::info!(dir = %image_dir.display(), "the model's image lives in a mapped file");
        config.images = Arc::new(FileImages::new(image_dir));
        let weights = start
            .map(|(path, version)| {
                let file = MappedFile::open(&path)?;
                Weights::from_checkpoint(&file.checkpoint()?, version, config.images.clone())
                    .with_context(|| format!("{} is not a checkpoint", path.display()))
            })
            .transpose()?;
        Ok(ActorStart { config, weights })
    }

    /// The file's settings (if any) under the flags.
    fn merged(self) -> Result<NodeArgs> {
        let file = match &self.config {
            Some(path) => read_config(path)?,
            None => NodeArgs::default(),
        };
        Ok(NodeArgs {
            config: None,
            id: self.id.or(file.id),
            region: self.region.or(file.region),
            upstreams: if self.upstreams.is_empty() {
                file.upstreams
            } else {
                self.upstreams
            },
            weights: self.weights.or(file.weights),
            version: self.version.or(file.version),
            join: self.join || file.join,
            streams: self.streams.or(file.streams),
            tune_ms: self.tune_ms.or(file.tune_ms),
            return_after_ms: self.return_after_ms.or(file.return_after_ms),
            suspend_after_ms: self.suspend_after_ms.or(file.suspend_after_ms),
            congestion: self.congestion.or(file.congestion),
            trainer_key: self.trainer_key.or(file.trainer_key),
            insecure_unsigned: self.insecure_unsigned || file.insecure_unsigned,
            run_id: self.run_id.or(file.run_id),
            limits: self.limits.or(file.limits),
            image_dir: self.image_dir.or(file.image_dir),
            snapshot_dir: self.snapshot_dir.or(file.snapshot_dir),
            trust: self.trust,
        })
    }
}

fn never_if_zero(ms: u64) -> Option<Duration> {
    (ms > 0).then(|| Duration::from_millis(ms))
}

/// The trainer's public key from `path`, which contradicts `insecure_unsigned`.
fn trainer_key(
    path: Option<PathBuf>,
    insecure_unsigned: bool,
) -> Result<Option<aurora_delta::VerifyingKey>> {
    match path {
        Some(_) if insecure_unsigned => {
            bail!("--trainer-key and --insecure-unsigned contradict each other")
        }
        Some(path) => {
            let key = aurora_trust::signing::load_public_key(&path)?;
            let fingerprint = aurora_delta::key_fingerprint(&key);
            tracing::info!(key = %fingerprint, "taking only versions the trainer key signed");
            Ok(Some(key))
        }
        None => Ok(None),
    }
}

fn read_config(path: &Path) -> Result<NodeArgs> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// How long a stopping relay waits for its subscribers to be sent away.
const STOP_DEADLINE: Duration = Duration::from_secs(10);

#[derive(Args)]
pub struct RelayArgs {
    /// Address actors connect to (port 0 picks one; the bound address is printed)
    /// [default: 127.0.0.1:7400].
    #[arg(long)]
    transport_listen: Option<SocketAddr>,
    /// The old name of --transport-listen.
    #[arg(long, hide = true, conflicts_with = "transport_listen")]
    listen: Option<SocketAddr>,
    #[command(flatten)]
    node: NodeArgs,
}

pub fn run(args: RelayArgs) -> Result<()> {
    let listen = crate::renamed(
        (args.transport_listen, "--transport-listen"),
        (args.listen, "--listen"),
    );
    let settings = args
        .node
        .relay(listen.unwrap_or(SocketAddr::from(([127, 0, 0, 1], 7400))))?;
    crate::runtime(None)?.block_on(async {
        let mut stop = StopSignals::new()?;
        let keeps_snapshot = settings.snapshot_dir.is_some();
        let relay = RelayNode::start(settings).await?;
        // One line on stdout announces readiness to scripts and tests; logs go to stderr.
        println!("listening on {}", relay.transport_address());
        std::io::stdout().flush()?;
        let held = async {
            if keeps_snapshot {
                show_snapshot_progress(relay.transport(), "taking the snapshot to keep", |s| {
                    s.kept_snapshot.is_some()
                })
                .await;
            }
            report_held(relay.transport()).await
        };
        tokio::select! {
            held = held => held,
            signal = stop.recv() => stop_relay(&relay, signal).await,
        }
    })
}

/// A relay's graceful stop on `signal`: its actors move to their next upstream now, not
/// when its sockets close. Prints `stopped`.
pub(crate) async fn stop_relay(relay: &RelayNode, signal: &str) -> Result<()> {
    tracing::info!(
        signal,
        "asked to stop: sending the subscribers to their next upstream"
    );
    let stopped = relay
        .stop(format!("the relay is stopping ({signal})"), STOP_DEADLINE)
        .await?;
    if stopped.subscribers_left > 0 {
        tracing::warn!(
            subscribers = stopped.subscribers_left,
            "subscribers still connected after {STOP_DEADLINE:?}: stopping"
        );
    }
    println!("stopped");
    std::io::stdout().flush()?;
    Ok(())
}

/// Shows, on a terminal, the bytes a node takes from its upstreams until `done` holds of
/// its status (a joiner's snapshot until its first activation, a relay's kept
/// snapshot), then clears the line for what the node prints next.
pub(crate) async fn show_snapshot_progress(
    node: &NodeHandle,
    what: &'static str,
    done: fn(&NodeStatus) -> bool,
) {
    let mut status = node.watch();
    let bar = indicatif::ProgressBar::new_spinner();
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} {msg}: {bytes} from the upstream ({bytes_per_sec}) {elapsed}",
        )
        .expect("a valid template"),
    );
    bar.set_message(what);
    bar.enable_steady_tick(Duration::from_millis(120));
    loop {
        let (received, finished) = {
            let status = status.borrow_and_update();
            let received = status.receiver.as_ref().map_or(0, |r| r.segment_bytes);
            (received, done(&status))
        };
        if finished {
            break;
        }
        bar.set_position(received);
        if status.changed().await.is_err() {
            break;
        }
    }
    bar.finish_and_clear();
}

/// Prints `holds VERSION` on stdout as each version is complete here (verified, and
/// forwarded as it arrived), until the relay stops.
async fn report_held(relay: &NodeHandle) -> Result<()> {
    let mut status = relay.watch();
    let mut shown = 0;
    loop {
        // Only what is new since the last change: the status keeps the recent versions.
        let new: Vec<u64> = status
            .borrow_and_update()
            .completed
            .iter()
            .copied()
            .filter(|&version| version > shown)
            .collect();
        for &version in &new {
            println!("holds {version}");
            shown = version;
        }
        std::io::stdout().flush()?;
        if status.changed().await.is_err() {
            bail!("the node stopped");
        }
    }
}

/// Prints `active VERSION HASH` on stdout at every activation, until the node stops.
pub(crate) async fn report_activations(node: &NodeHandle) -> Result<()> {
    let mut status = node.watch();
    let mut shown = None;
    loop {
        let active = status.borrow_and_update().active;
        if active != shown
            && let Some(active) = active
        {
            println!("active {} {}", active.version, active.hash);
            std::io::stdout().flush()?;
            shown = Some(active);
        }
        if status.changed().await.is_err() {
            bail!("the node stopped");
        }
    }
}
