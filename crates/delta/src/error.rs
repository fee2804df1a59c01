use crate::Hash;

/// Everything that can go wrong while reading, validating, decoding or applying a delta.
///
/// Every variant names what was wrong and where, because these errors surface to operators
/// looking at a corrupted or foreign file, not to programmers.
#[derive(Debug, thiserror::Error)]
pub enum DeltaError {
    #[error("not an aurora delta: bad magic bytes")]
    BadMagic,
    #[error("unsupported delta format version {found} (this build reads version {supported})")]
    UnsupportedVersion { found: u16, supported: u16 },
    #[error("delta is truncated: {what} needs {needed} bytes but only {available} remain")]
    Truncated {
        what: &'static str,
        needed: u64,
        available: u64,
    },
    #[error("delta is malformed: {0}")]
    Malformed(String),
    #[error("{what} exceeds its limit: {value} > {limit}")]
    LimitExceeded {
        what: &'static str,
        value: u64,
        limit: u64,
    },
    #[error("manifest hash mismatch: the file's header or segment table is corrupted")]
    ManifestCorrupted,
    #[error("segment {index} is corrupted: hash {actual} does not match the manifest's {expected}")]
    SegmentCorrupted {
        index: u32,
        expected: Hash,
        actual: Hash,
    },
    #[error("segment {index} is malformed: {reason}")]
    SegmentMalformed { index: u32, reason: String },
    #[error("chunk of tensor '{tensor}' at element {start} is malformed: {reason}")]
    ChunkMalformed {
        tensor: String,
        start: u64,
        reason: String,
    },
    #[error("wrong base: the weights hash is {actual} but the delta expects {expected}")]
    WrongBase { expected: Hash, actual: Hash },
    #[error("base checkpoint does not match the delta: {0}")]
    BaseMismatch(String),
    #[error(
        "applying the delta did not reproduce the target (weights hash {actual}, expected {expected}); the weights were restored"
    )]
    TargetMismatch { expected: Hash, actual: Hash },
    #[error("checkpoint is invalid: {0}")]
    Checkpoint(String),
    #[error("tensor '{name}' differs in a way this delta cannot express: {reason}")]
    Unsupported { name: String, reason: String },
    #[error("delta chain is broken: {0}")]
    BrokenChain(String),
    #[error("undo journal is invalid: {0}")]
    Journal(String),
    #[error("the space a staged delta is kept in failed {doing}: {source}")]
    Spill {
        /// What it was asked to do.
        doing: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the space an image is kept in failed {doing}: {source}")]
    Image {
        /// What it was asked to do.
        doing: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{error}; then, restoring the weights: {undo}: they are now neither the delta's base nor its target"
    )]
    RestoreFailed {
        /// What failed while applying.
        error: Box<DeltaError>,
        /// What failed while undoing the batches already applied.
        undo: Box<DeltaError>,
    },
    #[error("extraction was cancelled by its consumer")]
    Cancelled,
    #[error("shard part {part} is invalid: {reason}")]
    ShardPart { part: usize, reason: String },
    #[error("the shards' parts do not make one checkpoint: {0}")]
    ShardCoverage(String),
    #[error("element writes refused, nothing written: {0}")]
    ElementWrites(String),
}

pub type Result<T, E = DeltaError> = std::result::Result<T, E>;
