use std::path::PathBuf;

use aurora_checkpoint::FileError;
use aurora_delta::{DeltaError, Hash};

/// Everything that can go wrong in the checkpoint store.
///
/// Every variant names the version and, where there is one, the file, because these
/// errors reach operators looking at a store on disk.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    // The source is printed by the error chain (`{:#}`), not repeated here.
    #[error("{path}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    File(#[from] FileError),
    #[error("catalog database")]
    Catalog(#[source] redb::Error),
    #[error(
        "the catalog has schema version {found}, and this build reads version {supported} only: \
         {}",
        if *found > *supported { "it was written by a newer aurora" } else { "it is not one aurora wrote" }
    )]
    Schema { found: u32, supported: u32 },
    #[error("the catalog has no run id: it was damaged, or not written by aurora")]
    NoRunId,
    #[error("no randomness for the run's id: {0}")]
    Random(String),
    #[error("delta refused: it does not verify")]
    InvalidDelta(#[source] DeltaError),
    #[error("snapshot for version {version} refused: it is not a valid checkpoint")]
    InvalidSnapshot { version: u64, source: DeltaError },
    #[error("the weights of version {version} cannot be rebuilt from the store")]
    Rebuild { version: u64, source: DeltaError },
    #[error("the composed delta from version {base} to {target} cannot be built")]
    ComposedArtifact {
        base: u64,
        target: u64,
        source: DeltaError,
    },
    #[error(
        "no composed delta from version {base} to {target}: it must go forward to a stored version (latest {latest:?})"
    )]
    NoComposed {
        base: u64,
        target: u64,
        latest: Option<u64>,
    },
    #[error("the snapshot of version {version} cannot travel as an artifact")]
    SnapshotArtifact { version: u64, source: DeltaError },
    #[error(
        "delta for version {version} starts from version {base_version}; the store accepts only D(v) from v-1"
    )]
    NotConsecutive { version: u64, base_version: u64 },
    #[error(
        "delta for version {version} starts from weights {offered}, but the stored version {} has weights {known}",
        .version - 1
    )]
    WrongBase {
        version: u64,
        known: Hash,
        offered: Hash,
    },
    #[error(
        "{kind} for version {version} gives weights {offered}, but the store already holds version {version} with weights {known}"
    )]
    WrongWeights {
        kind: &'static str,
        version: u64,
        known: Hash,
        offered: Hash,
    },
    #[error(
        "a different {kind} for version {version} is already stored ({existing}); refusing {offered}"
    )]
    Conflict {
        kind: &'static str,
        version: u64,
        existing: Hash,
        offered: Hash,
    },
    #[error("no {kind} for version {version} in the store")]
    NotFound { kind: &'static str, version: u64 },
    #[error("the catalog lists the {kind} for version {version} but its file {path} is missing")]
    Missing {
        kind: &'static str,
        version: u64,
        path: PathBuf,
    },
    #[error(
        "stored {kind} for version {version} ({path}) is corrupted: {reason}; it is not served"
    )]
    Corrupted {
        kind: &'static str,
        version: u64,
        path: PathBuf,
        reason: String,
    },
    #[error("actor at version {actor} is ahead of the store (latest is {latest:?})")]
    ActorAhead { actor: u64, latest: Option<u64> },
    #[error(
        "no way from version {actor} to {latest}: a delta in between was pruned and no snapshot with a complete chain after it remains"
    )]
    NoRoute { actor: u64, latest: u64 },
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// Wraps any of redb's per-operation errors; they all convert into `redb::Error`.
pub(crate) fn catalog(error: impl Into<redb::Error>) -> StoreError {
    StoreError::Catalog(error.into())
}
