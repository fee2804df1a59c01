//! Serving stored artifacts, each verified against its record before it is returned.

use aurora_checkpoint::MappedFile;
use aurora_delta::{Checkpoint, Encoding, ExtractOptions, Extraction, Hash};

use crate::catalog::{
    DELTA_TABLE, SNAPSHOT_TABLE, SnapshotRecord, TrainerData, delta_record, snapshot_record,
    trainer_data_record,
};
use crate::files::{open_artifact, open_delta_artifact};
use crate::{Result, Store, StoreError};

impl Store {
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

    /// `version`'s trainer data of `kind`, verified against its hash.
    pub fn trainer_data(&self, kind: TrainerData, version: u64) -> Result<Vec<u8>> {
        let record = self.stored(kind.name(), kind.table(), version, |v, value| {
            trainer_data_record(kind, v, value)
        })?;
        let path = self.trainer_data_path(&record);
        let file = open_artifact(kind.name(), version, &path, record.size_bytes)?;
        let actual = Hash::of(file.bytes());
        if actual != record.hash {
            return Err(StoreError::Corrupted {
                kind: kind.name(),
                version,
                path,
                reason: format!("its hash is {actual}, the catalog says {}", record.hash),
            });
        }
        Ok(file.bytes().to_vec())
    }

    /// The snapshot of `version`, memory-mapped, with its weights hash verified.
    pub fn snapshot(&self, version: u64) -> Result<MappedFile> {
        Ok(self.verified_snapshot(version)?.0)
    }

    /// [`Store::snapshot`] with the record whose weights hash it was checked against.
    pub(crate) fn verified_snapshot(&self, version: u64) -> Result<(MappedFile, SnapshotRecord)> {
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
}
