//! Accepting artifacts: each is verified and checked against the acceptance rule under
//! the catalog's write lock, then written, then recorded.

use std::path::Path;

use aurora_checkpoint::{MappedFile, write_checkpoint};
use aurora_delta::{ArtifactSignature, Checkpoint, DeltaFile, Hash};
use redb::ReadableTable;

use crate::catalog::{
    DELTA_TABLE, DeltaRecord, SNAPSHOT_TABLE, SnapshotRecord, TrainerData, TrainerDataRecord,
    delta_value, get_delta, get_snapshot, known_weights, snapshot_value, trainer_data_record,
};
use crate::error::catalog;
use crate::files::{commit_with_file, commit_with_written};
use crate::{Result, Store, StoreError};

impl Store {
    /// Verifies and stores a delta artifact with the trainer's signature (checked by
    /// whoever pins the trainer key: the store holds no key), then records it (see the
    /// acceptance rule in the crate docs). Storing the same artifact again returns its
    /// record.
    pub fn put_delta(
        &self,
        bytes: &[u8],
        signature: Option<ArtifactSignature>,
    ) -> Result<DeltaRecord> {
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
            signature,
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
        self.drop_superseded_composed()?;
        Ok(record)
    }

    /// Stores a snapshot of `version` from a safetensors image, after computing its
    /// weights hash and checking it against the deltas into and out of `version`.
    pub fn put_snapshot(&self, version: u64, safetensors: &[u8]) -> Result<SnapshotRecord> {
        let checkpoint = Checkpoint::from_safetensors(safetensors)
            .map_err(|source| StoreError::InvalidSnapshot { version, source })?;
        self.put_snapshot_checkpoint(version, &checkpoint)
    }

    /// [`Store::put_snapshot`] from a safetensors file, memory-mapped rather than read.
    pub fn put_snapshot_file(&self, version: u64, path: &Path) -> Result<SnapshotRecord> {
        let file = MappedFile::open(path)?;
        self.put_snapshot(version, file.bytes())
    }

    /// Stores `checkpoint` as the snapshot of `version`, written tensor by tensor from
    /// where its data lies (no image of the model in memory), after checking its weights
    /// hash against the deltas into and out of `version`. The file is the canonical
    /// safetensors form of the tensors, whatever form they came in.
    pub fn put_snapshot_checkpoint(
        &self,
        version: u64,
        checkpoint: &Checkpoint<'_>,
    ) -> Result<SnapshotRecord> {
        let weights_hash = checkpoint.weights_hash();
        let txn = self.db.begin_write().map_err(catalog)?;
        {
            let deltas = txn.open_table(DELTA_TABLE).map_err(catalog)?;
            let snapshots = txn.open_table(SNAPSHOT_TABLE).map_err(catalog)?;
            if let Some(existing) = get_snapshot(&snapshots, version)? {
                if existing.weights_hash == weights_hash {
                    return Ok(existing);
                }
                return Err(StoreError::Conflict {
                    kind: "snapshot",
                    version,
                    existing: existing.weights_hash,
                    offered: weights_hash,
                });
            }
            let known = get_delta(&deltas, version)?
                .map(|d| d.target_hash)
                .or(get_delta(&deltas, version + 1)?.map(|d| d.base_hash));
            if let Some(known) = known
                && known != weights_hash
            {
                return Err(StoreError::WrongWeights {
                    kind: "snapshot",
                    version,
                    known,
                    offered: weights_hash,
                });
            }
        }
        let mut record = SnapshotRecord {
            version,
            weights_hash,
            size_bytes: 0,
        };
        // The name depends on the version and the weights hash alone.
        let path = self.snapshot_path(&record);
        commit_with_written(
            txn,
            &path,
            || Ok(write_checkpoint(&path, checkpoint)?),
            |txn, size_bytes| {
                record.size_bytes = size_bytes;
                txn.open_table(SNAPSHOT_TABLE)
                    .map_err(catalog)?
                    .insert(version, snapshot_value(&record))
                    .map_err(catalog)?;
                Ok(())
            },
        )?;
        tracing::info!(version, hash = %record.weights_hash, bytes = record.size_bytes, "stored snapshot");
        self.drop_superseded_composed()?;
        Ok(record)
    }

    /// Stores `version`'s trainer data of `kind` (opaque bytes: the trainer's
    /// serialization). Immutable like every artifact: the same bytes again are a no-op,
    /// other bytes for a stored version a conflict.
    pub fn put_trainer_data(
        &self,
        kind: TrainerData,
        version: u64,
        bytes: &[u8],
    ) -> Result<TrainerDataRecord> {
        let record = TrainerDataRecord {
            kind,
            version,
            hash: Hash::of(bytes),
            size_bytes: bytes.len() as u64,
        };
        let txn = self.db.begin_write().map_err(catalog)?;
        {
            let table = txn.open_table(kind.table()).map_err(catalog)?;
            if let Some(existing) = table.get(version).map_err(catalog)? {
                let existing = trainer_data_record(kind, version, existing.value());
                if existing.hash == record.hash {
                    return Ok(existing);
                }
                return Err(StoreError::Conflict {
                    kind: kind.name(),
                    version,
                    existing: existing.hash,
                    offered: record.hash,
                });
            }
        }
        commit_with_file(txn, &self.trainer_data_path(&record), bytes, |txn| {
            txn.open_table(kind.table())
                .map_err(catalog)?
                .insert(version, (record.hash.0, record.size_bytes))
                .map_err(catalog)?;
            Ok(())
        })?;
        tracing::info!(kind = kind.name(), version, hash = %record.hash, bytes = record.size_bytes, "stored trainer data");
        Ok(record)
    }
}
