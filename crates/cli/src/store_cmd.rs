use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use aurora_checkpoint::MappedFile;
use aurora_delta::stats::delta_stats;
use aurora_delta::{ArtifactKind, ArtifactSignature, DetachedSignature, Statement};
use aurora_store::{Plan, Store, TrainerData};
use clap::Subcommand;

#[derive(Subcommand)]
pub enum StoreCommand {
    /// Add a delta artifact (verified before it is stored), with the trainer's signature:
    /// made now with --signing-key, for the store's run, or read from DELTA.sig
    /// (`aurora delta sign --run-id`, for the run `aurora store list` names).
    PutDelta {
        root: PathBuf,
        delta: PathBuf,
        /// The trainer's signing key: the delta is signed as the store's run's.
        #[arg(long)]
        signing_key: Option<PathBuf>,
    },
    /// Add a full safetensors snapshot of VERSION.
    PutSnapshot {
        root: PathBuf,
        version: u64,
        checkpoint: PathBuf,
    },
    /// List the stored versions: snapshots, deltas and the rollouts each was trained on.
    List { root: PathBuf },
    /// Re-verify every stored artifact against its hash; with --key also every stored
    /// delta's signature.
    Verify {
        root: PathBuf,
        /// The trainer's public key (PEM): every stored delta must carry its signature.
        #[arg(long)]
        key: Option<PathBuf>,
    },
    /// What the store holds for VERSION (delta, snapshot, composed deltas, rollouts),
    /// each read back verified, and the delta's per-tensor statistics.
    Inspect {
        root: PathBuf,
        version: u64,
        #[arg(long)]
        json: bool,
        /// Tensors of the delta to list, largest first (0 lists all).
        #[arg(long, default_value_t = 12)]
        top: usize,
    },
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
        StoreCommand::PutDelta {
            root,
            delta,
            signing_key,
        } => {
            let store = Store::open(&root)?;
            let file = MappedFile::open(&delta)?;
            let signature = match signing_key {
                Some(key) => {
                    let key = aurora_trust::signing::load_signing_key(&key)?;
                    let parsed = file.delta()?;
                    let statement =
                        Statement::artifact(ArtifactKind::Delta, parsed.id, parsed.header());
                    Some(aurora_delta::sign(&key, &store.run_id(), &statement))
                }
                None => detached_signature(&delta, &file, &store)?,
            };
            let record = store
                .put_delta(file.bytes(), signature)
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
            println!("run {}", store.run_id());
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
            for kind in TrainerData::ALL {
                for record in store.trainer_data_records(kind)?.values() {
                    println!(
                        "{:>8}  {:<9} {:>12}  {}",
                        record.version,
                        kind.name(),
                        record.size_bytes,
                        record.hash
                    );
                }
            }
        }
        StoreCommand::Verify { root, key } => {
            let pinned = key
                .map(|key| aurora_trust::signing::load_public_key(&key))
                .transpose()?;
            let store = Store::open(&root)?;
            let (deltas, snapshots) = store.records()?;
            let composed = store.composed_records()?;
            let trainer_data = TrainerData::ALL
                .map(|kind| store.trainer_data_records(kind))
                .into_iter()
                .collect::<Result<Vec<_>, _>>()?;
            let mut failures = Vec::new();
            for (&version, record) in &deltas {
                let file = match store.delta(version) {
                    Ok(file) => file,
                    Err(error) => {
                        failures.push(format!("{error:#}"));
                        continue;
                    }
                };
                if let Some(pinned) = &pinned {
                    let parsed = file.delta()?;
                    let statement =
                        Statement::artifact(ArtifactKind::Delta, parsed.id, parsed.header());
                    if let Err(error) = aurora_delta::verify(
                        pinned,
                        &store.run_id(),
                        &statement,
                        record.signature.as_ref(),
                    ) {
                        failures.push(format!("delta {version}: {error}"));
                    }
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
            for record in trainer_data.iter().flat_map(|records| records.values()) {
                if let Err(error) = store.trainer_data(record.kind, record.version) {
                    failures.push(format!("{error:#}"));
                }
            }
            let [rollouts, states] = [0, 1].map(|i| trainer_data[i].len());
            for failure in &failures {
                eprintln!("{failure}");
            }
            if !failures.is_empty() {
                bail!(
                    "{} of {} artifacts failed verification",
                    failures.len(),
                    deltas.len() + snapshots.len() + composed.len() + rollouts + states
                );
            }
            println!(
                "{} deltas, {} snapshots, {} composed deltas, {} rollouts and {} trainer states verified",
                deltas.len(),
                snapshots.len(),
                composed.len(),
                rollouts,
                states
            );
            if let Some(pinned) = &pinned {
                println!(
                    "every delta is signed by the trainer key {}",
                    aurora_delta::key_fingerprint(pinned)
                );
            }
        }
        StoreCommand::Inspect {
            root,
            version,
            json,
            top,
        } => inspect(&Store::open(&root)?, version, json, top)?,
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

/// [`StoreCommand::Inspect`]: every record of `version`, each artifact read back (and so
/// verified) before it is reported.
/// The signature in `delta`'s detached signature file, if it has one; it must be of this
/// delta and of `store`'s run (its signer is checked by `store verify --key`, the store
/// holding no key).
fn detached_signature(
    delta: &Path,
    file: &MappedFile,
    store: &Store,
) -> Result<Option<ArtifactSignature>> {
    let mut path = delta.as_os_str().to_os_string();
    path.push(".sig");
    let path = PathBuf::from(path);
    let bytes = match std::fs::read(&path) {
        Ok(bytes) => bytes,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(error) => return Err(error).with_context(|| format!("reading {}", path.display())),
    };
    let detached =
        DetachedSignature::parse(&bytes).with_context(|| format!("reading {}", path.display()))?;
    let parsed = file.delta()?;
    if detached.kind != ArtifactKind::Delta || detached.id != parsed.id {
        bail!(
            "{} signs {} with id {}, not this delta (id {})",
            path.display(),
            detached.kind,
            detached.id,
            parsed.id
        );
    }
    if detached.run != store.run_id() {
        bail!(
            "{} signs it for run {}, and this store is run {}'s",
            path.display(),
            detached.run,
            store.run_id()
        );
    }
    Ok(Some(detached.signature))
}

fn inspect(store: &Store, version: u64, json: bool, top: usize) -> Result<()> {
    let (deltas, snapshots) = store.records()?;
    let delta = deltas.get(&version).copied();
    let snapshot = snapshots.get(&version).copied();
    let trainer_data = TrainerData::ALL
        .into_iter()
        .map(|kind| Ok(store.trainer_data_records(kind)?.get(&version).copied()))
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .flatten()
        .collect::<Vec<_>>();
    let composed: Vec<_> = store
        .composed_records()?
        .into_values()
        .filter(|c| c.base_version == version || c.target_version == version)
        .collect();
    if delta.is_none() && snapshot.is_none() && trainer_data.is_empty() && composed.is_empty() {
        bail!("version {version} is not in the store");
    }
    let stats = match delta {
        Some(_) => {
            let file = store.delta(version)?;
            Some(delta_stats(
                &aurora_delta::DeltaFile::parse(file.bytes())?,
                file.bytes().len() as u64,
            )?)
        }
        None => None,
    };
    if let Some(snapshot) = snapshot {
        store.snapshot(snapshot.version)?;
    }
    for record in &trainer_data {
        store.trainer_data(record.kind, version)?;
    }
    for c in &composed {
        store.composed_artifact(c.base_version, c.target_version)?;
    }
    if json {
        let value = serde_json::json!({
            "version": version,
            "delta": delta.map(|d| serde_json::json!({
                "base_version": d.base_version,
                "id": d.id.to_hex(),
                "base_hash": d.base_hash.to_hex(),
                "target_hash": d.target_hash.to_hex(),
                "bytes": d.size_bytes,
                "stats": stats,
            })),
            "snapshot": snapshot.map(|s| serde_json::json!({
                "weights_hash": s.weights_hash.to_hex(),
                "bytes": s.size_bytes,
            })),
            "composed": composed.iter().map(|c| serde_json::json!({
                "base_version": c.base_version,
                "target_version": c.target_version,
                "id": c.id.to_hex(),
                "bytes": c.size_bytes,
            })).collect::<Vec<_>>(),
            "trainer_data": trainer_data.iter().map(|r| serde_json::json!({
                "kind": r.kind.name(),
                "hash": r.hash.to_hex(),
                "bytes": r.size_bytes,
            })).collect::<Vec<_>>(),
        });
        return crate::print_stdout(&(serde_json::to_string_pretty(&value)? + "\n"));
    }
    let mut text = format!("version {version}, every artifact below verified\n");
    if let Some(d) = delta {
        text += &format!(
            "  delta      from {} ({}) to {}, {} bytes, id {}\n",
            d.base_version, d.base_hash, d.target_hash, d.size_bytes, d.id
        );
    }
    if let Some(s) = snapshot {
        text += &format!(
            "  snapshot   weights {}, {} bytes\n",
            s.weights_hash, s.size_bytes
        );
    }
    for c in &composed {
        text += &format!(
            "  composed   {} -> {}, {} bytes, id {}\n",
            c.base_version, c.target_version, c.size_bytes, c.id
        );
    }
    for r in &trainer_data {
        text += &format!(
            "  {:<10} {} bytes, hash {}\n",
            r.kind.name(),
            r.size_bytes,
            r.hash
        );
    }
    if let Some(stats) = &stats {
        text += "\n";
        text += &crate::delta_cmd::format_stats(stats, top)?;
    }
    crate::print_stdout(&text)
}
