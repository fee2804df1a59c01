//! The checkpoint store: versioned, immutable artifacts on disk, catalogued in redb.
//!
//! # On-disk layout
//!
//! ```text
//! <root>/
//!   catalog.redb                                  the catalog (redb; also the store's lock)
//!   deltas/<target_version>-<id hex>.adelta       D(v): turns version v-1 into v
//!   snapshots/<version>-<weights hash hex>.safetensors
//!   composed/<base>-<target>-<id hex>.adelta      C(base -> target), built on demand
//!   rollouts/<version>-<hash hex>.json            the rollouts version v was trained on
//! ```
//!
//! File names carry the artifact's identity (a delta's id is its manifest hash, a
//! snapshot's is its weights hash), so two different artifacts never share a path and a
//! file is never rewritten with other contents.
//!
//! # Catalog tables
//!
//! - `deltas`: version (u64) → (base version, id, base weights hash, target weights hash,
//!   file size in bytes).
//! - `snapshots`: version (u64) → (weights hash, file size in bytes).
//! - `composed`: (base version, target version) → (id, base weights hash, target weights
//!   hash, file size in bytes).
//! - `rollouts`: version (u64) → (BLAKE3 hash of the file, file size in bytes): the
//!   collected rollouts a trainer turned into that version, as it serialized them.
//!
//! The catalog is the truth: a file is part of the store only while a record names it.
//!
//! # Write order and crash safety
//!
//! - **Put**: the artifact is verified in memory, then written with
//!   [`aurora_checkpoint::write_atomically`] (temporary file, fsync, rename, directory
//!   fsync), and only then is its record committed. A crash before the commit leaves an
//!   unreferenced file or a temporary file, never a record without its file.
//! - **Prune**: the records are removed and committed first, the files deleted after. A
//!   crash in between leaves unreferenced files, never a record without its file.
//! - **Open**: every file in `deltas/`, `snapshots/` and `composed/` that no record names (orphans of
//!   the two crashes above, and temporary files) is deleted. Only one process can hold
//!   the catalog open (redb locks it), so no other writer's temporary file is touched.
//!
//! So the catalog never points at a missing file through our own doing; a file removed
//! or damaged behind the store's back is reported by the read that finds it.
//!
//! # Reads
//!
//! Every read is verified before it is returned: a delta's (or composed delta's) manifest
//! hash and every segment hash, and its id and versions against the record; a snapshot's weights hash
//! against the record. A corrupted artifact is an error naming the version and the file,
//! and is never served.
//!
//! A snapshot travels to a peer with no weights as an artifact in the delta format
//! ([`Store::snapshot_artifact`]): the delta from the empty checkpoint to it, every tensor
//! added, base and target version both its version (docs/wire-protocol.md §4.4).
//!
//! # Acceptance rule
//!
//! A delta for version v must start from v-1 (`base_version == v-1`). If version v-1 is
//! known (as a delta's target or as a snapshot), the delta's base hash must equal its
//! weights hash; if version v is known as a snapshot, the delta's target hash must equal
//! it. A snapshot must agree the same way with the deltas into and out of its version.
//! A second, different artifact for a version already stored is refused; the same one
//! again is accepted and changes nothing.
//!
//! # Composed deltas
//!
//! [`Store::composed_artifact`] builds C(a -> v), one exact delta from version a to v,
//! the first time it is asked for: the weights of a are rebuilt from the newest snapshot
//! at or below a whose chain of deltas reaches v (applying the deltas up to a, each
//! verified by its target hash), then `aurora_delta::compose` applies D(a+1..=v) and
//! extracts v against a with the `aurora` encoding. Applied to the weights of a, it
//! reproduces v's weights hash bit for bit (compose checks every link's target hash).
//! It is stored like a delta (crash-safe write, then the record) and re-verified on
//! every read; being deterministic, building it again gives the same artifact.
//! Pruning keeps only the composed deltas whose target is the latest version: any other
//! one is never served again, since an Actor always catches up to the latest.
//!
//! # Catch-up rule
//!
//! An Actor at version a catches up to version v (the latest) by whichever needs fewest
//! bytes: replaying D(a+1..=v), loading a snapshot s <= v and replaying D(s+1..=v), or
//! one composed delta C(a -> v). A composed delta is considered only when the Actor is at
//! least two versions behind (one behind, it would be D(v) itself), and its size is
//! known only once it is built: [`Store::composed_catch_up_plan`] (the hub's, when it
//! serves a lagging Actor) builds it once and stores it; [`Store::catch_up_plan`] (a
//! cheap read, also used by pruning) counts one only if it is already stored. On equal bytes replay wins, then the composed delta, then the
//! later snapshot. See [`Plan`] and `plan::choose`, which is pure: sizes in, plan out.

mod error;
mod plan;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use aurora_checkpoint::{FileError, MappedFile, write_atomically};
use aurora_delta::{
    Checkpoint, DeltaFile, Encoding, ExtractOptions, Extraction, Hash, compose, owned_checkpoint,
    replay,
};
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition, WriteTransaction};

pub use error::{Result, StoreError};
pub use plan::Plan;

use error::catalog;

/// The catalog record of a stored delta D(version).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaRecord {
    pub version: u64,
    pub base_version: u64,
    pub id: Hash,
    pub base_hash: Hash,
    pub target_hash: Hash,
    pub size_bytes: u64,
}

/// The catalog record of the rollouts a version was trained on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RolloutsRecord {
    pub version: u64,
    /// BLAKE3 of the stored bytes.
    pub hash: Hash,
    pub size_bytes: u64,
}

/// The catalog record of a stored snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotRecord {
    pub version: u64,
    pub weights_hash: Hash,
    pub size_bytes: u64,
}

/// The catalog record of a stored composed delta C(base_version -> target_version).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ComposedRecord {
    pub base_version: u64,
    pub target_version: u64,
    pub id: Hash,
    pub base_hash: Hash,
    pub target_hash: Hash,
    pub size_bytes: u64,
}

/// What [`Store::prune`] removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PruneReport {
    pub deltas: Vec<u64>,
    pub snapshots: Vec<u64>,
    /// (base, target) of each composed delta removed.
    pub composed: Vec<(u64, u64)>,
    pub bytes_freed: u64,
}

/// Whether a snapshot should be taken at `version` under a "one every `every_k` versions"
/// policy. Version 0, the initial checkpoint, is always snapshotted, since every chain
/// starts from it; `every_k == 0` means only version 0.
pub fn should_snapshot(version: u64, every_k: u64) -> bool {
    version == 0 || (every_k > 0 && version.is_multiple_of(every_k))
}

/// An open checkpoint store. Holds the catalog's lock until dropped.
pub struct Store {
    root: PathBuf,
    db: Database,
}

impl Store {
    /// Opens (or creates) the store at `root` and deletes files no record names.
    pub fn open(root: impl AsRef<Path>) -> Result<Store> {
        let root = root.as_ref().to_path_buf();
        for dir in [DELTAS, SNAPSHOTS, COMPOSED, ROLLOUTS] {
            let path = root.join(dir);
            fs::create_dir_all(&path).map_err(|source| StoreError::Io { path, source })?;
        }
        let db = Database::create(root.join(CATALOG)).map_err(catalog)?;
        // Create every table now so that readers never meet a missing table.
        let txn = db.begin_write().map_err(catalog)?;
        check_schema(&txn)?;
        txn.open_table(DELTA_TABLE).map_err(catalog)?;
        txn.open_table(SNAPSHOT_TABLE).map_err(catalog)?;
        txn.open_table(COMPOSED_TABLE).map_err(catalog)?;
        txn.open_table(ROLLOUTS_TABLE).map_err(catalog)?;
        txn.commit().map_err(catalog)?;
        let store = Store { root, db };
        store.remove_orphans()?;
        Ok(store)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Verifies and stores a delta artifact, then records it (see the acceptance rule in
    /// the module docs). Storing the same artifact again returns its record.
    pub fn put_delta(&self, bytes: &[u8]) -> Result<DeltaRecord> {
        let delta = DeltaFile::parse(bytes).map_err(StoreError::InvalidDelta)?;
        for index in 0..delta.segment_count() {
            delta
                .verify_segment(index)
                .map_err(StoreError::InvalidDelta)?;
        }
        let header = delta.header();
        let record = DeltaRecord {
            version: header.target_version,
            base_version: header.base_version,
            id: delta.id,
            base_hash: header.base_hash,
            target_hash: header.target_hash,
            size_bytes: bytes.len() as u64,
        };
        let version = record.version;
        if version == 0 || record.base_version != version - 1 {
            return Err(StoreError::NotConsecutive {
                version,
                base_version: record.base_version,
            });
        }
        // The write transaction is held across the file write so that the checks and the
        // commit see the same catalog (redb has one writer at a time).
        let txn = self.db.begin_write().map_err(catalog)?;
        {
            let deltas = txn.open_table(DELTA_TABLE).map_err(catalog)?;
            let snapshots = txn.open_table(SNAPSHOT_TABLE).map_err(catalog)?;
            if let Some(existing) = get_delta(&deltas, version)? {
                if existing.id == record.id {
                    return Ok(existing);
                }
                return Err(StoreError::Conflict {
                    kind: "delta",
                    version,
                    existing: existing.id,
                    offered: record.id,
                });
            }
            if let Some(known) = known_weights(&deltas, &snapshots, version - 1)?
                && known != record.base_hash
            {
                return Err(StoreError::WrongBase {
                    version,
                    known,
                    offered: record.base_hash,
                });
            }
            if let Some(snapshot) = get_snapshot(&snapshots, version)?
                && snapshot.weights_hash != record.target_hash
            {
                return Err(StoreError::WrongWeights {
                    kind: "delta",
                    version,
                    known: snapshot.weights_hash,
                    offered: record.target_hash,
                });
            }
        }
        commit_with_file(txn, &self.delta_path(&record), bytes, |txn| {
            txn.open_table(DELTA_TABLE)
                .map_err(catalog)?
                .insert(version, delta_value(&record))
                .map_err(catalog)?;
            Ok(())
        })?;
        tracing::info!(version, id = %record.id, bytes = record.size_bytes, "stored delta");
        Ok(record)
    }

    /// Stores a snapshot of `version` from a safetensors image, after computing its
    /// weights hash and checking it against the deltas into and out of `version`.
    pub fn put_snapshot(&self, version: u64, safetensors: &[u8]) -> Result<SnapshotRecord> {
        let checkpoint = Checkpoint::from_safetensors(safetensors)
            .map_err(|source| StoreError::InvalidSnapshot { version, source })?;
        let record = SnapshotRecord {
            version,
            weights_hash: checkpoint.weights_hash(),
            size_bytes: safetensors.len() as u64,
        };
        let txn = self.db.begin_write().map_err(catalog)?;
        {
            let deltas = txn.open_table(DELTA_TABLE).map_err(catalog)?;
            let snapshots = txn.open_table(SNAPSHOT_TABLE).map_err(catalog)?;
            if let Some(existing) = get_snapshot(&snapshots, version)? {
                if existing.weights_hash == record.weights_hash {
                    return Ok(existing);
                }
                return Err(StoreError::Conflict {
                    kind: "snapshot",
                    version,
                    existing: existing.weights_hash,
                    offered: record.weights_hash,
                });
            }
            let known = get_delta(&deltas, version)?
                .map(|d| d.target_hash)
                .or(get_delta(&deltas, version + 1)?.map(|d| d.base_hash));
            if let Some(known) = known
                && known != record.weights_hash
            {
                return Err(StoreError::WrongWeights {
                    kind: "snapshot",
                    version,
                    known,
                    offered: record.weights_hash,
                });
            }
        }
        commit_with_file(txn, &self.snapshot_path(&record), safetensors, |txn| {
            txn.open_table(SNAPSHOT_TABLE)
                .map_err(catalog)?
                .insert(version, snapshot_value(&record))
                .map_err(catalog)?;
            Ok(())
        })?;
        tracing::info!(version, hash = %record.weights_hash, bytes = record.size_bytes, "stored snapshot");
        Ok(record)
    }

    /// [`Store::put_snapshot`] from a safetensors file, memory-mapped rather than read.
    pub fn put_snapshot_file(&self, version: u64, path: &Path) -> Result<SnapshotRecord> {
        let file = MappedFile::open(path)?;
        self.put_snapshot(version, file.bytes())
    }

    /// The highest version the store holds, as a delta's target or a snapshot.
    pub fn latest_version(&self) -> Result<Option<u64>> {
        let txn = self.db.begin_read().map_err(catalog)?;
        Ok(last_version(&txn, DELTA_TABLE)?.max(last_version(&txn, SNAPSHOT_TABLE)?))
    }

    /// Every delta and snapshot record, by version.
    pub fn records(&self) -> Result<(BTreeMap<u64, DeltaRecord>, BTreeMap<u64, SnapshotRecord>)> {
        let txn = self.db.begin_read().map_err(catalog)?;
        Ok((
            read_all(&txn, DELTA_TABLE, |v, value| (v, delta_record(v, value)))?,
            read_all(&txn, SNAPSHOT_TABLE, |v, value| {
                (v, snapshot_record(v, value))
            })?,
        ))
    }

    /// D(version), memory-mapped and fully verified. Artifacts are never modified in
    /// place, so the verified mapping stays valid while it is held.
    pub fn delta(&self, version: u64) -> Result<MappedFile> {
        let record = self.stored("delta", DELTA_TABLE, version, delta_record)?;
        let path = self.delta_path(&record);
        open_delta_artifact(
            "delta",
            &path,
            record.size_bytes,
            record.id,
            (record.base_version, version),
        )
    }

    /// Every composed delta record, by (base version, target version).
    pub fn composed_records(&self) -> Result<BTreeMap<(u64, u64), ComposedRecord>> {
        let txn = self.db.begin_read().map_err(catalog)?;
        read_all(&txn, COMPOSED_TABLE, |key, value| {
            (key, composed_record(key, value))
        })
    }

    /// Stores the rollouts that `version` was trained on (opaque bytes: the trainer's
    /// serialization). Immutable like every artifact: the same bytes again are a no-op,
    /// other bytes for a stored version a conflict.
    pub fn put_rollouts(&self, version: u64, bytes: &[u8]) -> Result<RolloutsRecord> {
        let record = RolloutsRecord {
            version,
            hash: Hash::of(bytes),
            size_bytes: bytes.len() as u64,
        };
        let txn = self.db.begin_write().map_err(catalog)?;
        {
            let table = txn.open_table(ROLLOUTS_TABLE).map_err(catalog)?;
            if let Some(existing) = table.get(version).map_err(catalog)? {
                let existing = rollouts_record(version, existing.value());
                if existing.hash == record.hash {
                    return Ok(existing);
                }
                return Err(StoreError::Conflict {
                    kind: "rollouts",
                    version,
                    existing: existing.hash,
                    offered: record.hash,
                });
            }
        }
        commit_with_file(txn, &self.rollouts_path(&record), bytes, |txn| {
            txn.open_table(ROLLOUTS_TABLE)
                .map_err(catalog)?
                .insert(version, (record.hash.0, record.size_bytes))
                .map_err(catalog)?;
            Ok(())
        })?;
        tracing::info!(version, hash = %record.hash, bytes = record.size_bytes, "stored rollouts");
        Ok(record)
    }

    /// The rollouts `version` was trained on, verified against their hash.
    pub fn rollouts(&self, version: u64) -> Result<Vec<u8>> {
        let record = self.stored("rollouts", ROLLOUTS_TABLE, version, rollouts_record)?;
        let path = self.rollouts_path(&record);
        let file = open_artifact("rollouts", version, &path, record.size_bytes)?;
        let actual = Hash::of(file.bytes());
        if actual != record.hash {
            return Err(StoreError::Corrupted {
                kind: "rollouts",
                version,
                path,
                reason: format!("its hash is {actual}, the catalog says {}", record.hash),
            });
        }
        Ok(file.bytes().to_vec())
    }

    /// Every rollouts record, by version.
    pub fn rollouts_records(&self) -> Result<BTreeMap<u64, RolloutsRecord>> {
        let txn = self.db.begin_read().map_err(catalog)?;
        read_all(&txn, ROLLOUTS_TABLE, |v, value| {
            (v, rollouts_record(v, value))
        })
    }

    /// The record of the stored composed delta C(base -> target), if there is one.
    pub fn composed_record(&self, base: u64, target: u64) -> Result<Option<ComposedRecord>> {
        self.lookup(COMPOSED_TABLE, (base, target), |value| {
            composed_record((base, target), value)
        })
    }

    /// The record of `version` in `table` (of artifacts of `kind`), or `NotFound`.
    fn stored<V: redb::Value + 'static, R>(
        &self,
        kind: &'static str,
        table: TableDefinition<u64, V>,
        version: u64,
        record: impl FnOnce(u64, V::SelfType<'_>) -> R,
    ) -> Result<R> {
        self.lookup(table, version, |value| record(version, value))?
            .ok_or(StoreError::NotFound { kind, version })
    }

    /// What `record` makes of the value under `key` in `table`, if there is one: a
    /// keyed read, not a read of the whole table.
    fn lookup<K, V, R>(
        &self,
        table: TableDefinition<K, V>,
        key: K,
        record: impl FnOnce(V::SelfType<'_>) -> R,
    ) -> Result<Option<R>>
    where
        K: redb::Key + std::borrow::Borrow<K::SelfType<'static>> + 'static,
        V: redb::Value + 'static,
    {
        let txn = self.db.begin_read().map_err(catalog)?;
        let table = txn.open_table(table).map_err(catalog)?;
        Ok(table
            .get(key)
            .map_err(catalog)?
            .map(|value| record(value.value())))
    }

    /// C(base -> target): one exact delta from version `base` to `target`, read fully
    /// verified from the cache or built and stored first (see the module docs).
    pub fn composed_artifact(&self, base: u64, target: u64) -> Result<Vec<u8>> {
        let (record, built) = self.ensure_composed(base, target)?;
        if let Some(bytes) = built {
            return Ok(bytes);
        }
        let file = open_delta_artifact(
            "composed delta",
            &self.composed_path(&record),
            record.size_bytes,
            record.id,
            (base, target),
        )?;
        Ok(file.bytes().to_vec())
    }

    /// The record of C(base -> target), building and storing the artifact if the
    /// catalog has none; then also the bytes just built (and verified by the build), so
    /// a caller that wants them need not read them back.
    fn ensure_composed(&self, base: u64, target: u64) -> Result<(ComposedRecord, Option<Vec<u8>>)> {
        if let Some(record) = self.composed_record(base, target)? {
            return Ok((record, None));
        }
        let bytes = self.build_composed(base, target)?;
        let file = DeltaFile::parse(&bytes).map_err(|source| StoreError::ComposedArtifact {
            base,
            target,
            source,
        })?;
        let header = file.header();
        let record = ComposedRecord {
            base_version: base,
            target_version: target,
            id: file.id,
            base_hash: header.base_hash,
            target_hash: header.target_hash,
            size_bytes: bytes.len() as u64,
        };
        let txn = self.db.begin_write().map_err(catalog)?;
        {
            let table = txn.open_table(COMPOSED_TABLE).map_err(catalog)?;
            if let Some(existing) = table.get((base, target)).map_err(catalog)? {
                // Built by another call meanwhile: composing is deterministic, so it is
                // the same artifact.
                return Ok((
                    composed_record((base, target), existing.value()),
                    Some(bytes),
                ));
            }
        }
        commit_with_file(txn, &self.composed_path(&record), &bytes, |txn| {
            txn.open_table(COMPOSED_TABLE)
                .map_err(catalog)?
                .insert((base, target), composed_value(&record))
                .map_err(catalog)?;
            Ok(())
        })?;
        tracing::info!(base, target, id = %record.id, bytes = record.size_bytes, "stored a composed delta");
        Ok((record, Some(bytes)))
    }

    /// Composes D(base+1..=target) against the weights of `base`, rebuilt from the
    /// newest snapshot at or below `base` whose chain of deltas reaches `target`.
    fn build_composed(&self, base: u64, target: u64) -> Result<Vec<u8>> {
        let (deltas, snapshots) = self.records()?;
        let latest = deltas.keys().chain(snapshots.keys()).max().copied();
        if base >= target || latest.is_none_or(|latest| target > latest) {
            return Err(StoreError::NoComposed {
                base,
                target,
                latest,
            });
        }
        let start = snapshots
            .range(..=base)
            .rev()
            .map(|(&s, _)| s)
            .find(|&s| (s + 1..=target).all(|v| deltas.contains_key(&v)))
            .ok_or(StoreError::NoRoute {
                actor: base,
                latest: target,
            })?;
        let (snapshot, snapshot_record) = self.verified_snapshot(start)?;
        let files = (start + 1..=target)
            .map(|version| self.delta(version))
            .collect::<Result<Vec<MappedFile>>>()?;
        let failed = |source| StoreError::ComposedArtifact {
            base,
            target,
            source,
        };
        let chain = files
            .iter()
            .map(|file| DeltaFile::parse(file.bytes()))
            .collect::<Result<Vec<DeltaFile<'_>>, _>>()
            .map_err(failed)?;
        let start_weights = Checkpoint::from_safetensors(snapshot.bytes()).map_err(|source| {
            StoreError::InvalidSnapshot {
                version: start,
                source,
            }
        })?;
        let (to_base, to_target) = chain.split_at((base - start) as usize);
        // The weights of `base`: the snapshot (its hash verified on reading), then the
        // deltas up to `base`, each verified by its target hash as it is applied.
        let rebuilt =
            replay(&start_weights, to_base, Some(snapshot_record.weights_hash)).map_err(failed)?;
        let base_weights = match &rebuilt {
            Some(tensors) => owned_checkpoint(tensors).map_err(failed)?,
            None => start_weights,
        };
        let base_hash = to_base
            .last()
            .map_or(snapshot_record.weights_hash, |delta| {
                delta.header().target_hash
            });
        let options = ExtractOptions {
            base_hash: Some(base_hash),
            ..ExtractOptions::default()
        };
        let (_, bytes) = compose(&base_weights, to_target, options).map_err(failed)?;
        Ok(bytes)
    }

    /// The snapshot of `version`, memory-mapped, with its weights hash verified.
    pub fn snapshot(&self, version: u64) -> Result<MappedFile> {
        Ok(self.verified_snapshot(version)?.0)
    }

    /// [`Store::snapshot`] with the record whose weights hash it was checked against.
    fn verified_snapshot(&self, version: u64) -> Result<(MappedFile, SnapshotRecord)> {
        let record = self.stored("snapshot", SNAPSHOT_TABLE, version, snapshot_record)?;
        let path = self.snapshot_path(&record);
        let file = open_artifact("snapshot", version, &path, record.size_bytes)?;
        let corrupted = |reason: String| StoreError::Corrupted {
            kind: "snapshot",
            version,
            path: path.clone(),
            reason,
        };
        let hash = Checkpoint::from_safetensors(file.bytes())
            .map_err(|e| corrupted(e.to_string()))?
            .weights_hash();
        if hash != record.weights_hash {
            return Err(corrupted(format!(
                "weights hash {hash}, the catalog records {}",
                record.weights_hash
            )));
        }
        Ok((file, record))
    }

    /// The newest snapshot's version: where a new Actor starts.
    pub fn newest_snapshot(&self) -> Result<Option<u64>> {
        let txn = self.db.begin_read().map_err(catalog)?;
        last_version(&txn, SNAPSHOT_TABLE)
    }

    /// The snapshot of `version` as an artifact for a peer with no weights: the delta
    /// from the empty checkpoint to it (every tensor added, in dense chunks), whose base
    /// and target version are both `version`, cut into segments of about
    /// `segment_target_bytes`. The snapshot is verified as it is read; the artifact is
    /// the same bytes for the same snapshot and segment size, whoever builds it, so a
    /// transfer resumes across upstreams.
    pub fn snapshot_artifact(&self, version: u64, segment_target_bytes: usize) -> Result<Vec<u8>> {
        let (file, record) = self.verified_snapshot(version)?;
        let target = Checkpoint::from_safetensors(file.bytes())
            .map_err(|source| StoreError::InvalidSnapshot { version, source })?;
        let empty = Checkpoint::default();
        let options = ExtractOptions {
            encoding: Encoding::Dense,
            base_version: version,
            target_version: version,
            segment_target_bytes,
            // Verified just above: no second pass over the weights.
            target_hash: Some(record.weights_hash),
            ..ExtractOptions::default()
        };
        let (_, bytes) = Extraction::new(&empty, &target, options)
            .and_then(|extraction| extraction.to_bytes())
            .map_err(|source| StoreError::SnapshotArtifact { version, source })?;
        Ok(bytes)
    }

    /// The cheapest way by bytes for an Actor at `actor_version` to reach the latest
    /// version (see the catch-up rule in the module docs). A composed delta counts only
    /// if it is already stored: this is a cheap read; [`Store::composed_catch_up_plan`]
    /// builds one.
    pub fn catch_up_plan(&self, actor_version: u64) -> Result<Plan> {
        let Some(target) = self.latest_version()? else {
            return Err(StoreError::ActorAhead {
                actor: actor_version,
                latest: None,
            });
        };
        let composed = self
            .composed_record(actor_version, target)?
            .map(|c| c.size_bytes);
        self.plan_to(actor_version, target, composed, true)
    }

    /// The cheapest way by bytes for an Actor that holds the weights of `actor_version`
    /// to reach `target` (the version a hub serves, which a newer put may have passed)
    /// over the wire: replaying the deltas or one composed delta. Snapshots are left
    /// out, since the wire serves them only to peers joining without weights (a smaller
    /// snapshot must not turn down a composed delta that beats replaying). Builds and
    /// stores the composed delta first when the Actor is at least two versions behind,
    /// so its size is known; that costs a decode of the chain, once per (base, target).
    pub fn composed_catch_up_plan(&self, actor_version: u64, target: u64) -> Result<Plan> {
        Ok(self.plan_with_composed(actor_version, target)?.0)
    }

    /// [`Store::composed_catch_up_plan`] and, when it chooses the composed delta, its
    /// bytes, verified: those the plan has just built, or else read from the cache.
    pub fn composed_catch_up(
        &self,
        actor_version: u64,
        target: u64,
    ) -> Result<(Plan, Option<Vec<u8>>)> {
        let (plan, built) = self.plan_with_composed(actor_version, target)?;
        let bytes = match (&plan, built) {
            (Plan::Composed { .. }, Some(bytes)) => Some(bytes),
            (Plan::Composed { .. }, None) => Some(self.composed_artifact(actor_version, target)?),
            _ => None,
        };
        Ok((plan, bytes))
    }

    /// The plan, and the composed delta's bytes if building it was part of planning.
    fn plan_with_composed(
        &self,
        actor_version: u64,
        target: u64,
    ) -> Result<(Plan, Option<Vec<u8>>)> {
        let (composed, built) = if actor_version + 2 <= target {
            match self.ensure_composed(actor_version, target) {
                Ok((record, built)) => (Some(record.size_bytes), built),
                // No snapshot and chain rebuild the base: the other plans decide. (A
                // target the store lacks is reported by `plan_to`.)
                Err(StoreError::NoRoute { .. } | StoreError::NoComposed { .. }) => (None, None),
                Err(error) => return Err(error),
            }
        } else {
            (None, None)
        };
        Ok((self.plan_to(actor_version, target, composed, false)?, built))
    }

    /// [`plan::choose`] over the catalog's sizes (snapshots only `with_snapshots`), after
    /// checking that the Actor is not past `target` and `target` is stored.
    fn plan_to(
        &self,
        actor_version: u64,
        target: u64,
        composed: Option<u64>,
        with_snapshots: bool,
    ) -> Result<Plan> {
        let (deltas, snapshots) = self.records()?;
        let latest = deltas.keys().chain(snapshots.keys()).max().copied();
        if latest.is_none_or(|latest| target > latest) {
            return Err(StoreError::NotFound {
                kind: "version",
                version: target,
            });
        }
        if actor_version > target {
            return Err(StoreError::ActorAhead {
                actor: actor_version,
                latest: Some(target),
            });
        }
        let (delta_sizes, mut snapshot_sizes) = sizes(&deltas, &snapshots);
        if !with_snapshots {
            snapshot_sizes.clear();
        }
        plan::choose(
            actor_version,
            target,
            &delta_sizes,
            &snapshot_sizes,
            composed,
        )
        .ok_or(StoreError::NoRoute {
            actor: actor_version,
            latest: target,
        })
    }

    /// Removes artifacts older than `keep_versions_from` that nobody needs. Kept:
    /// - every delta and snapshot of version `keep_versions_from` or later;
    /// - the newest snapshot and every delta after it, so a new Actor can always join;
    /// - for each live Actor at version a: the deltas after a and the snapshot its
    ///   current catch-up plan starts from, so its plan is unchanged by the prune;
    /// - the composed deltas whose target is the latest version (no other is served
    ///   again: Actors catch up to the latest);
    /// - every version's rollouts: the run's training data, which no Actor needs and
    ///   no prune of weights should take away.
    ///
    /// Records are removed in one committed transaction before any file is deleted (see
    /// the module docs for why this order is crash-safe).
    pub fn prune(
        &self,
        keep_versions_from: u64,
        live_actor_versions: &[u64],
    ) -> Result<PruneReport> {
        let (deltas, snapshots) = self.records()?;
        let composed = self.composed_records()?;
        let Some(latest) = deltas.keys().chain(snapshots.keys()).max().copied() else {
            return Ok(PruneReport::default());
        };
        let mut keep_deltas: BTreeSet<u64> =
            deltas.range(keep_versions_from..).map(|d| *d.0).collect();
        let mut keep_snapshots: BTreeSet<u64> = snapshots
            .range(keep_versions_from..)
            .map(|s| *s.0)
            .collect();
        if let Some(&newest) = snapshots.keys().next_back() {
            keep_snapshots.insert(newest);
            keep_deltas.extend(deltas.range(newest + 1..).map(|d| *d.0));
        }
        let (delta_sizes, snapshot_sizes) = sizes(&deltas, &snapshots);
        // An Actor ahead of the store has nothing here to lose.
        for &actor in live_actor_versions.iter().filter(|&&a| a <= latest) {
            keep_deltas.extend(deltas.range(actor + 1..).map(|d| *d.0));
            let composed_size = composed.get(&(actor, latest)).map(|c| c.size_bytes);
            if let Some(Plan::Snapshot { snapshot, .. }) =
                plan::choose(actor, latest, &delta_sizes, &snapshot_sizes, composed_size)
            {
                keep_snapshots.insert(snapshot);
            }
        }
        let doomed_deltas: Vec<&DeltaRecord> = deltas
            .values()
            .filter(|d| !keep_deltas.contains(&d.version))
            .collect();
        let doomed_snapshots: Vec<&SnapshotRecord> = snapshots
            .values()
            .filter(|s| !keep_snapshots.contains(&s.version))
            .collect();
        let doomed_composed: Vec<&ComposedRecord> = composed
            .values()
            .filter(|c| c.target_version != latest)
            .collect();

        let txn = self.db.begin_write().map_err(catalog)?;
        {
            let mut table = txn.open_table(DELTA_TABLE).map_err(catalog)?;
            for record in &doomed_deltas {
                table.remove(record.version).map_err(catalog)?;
            }
            let mut table = txn.open_table(SNAPSHOT_TABLE).map_err(catalog)?;
            for record in &doomed_snapshots {
                table.remove(record.version).map_err(catalog)?;
            }
            let mut table = txn.open_table(COMPOSED_TABLE).map_err(catalog)?;
            for record in &doomed_composed {
                table
                    .remove((record.base_version, record.target_version))
                    .map_err(catalog)?;
            }
        }
        txn.commit().map_err(catalog)?;

        let paths = doomed_deltas
            .iter()
            .map(|d| self.delta_path(d))
            .chain(doomed_snapshots.iter().map(|s| self.snapshot_path(s)))
            .chain(doomed_composed.iter().map(|c| self.composed_path(c)));
        for path in paths {
            remove_unreferenced(&path)?;
        }
        let report = PruneReport {
            deltas: doomed_deltas.iter().map(|d| d.version).collect(),
            snapshots: doomed_snapshots.iter().map(|s| s.version).collect(),
            composed: doomed_composed
                .iter()
                .map(|c| (c.base_version, c.target_version))
                .collect(),
            bytes_freed: doomed_deltas.iter().map(|d| d.size_bytes).sum::<u64>()
                + doomed_snapshots.iter().map(|s| s.size_bytes).sum::<u64>()
                + doomed_composed.iter().map(|c| c.size_bytes).sum::<u64>(),
        };
        tracing::info!(?report, "pruned the store");
        Ok(report)
    }

    fn delta_path(&self, record: &DeltaRecord) -> PathBuf {
        self.root
            .join(DELTAS)
            .join(format!("{}-{}.adelta", record.version, record.id))
    }

    fn composed_path(&self, record: &ComposedRecord) -> PathBuf {
        self.root.join(COMPOSED).join(format!(
            "{}-{}-{}.adelta",
            record.base_version, record.target_version, record.id
        ))
    }

    fn rollouts_path(&self, record: &RolloutsRecord) -> PathBuf {
        self.root
            .join(ROLLOUTS)
            .join(format!("{}-{}.json", record.version, record.hash))
    }

    fn snapshot_path(&self, record: &SnapshotRecord) -> PathBuf {
        self.root.join(SNAPSHOTS).join(format!(
            "{}-{}.safetensors",
            record.version, record.weights_hash
        ))
    }

    /// Deletes every file in `deltas/`, `snapshots/` and `composed/` that no record names: the
    /// leftovers of a crash between a file write and its commit, or between a prune's
    /// commit and its deletions, and temporary files of interrupted writes.
    fn remove_orphans(&self) -> Result<()> {
        let (deltas, snapshots) = self.records()?;
        let referenced: BTreeSet<PathBuf> = deltas
            .values()
            .map(|d| self.delta_path(d))
            .chain(snapshots.values().map(|s| self.snapshot_path(s)))
            .chain(
                self.composed_records()?
                    .values()
                    .map(|c| self.composed_path(c)),
            )
            .chain(
                self.rollouts_records()?
                    .values()
                    .map(|r| self.rollouts_path(r)),
            )
            .collect();
        for dir in [DELTAS, SNAPSHOTS, COMPOSED, ROLLOUTS] {
            let dir = self.root.join(dir);
            let io = |source| StoreError::Io {
                path: dir.clone(),
                source,
            };
            for entry in fs::read_dir(&dir).map_err(io)? {
                let path = entry.map_err(io)?.path();
                if !referenced.contains(&path) {
                    tracing::warn!(path = %path.display(), "removing a file the catalog does not list");
                    remove_unreferenced(&path)?;
                }
            }
        }
        Ok(())
    }
}

const CATALOG: &str = "catalog.redb";
const DELTAS: &str = "deltas";
const SNAPSHOTS: &str = "snapshots";
const COMPOSED: &str = "composed";
const ROLLOUTS: &str = "rollouts";

/// (base version, id, base hash, target hash, size in bytes)
type DeltaValue = (u64, [u8; 32], [u8; 32], [u8; 32], u64);
/// (weights hash, size in bytes)
type SnapshotValue = ([u8; 32], u64);
/// (id, base hash, target hash, size in bytes)
type ComposedValue = ([u8; 32], [u8; 32], [u8; 32], u64);

/// The catalog's layout: its tables and their value encodings. A change to either takes
/// a new number; a catalog of another number is refused, never misread.
pub const SCHEMA_VERSION: u32 = 1;
const SCHEMA_TABLE: TableDefinition<&str, u32> = TableDefinition::new("schema");

/// Stamps a new catalog with [`SCHEMA_VERSION`] and refuses one of another version. A
/// catalog from before the stamp has this version's layout and is stamped.
fn check_schema(txn: &WriteTransaction) -> Result<()> {
    let mut table = txn.open_table(SCHEMA_TABLE).map_err(catalog)?;
    let found = table.get("version").map_err(catalog)?.map(|v| v.value());
    match found {
        None => {
            table.insert("version", SCHEMA_VERSION).map_err(catalog)?;
            Ok(())
        }
        Some(SCHEMA_VERSION) => Ok(()),
        Some(found) => Err(StoreError::Schema {
            found,
            supported: SCHEMA_VERSION,
        }),
    }
}

const DELTA_TABLE: TableDefinition<u64, DeltaValue> = TableDefinition::new("deltas");
const SNAPSHOT_TABLE: TableDefinition<u64, SnapshotValue> = TableDefinition::new("snapshots");
/// version → (hash of the file, size in bytes)
const ROLLOUTS_TABLE: TableDefinition<u64, ([u8; 32], u64)> = TableDefinition::new("rollouts");
/// (base version, target version) → (id, base hash, target hash, size in bytes)
const COMPOSED_TABLE: TableDefinition<(u64, u64), ComposedValue> = TableDefinition::new("composed");

/// Every entry of `table`, as `entry` makes it (a map key and a record), in key order.
fn read_all<K, V, M: Ord, R>(
    txn: &redb::ReadTransaction,
    table: TableDefinition<K, V>,
    entry: impl Fn(K::SelfType<'_>, V::SelfType<'_>) -> (M, R),
) -> Result<BTreeMap<M, R>>
where
    K: redb::Key + 'static,
    V: redb::Value + 'static,
{
    let table = txn.open_table(table).map_err(catalog)?;
    let mut records = BTreeMap::new();
    for item in table.iter().map_err(catalog)? {
        let (key, value) = item.map_err(catalog)?;
        let (key, record) = entry(key.value(), value.value());
        records.insert(key, record);
    }
    Ok(records)
}

/// The highest version in `table`: a lookup at the end of its key order, not a read of
/// the table.
fn last_version<V: redb::Value + 'static>(
    txn: &redb::ReadTransaction,
    table: TableDefinition<u64, V>,
) -> Result<Option<u64>> {
    let table = txn.open_table(table).map_err(catalog)?;
    Ok(table.last().map_err(catalog)?.map(|(key, _)| key.value()))
}

fn rollouts_record(version: u64, (hash, size_bytes): ([u8; 32], u64)) -> RolloutsRecord {
    RolloutsRecord {
        version,
        hash: Hash(hash),
        size_bytes,
    }
}

fn delta_value(r: &DeltaRecord) -> DeltaValue {
    (
        r.base_version,
        r.id.0,
        r.base_hash.0,
        r.target_hash.0,
        r.size_bytes,
    )
}

fn delta_record(version: u64, v: DeltaValue) -> DeltaRecord {
    DeltaRecord {
        version,
        base_version: v.0,
        id: Hash(v.1),
        base_hash: Hash(v.2),
        target_hash: Hash(v.3),
        size_bytes: v.4,
    }
}

fn composed_value(r: &ComposedRecord) -> ComposedValue {
    (r.id.0, r.base_hash.0, r.target_hash.0, r.size_bytes)
}

fn composed_record((base_version, target_version): (u64, u64), v: ComposedValue) -> ComposedRecord {
    ComposedRecord {
        base_version,
        target_version,
        id: Hash(v.0),
        base_hash: Hash(v.1),
        target_hash: Hash(v.2),
        size_bytes: v.3,
    }
}

fn snapshot_value(r: &SnapshotRecord) -> SnapshotValue {
    (r.weights_hash.0, r.size_bytes)
}

fn snapshot_record(version: u64, v: SnapshotValue) -> SnapshotRecord {
    SnapshotRecord {
        version,
        weights_hash: Hash(v.0),
        size_bytes: v.1,
    }
}

fn get_delta(
    table: &impl ReadableTable<u64, DeltaValue>,
    version: u64,
) -> Result<Option<DeltaRecord>> {
    let value = table.get(version).map_err(catalog)?;
    Ok(value.map(|v| delta_record(version, v.value())))
}

fn get_snapshot(
    table: &impl ReadableTable<u64, SnapshotValue>,
    version: u64,
) -> Result<Option<SnapshotRecord>> {
    let value = table.get(version).map_err(catalog)?;
    Ok(value.map(|v| snapshot_record(version, v.value())))
}

/// The weights hash of `version` if the store knows it, as a delta's target or a snapshot.
fn known_weights(
    deltas: &impl ReadableTable<u64, DeltaValue>,
    snapshots: &impl ReadableTable<u64, SnapshotValue>,
    version: u64,
) -> Result<Option<Hash>> {
    if let Some(delta) = get_delta(deltas, version)? {
        return Ok(Some(delta.target_hash));
    }
    Ok(get_snapshot(snapshots, version)?.map(|s| s.weights_hash))
}

fn sizes(
    deltas: &BTreeMap<u64, DeltaRecord>,
    snapshots: &BTreeMap<u64, SnapshotRecord>,
) -> (BTreeMap<u64, u64>, BTreeMap<u64, u64>) {
    (
        deltas.iter().map(|(&v, d)| (v, d.size_bytes)).collect(),
        snapshots.iter().map(|(&v, s)| (v, s.size_bytes)).collect(),
    )
}

/// Writes `bytes` to `path` crash-safely, lets `record` add the catalog entry, and
/// commits `txn`. A failed commit removes the file: it was never recorded, so it is not
/// part of the store (and `open` would remove it anyway).
fn commit_with_file(
    txn: WriteTransaction,
    path: &Path,
    bytes: &[u8],
    record: impl FnOnce(&WriteTransaction) -> Result<()>,
) -> Result<()> {
    write_file(path, bytes)?;
    let committed = record(&txn).and_then(|()| txn.commit().map_err(catalog));
    if committed.is_err() {
        let _ = fs::remove_file(path);
    }
    committed
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomically(path, |writer| {
        writer.write_all(bytes).map_err(|source| {
            StoreError::File(FileError::Io {
                path: path.to_path_buf(),
                source,
            })
        })
    })
}

/// Maps a recorded artifact after checking that it exists and has the recorded length.
fn open_artifact(
    kind: &'static str,
    version: u64,
    path: &Path,
    size_bytes: u64,
) -> Result<MappedFile> {
    let length = match fs::metadata(path) {
        Ok(metadata) => metadata.len(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(StoreError::Missing {
                kind,
                version,
                path: path.to_path_buf(),
            });
        }
        Err(source) => {
            return Err(StoreError::Io {
                path: path.to_path_buf(),
                source,
            });
        }
    };
    if length != size_bytes {
        return Err(StoreError::Corrupted {
            kind,
            version,
            path: path.to_path_buf(),
            reason: format!("{length} bytes, the catalog records {size_bytes}"),
        });
    }
    Ok(MappedFile::open(path)?)
}

/// Maps a recorded delta-format artifact (a delta or a composed delta) and verifies it:
/// its length, manifest hash and every segment hash, and its id, base and target
/// versions against the record. Reported under `kind` and the target version.
fn open_delta_artifact(
    kind: &'static str,
    path: &Path,
    size_bytes: u64,
    id: Hash,
    (base_version, target_version): (u64, u64),
) -> Result<MappedFile> {
    let file = open_artifact(kind, target_version, path, size_bytes)?;
    let corrupted = |reason: String| StoreError::Corrupted {
        kind,
        version: target_version,
        path: path.to_path_buf(),
        reason,
    };
    let delta = DeltaFile::parse(file.bytes()).map_err(|e| corrupted(e.to_string()))?;
    for index in 0..delta.segment_count() {
        delta
            .verify_segment(index)
            .map_err(|e| corrupted(e.to_string()))?;
    }
    let header = delta.header();
    if delta.id != id
        || header.base_version != base_version
        || header.target_version != target_version
    {
        return Err(corrupted(format!(
            "it is artifact {} from version {} to {}, the catalog records {id} from {base_version} to {target_version}",
            delta.id, header.base_version, header.target_version
        )));
    }
    Ok(file)
}

/// Deletes a file no record names; one already gone is fine (a crash may have come after
/// some deletions).
fn remove_unreferenced(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(StoreError::Io {
            path: path.to_path_buf(),
            source: e,
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests;
