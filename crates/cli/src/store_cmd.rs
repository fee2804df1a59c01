use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use aurora_checkpoint::MappedFile;
use aurora_store::{Plan, Store};
use clap::Subcommand;

#[derive(Subcommand)]
pub enum StoreCommand {
    /// Add a delta artifact (verified before it is stored).
    PutDelta { root: PathBuf, delta: PathBuf },
    /// Add a full safetensors snapshot of VERSION.
    PutSnapshot {
        root: PathBuf,
        version: u64,
        checkpoint: PathBuf,
    },
    /// List the stored versions: snapshots, deltas and the rollouts each was trained on.
    List { root: PathBuf },
    /// Re-verify every stored artifact against its hash.
    Verify { root: PathBuf },
    /// How an actor at VERSION reaches the latest version, cheapest by bytes.
    Plan { root: PathBuf, version: u64 },
    /// Delete what is older than --keep-from and no live actor needs.
    Prune {
        root: PathBuf,
        #[arg(long)]
        keep_from: u64,
        /// Versions of the live actors (comma-separated).
        #[arg(long, value_delimiter = ',')]
        live: Vec<u64>,
    },
}

pub fn run(command: StoreCommand) -> Result<()> {
    match command {
        StoreCommand::PutDelta { root, delta } => {
            let store = Store::open(&root)?;
            let file = MappedFile::open(&delta)?;
            let record = store
                .put_delta(file.bytes())
                .with_context(|| format!("storing {}", delta.display()))?;
            println!(
                "stored delta {} -> {} ({} bytes, id {})",
                record.base_version, record.version, record.size_bytes, record.id
            );
        }
        StoreCommand::PutSnapshot {
            root,
            version,
            checkpoint,
        } => {
            let store = Store::open(&root)?;
            let record = store
                .put_snapshot_file(version, &checkpoint)
                .with_context(|| format!("storing {}", checkpoint.display()))?;
            println!(
                "stored snapshot {} ({} bytes, weights {})",
                record.version, record.size_bytes, record.weights_hash
            );
        }
        StoreCommand::List { root } => {
            let store = Store::open(&root)?;
            let (deltas, snapshots) = store.records()?;
            println!("latest version: {:?}", store.latest_version()?);
            println!("{:>8}  {:<9} {:>12}  hash", "version", "kind", "bytes");
            for record in snapshots.values() {
                println!(
                    "{:>8}  {:<9} {:>12}  {}",
                    record.version, "snapshot", record.size_bytes, record.weights_hash
                );
            }
            for record in deltas.values() {
                println!(
                    "{:>8}  {:<9} {:>12}  {}",
                    record.version, "delta", record.size_bytes, record.target_hash
                );
            }
            for record in store.rollouts_records()?.values() {
                println!(
                    "{:>8}  {:<9} {:>12}  {}",
                    record.version, "rollouts", record.size_bytes, record.hash
                );
            }
        }
        StoreCommand::Verify { root } => {
            let store = Store::open(&root)?;
            let (deltas, snapshots) = store.records()?;
            let composed = store.composed_records()?;
            let rollouts = store.rollouts_records()?;
            let mut failures = Vec::new();
            for &version in deltas.keys() {
                if let Err(error) = store.delta(version) {
                    failures.push(format!("{error:#}"));
                }
            }
            for &version in snapshots.keys() {
                if let Err(error) = store.snapshot(version) {
                    failures.push(format!("{error:#}"));
                }
            }
            // Listed records only: reading a catalogued composed delta never builds one.
            for &(base, target) in composed.keys() {
                if let Err(error) = store.composed_artifact(base, target) {
                    failures.push(format!("{error:#}"));
                }
            }
            for &version in rollouts.keys() {
                if let Err(error) = store.rollouts(version) {
                    failures.push(format!("{error:#}"));
                }
            }
            for failure in &failures {
                eprintln!("{failure}");
            }
            if !failures.is_empty() {
                bail!(
                    "{} of {} artifacts failed verification",
                    failures.len(),
                    deltas.len() + snapshots.len() + composed.len() + rollouts.len()
                );
            }
            println!(
                "{} deltas, {} snapshots, {} composed deltas and {} rollouts verified",
                deltas.len(),
                snapshots.len(),
                composed.len(),
                rollouts.len()
            );
        }
        StoreCommand::Plan { root, version } => {
            let store = Store::open(&root)?;
            match store.catch_up_plan(version)? {
                Plan::UpToDate { version } => println!("up to date at version {version}"),
                Plan::Replay { deltas, bytes } => println!(
                    "replay deltas {}..={} ({bytes} bytes)",
                    deltas.start,
                    deltas.end.saturating_sub(1)
                ),
                Plan::Snapshot {
                    snapshot,
                    deltas,
                    bytes,
                } => println!(
                    "load snapshot {snapshot}, then {} deltas ({bytes} bytes)",
                    deltas.end - deltas.start
                ),
                Plan::Composed {
                    base_version,
                    target_version,
                    bytes,
                } => println!("compose {base_version} -> {target_version} ({bytes} bytes)"),
            }
        }
        StoreCommand::Prune {
            root,
            keep_from,
            live,
        } => {
            let store = Store::open(&root)?;
            let report = store.prune(keep_from, &live)?;
            println!(
                "removed {} deltas and {} snapshots, {} bytes freed",
                report.deltas.len(),
                report.snapshots.len(),
                report.bytes_freed
            );
        }
    }
    Ok(())
}
