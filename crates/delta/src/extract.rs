//! Streaming extraction: base + target checkpoints in, segments out as they are ready.
//!
//! Work is cut into chunk jobs (one element range of one tensor, at most
//! [`CHUNK_BYTES`] of data), encoded in parallel on the rayon pool within a bounded
//! window, packed into segments in a fixed order and handed to the caller through a
//! bounded queue. The artifact is therefore identical for any thread count, a sender can
//! transmit the first segment while later ones are still being encoded, and memory stays
//! bounded by the window and the queue.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};

use crate::checkpoint::{Checkpoint, Hash, TensorView};
use crate::codec::{ChunkEncoding, ChunkRecord, EncodedPiece, Encoding, encode_range};
use crate::dtype::Dtype;
use crate::error::{DeltaError, Result};
use crate::format::{
    DeltaHeader, MAX_CHUNK_ELEMENTS, MAX_DIMS, MAX_NAME_BYTES, MAX_SEGMENT_BYTES, MAX_TENSORS,
    Manifest, SegmentEntry, TensorChange, TensorEntry, TensorSpec,
};

/// A chunk covers at most this many bytes of tensor data: large enough that per-chunk
/// headers and tables cost well under 1% at 1% density, small enough to spread one large
/// tensor over every core.
pub const CHUNK_BYTES: u64 = 8 << 20;

#[derive(Debug, Clone)]
pub struct ExtractOptions {
    pub encoding: Encoding,
    pub base_version: u64,
    pub target_version: u64,
    /// Segments are closed once they reach this size (a single chunk may exceed it).
    pub segment_target_bytes: usize,
    /// Segments buffered between the encoder and a slow consumer.
    pub queue_segments: usize,
    /// The base's weights hash if the caller knows it; computed when absent.
    pub base_hash: Option<Hash>,
    pub target_hash: TargetHash,
}

/// Where the header's target weights hash comes from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TargetHash {
    /// Computed by [`Extraction::new`] (beside the base's, when that is computed too).
    #[default]
    Compute,
    /// Known to the caller.
    Known(Hash),
    /// Left pending (all zero) in the header, for a caller that computes it while the
    /// encoder runs and completes the manifest before sealing: a hub offers a delta
    /// before the hash of its target is done (docs/wire-protocol.md §4.4).
    Later,
}

impl Default for ExtractOptions {
    fn default() -> Self {
        ExtractOptions {
            encoding: Encoding::Aurora,
            base_version: 0,
            target_version: 1,
            segment_target_bytes: 256 << 10,
            queue_segments: 8,
            base_hash: None,
            target_hash: TargetHash::Compute,
        }
    }
}

/// What a publisher streams: a delta's header, known before its first segment, and its
/// segments in order as [`Extraction::run`] produces them.
pub trait SegmentSource: Sync {
    fn header(&self) -> &DeltaHeader;

    /// Passes each segment to `sink` in order and returns the manifest; an error of
    /// `sink` stops it and is returned.
    fn run<E: From<DeltaError> + Send>(
        &self,
        sink: impl FnMut(Segment) -> std::result::Result<(), E> + Send,
    ) -> std::result::Result<Manifest, E>;
}

impl SegmentSource for Extraction<'_> {
    fn header(&self) -> &DeltaHeader {
        Extraction::header(self)
    }

    fn run<E: From<DeltaError> + Send>(
        &self,
        sink: impl FnMut(Segment) -> std::result::Result<(), E> + Send,
    ) -> std::result::Result<Manifest, E> {
        Extraction::run(self, sink)
    }
}

/// One finished segment, in artifact order.
#[derive(Debug, Clone)]
pub struct Segment {
    pub index: u32,
    pub bytes: Vec<u8>,
    pub hash: Hash,
}

/// One element range of one tensor, with its bytes on both sides (no base: a dense job).
struct ChunkJob<'c> {
    tensor: u32,
    start: u64,
    len: u64,
    base: Option<&'c [u8]>,
    target: &'c [u8],
}

/// A planned extraction: the header is final, the segments are produced by [`run`].
///
/// [`run`]: Extraction::run
pub struct Extraction<'c> {
    header: DeltaHeader,
    jobs: Vec<ChunkJob<'c>>,
    options: ExtractOptions,
    input_done: AtomicU64,
}

impl<'c> Extraction<'c> {
    /// Classifies every tensor and plans the chunk jobs. Tensors whose name appears on
    /// one side only are added or removed; a changed dtype or shape is a replacement.
    pub fn new(
        base: &'c Checkpoint<'_>,
        target: &'c Checkpoint<'_>,
        options: ExtractOptions,
    ) -> Result<Self> {
        let mut names: Vec<&str> = base
            .tensors()
            .iter()
            .chain(target.tensors())
            .map(|t| t.name.as_str())
            .collect();
        names.sort_unstable();
        names.dedup();
        let spec = |t: &TensorView<'_>| TensorSpec {
            dtype: t.dtype,
            shape: t.shape.clone(),
        };
        if names.len() as u64 > u64::from(MAX_TENSORS) {
            return Err(DeltaError::LimitExceeded {
                what: "tensor count",
                value: names.len() as u64,
                limit: u64::from(MAX_TENSORS),
            });
        }
        let mut tensors = Vec::with_capacity(names.len());
        let mut jobs = Vec::new();
        for (index, name) in names.iter().enumerate() {
            // A writer must never produce what every reader refuses (§4.3).
            let rank = [base.get(name), target.get(name)]
                .into_iter()
                .flatten()
                .map(|t| t.shape.len())
                .max()
                .unwrap_or(0);
            if name.len() > MAX_NAME_BYTES || rank > MAX_DIMS {
                return Err(DeltaError::Unsupported {
                    name: name.chars().take(80).collect(),
                    reason: format!(
                        "names are limited to {MAX_NAME_BYTES} bytes and shapes to {MAX_DIMS} dimensions"
                    ),
                });
            }
            let change = match (base.get(name), target.get(name)) {
                (Some(b), Some(t)) if b.dtype == t.dtype && b.shape == t.shape => {
                    TensorChange::Patched(spec(t))
                }
                (Some(b), Some(t)) => TensorChange::Replaced {
                    base: spec(b),
                    target: spec(t),
                },
                (Some(b), None) => TensorChange::Removed(spec(b)),
                (None, Some(t)) => TensorChange::Added(spec(t)),
                (None, None) => unreachable!("name came from one of the checkpoints"),
            };
            if let Some(target_tensor) = target.get(name) {
                let dense = options.encoding == Encoding::Dense
                    || !matches!(change, TensorChange::Patched(_));
                let base_data =
                    (!dense).then(|| base.get(name).expect("patched tensors have a base").data);
                plan_jobs(
                    &mut jobs,
                    index as u32,
                    target_tensor.dtype,
                    0,
                    base_data,
                    target_tensor.data,
                );
            }
            tensors.push(TensorEntry {
                name: name.to_string(),
                change,
            });
        }
        let hash_target = || match options.target_hash {
            TargetHash::Compute => target.weights_hash(),
            TargetHash::Known(hash) => hash,
            TargetHash::Later => Hash::ZERO,
        };
        let (base_hash, target_hash) = match options.base_hash {
            Some(known) => (known, hash_target()),
            None => rayon::join(|| base.weights_hash(), hash_target),
        };
        let header = DeltaHeader {
            base_version: options.base_version,
            target_version: options.target_version,
            base_hash,
            target_hash,
            encoding: options.encoding,
            tensors,
        };
        Ok(Extraction {
            header,
            jobs,
            options,
            input_done: AtomicU64::new(0),
        })
    }

    /// An extraction of some element ranges of `header`'s patched tensors only: what a
    /// holder of shards encodes (§11). Each piece is a tensor's index, the range's first
    /// element and the range's bytes on both sides (no base: dense chunks), checked by
    /// the caller.
    pub(crate) fn of_pieces(
        header: DeltaHeader,
        pieces: impl IntoIterator<Item = (u32, u64, Option<&'c [u8]>, &'c [u8])>,
        options: ExtractOptions,
    ) -> Self {
        let mut jobs = Vec::new();
        for (tensor, first, base, target) in pieces {
            let dtype = header.tensors[tensor as usize]
                .change
                .target()
                .expect("pieces are of patched tensors")
                .dtype;
            plan_jobs(&mut jobs, tensor, dtype, first, base, target);
        }
        Extraction {
            header,
            jobs,
            options,
            input_done: AtomicU64::new(0),
        }
    }

    pub fn header(&self) -> &DeltaHeader {
        &self.header
    }

    /// Bytes of target data the encoder will read in all.
    pub fn input_bytes(&self) -> u64 {
        self.jobs.iter().map(|job| job.target.len() as u64).sum()
    }

    /// Bytes of target data encoded so far; safe to poll from another thread.
    pub fn input_done(&self) -> u64 {
        self.input_done.load(Ordering::Relaxed)
    }

    /// Encodes every chunk and passes each finished segment to `sink` in order. Encoding
    /// runs on the calling thread and the current rayon pool (so `pool.install` chooses
    /// the threads); `sink` runs on its own thread behind a bounded queue, so a slow
    /// consumer holds back the encoder instead of letting memory grow. An error from
    /// `sink` stops extraction and is returned. To consume segments as a channel (for
    /// example from an async transport), pass a sink that sends into one.
    pub fn run<E: From<DeltaError> + Send>(
        &self,
        mut sink: impl FnMut(Segment) -> std::result::Result<(), E> + Send,
    ) -> std::result::Result<Manifest, E> {
        let (sender, receiver) =
            crossbeam_channel::bounded::<Segment>(self.options.queue_segments.max(1));
        let entries = std::thread::scope(|scope| {
            let consumer = scope.spawn(move || {
                let mut entries = Vec::new();
                // Returning early drops the receiver, which makes the producer's next
                // send fail so it stops.
                for segment in receiver {
                    entries.push(SegmentEntry {
                        len: segment.bytes.len() as u32,
                        hash: segment.hash,
                    });
                    sink(segment)?;
                }
                Ok::<_, E>(entries)
            });
            self.produce(&sender);
            drop(sender);
            consumer
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        })?;
        Ok(Manifest {
            header: self.header.clone(),
            segments: entries,
        })
    }

    /// Convenience: the whole artifact in memory.
    pub fn to_bytes(&self) -> Result<(Manifest, Vec<u8>)> {
        let mut out = self.header.encode();
        let manifest = self.run(|segment: Segment| {
            out.extend_from_slice(&segment.bytes);
            Ok::<(), DeltaError>(())
        })?;
        out.extend_from_slice(&manifest.encode_tail());
        Ok((manifest, out))
    }

    /// Encodes the jobs on the current rayon pool: each worker claims the next job (at
    /// most `window` ahead of the oldest unpacked one, which bounds memory), and whoever
    /// completes the oldest job packs every finished job in order and sends the segments.
    /// Unlike fixed batches, no worker idles behind a large chunk.
    fn produce(&self, sender: &crossbeam_channel::Sender<Segment>) {
        let workers = rayon::current_num_threads();
        let pipeline = Mutex::new(Pipeline {
            next_claim: 0,
            next_pack: 0,
            ready: BTreeMap::new(),
            packer: SegmentPacker::new(self.options.segment_target_bytes),
            stopped: false,
        });
        let progress = Condvar::new();
        let window = workers * 4;
        rayon::scope(|scope| {
            for _ in 0..workers {
                scope.spawn(|_| self.work(&pipeline, &progress, window, sender));
            }
        });
        let pipeline = pipeline
            .into_inner()
            .unwrap_or_else(|poison| poison.into_inner());
        if !pipeline.stopped
            && let Some(segment) = pipeline.packer.finish()
        {
            // A consumer that already hung up has its own error to report.
            let _ = sender.send(segment);
        }
    }

    fn work(
        &self,
        pipeline: &Mutex<Pipeline>,
        progress: &Condvar,
        window: usize,
        sender: &crossbeam_channel::Sender<Segment>,
    ) {
        let lock = || pipeline.lock().unwrap_or_else(|poison| poison.into_inner());
        loop {
            let index = {
                let mut state = lock();
                loop {
                    if state.stopped || state.next_claim == self.jobs.len() {
                        return;
                    }
                    if state.next_claim < state.next_pack + window {
                        break;
                    }
                    state = progress
                        .wait(state)
                        .unwrap_or_else(|poison| poison.into_inner());
                }
                state.next_claim += 1;
                state.next_claim - 1
            };
            let encoded = self.encode_job(&self.jobs[index]);
            let mut guard = lock();
            let state = &mut *guard;
            state.ready.insert(index, encoded);
            while state
                .ready
                .first_key_value()
                .is_some_and(|(next, _)| *next == state.next_pack)
            {
                let (_, pieces) = state.ready.pop_first().expect("checked above");
                let job = &self.jobs[state.next_pack];
                for piece in pieces {
                    let record = ChunkRecord {
                        tensor: job.tensor,
                        start: job.start + piece.start,
                        len: piece.len,
                        encoding: piece.encoding,
                        payload: &piece.payload,
                    };
                    // Sending under the lock keeps segments in order; a full queue holds
                    // every worker back, which is the intended backpressure.
                    if let Some(segment) = state.packer.push(&record)
                        && sender.send(segment).is_err()
                    {
                        state.stopped = true;
                    }
                }
                state.next_pack += 1;
            }
            drop(guard);
            progress.notify_all();
        }
    }

    fn encode_job(&self, job: &ChunkJob<'_>) -> Vec<EncodedPiece> {
        self.input_done
            .fetch_add(job.target.len() as u64, Ordering::Relaxed);
        let Some(base) = job.base else {
            return vec![EncodedPiece {
                start: 0,
                len: job.len,
                encoding: ChunkEncoding::Dense,
                payload: job.target.to_vec(),
            }];
        };
        let dtype = self.header.tensors[job.tensor as usize]
            .change
            .target()
            .expect("planned from the target")
            .dtype;
        encode_range(self.options.encoding, dtype, base, job.target)
    }
}

/// Cuts the element range that `target` holds of tensor `tensor` (from element `first`)
/// into chunk jobs of at most [`CHUNK_BYTES`]; `base` is the same range of the base (none
/// for dense chunks).
fn plan_jobs<'c>(
    jobs: &mut Vec<ChunkJob<'c>>,
    tensor: u32,
    dtype: Dtype,
    first: u64,
    base: Option<&'c [u8]>,
    target: &'c [u8],
) {
    let size = dtype.size_bytes();
    let per_chunk = (CHUNK_BYTES / size as u64).clamp(1, MAX_CHUNK_ELEMENTS) as usize * size;
    for (index, target) in target.chunks(per_chunk).enumerate() {
        let at = index * per_chunk;
        jobs.push(ChunkJob {
            tensor,
            start: first + (at / size) as u64,
            len: (target.len() / size) as u64,
            base: base.map(|base| &base[at..at + target.len()]),
            target,
        });
    }
}

/// Shared state of the encoding workers.
struct Pipeline {
    next_claim: usize,
    next_pack: usize,
    ready: BTreeMap<usize, Vec<EncodedPiece>>,
    packer: SegmentPacker,
    stopped: bool,
}

/// Packs chunk records into segments of about the target size.
struct SegmentPacker {
    target_bytes: usize,
    current: Vec<u8>,
    next_index: u32,
}

impl SegmentPacker {
    fn new(target_bytes: usize) -> Self {
        SegmentPacker {
            target_bytes: target_bytes.clamp(1, MAX_SEGMENT_BYTES as usize / 2),
            current: Vec::new(),
            next_index: 0,
        }
    }

    fn push(&mut self, record: &ChunkRecord<'_>) -> Option<Segment> {
        record.write(&mut self.current);
        debug_assert!(self.current.len() <= MAX_SEGMENT_BYTES as usize);
        (self.current.len() >= self.target_bytes).then(|| self.seal())
    }

    fn finish(mut self) -> Option<Segment> {
        (!self.current.is_empty()).then(|| self.seal())
    }

    fn seal(&mut self) -> Segment {
        let bytes = std::mem::take(&mut self.current);
        let segment = Segment {
            index: self.next_index,
            hash: Hash::of(&bytes),
            bytes,
        };
        self.next_index += 1;
        segment
    }
}
