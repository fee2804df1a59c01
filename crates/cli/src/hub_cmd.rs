//! `aurora hub`: the trainer node (control plane, transport hub, checkpoint store) as a
//! process of its own, for trainers that are not Python or not ours. With `--watch` it
//! publishes every checkpoint a trainer saves into a directory, so the trainer needs no
//! code change: each complete checkpoint (a directory with the completion marker and its
//! safetensors files) becomes the next version, extracted against the one before,
//! streamed cut-through and committed.

use std::collections::BTreeMap;
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use aurora_checkpoint::MappedFile;
use aurora_delta::Checkpoint;
use aurora_node::{TrainerNode, TrainerSettings};
use clap::Args;
use serde::{Deserialize, Serialize};

use crate::limits_file::NodeLimits;
use crate::signals::StopSignals;
use crate::trust_args::TrustArgs;

#[derive(Args)]
pub struct HubArgs {
    /// The node's directory: its checkpoint store (`store/`) and the control plane's
    /// database (`hub.redb`). Reopened, the hub carries on from both.
    #[arg(long, default_value = "hub")]
    dir: PathBuf,
    /// The control plane's HTTP API (port 0 picks a free one; the bound address is
    /// printed) [default: 127.0.0.1:7300].
    #[arg(long)]
    control_listen: Option<SocketAddr>,
    /// The old name of --control-listen.
    #[arg(long, hide = true, conflicts_with = "control_listen")]
    listen: Option<SocketAddr>,
    /// The delta transport (port 0 picks one; the bound address is printed).
    #[arg(long, default_value = "127.0.0.1:7301")]
    transport_listen: SocketAddr,
    /// Publish each checkpoint that appears in this directory: a subdirectory holding
    /// the completion marker and the checkpoint's safetensors files (one or more shards),
    /// taken in the order of the numbers in their names.
    #[arg(long)]
    watch: Option<PathBuf>,
    /// The file a trainer writes into a checkpoint's directory once the checkpoint is
    /// complete.
    #[arg(long, default_value = "COMPLETE", requires = "watch")]
    marker: String,
    /// How often the watched directory is read.
    #[arg(long, default_value_t = 1000, requires = "watch")]
    poll_ms: u64,
    /// The store keeps a whole snapshot, which joining nodes take, every this many
    /// versions (version 0 always).
    #[arg(long, default_value_t = 10)]
    snapshot_every: u64,
    /// The trainer's signing key (PKCS#8 PEM, mode 0600): every version, snapshot,
    /// composed delta and commit served is signed with it, and relays and actors pin its
    /// public key (--trainer-key). Required with certificates, unless
    /// --insecure-unsigned.
    #[arg(long)]
    signing_key: Option<PathBuf>,
    /// INSECURE: with certificates but no --signing-key, serve unsigned versions (only
    /// nodes that also say --insecure-unsigned take them).
    #[arg(long, conflicts_with = "signing_key")]
    insecure_unsigned: bool,
    /// A TOML file of limits beyond the defaults: `[control]` (the API's caps and
    /// timeouts) and `[transport]` (connection caps, the build budget; see
    /// docs/security.md).
    #[arg(long)]
    limits: Option<PathBuf>,
    /// Both planes' security (its certificate is the trainer's).
    #[command(flatten)]
    trust: TrustArgs,
}

pub fn run(args: HubArgs) -> Result<()> {
    let control_listen = crate::renamed(
        (args.control_listen, "--control-listen"),
        (args.listen, "--listen"),
    );
    let limits = NodeLimits::load(args.limits.as_deref())?;
    let mut settings = TrainerSettings::new(&args.dir, args.trust.load()?);
    settings.control_limits = limits.control;
    settings.transport_limits = limits.transport;
    settings.control_listen = control_listen.unwrap_or(SocketAddr::from(([127, 0, 0, 1], 7300)));
    settings.transport_listen = args.transport_listen;
    settings.snapshot_every = args.snapshot_every;
    settings.signing_key = match &args.signing_key {
        Some(path) => Some(Arc::new(aurora_trust::signing::load_signing_key(path)?)),
        None => None,
    };
    settings.insecure_unsigned = args.insecure_unsigned;
    let runtime = crate::runtime(None)?;
    let mut stop = runtime.block_on(async { StopSignals::new() })?;
    let node = Arc::new(
        runtime
            .block_on(TrainerNode::start(settings))
            .with_context(|| format!("starting the hub in {}", args.dir.display()))?,
    );
    // One line each on stdout announces readiness to scripts and tests; logs go to stderr.
    println!("run {}", node.run_id());
    println!("listening on {}", node.control_address());
    println!("transport listening on {}", node.transport_address());
    std::io::stdout().flush()?;
    let mut stopping = Box::pin(stop.recv());
    let Some(watched) = args.watch else {
        stopped(runtime.block_on(stopping));
        return Ok(());
    };
    let mut watcher = Watcher::open(&args.dir, watched, args.marker, &node)?;
    loop {
        // A signal stops the hub between versions: the one being published is finished,
        // stored and recorded first.
        for checkpoint in watcher.complete_and_new()? {
            watcher.publish(&node, &runtime, &checkpoint)?;
        }
        let poll = Duration::from_millis(args.poll_ms);
        let signal = runtime.block_on(async {
            tokio::select! {
                signal = &mut stopping => Some(signal),
                _ = tokio::time::sleep(poll) => None,
            }
        });
        if let Some(signal) = signal {
            stopped(signal);
            return Ok(());
        }
    }
}

/// A hub stopped by `signal`: everything it published is in its store (each put is
/// durable when it returns), so it just says so.
fn stopped(signal: &str) {
    tracing::info!(signal, "asked to stop: every published version is stored");
    println!("stopped");
}

/// Which checkpoint of the watched directory became which version, and which were set
/// aside as unreadable, kept beside the store (`watched.json`) so a restarted hub
/// neither skips nor repeats one, nor trips on a bad one again.
#[derive(Default, Serialize, Deserialize)]
struct Published {
    versions: BTreeMap<String, u64>,
    /// Checkpoints marked complete that are not checkpoints (truncated, corrupted, no
    /// tensors), with why: never published, the next one's delta is taken from the last
    /// good one. The directory is the trainer's and is left as it is.
    #[serde(default)]
    set_aside: BTreeMap<String, String>,
}

struct Watcher {
    directory: PathBuf,
    marker: String,
    record_path: PathBuf,
    record: Published,
    /// The latest published checkpoint's files: the base of the next delta.
    base: Option<Vec<MappedFile>>,
}

impl Watcher {
    fn open(dir: &Path, directory: PathBuf, marker: String, node: &TrainerNode) -> Result<Watcher> {
        let record_path = dir.join("watched.json");
        let record: Published = match std::fs::read(&record_path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .with_context(|| format!("reading {}", record_path.display()))?,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Published::default(),
            Err(error) => {
                return Err(error).with_context(|| format!("reading {}", record_path.display()));
            }
        };
        let mut watcher = Watcher {
            directory,
            marker,
            record_path,
            record,
            base: None,
        };
        watcher.adopt_published(node)?;
        // Carry on from the last checkpoint published, if it is still what the store
        // says the latest version is.
        if let Some((name, &version)) = watcher.record.versions.iter().max_by_key(|(_, v)| **v) {
            let latest = node
                .latest()
                .context("the record names versions the store lacks")?;
            let files = watcher.map(name)?;
            let hash = checkpoint_of(&files)?.weights_hash();
            if (version, hash) != (latest.version, latest.hash) {
                bail!(
                    "checkpoint {name} was published as version {version} ({hash}), but the \
                     latest version is {} ({}): the watched directory changed",
                    latest.version,
                    latest.hash
                );
            }
            watcher.base = Some(files);
        }
        Ok(watcher)
    }

    /// Records the checkpoints a hub published but stopped before recording: each
    /// version the store holds beyond the record must be the next complete checkpoint,
    /// by its weights hash.
    fn adopt_published(&mut self, node: &TrainerNode) -> Result<()> {
        let Some(latest) = node.latest() else {
            return Ok(());
        };
        let (deltas, snapshots) = node.store().records()?;
        let hash_of = |version: u64| {
            deltas
                .get(&version)
                .map(|d| d.target_hash)
                .or(snapshots.get(&version).map(|s| s.weights_hash))
        };
        let first = self.record.versions.values().max().map_or(0, |v| v + 1);
        let unrecorded = (first..=latest.version).zip(self.complete_and_new()?);
        for (version, name) in unrecorded {
            let stored = hash_of(version)
                .with_context(|| format!("the store holds no version {version}"))?;
            let hash = checkpoint_of(&self.map(&name)?)?.weights_hash();
            if hash != stored {
                bail!(
                    "version {version} is in the store ({stored}) but no record says which \
                     checkpoint it is, and the next one, {name}, is not it ({hash})"
                );
            }
            tracing::info!(
                checkpoint = name,
                version,
                "found published before a restart"
            );
            self.record.versions.insert(name, version);
        }
        self.save_record()
    }

    fn save_record(&self) -> Result<()> {
        aurora_checkpoint::write_atomically::<anyhow::Error>(&self.record_path, |file| {
            serde_json::to_writer_pretty(file, &self.record)?;
            Ok(())
        })
    }

    /// Complete checkpoints not published yet, in the order of the numbers in their names.
    fn complete_and_new(&self) -> Result<Vec<String>> {
        let entries = std::fs::read_dir(&self.directory)
            .with_context(|| format!("reading {}", self.directory.display()))?;
        let mut found = Vec::new();
        for entry in entries {
            let entry = entry.with_context(|| format!("reading {}", self.directory.display()))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if entry.path().join(&self.marker).is_file()
                && !self.record.versions.contains_key(&name)
                && !self.record.set_aside.contains_key(&name)
            {
                found.push(name);
            }
        }
        found.sort_by_key(|name| (step_number(name), name.clone()));
        Ok(found)
    }

    fn map(&self, name: &str) -> Result<Vec<MappedFile>> {
        let directory = self.directory.join(name);
        let mut paths: Vec<PathBuf> = std::fs::read_dir(&directory)
            .with_context(|| format!("reading {}", directory.display()))?
            .map(|entry| entry.map(|e| e.path()))
            .collect::<std::io::Result<_>>()
            .with_context(|| format!("reading {}", directory.display()))?;
        paths.retain(|path| path.extension().is_some_and(|e| e == "safetensors"));
        paths.sort();
        if paths.is_empty() {
            bail!("checkpoint {name} is marked complete but holds no .safetensors file");
        }
        paths
            .iter()
            .map(|path| {
                MappedFile::open(path).with_context(|| format!("opening {}", path.display()))
            })
            .collect()
    }

    /// Publishes checkpoint `name` as the next version, or sets it aside if it is not a
    /// checkpoint: a bad file a trainer marked complete costs a log line, not the hub.
    /// Anything else that fails (the store, the transport) stops the hub.
    fn publish(
        &mut self,
        node: &Arc<TrainerNode>,
        runtime: &tokio::runtime::Runtime,
        name: &str,
    ) -> Result<()> {
        let files = match self.map(name).and_then(|files| {
            checkpoint_of(&files)?;
            Ok(files)
        }) {
            Ok(files) => files,
            Err(error) => return self.set_aside(name, &error),
        };
        let target = checkpoint_of(&files)?;
        let published = match &self.base {
            None => node.publish_first(0, &target),
            Some(base) => node.publish(&checkpoint_of(base)?, &target),
        };
        let published = match published {
            Ok(published) => published,
            // The extraction refused the tensors (a dtype or a size the format cannot
            // carry, a target that does not fit its base): the checkpoint, not the hub.
            Err(aurora_node::NodeError::Delta(error)) => {
                return self.set_aside(name, &anyhow::Error::new(error));
            }
            Err(other) => return Err(other.into()),
        };
        runtime.block_on(node.commit())?;
        self.record
            .versions
            .insert(name.to_string(), published.version);
        // Recorded before it is announced; a hub stopped between the publish and the
        // record finds the checkpoint again on restart (`adopt_published`).
        self.save_record()?;
        self.base = Some(files);
        tracing::info!(
            checkpoint = name,
            version = published.version,
            bytes = published.artifact_bytes,
            "published"
        );
        println!(
            "published {name} as version {} {}",
            published.version, published.weights_hash
        );
        std::io::stdout().flush()?;
        Ok(())
    }
}

impl Watcher {
    /// Records checkpoint `name` as set aside for `error`, logs it and says so on stdout.
    fn set_aside(&mut self, name: &str, error: &anyhow::Error) -> Result<()> {
        let reason = format!("{error:#}");
        tracing::error!(
            checkpoint = name,
            reason,
            "set aside: the checkpoint is marked complete but cannot be published; the next \
             one is taken against the last published"
        );
        self.record
            .set_aside
            .insert(name.to_string(), reason.clone());
        self.save_record()?;
        println!("set aside {name}: {reason}");
        std::io::stdout().flush()?;
        Ok(())
    }
}

/// One checkpoint from all its shards.
fn checkpoint_of(files: &[MappedFile]) -> Result<Checkpoint<'_>> {
    let mut tensors = Vec::new();
    for file in files {
        tensors.extend(file.checkpoint()?.tensors().iter().cloned());
    }
    Ok(Checkpoint::new(tensors)?)
}

/// The last number in a checkpoint's name (`checkpoint-1200`, `step_00012`), so steps
/// sort numerically; names without one sort first, by name.
fn step_number(name: &str) -> Option<u64> {
    let digits: String = name
        .chars()
        .rev()
        .skip_while(|c| !c.is_ascii_digit())
        .take_while(|c| c.is_ascii_digit())
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoints_sort_by_their_step_numbers() {
        let mut names = vec!["checkpoint-100", "checkpoint-20", "step_3", "initial"];
        names.sort_by_key(|name| (step_number(name), name.to_string()));
        assert_eq!(
            names,
            ["initial", "step_3", "checkpoint-20", "checkpoint-100"]
        );
        assert_eq!(step_number("run7-step-0042.tmp"), Some(42));
    }
}
