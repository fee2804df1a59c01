//! `aurora run`: a real RL job on this machine. The trainer node (control plane,
//! transport hub, store, GRPO trainer), one relay per region and the actors run as
//! separate processes of this binary (`aurora run-node ...`), talking over loopback TCP
//! exactly as they would across regions. This process starts them, applies the scripted
//! fault plan, shows progress, and writes `metrics.jsonl` and `report.html`.

mod actor;
pub mod config;
pub mod report;
mod trainer;
pub(crate) mod trust;
mod warmup;

use std::collections::BTreeMap;
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use crate::TOKEN_VARIABLE;
use crate::signals::StopSignals;
use crate::trust_args::TrustArgs;
use anyhow::{Context, Result, bail, ensure};
use aurora_control::Config;
use aurora_node::{NodeTrust, RelayNode, RelaySettings};
use aurora_wan::{Network, Scenario};
use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};

use crate::procs::{self, Line, Node, expect_line};
use config::{Fault, Preset, RunConfig, SyncMode};
use report::StepRecord;

/// Longest wait for a node to start (the warm-up, on a first run, included).
const START_TIMEOUT: Duration = Duration::from_secs(600);
/// Longest wait for one step.
const STEP_TIMEOUT: Duration = Duration::from_secs(300);
/// Longest wait for an actor asked to stop to leave the fleet and exit.
const ACTOR_STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest wait for a relay asked to stop (it gives its subscribers 10 s to move on).
const RELAY_STOP_TIMEOUT: Duration = Duration::from_secs(20);
/// Longest wait for a trainer that announced its stop to exit (it waits up to 30 s for
/// its actors to leave).
const TRAINER_STOP_TIMEOUT: Duration = Duration::from_secs(40);

#[derive(Args)]
pub struct RunArgs {
    /// The settings to start from: `default` learns within minutes; `sparse` is the
    /// paper's regime (a 50M-parameter model, at most 2% of its elements changed per
    /// step), for comparing delta with full sync.
    #[arg(long, value_enum, default_value = "default", conflicts_with = "resume")]
    preset: Preset,
    /// Settings to override the preset's (TOML; see `RunConfig`).
    #[arg(long, conflicts_with = "resume")]
    config: Option<PathBuf>,
    /// The run directory: settings, logs, store, metrics, report. Its warm-up cache is
    /// kept between runs; everything else is started afresh, unless `--resume`.
    #[arg(long, default_value = "runs/default")]
    dir: PathBuf,
    /// Carry on the run in `--dir` that stopped (its trainer, control plane and store as
    /// they were; relays start afresh and actors join from a snapshot), with its
    /// settings; `--steps` may extend it.
    #[arg(long)]
    resume: bool,
    /// Ship each version as a sparse delta or as the whole checkpoint.
    #[arg(long, value_enum, conflicts_with = "resume")]
    sync: Option<SyncMode>,
    /// RL steps (overrides the settings).
    #[arg(long)]
    steps: Option<u64>,
}

/// The nodes, started by `aurora run` (hidden from help).
#[derive(Subcommand)]
pub enum NodeCommand {
    Trainer {
        #[arg(long)]
        dir: PathBuf,
        /// Its control API (port 0: any free one; a restarted trainer takes its old one).
        #[arg(long, default_value = "127.0.0.1:0")]
        control_listen: SocketAddr,
        /// Its transport hub (port 0: any free one).
        #[arg(long, default_value = "127.0.0.1:0")]
        transport_listen: SocketAddr,
        #[command(flatten)]
        trust: TrustArgs,
    },
    Relay {
        #[arg(long)]
        dir: PathBuf,
        /// Where its actors connect (port 0: any free one).
        #[arg(long, default_value = "127.0.0.1:0")]
        transport_listen: SocketAddr,
        #[arg(long)]
        region: String,
        #[arg(long)]
        upstream: SocketAddr,
        #[command(flatten)]
        trust: TrustArgs,
    },
    Actor {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long)]
        id: u64,
        #[arg(long)]
        region: String,
        #[arg(long)]
        control: SocketAddr,
        /// Transport upstreams in order of preference.
        #[arg(long, required = true)]
        upstream: Vec<SocketAddr>,
        #[command(flatten)]
        trust: TrustArgs,
    },
}

/// The trainer's signing key in a run directory, and its public half that every relay
/// and actor of the run pins: `aurora run` is signed by default (docs/security.md). The
/// names `aurora certs init` gives them.
const SIGNING_KEY_FILE: &str = "signing.key";
const TRAINER_KEY_FILE: &str = "signing.pub";
/// What an earlier release called them, renamed when such a run is resumed.
const OLD_KEY_FILES: [(&str, &str); 2] = [
    ("trainer.key", SIGNING_KEY_FILE),
    ("trainer.pub", TRAINER_KEY_FILE),
];

/// Generates the run's trainer key unless the directory holds one (a resumed run keeps
/// its key, so what its store holds stays verifiable).
pub(crate) fn ensure_trainer_key(run_dir: &Path) -> Result<()> {
    for (old, new) in OLD_KEY_FILES {
        let (old, new) = (run_dir.join(old), run_dir.join(new));
        if old.exists() && !new.exists() {
            std::fs::rename(&old, &new)
                .with_context(|| format!("renaming {} to {}", old.display(), new.display()))?;
            tracing::info!(from = %old.display(), to = %new.display(), "the signing key's file renamed");
        }
    }
    let private = run_dir.join(SIGNING_KEY_FILE);
    if private.exists() {
        return Ok(());
    }
    aurora_trust::signing::create_key_pair(&private, &run_dir.join(TRAINER_KEY_FILE))?;
    Ok(())
}

/// Where the key the run's trainer signs with is kept ...
pub(crate) fn signing_key_path(run_dir: &Path) -> PathBuf {
    run_dir.join(SIGNING_KEY_FILE)
}

/// ... and its public half, which every relay and actor of the run pins.
pub(crate) fn trainer_key_path(run_dir: &Path) -> PathBuf {
    run_dir.join(TRAINER_KEY_FILE)
}

/// The key the run's trainer signs with.
fn signing_key(run_dir: &Path) -> Result<Arc<aurora_delta::SigningKey>> {
    Ok(Arc::new(aurora_trust::signing::load_signing_key(
        &signing_key_path(run_dir),
    )?))
}

/// The key every relay and actor of the run pins.
fn trainer_key(run_dir: &Path) -> Result<aurora_delta::VerifyingKey> {
    Ok(aurora_trust::signing::load_public_key(&trainer_key_path(
        run_dir,
    ))?)
}

/// The control plane's settings for a run of seconds-long steps on one machine: short
/// leases and a short heartbeat timeout, so a killed actor's prompts return quickly.
pub fn control_config() -> Config {
    let mut config = Config::default();
    config.lease.initial_ms = 20_000;
    config.lease.min_ms = 3_000;
    config.lease.max_ms = 60_000;
    config.heartbeat_timeout_ms = 4_000;
    config.preemption_grace_ms = 2_000;
    config.partial_batch = None;
    config
}

pub fn run_node(command: NodeCommand) -> Result<()> {
    match command {
        NodeCommand::Trainer {
            dir,
            control_listen,
            transport_listen,
            trust,
        } => trainer::run(
            &dir,
            trainer::Listen {
                control: control_listen,
                transport: transport_listen,
            },
            trust.load()?,
        ),
        NodeCommand::Relay {
            dir,
            transport_listen,
            region,
            upstream,
            trust,
        } => relay(&dir, transport_listen, region, upstream, trust.load()?),
        NodeCommand::Actor {
            dir,
            id,
            region,
            control,
            upstream,
            trust,
        } => actor::run(actor::ActorArgs {
            run_dir: dir,
            id,
            region,
            control,
            upstreams: upstream,
            trust: trust.load()?,
        }),
    }
}

fn relay(
    run_dir: &Path,
    listen: SocketAddr,
    region: String,
    upstream: SocketAddr,
    trust: NodeTrust,
) -> Result<()> {
    let config = RunConfig::load(&run_dir.join("config.toml"))?;
    let mut settings = RelaySettings::new(listen, vec![upstream], trust);
    settings.id = Some(format!("relay-{region}"));
    settings.streams = config.streams;
    settings.trainer_key = Some(trainer_key(run_dir)?);
    // It holds no weights: it keeps the hub's newest snapshot in a file and serves it to
    // the region's actors as they join, then forwards the deltas after it.
    let snapshots = run_dir.join("relays").join(&region);
    std::fs::create_dir_all(&snapshots)
        .with_context(|| format!("creating {}", snapshots.display()))?;
    settings.snapshot_dir = Some(snapshots);
    settings.region = Some(region);
    crate::runtime(Some(1))?.block_on(async move {
        let mut stop = StopSignals::of_run_node()?;
        let relay = RelayNode::start(settings).await?;
        println!("transport {}", relay.transport_address());
        std::io::stdout().flush()?;
        let signal = stop.recv().await;
        crate::relay_cmd::stop_relay(&relay, signal).await
    })
}

/// Every node's environment, beside `AURORA_LOG`, which nodes inherit (info when unset).
/// One compute thread each: the nodes already share the machine's cores, and extra rayon
/// workers would only spin (results do not depend on the thread count; see the engine's
/// documentation).
fn node_env(token: &str) -> [(&str, &str); 2] {
    [(TOKEN_VARIABLE, token), ("RAYON_NUM_THREADS", "1")]
}

/// The processes of a run, by role.
/// Where the nodes run: on loopback, or in the namespaces of an emulated WAN, which stays
/// up while this lives (dropping it takes the namespaces down).
struct Placement {
    network: Option<Network>,
    trainer_region: String,
}

impl Placement {
    fn new(config: &RunConfig) -> Result<Placement> {
        let Some(wan) = &config.network else {
            return Ok(Placement {
                network: None,
                trainer_region: "hub".into(),
            });
        };
        let scenario = Scenario::load(&wan.scenario)?;
        let names: Vec<&str> = scenario.regions.iter().map(|r| r.name.as_str()).collect();
        let needed =
            std::iter::once(&wan.trainer_region).chain(config.regions.iter().map(|r| &r.name));
        for region in needed {
            ensure!(
                scenario.region_index(region).is_some(),
                "region '{region}' is not a region of scenario {} ({})",
                scenario.name,
                names.join(", ")
            );
        }
        if let Some(reason) = aurora_wan::unavailable_reason() {
            bail!("cannot emulate scenario {}: {reason}", scenario.name);
        }
        let network = Network::up(&scenario)
            .with_context(|| format!("bringing up scenario {}", scenario.name))?;
        tracing::info!(scenario = %scenario.name, "nodes run in the emulated WAN");
        Ok(Placement {
            network: Some(network),
            trainer_region: wan.trainer_region.clone(),
        })
    }

    /// Where each region's nodes run, for the run's output; None on loopback.
    fn describe(&self, config: &RunConfig) -> Result<Option<String>> {
        let Some(network) = &self.network else {
            return Ok(None);
        };
        let mut placed = vec![format!(
            "trainer in {} ({})",
            self.trainer_region,
            network.address(&self.trainer_region)?
        )];
        for region in &config.regions {
            placed.push(format!(
                "region {} at {}",
                region.name,
                network.address(&region.name)?
            ));
        }
        Ok(Some(format!(
            "emulated WAN {}: {}",
            network.scenario().name,
            placed.join(", ")
        )))
    }

    fn trainer_region(&self) -> &str {
        &self.trainer_region
    }

    /// The command that starts a node of `region`: this binary, inside the region's
    /// namespace when there is a network (`ip netns exec` execs it, so the child's pid
    /// is the node's own and killing the child kills the node).
    fn command(&self, region: &str) -> Result<Command> {
        let exe = std::env::current_exe().context("locating the aurora binary")?;
        Ok(match &self.network {
            Some(network) => {
                let exe = exe
                    .to_str()
                    .context("the aurora binary's path is not UTF-8")?;
                network.command(region, exe)?
            }
            None => Command::new(exe),
        })
    }

    /// The address a listening node of `region` binds.
    fn bind(&self, region: &str) -> Result<IpAddr> {
        Ok(match &self.network {
            Some(network) => network.address(region)?.into(),
            None => Ipv4Addr::LOCALHOST.into(),
        })
    }
}

struct Fleet<'a> {
    placement: &'a Placement,
    run_dir: PathBuf,
    token: String,
    lines: mpsc::Sender<Line>,
    control: SocketAddr,
    hub_transport: SocketAddr,
    relays: BTreeMap<String, (Node, SocketAddr)>,
    actors: BTreeMap<u64, (Node, String)>,
    next_actor: u64,
}

impl Fleet<'_> {
    fn env(&self) -> [(&str, &str); 2] {
        node_env(&self.token)
    }

    /// The graceful stop, once the trainer has stopped between versions: every actor
    /// leaves the fleet (its leases back to the pool), then every relay sends its
    /// subscribers on.
    fn stop(&mut self) -> Result<()> {
        stop_all(
            self.actors.values_mut().map(|(node, _)| node),
            ACTOR_STOP_TIMEOUT,
        )?;
        stop_all(
            self.relays.values_mut().map(|(node, _)| node),
            RELAY_STOP_TIMEOUT,
        )
    }

    fn start_actor(&mut self, region: &str) -> Result<u64> {
        let id = self.next_actor;
        self.next_actor += 1;
        let mut args = vec![
            "run-node".to_string(),
            "actor".into(),
            "--dir".into(),
            self.run_dir.display().to_string(),
            "--id".into(),
            id.to_string(),
            "--region".into(),
            region.into(),
            "--control".into(),
            self.control.to_string(),
        ];
        args.extend(trust::node_args(
            &self.run_dir,
            aurora_trust::Role::Actor,
            &id.to_string(),
            region,
        )?);
        if let Some((_, relay)) = self.relays.get(region) {
            args.extend(["--upstream".into(), relay.to_string()]);
        }
        args.extend(["--upstream".into(), self.hub_transport.to_string()]);
        let node = Node::spawn(
            &format!("actor-{id}"),
            self.placement.command(region)?,
            &args,
            &self.env(),
            &self.run_dir,
            self.lines.clone(),
        )?;
        self.actors.insert(id, (node, region.to_string()));
        Ok(id)
    }
}

pub fn run(args: RunArgs) -> Result<()> {
    let mut config = match &args.config {
        _ if args.resume => RunConfig::load(&args.dir.join("config.toml"))
            .context("resuming needs the run directory of a run that started")?,
        Some(path) => RunConfig::load_over(&args.preset.config(), path)?,
        None => args.preset.config(),
    };
    if let Some(sync) = args.sync {
        config.sync = sync;
    }
    if let Some(steps) = args.steps {
        config.steps = steps;
    }
    config.validate()?;
    let run_dir = args.dir.clone();
    if !args.resume {
        prepare(&run_dir)?;
    }
    let run_dir = run_dir.canonicalize()?;
    config.save(&run_dir.join("config.toml"))?;
    ensure_trainer_key(&run_dir)?;
    trust::ensure_ca(&run_dir)?;
    let token = blake3::hash(format!("{:?}{}", Instant::now(), std::process::id()).as_bytes())
        .to_hex()
        .to_string();

    let started = Instant::now();
    let (sender, lines) = mpsc::channel();
    let env = node_env(&token);
    let placement = Placement::new(&config)?;
    let trainer_region = placement.trainer_region();
    let spawn_trainer = |ports: Option<(u16, u16)>| -> Result<Node> {
        let mut args: Vec<String> = vec![
            "run-node".into(),
            "trainer".into(),
            "--dir".into(),
            run_dir.display().to_string(),
        ];
        let bind = placement.bind(trainer_region)?;
        let (control, transport) = ports.unwrap_or((0, 0));
        args.extend([
            "--control-listen".into(),
            SocketAddr::new(bind, control).to_string(),
            "--transport-listen".into(),
            SocketAddr::new(bind, transport).to_string(),
        ]);
        args.extend(trust::node_args(
            &run_dir,
            aurora_trust::Role::Trainer,
            "trainer",
            trainer_region,
        )?);
        let command = placement.command(trainer_region)?;
        Node::spawn("trainer", command, &args, &env, &run_dir, sender.clone())
    };
    let mut trainer = spawn_trainer(None)?;
    let progress = ProgressBar::new(config.steps);
    progress.set_style(ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} {msg}",
    )?);
    progress.enable_steady_tick(Duration::from_millis(200));
    progress.set_message("warm-up");
    if let Some(placed) = placement.describe(&config)? {
        say(&progress, placed);
    }
    let show_warmup = |line: Line| {
        if let Some(rest) = line.text.strip_prefix("warmup ") {
            progress.set_message(format!("warm-up {rest}"));
        } else if let Some(json) = line.text.strip_prefix("resumed ") {
            let resumed: serde_json::Value = serde_json::from_str(json).unwrap_or_default();
            progress.set_position(resumed["version"].as_u64().unwrap_or(0));
            say(
                &progress,
                format!(
                    "resumed at v{} ({} versions trained again, {:.2} s)",
                    resumed["version"],
                    resumed["replayed"],
                    resumed["seconds"].as_f64().unwrap_or(0.0)
                ),
            );
        }
    };
    let control: SocketAddr =
        expect_line(&lines, "trainer", "control ", START_TIMEOUT, show_warmup)?.parse()?;
    let hub_transport: SocketAddr =
        expect_line(&lines, "trainer", "transport ", START_TIMEOUT, |_| {})?.parse()?;
    let ready: serde_json::Value = serde_json::from_str(&expect_line(
        &lines,
        "trainer",
        "ready ",
        START_TIMEOUT,
        |_| {},
    )?)?;
    let training_started = Instant::now();
    say(
        &progress,
        format!(
            "model of {} parameters ({} bytes dense); base held-out accuracy {:.1}%; warm-up {:.1} s",
            ready["parameters"],
            ready["dense_bytes"],
            100.0 * ready["accuracy"].as_f64().unwrap_or(0.0),
            ready["warmup_s"].as_f64().unwrap_or(0.0)
        ),
    );

    let mut fleet = Fleet {
        placement: &placement,
        run_dir: run_dir.clone(),
        token: token.clone(),
        lines: sender.clone(),
        control,
        hub_transport,
        relays: BTreeMap::new(),
        actors: BTreeMap::new(),
        next_actor: 0,
    };
    for region in &config.regions {
        let name = format!("relay-{}", region.name);
        let mut relay_args: Vec<String> = vec![
            "run-node".into(),
            "relay".into(),
            "--dir".into(),
            run_dir.display().to_string(),
            "--transport-listen".into(),
            SocketAddr::new(placement.bind(&region.name)?, 0).to_string(),
            "--region".into(),
            region.name.clone(),
            "--upstream".into(),
            hub_transport.to_string(),
        ];
        relay_args.extend(trust::node_args(
            &run_dir,
            aurora_trust::Role::Relay,
            &name,
            &region.name,
        )?);
        let node = Node::spawn(
            &name,
            placement.command(&region.name)?,
            &relay_args,
            &env,
            &run_dir,
            sender.clone(),
        )?;
        let address: SocketAddr =
            expect_line(&lines, &name, "transport ", START_TIMEOUT, |_| {})?.parse()?;
        fleet.relays.insert(region.name.clone(), (node, address));
    }
    for region in &config.regions {
        for _ in 0..region.actors {
            fleet.start_actor(&region.name)?;
        }
    }

    let metrics_path = run_dir.join("metrics.jsonl");
    // A resumed run goes on with the records of the steps before it.
    let mut metrics = std::fs::OpenOptions::new()
        .create(true)
        .append(args.resume)
        .write(true)
        .truncate(!args.resume)
        .open(&metrics_path)?;
    let mut records: Vec<StepRecord> = Vec::new();
    let mut pending_events: Vec<String> = Vec::new();
    // Each fault happens once: a restarted trainer opens again the step it was killed at.
    let mut applied = vec![false; config.faults.len()];
    let mut restarted_at: Option<Instant> = None;
    watch_stop_signals(sender.clone())?;
    // The first signal: the trainer is asked to stop, and the run waits for its word.
    let mut stopping: Option<String> = None;
    let mut stopped_at: Option<(u64, String)> = None;
    loop {
        let line = match lines.recv_timeout(STEP_TIMEOUT) {
            Ok(line) => line,
            Err(_) => bail!(
                "no progress for {STEP_TIMEOUT:?}; see the logs in {}",
                run_dir.join("logs").display()
            ),
        };
        if line.from == SIGNALLED {
            trainer.terminate()?;
            say(
                &progress,
                format!(
                    "stopping ({}): the trainer finishes the version in hand, then the fleet leaves",
                    line.text
                ),
            );
            stopping = Some(line.text);
            continue;
        }
        if line.text == procs::CLOSED {
            if line.from == "trainer" {
                let status = trainer.wait()?;
                bail!(
                    "the trainer exited ({status}); see {}",
                    run_dir.join("logs/trainer.log").display()
                );
            }
            tracing::info!(node = %line.from, "exited");
            continue;
        }
        if line.from != "trainer" {
            continue;
        }
        if let Some(step) = line.text.strip_prefix("open ") {
            if stopping.is_some() {
                continue;
            }
            let step: u64 = step.parse()?;
            for (index, fault) in config.faults.iter().enumerate() {
                if fault.at_step() != step || std::mem::replace(&mut applied[index], true) {
                    continue;
                }
                let event = match fault {
                    Fault::KillTrainer {
                        restart_after_s, ..
                    } => {
                        let pid = trainer.id();
                        trainer.kill()?;
                        expect_line(&lines, "trainer", procs::CLOSED, START_TIMEOUT, |_| {})?;
                        let outage = Instant::now();
                        std::thread::sleep(Duration::from_secs_f64(*restart_after_s));
                        trainer = spawn_trainer(Some((control.port(), hub_transport.port())))?;
                        let resumed: serde_json::Value = serde_json::from_str(&expect_line(
                            &lines,
                            "trainer",
                            "resumed ",
                            START_TIMEOUT,
                            |_| {},
                        )?)?;
                        restarted_at = Some(Instant::now());
                        format!(
                            "killed the trainer (pid {pid}); restarted after {restart_after_s} s, \
                             it resumed at v{} ({} versions trained again) {:.2} s after the kill",
                            resumed["version"],
                            resumed["replayed"],
                            outage.elapsed().as_secs_f64()
                        )
                    }
                    other => apply_fault(&mut fleet, other)?,
                };
                say(&progress, format!("step {step}: {event}"));
                pending_events.push(event);
            }
        } else if let Some(json) = line.text.strip_prefix("step ") {
            let mut record: StepRecord = serde_json::from_str(json)?;
            record.events.append(&mut pending_events);
            if let Some(at) = restarted_at.take() {
                record.events.push(format!(
                    "v{} published {:.2} s after the trainer restarted",
                    record.trained_version,
                    at.elapsed().as_secs_f64()
                ));
            }
            writeln!(metrics, "{}", serde_json::to_string(&record)?)?;
            progress.set_position(record.step + 1);
            say(&progress, describe(&record));
            records.push(record);
        } else if let Some(json) = line.text.strip_prefix("final ") {
            let last: serde_json::Value = serde_json::from_str(json)?;
            let behind: Vec<String> = last["actors"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|a| a["version"] != last["version"])
                .map(|a| format!("actor {} on v{}", a["id"], a["version"]))
                .collect();
            if behind.is_empty() {
                say(
                    &progress,
                    format!(
                        "every actor runs the final version v{} (weights hash {})",
                        last["version"], last["weights_hash"]
                    ),
                );
            } else {
                say(
                    &progress,
                    format!("not on the final version: {}", behind.join(", ")),
                );
            }
        } else if let Some(json) = line.text.strip_prefix("stopped ") {
            let stopped: serde_json::Value = serde_json::from_str(json)?;
            let version = stopped["version"]
                .as_u64()
                .context("a stop without a version")?;
            // The run's own signal, or the one the trainer was sent from elsewhere.
            let signal = stopping
                .take()
                .or_else(|| stopped["signal"].as_str().map(String::from))
                .unwrap_or_else(|| "SIGTERM".into());
            stopped_at = Some((version, signal));
            break;
        } else if line.text == "done" {
            break;
        }
    }
    progress.finish_and_clear();
    if stopped_at.is_some() {
        fleet.stop()?;
        let status = trainer.wait_within(TRAINER_STOP_TIMEOUT)?;
        ensure!(
            status.success(),
            "the trainer did not stop cleanly ({status}): see its log"
        );
    }
    drop(fleet);
    drop(trainer);
    drop(metrics);
    let records = report::read_metrics(&metrics_path)?;
    let base_accuracy = ready["accuracy"].as_f64();
    report::write_report(
        &run_dir.join("report.html"),
        "aurora run",
        base_accuracy,
        &records,
    )?;
    let first = records.iter().find_map(|r| r.accuracy);
    let last = records.iter().rev().find_map(|r| r.accuracy);
    println!(
        "{} steps in {:.0} s; held-out accuracy {:.1}% at the base, {} at the end; report: {}",
        records.len(),
        started.elapsed().as_secs_f64(),
        100.0 * base_accuracy.unwrap_or(0.0),
        last.or(first)
            .map_or("n/a".into(), |a| format!("{:.1}%", 100.0 * a)),
        run_dir.join("report.html").display()
    );
    if let Some(sync) = sync_summary(&records, training_started.elapsed()) {
        println!("{sync}");
    }
    if let Some((version, signal)) = stopped_at {
        println!(
            "stopped at v{version} ({signal}); `aurora run --resume --dir {}` goes on from there",
            args.dir.display()
        );
        std::io::stdout().flush()?;
        // As a shell reports a process the signal ended: the run did not finish.
        std::process::exit(crate::signals::ended_by(&signal));
    }
    Ok(())
}

/// Asks every one of `nodes` to stop at once, then waits for each to end cleanly.
fn stop_all<'a>(nodes: impl Iterator<Item = &'a mut Node>, timeout: Duration) -> Result<()> {
    let mut nodes: Vec<&mut Node> = nodes.collect();
    for node in &nodes {
        node.terminate()?;
    }
    for node in &mut nodes {
        let status = node.wait_within(timeout)?;
        ensure!(
            status.success(),
            "{} did not stop cleanly on SIGTERM ({status}): see its log",
            node.name
        );
    }
    Ok(())
}

/// The sender of the line that says a stop was asked for (the signal's name).
const SIGNALLED: &str = "aurora run";

/// Watches SIGTERM and SIGINT (a terminal's Ctrl-C) from now on: the first becomes a
/// line from [`SIGNALLED`] among the nodes' lines, so the run stops its nodes in order; a
/// second ends the run at once, and its nodes with it.
fn watch_stop_signals(lines: mpsc::Sender<Line>) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut stop = runtime.block_on(async { StopSignals::new() })?;
    std::thread::Builder::new()
        .name("stop-signals".into())
        .spawn(move || {
            runtime.block_on(async {
                let signal = stop.recv().await;
                let _ = lines.send(Line {
                    from: SIGNALLED.into(),
                    text: signal.into(),
                });
                // Kept running for the second signal.
                std::future::pending::<()>().await
            })
        })
        .context("starting the signal watcher")?;
    Ok(())
}

/// The weights' path to the actors, and the time it held the run up as a share of the
/// step time (`report::sync_held_s`): the mean step is the RL part of the run (warm-up
/// excluded) over its steps.
fn sync_summary(records: &[StepRecord], training: Duration) -> Option<String> {
    let steps = records.len() as f64;
    if steps == 0.0 {
        return None;
    }
    let mean = |time: fn(&StepRecord) -> f64| records.iter().map(time).sum::<f64>() / steps;
    let step_s = training.as_secs_f64() / steps;
    let transfer_s = mean(|r| r.times.transfer_s);
    let activation_s = mean(|r| r.times.activation_s);
    let held_s = mean(|r| r.times.sync_held_s);
    let bytes = mean(|r| r.sync_bytes as f64);
    let dense = mean(|r| r.dense_bytes as f64);
    let (least, most) = report::density_range(records)?;
    Some(format!(
        "sync per version: {:.0} KB (1:{:.0} of the {:.0} KB checkpoint), extraction to \
         staged everywhere {transfer_s:.3} s, activation {activation_s:.3} s; sync held the \
         run up {held_s:.3} s per step: {:.1}% of the mean step ({step_s:.2} s)\nelements \
         changed per step: {:.3}% to {:.3}%, {}",
        bytes / 1e3,
        dense / bytes.max(1.0),
        dense / 1e3,
        100.0 * held_s / step_s,
        100.0 * least,
        100.0 * most,
        report::regime(records)
    ))
}

/// Creates the run directory, keeping only its warm-up cache from an earlier run.
fn prepare(run_dir: &Path) -> Result<()> {
    std::fs::create_dir_all(run_dir).with_context(|| format!("creating {}", run_dir.display()))?;
    for entry in std::fs::read_dir(run_dir)? {
        let path = entry?.path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if name.starts_with("warmup-") && name.ends_with(".state") {
            continue;
        }
        if path.is_dir() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        }
        .with_context(|| format!("clearing {}", path.display()))?;
    }
    Ok(())
}

fn apply_fault(fleet: &mut Fleet<'_>, fault: &Fault) -> Result<String> {
    Ok(match fault {
        Fault::KillActor { actor, .. } | Fault::StopActor { actor, .. } => {
            let (mut node, region) = fleet
                .actors
                .remove(&(*actor as u64))
                .with_context(|| format!("actor {actor} is not running"))?;
            let pid = node.id();
            if matches!(fault, Fault::KillActor { .. }) {
                node.kill()?;
                format!("killed actor {actor} (region {region}, pid {pid})")
            } else {
                let status = node.stop(ACTOR_STOP_TIMEOUT)?;
                ensure!(
                    status.success(),
                    "actor {actor} did not leave cleanly on SIGTERM ({status}): see its log"
                );
                format!(
                    "stopped actor {actor} (region {region}, pid {pid}): it left the fleet on SIGTERM"
                )
            }
        }
        Fault::StartActor { region, .. } => {
            let id = fleet.start_actor(region)?;
            format!("started actor {id} in region {region}")
        }
        Fault::KillRelay { region, .. } => {
            let (mut node, address) = fleet
                .relays
                .remove(region)
                .with_context(|| format!("no relay runs in region {region}"))?;
            node.kill()?;
            format!("killed the relay of region {region} ({address})")
        }
        Fault::KillTrainer { .. } => bail!("the trainer is restarted by the run itself"),
    })
}

fn describe(record: &StepRecord) -> String {
    let versions: Vec<String> = record
        .actors
        .iter()
        .map(|a| format!("{}:v{}", a.id, a.version))
        .collect();
    format!(
        "step {:>3} v{}->v{} reward {:.3}{} {:>6.0} tok/s sync {:.1} KB of {:.1} KB ({:.2}% changed) gen {:.1}s train {:.1}s extract {:.2}s transfer {:.2}s activate {:.2}s held {:.2}s actors [{}]",
        record.step,
        record.version,
        record.trained_version,
        record.train.mean_reward,
        record
            .accuracy
            .map_or(String::new(), |a| format!(" acc {:.1}%", 100.0 * a)),
        record.tokens_per_s,
        record.sync_bytes as f64 / 1e3,
        record.dense_bytes as f64 / 1e3,
        100.0 * record.density(),
        record.times.generation_s,
        record.times.training_s,
        record.times.extraction_s,
        record.times.transfer_s,
        record.times.activation_s,
        record.times.sync_held_s,
        versions.join(" ")
    )
}

/// Prints a line above the progress bar, or plainly when there is no terminal (where a
/// hidden bar would swallow `println`).
fn say(progress: &ProgressBar, line: impl AsRef<str>) {
    progress.suspend(|| println!("{}", line.as_ref()));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_of_an_earlier_release_keeps_its_key_under_the_new_names() {
        let dir = tempfile::tempdir().unwrap();
        let (old_private, old_public) = (
            dir.path().join("trainer.key"),
            dir.path().join("trainer.pub"),
        );
        aurora_trust::signing::create_key_pair(&old_private, &old_public).unwrap();
        let public = std::fs::read(&old_public).unwrap();
        ensure_trainer_key(dir.path()).unwrap();
        assert!(!old_private.exists() && !old_public.exists());
        assert_eq!(
            std::fs::read(dir.path().join(TRAINER_KEY_FILE)).unwrap(),
            public
        );
        assert_eq!(
            signing_key(dir.path()).unwrap().verifying_key(),
            trainer_key(dir.path()).unwrap()
        );
    }
}
