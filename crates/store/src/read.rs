//! Serving stored artifacts, each verified against its record before it is returned.

use std::path::Path;

use aurora_checkpoint::{FileError, MappedFile, write_delta};
use aurora_delta::{
    Checkpoint, DeltaError, Encoding, ExtractOptions, Extraction, Hash, TargetHash,
};

use crate::catalog::{
    DELTA_TABLE, SNAPSHOT_TABLE, SnapshotRecord, TrainerData, delta_record, snapshot_record,
    trainer_data_record,
};
use crate::files::{open_artifact, open_delta_artifact, verified_delta};
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
    /// `segment_target_bytes`. It is the same bytes for the same snapshot and segment
    /// size, whoever builds it, so a transfer resumes across upstreams.
    ///
    /// Built once into `snapshot-artifacts/`, segment by segment as it is extracted from
    /// the mapped snapshot, and mapped from there: neither building nor serving it holds
    /// the model in memory, however large. Every call verifies the file whole (its
    /// manifest, every segment, and its target against the snapshot's record); a
    /// damaged one is built again.
    pub fn snapshot_artifact(
        &self,
        version: u64,
        segment_target_bytes: usize,
    ) -> Result<MappedFile> {
        let record = self.stored("snapshot", SNAPSHOT_TABLE, version, snapshot_record)?;
        let path = self.snapshot_artifact_path(&record, segment_target_bytes);
        if path.exists() {
            match verified_snapshot_artifact(&path, &record) {
                Ok(file) => return Ok(file),
                Err(error) => tracing::warn!(
                    path = %path.display(),
                    %error,
                    "the snapshot artifact does not verify; building it again"
                ),
            }
        }
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
            target_hash: TargetHash::Known(record.weights_hash),
            ..ExtractOptions::default()
        };
        let extraction = Extraction::new(&empty, &target, options)
            .map_err(|source| StoreError::SnapshotArtifact { version, source })?;
        write_delta(&path, &extraction.header().encode(), |sink| {
            extraction.run(|segment| sink(segment).map_err(BuildError::File))
        })
        .map_err(|error| match error {
            BuildError::File(error) => StoreError::File(error),
            BuildError::Extraction(source) => StoreError::SnapshotArtifact { version, source },
        })?;
        verified_snapshot_artifact(&path, &record)
    }
}

/// Why writing an artifact as it is extracted failed.
enum BuildError {
    Extraction(DeltaError),
    File(FileError),
}

impl From<DeltaError> for BuildError {
    fn from(error: DeltaError) -> BuildError {
        BuildError::Extraction(error)
    }
}

impl From<FileError> for BuildError {
    fn from(error: FileError) -> BuildError {
        BuildError::File(error)
    }
}

/// Maps the artifact of the snapshot `record` at `path` and verifies it whole: its
/// manifest and every segment, the snapshot's version as base and target, its weights
/// hash as target.
fn verified_snapshot_artifact(path: &Path, record: &SnapshotRecord) -> Result<MappedFile> {
    let file = MappedFile::open(path)?;
    let corrupted = |reason: String| StoreError::Corrupted {
        kind: "snapshot artifact",
        version: record.version,
        path: path.to_path_buf(),
        reason,
    };
    let delta = verified_delta(&file, corrupted)?;
    let header = delta.header();
    if (header.base_version, header.target_version) != (record.version, record.version)
        || header.target_hash != record.weights_hash
    {
        return Err(corrupted(format!(
            "it takes version {} to {} with weights {}, the snapshot is version {} with weights {}",
            header.base_version,
            header.target_version,
            header.target_hash,
            record.version,
            record.weights_hash
        )));
    }
    drop(delta);
    Ok(file)
}
