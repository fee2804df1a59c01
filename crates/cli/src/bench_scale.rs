//! `aurora bench scale`: the whole path at a model's real size, as separate processes on
//! this machine, measured per node and phase. A synthetic chain of checkpoints
//! ([`aurora_synth::write_checkpoints`]) is written one version at a time into a
//! directory that `aurora hub --watch` publishes (extraction, the store, cut-through
//! streaming); two actors start with no weights and join by the hub's snapshot over the
//! wire (mutual TLS, signed versions), their images in mapped files, then follow every
//! delta through a relay, which holds no weights. For each phase (each synthetic checkpoint, the join, each
//! delta) it records the time, each process's peak anonymous resident memory (`RssAnon`:
//! file-backed pages, the page cache of mapped checkpoints and images, are not the
//! process's to keep), the bytes that crossed loopback and the disk in use; and it
//! checks every node is on each checkpoint's weights hash.
//!
//! Memory is sampled every [`SAMPLE_INTERVAL`], so a peak shorter than that can be
//! missed; the growth from one model size to the next is what the figures show.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use aurora_checkpoint::MappedFile;
use aurora_synth::SynthConfig;
use aurora_trust::Role;
use clap::Args;

use crate::procs::{self, Line};
use serde::Serialize;

/// How often each process's memory is read.
const SAMPLE_INTERVAL: Duration = Duration::from_millis(20);

/// Longest wait for one phase: joining an 8B model by snapshot on a loaded machine takes
/// minutes.
const PHASE_TIMEOUT: Duration = Duration::from_secs(3600);

#[derive(Args)]
pub struct ScaleArgs {
    /// Model shape (`aurora synth` presets: tiny, small, medium, 0.6b, 1.7b, 4b, 8b).
    #[arg(long, default_value = "0.6b")]
    preset: String,
    /// Deltas to follow after the join.
    #[arg(long, default_value_t = 3)]
    deltas: u64,
    /// The synthetic trainer's learning rate (1e-6: about 1% of BF16 elements change).
    #[arg(long, default_value_t = 1e-6)]
    lr: f32,
    /// Where the checkpoints, the nodes' directories and their logs go (several times
    /// the model's size on disk); removed at the end unless --keep.
    #[arg(long)]
    dir: Option<PathBuf>,
    #[arg(long)]
    keep: bool,
    /// Where the nodes keep their images (unnamed mapped files); default: inside --dir.
    #[arg(long)]
    image_dir: Option<PathBuf>,
    /// Also write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// One phase's figures.
#[derive(Serialize)]
struct Phase {
    name: String,
    seconds: f64,
    /// Peak `RssAnon` of each process in this phase, bytes.
    peak_anonymous_bytes: BTreeMap<String, u64>,
    /// Bytes sent over loopback during the phase (every node's traffic, each byte once).
    wire_bytes: u64,
    /// Disk in use at the phase's end beyond what was used before the benchmark began:
    /// checkpoints, the store, and the nodes' mapped images (unnamed files, seen only
    /// in the filesystem's totals).
    disk_bytes: u64,
}

#[derive(Serialize)]
struct Report {
    preset: String,
    parameters: u64,
    checkpoint_bytes: u64,
    phases: Vec<Phase>,
}

pub fn run(args: ScaleArgs) -> Result<()> {
    let shape = crate::synth_cmd::shape(&args.preset)?;
    let dir = args
        .dir
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("runs/scale-{}", args.preset)));
    ensure!(
        !dir.exists(),
        "{} exists: give a new directory (--dir)",
        dir.display()
    );
    std::fs::create_dir_all(dir.join("logs"))
        .with_context(|| format!("creating {}", dir.display()))?;
    let memory = Memory::start(&dir)?;
    let mut phases = Vec::new();

    // The trainer's checkpoints, made by this process.
    memory.watch("bench", std::process::id());
    let checkpoints: Vec<PathBuf> = (0..=args.deltas)
        .map(|v| {
            dir.join("checkpoints")
                .join(format!("step-{v:05}.safetensors"))
        })
        .collect();
    std::fs::create_dir_all(dir.join("checkpoints"))?;
    let config = SynthConfig {
        learning_rate: args.lr,
        ..SynthConfig::new(shape, 0)
    };
    // The chain is written a version at a time, as the phases need it, and each
    // checkpoint is removed once the next is published: the disk holds two of them at
    // most, beside the store and the nodes' images.
    let synth = |version: u64, phases: &mut Vec<Phase>| -> Result<String> {
        memory.watch("bench", std::process::id());
        let started = memory.phase();
        let path = &checkpoints[version as usize];
        aurora_synth::write_checkpoints(&config, version, std::slice::from_ref(path), |_, _| {})?;
        phases.push(memory.end(&format!("synth {version}"), started));
        memory.forget("bench");
        Ok(MappedFile::open(path)?
            .checkpoint()?
            .weights_hash()
            .to_hex())
    };
    let mut hashes = vec![synth(0, &mut phases)?];
    let checkpoint_bytes = std::fs::metadata(&checkpoints[0])?.len();

    let fleet = FleetTrust::create(&dir)?;
    let watched = dir.join("watch");
    let save = |version: u64| -> Result<()> {
        let checkpoint = watched.join(format!("checkpoint-{version}"));
        std::fs::create_dir_all(&checkpoint)?;
        // A link, not a copy: the trainer's file as it wrote it.
        std::fs::hard_link(
            &checkpoints[version as usize],
            checkpoint.join("model.safetensors"),
        )?;
        std::fs::write(checkpoint.join("COMPLETE"), b"")?;
        Ok(())
    };
    save(0)?;

    let started = memory.phase();
    let hub_dir = dir.join("hub");
    let mut hub_args = vec![
        "hub".into(),
        "--dir".into(),
        hub_dir.display().to_string(),
        "--control-listen".into(),
        "127.0.0.1:0".into(),
        "--transport-listen".into(),
        "127.0.0.1:0".into(),
        "--watch".into(),
        watched.display().to_string(),
        "--poll-ms".into(),
        "50".into(),
        "--signing-key".into(),
        fleet.signing_key().display().to_string(),
    ];
    hub_args.extend(fleet.issue(Role::Trainer, "hub", "hub")?);
    let hub = BenchNode::start("hub", &hub_args, &dir)?;
    memory.watch("hub", hub.id());
    let hub_address = hub.expect("transport listening on ")?;
    ensure!(
        hub.expect("published checkpoint-0 as version 0 ")? == hashes[0],
        "the hub published other weights than the checkpoint's"
    );
    // The nodes' images: unnamed mapped files, here so that they take this disk.
    let images = args.image_dir.clone().unwrap_or_else(|| dir.join("images"));
    std::fs::create_dir_all(&images)?;
    let mut relay_args = vec![
        "relay".into(),
        "--transport-listen".into(),
        "127.0.0.1:0".into(),
        "--upstream".into(),
        hub_address.clone(),
    ];
    relay_args.extend(fleet.downstream(Role::Relay, "relay-eu")?);
    let relay = BenchNode::start("relay", &relay_args, &dir)?;
    memory.watch("relay", relay.id());
    let relay_address = relay.expect("listening on ")?;
    let mut actors = Vec::new();
    for (name, id) in [("a1", "1"), ("a2", "2")] {
        let mut actor_args = vec![
            "actor".into(),
            "--join".into(),
            "--upstream".into(),
            relay_address.clone(),
            "--upstream".into(),
            hub_address.clone(),
            "--image-dir".into(),
            images.display().to_string(),
        ];
        actor_args.extend(fleet.downstream(Role::Actor, id)?);
        let actor = BenchNode::start(name, &actor_args, &dir)?;
        memory.watch(name, actor.id());
        actors.push(actor);
    }
    let every_node_at = |version: u64, hashes: &[String]| -> Result<()> {
        // The relay holds each delta it forwards (the snapshot came from the hub).
        if version > 0 {
            relay.expect(&format!("holds {version}"))?;
        }
        for node in &actors {
            let hash = node.expect(&format!("active {version} "))?;
            ensure!(
                hash == hashes[version as usize],
                "{} activated version {version} as {hash}, the checkpoint's weights are {}",
                node.name(),
                hashes[version as usize]
            );
        }
        Ok(())
    };
    every_node_at(0, &hashes)?;
    phases.push(memory.end("join (snapshot)", started));

    for version in 1..=args.deltas {
        hashes.push(synth(version, &mut phases)?);
        let started = memory.phase();
        save(version)?;
        hub.expect(&format!(
            "published checkpoint-{version} as version {version} "
        ))?;
        every_node_at(version, &hashes)?;
        phases.push(memory.end(&format!("delta {version}"), started));
        // The hub now extracts from this version's files, not the last one's.
        let previous = version - 1;
        std::fs::remove_file(&checkpoints[previous as usize])?;
        std::fs::remove_dir_all(watched.join(format!("checkpoint-{previous}")))?;
    }
    let report = Report {
        preset: args.preset.clone(),
        parameters: shape.parameters(),
        checkpoint_bytes,
        phases,
    };
    print(&report);
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    drop((hub, relay, actors));
    if !args.keep {
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    Ok(())
}

fn print(report: &Report) {
    let mb = |bytes: u64| bytes as f64 / 1e6;
    println!(
        "{} ({} parameters, {:.1} MB checkpoint): peak anonymous memory (MB) per process and phase",
        report.preset,
        report.parameters,
        mb(report.checkpoint_bytes)
    );
    let names = ["bench", "hub", "relay", "a1", "a2"];
    print!("{:<18} {:>9}", "phase", "seconds");
    for name in names {
        print!(" {name:>8}");
    }
    println!(" {:>10} {:>9}", "wire MB", "disk GB");
    for phase in &report.phases {
        print!("{:<18} {:>9.2}", phase.name, phase.seconds);
        for name in names {
            match phase.peak_anonymous_bytes.get(name) {
                Some(&bytes) => print!(" {:>8.1}", mb(bytes)),
                None => print!(" {:>8}", "-"),
            }
        }
        println!(
            " {:>10.1} {:>9.1}",
            mb(phase.wire_bytes),
            phase.disk_bytes as f64 / 1e9
        );
    }
}

/// The fleet's trust material in the benchmark's directory, as `aurora run` makes it: a
/// CA of its own, a certificate for each node, and the trainer's signing key.
struct FleetTrust {
    dir: PathBuf,
}

impl FleetTrust {
    fn create(dir: &Path) -> Result<FleetTrust> {
        crate::run::trust::ensure_ca(dir)?;
        crate::run::ensure_trainer_key(dir)?;
        Ok(FleetTrust {
            dir: dir.to_path_buf(),
        })
    }

    fn signing_key(&self) -> PathBuf {
        crate::run::signing_key_path(&self.dir)
    }

    /// Issues node `id`'s certificate; its trust flags.
    fn issue(&self, role: Role, id: &str, region: &str) -> Result<Vec<String>> {
        crate::run::trust::node_args(&self.dir, role, id, region)
    }

    /// A relay's or an actor's flags: its certificate, and the trainer's key pinned.
    fn downstream(&self, role: Role, id: &str) -> Result<Vec<String>> {
        let mut flags = self.issue(role, id, "eu")?;
        flags.push("--trainer-key".into());
        flags.push(
            crate::run::trainer_key_path(&self.dir)
                .display()
                .to_string(),
        );
        Ok(flags)
    }
}

/// A node process of this binary ([`procs::Node`]), with its own stdout lines.
struct BenchNode {
    node: procs::Node,
    lines: mpsc::Receiver<Line>,
}

impl BenchNode {
    fn start(name: &str, args: &[String], dir: &Path) -> Result<BenchNode> {
        let (sender, lines) = mpsc::channel();
        let command = Command::new(std::env::current_exe()?);
        let node = procs::Node::spawn(name, command, args, &[], dir, sender)?;
        Ok(BenchNode { node, lines })
    }

    fn name(&self) -> &str {
        &self.node.name
    }

    fn id(&self) -> u32 {
        self.node.id()
    }

    /// The rest of the next line starting with `prefix`.
    fn expect(&self, prefix: &str) -> Result<String> {
        procs::expect_line(&self.lines, self.name(), prefix, PHASE_TIMEOUT, |_| {})
    }
}

/// Samples the anonymous resident memory of the watched processes, keeping each one's
/// peak since the phase began.
struct Memory {
    shared: Arc<Mutex<Sampled>>,
    stop: Arc<AtomicBool>,
    /// The benchmark's directory, and its filesystem's use before the benchmark.
    dir: PathBuf,
    disk_before: u64,
}

#[derive(Default)]
struct Sampled {
    watched: BTreeMap<String, u32>,
    peaks: BTreeMap<String, u64>,
}

/// When a phase began: its clock and the loopback counter.
struct PhaseStart {
    at: Instant,
    wire_bytes: u64,
}

impl Memory {
    fn start(dir: &Path) -> Result<Memory> {
        let shared = Arc::new(Mutex::new(Sampled::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (sampled, stopped) = (shared.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stopped.load(Ordering::Relaxed) {
                let mut sampled = sampled.lock().unwrap_or_else(|p| p.into_inner());
                let readings: Vec<(String, u64)> = sampled
                    .watched
                    .iter()
                    .filter_map(|(name, &pid)| Some((name.clone(), anonymous_bytes(pid)?)))
                    .collect();
                for (name, bytes) in readings {
                    let peak = sampled.peaks.entry(name).or_default();
                    *peak = (*peak).max(bytes);
                }
                drop(sampled);
                std::thread::sleep(SAMPLE_INTERVAL);
            }
        });
        Ok(Memory {
            shared,
            stop,
            dir: dir.to_path_buf(),
            disk_before: disk_used(dir),
        })
    }

    fn watch(&self, name: &str, pid: u32) {
        self.lock().watched.insert(name.into(), pid);
    }

    fn forget(&self, name: &str) {
        self.lock().watched.remove(name);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Sampled> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A phase begins: peaks start again from the processes' present memory.
    fn phase(&self) -> PhaseStart {
        self.lock().peaks.clear();
        PhaseStart {
            at: Instant::now(),
            wire_bytes: loopback_bytes(),
        }
    }

    fn end(&self, name: &str, start: PhaseStart) -> Phase {
        let phase = Phase {
            name: name.into(),
            seconds: start.at.elapsed().as_secs_f64(),
            peak_anonymous_bytes: self.lock().peaks.clone(),
            wire_bytes: loopback_bytes().saturating_sub(start.wire_bytes),
            disk_bytes: disk_used(&self.dir).saturating_sub(self.disk_before),
        };
        tracing::info!(phase = name, seconds = phase.seconds, "phase done");
        let _ = std::io::stdout().flush();
        phase
    }
}

impl Drop for Memory {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Bytes in use on the filesystem holding `dir` (0 if it cannot be read).
fn disk_used(dir: &Path) -> u64 {
    let Ok(path) = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()) else {
        return 0;
    };
    // SAFETY: `stats` is written by the call; `path` is a valid C string.
    let mut stats: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(path.as_ptr(), &mut stats) } != 0 {
        return 0;
    }
    (stats.f_blocks - stats.f_bfree) as u64 * stats.f_frsize as u64
}

/// `RssAnon` of process `pid`, or `None` once it is gone.
fn anonymous_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|line| line.starts_with("RssAnon:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Bytes the loopback interface has sent.
fn loopback_bytes() -> u64 {
    std::fs::read_to_string("/sys/class/net/lo/statistics/tx_bytes")
        .ok()
        .and_then(|text| text.trim().parse().ok())
        .unwrap_or(0)
}
