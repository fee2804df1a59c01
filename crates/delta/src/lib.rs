//! Lossless sparse delta checkpoints.
//!
//! A delta D(v) turns the checkpoint of version v-1 into that of version v bit for bit.
//! This crate is the pure core: checkpoints come in as byte slices, artifacts go out as
//! bytes, and nothing here opens a file or a socket. The format is specified in
//! `docs/delta-format.md`; section numbers in comments refer to it.
//!
//! - [`Extraction`] plans a delta between two checkpoints and streams its segments.
//! - [`DeltaFile`] parses and verifies an artifact; [`decode`] turns it into a [`Patch`]
//!   after checking the base, which then applies in place (transactionally) or
//!   materialises a new checkpoint.
//! - [`ShardTable`] extracts a delta where the model is sharded, each holder of shards
//!   encoding and hashing its own, and assembles the holders' parts into one delta.
//! - [`compose`] and [`invert`] build catch-up and rollback deltas.
//! - [`sign`] and [`verify`] sign and check the trainer's statements of artifacts and
//!   commits ([`Statement`]).
//! - [`fused`] maps Hugging Face tensor names onto the fused parameters of inference
//!   engines.

mod apply;
mod bits;
mod checkpoint;
mod codec;
mod compose;
mod dtype;
mod error;
mod extract;
mod format;
pub mod fp8;
pub mod fused;
mod image;
mod shard;
mod signature;
mod spill;
pub mod stats;
mod undo;

pub use apply::{
    OwnedTensor, Patch, PatchChunk, TargetImage, apply, check_base, decode, decode_segment,
    owned_checkpoint,
};
pub use checkpoint::{
    ChangeSet, ChangedElements, ChangedTensor, Checkpoint, Hash, SafetensorsView, TensorLayout,
    TensorView, safetensors_layout,
};
pub use codec::elements::{ElementLayout, ElementTarget, ElementWrite, Runs, swap_elements};
pub use codec::scan::count_changed;
pub use codec::{Changes, ChunkEncoding, Encoding, encode_chunk};
pub use compose::{compose, invert, replay};
pub use dtype::Dtype;
pub use error::{DeltaError, Result};
pub use extract::{CHUNK_BYTES, ExtractOptions, Extraction, Segment, SegmentSource, TargetHash};
pub use format::{
    DeltaFile, DeltaHeader, FORMAT_VERSION, MAX_CHUNK_ELEMENTS, MAX_DIMS, MAX_NAME_BYTES,
    MAX_SEGMENT_BYTES, MAX_TENSORS, Manifest, SegmentEntry, TensorChange, TensorEntry, TensorSpec,
    assemble,
};
pub use image::{Heap, Image, ImageMemory, ImageSpace, Spill, checkpoint_image};
pub use shard::{
    HashLayout, HashShare, SHARD_PART_MAGIC, SHARD_PART_VERSION, ShardAssembly, ShardPiece,
    ShardTable,
};
pub use signature::{
    ARTIFACT_DOMAIN, ArtifactKind, ArtifactSignature, COMMIT_DOMAIN, DETACHED_BYTES,
    DETACHED_MAGIC, DETACHED_VERSION, DetachedSignature, OFFER_DOMAIN, RunId, SignatureError,
    SigningKey, Statement, VerifyingKey, key_fingerprint, sign, verify,
};
pub use spill::{SpilledChunks, SpilledPatch};
pub use undo::{JOURNAL_MAGIC, JOURNAL_VERSION, JournalInfo, UndoJournal, replay_undo_journal};
