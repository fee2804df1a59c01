//! The artifact files on disk: where each one lives, the crash-safe write that precedes
//! its record, the checks before a recorded file is served, and the removal of files no
//! record names.

use std::collections::BTreeSet;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use aurora_checkpoint::{FileError, MappedFile, write_atomically};
use aurora_delta::{DeltaFile, Hash};
use redb::WriteTransaction;

use crate::catalog::{ComposedRecord, DeltaRecord, SnapshotRecord, TrainerData, TrainerDataRecord};
use crate::error::catalog;
use crate::{Result, Store, StoreError};

pub(crate) const CATALOG: &str = "catalog.redb";
pub(crate) const DELTAS: &str = "deltas";
pub(crate) const SNAPSHOTS: &str = "snapshots";
pub(crate) const COMPOSED: &str = "composed";
/// Snapshots as the artifacts joiners take, built on demand: derived data, named by the
/// snapshot they come from and kept only while it is.
pub(crate) const SNAPSHOT_ARTIFACTS: &str = "snapshot-artifacts";

/// Every directory of artifact files.
pub(crate) fn artifact_dirs() -> impl Iterator<Item = &'static str> {
    [DELTAS, SNAPSHOTS, COMPOSED, SNAPSHOT_ARTIFACTS]
        .into_iter()
        .chain(TrainerData::ALL.map(|kind| kind.location().0))
}

impl Store {
    pub(crate) fn delta_path(&self, record: &DeltaRecord) -> PathBuf {
        self.root
            .join(DELTAS)
            .join(format!("{}-{}.adelta", record.version, record.id))
    }

    pub(crate) fn composed_path(&self, record: &ComposedRecord) -> PathBuf {
        self.root.join(COMPOSED).join(format!(
            "{}-{}-{}.adelta",
            record.base_version, record.target_version, record.id
        ))
    }

    pub(crate) fn trainer_data_path(&self, record: &TrainerDataRecord) -> PathBuf {
        let (dir, extension) = record.kind.location();
        self.root
            .join(dir)
            .join(format!("{}-{}.{extension}", record.version, record.hash))
    }

    /// Where the snapshot of `record` is kept as the artifact a joiner takes, cut into
    /// segments of about `segment_target_bytes`.
    pub(crate) fn snapshot_artifact_path(
        &self,
        record: &SnapshotRecord,
        segment_target_bytes: usize,
    ) -> PathBuf {
        self.root.join(SNAPSHOT_ARTIFACTS).join(format!(
            "{}-{segment_target_bytes}.adelta",
            snapshot_stem(record)
        ))
    }

    pub(crate) fn snapshot_path(&self, record: &SnapshotRecord) -> PathBuf {
        self.root
            .join(SNAPSHOTS)
            .join(format!("{}.safetensors", snapshot_stem(record)))
    }

    /// Deletes every file in the artifact directories that no record names: the
    /// leftovers of a crash between a file write and its commit, or between a prune's
    /// commit and its deletions, and temporary files of interrupted writes.
    pub(crate) fn remove_orphans(&self) -> Result<()> {
        let (deltas, snapshots) = self.records()?;
        let mut referenced: BTreeSet<PathBuf> = deltas
            .values()
            .map(|d| self.delta_path(d))
            .chain(snapshots.values().map(|s| self.snapshot_path(s)))
            .chain(
                self.composed_records()?
                    .values()
                    .map(|c| self.composed_path(c)),
            )
            .collect();
        for kind in TrainerData::ALL {
            let records = self.trainer_data_records(kind)?;
            referenced.extend(records.values().map(|r| self.trainer_data_path(r)));
        }
        // A snapshot's artifacts (one per segment size) go with it.
        let snapshot_stems: BTreeSet<String> = snapshots.values().map(snapshot_stem).collect();
        let is_referenced = |path: &Path| {
            referenced.contains(path)
                || path.parent() == Some(&self.root.join(SNAPSHOT_ARTIFACTS))
                    && path
                        .file_name()
                        .and_then(|name| name.to_str())
                        .and_then(|name| name.rsplit_once('-'))
                        .is_some_and(|(stem, _)| snapshot_stems.contains(stem))
        };
        for dir in artifact_dirs() {
            let dir = self.root.join(dir);
            let io = |source| StoreError::Io {
                path: dir.clone(),
                source,
            };
            for entry in fs::read_dir(&dir).map_err(io)? {
                let path = entry.map_err(io)?.path();
                if !is_referenced(&path) {
                    tracing::warn!(path = %path.display(), "removing a file the catalog does not list");
                    remove_unreferenced(&path)?;
                }
            }
        }
        Ok(())
    }
}

impl Store {
    /// Deletes the artifacts built from the snapshot of `record` (every segment size):
    /// they go when it goes.
    pub(crate) fn remove_snapshot_artifacts(&self, record: &SnapshotRecord) -> Result<()> {
        let dir = self.root.join(SNAPSHOT_ARTIFACTS);
        let io = |source| StoreError::Io {
            path: dir.clone(),
            source,
        };
        let prefix = format!("{}-", snapshot_stem(record));
        for entry in fs::read_dir(&dir).map_err(io)? {
            let path = entry.map_err(io)?.path();
            let built_from_it = path
                .file_name()
                .and_then(|name| name.to_str())
                .and_then(|name| name.strip_prefix(&prefix))
                .is_some_and(|rest| !rest.contains('-'));
            if built_from_it {
                remove_unreferenced(&path)?;
            }
        }
        Ok(())
    }
}

/// What names a snapshot's files: its version and weights hash.
fn snapshot_stem(record: &SnapshotRecord) -> String {
    format!("{}-{}", record.version, record.weights_hash)
}

/// Writes `bytes` to `path` crash-safely, lets `record` add the catalog entry, and
/// commits `txn`. A failed commit removes the file: it was never recorded, so it is not
/// part of the store (and `open` would remove it anyway).
pub(crate) fn commit_with_file(
    txn: WriteTransaction,
    path: &Path,
    bytes: &[u8],
    record: impl FnOnce(&WriteTransaction) -> Result<()>,
) -> Result<()> {
    commit_with_written(txn, path, || write_file(path, bytes), |txn, ()| record(txn))
}

/// [`commit_with_file`] with the file made by `write`, which must write `path`
/// crash-safely (a file too large to hold in memory, written as it is produced); what
/// it returns (the file's size, say) goes to `record`.
pub(crate) fn commit_with_written<T>(
    txn: WriteTransaction,
    path: &Path,
    write: impl FnOnce() -> Result<T>,
    record: impl FnOnce(&WriteTransaction, T) -> Result<()>,
) -> Result<()> {
    let written = write()?;
    let committed = record(&txn, written).and_then(|()| txn.commit().map_err(catalog));
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
pub(crate) fn open_artifact(
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
pub(crate) fn open_delta_artifact(
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
    let delta = verified_delta(&file, corrupted)?;
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

/// `file` parsed as a delta-format artifact with its manifest and every segment hash
/// verified; what is wrong goes to `corrupted`.
pub(crate) fn verified_delta(
    file: &MappedFile,
    corrupted: impl Fn(String) -> StoreError,
) -> Result<DeltaFile<'_>> {
    let delta = DeltaFile::parse(file.bytes()).map_err(|e| corrupted(e.to_string()))?;
    for index in 0..delta.segment_count() {
        delta
            .verify_segment(index)
            .map_err(|e| corrupted(e.to_string()))?;
    }
    Ok(delta)
}

/// Deletes a file no record names; one already gone is fine (a crash may have come after
/// some deletions).
pub(crate) fn remove_unreferenced(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(StoreError::Io {
            path: path.to_path_buf(),
            source: e,
        }),
        _ => Ok(()),
    }
}
