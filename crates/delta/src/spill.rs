//! A staged delta kept in a [`Spill`] rather than in the receiver's memory.
//!
//! Between staging and activation a receiver holds a delta's decoded changes: for a
//! sparse step about 1% of the model's elements at six bytes each (0.3 GB at 4B, 4 GB
//! at 70B), and for a dense one (full sync) the whole model. Each decoded segment is
//! written to the spill as it comes ([`SpilledChunks::write`]) and only the chunks'
//! places are kept in memory; activation reads the changes back a bounded batch at a
//! time, swaps them in, and writes the values they replaced over them, so a target
//! hash mismatch is undone the same way ([`SpilledPatch::apply_in_place`]). With a
//! file-backed spill the receiver's own memory stays flat whatever the delta's size.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use rayon::prelude::*;

use crate::apply::{
    ChunkRange, Patch, PatchChunk, Threads, changed_tensors, check_in_place, check_ranges,
    placements, preserves_layout, swap_chunks,
};
use crate::checkpoint::{
    ChangeSet, ChangedElements, ChangedTensor, Checkpoint, Hash, TensorLayout, hash_bytes,
};
use crate::codec::{Changes, ChunkEncoding};
use crate::error::{DeltaError, Result};
use crate::format::DeltaHeader;
use crate::image::Spill;

/// Changes read back and swapped in at once, in bytes of the spill (a larger chunk goes
/// alone): what an activation holds in memory, whatever the delta's size. Extraction
/// makes chunks of at most 8 MiB of tensor data, so a batch still gives every core
/// several chunks to swap in parallel.
const BATCH_BYTES: usize = 16 << 20;

/// Chunks overlaid at once by [`SpilledPatch::target_hash`]: with chunks of at most 8 MiB,
/// at most two windows (32 MiB) are held, one being hashed and the next being built.
const OVERLAY_WINDOW_CHUNKS: usize = 2;

/// Bytes of a sparse change's position in the spill.
const POSITION_BYTES: usize = 4;

/// One decoded chunk in a spill: where it applies, and where its changes are.
#[derive(Debug, Clone)]
struct SpilledChunk {
    range: ChunkRange,
    encoding: ChunkEncoding,
    encoded_bytes: usize,
    /// The number of positions of sparse changes; `None` for dense ones.
    positions: Option<usize>,
    spill: Arc<dyn Spill>,
    /// Where the changes start in the spill: the positions (little-endian `u32`s) and
    /// then the values, or the dense bytes.
    at: u64,
    len: usize,
}

impl SpilledChunk {
    fn load(&self) -> Result<PatchChunk> {
        let read = |at: u64, len: usize| {
            let mut bytes = vec![0u8; len];
            self.spill
                .read_at(at, &mut bytes)
                .map_err(|reason| self.failed("reading", reason))
                .map(|()| bytes)
        };
        let changes = match self.positions {
            Some(count) => {
                let positions_len = count * POSITION_BYTES;
                let positions = read(self.at, positions_len)?
                    .chunks_exact(POSITION_BYTES)
                    .map(|p| u32::from_le_bytes(p.try_into().expect("four bytes")))
                    .collect();
                let values = read(self.at + positions_len as u64, self.len - positions_len)?;
                Changes::Sparse { positions, values }
            }
            None => Changes::Dense(read(self.at, self.len)?),
        };
        Ok(PatchChunk {
            tensor: self.range.tensor,
            start: self.range.start,
            len: self.range.len,
            encoding: self.encoding,
            encoded_bytes: self.encoded_bytes,
            changes,
        })
    }

    /// Writes back the values `chunk` (loaded from here, then swapped) now holds: its
    /// positions have not changed.
    /// The elements this chunk changes (flat indices in the tensor, ascending) and their
    /// new values, as spilled: one read.
    fn element_changes(&self, element_bytes: usize) -> Result<ChangedElements> {
        let start = self.range.start;
        let mut bytes = vec![0u8; self.len];
        self.spill
            .read_at(self.at, &mut bytes)
            .map_err(|reason| self.failed("reading", reason))?;
        let Some(count) = self.positions else {
            let indices = (start..start + (bytes.len() / element_bytes) as u64).collect();
            return Ok(ChangedElements {
                indices,
                values: bytes,
            });
        };
        let values = bytes.split_off(count * POSITION_BYTES);
        let indices = bytes
            .chunks_exact(POSITION_BYTES)
            .map(|p| start + u64::from(u32::from_le_bytes(p.try_into().expect("four bytes"))))
            .collect();
        Ok(ChangedElements { indices, values })
    }

    fn store_values(&self, chunk: &PatchChunk) -> Result<()> {
        let (at, values) = match &chunk.changes {
            Changes::Sparse { positions, values } => {
                (self.at + (positions.len() * POSITION_BYTES) as u64, values)
            }
            Changes::Dense(bytes) => (self.at, bytes),
        };
        self.spill
            .write_at(at, values)
            .map_err(|reason| self.failed("writing back", reason))
    }

    fn failed(&self, doing: &str, source: std::io::Error) -> DeltaError {
        DeltaError::Spill {
            doing: format!(
                "{doing} the changes of tensor {} at element {}",
                self.range.tensor, self.range.start
            ),
            source,
        }
    }
}

/// The decoded chunks of one segment, written to a spill.
#[derive(Debug, Clone, Default)]
pub struct SpilledChunks {
    chunks: Vec<SpilledChunk>,
}

impl SpilledChunks {
    /// Writes `chunks` to `spill` in one append; only their places are kept.
    pub fn write(spill: &Arc<dyn Spill>, chunks: Vec<PatchChunk>) -> Result<SpilledChunks> {
        let total = chunks
            .iter()
            .map(|chunk| match &chunk.changes {
                Changes::Sparse { positions, values } => {
                    positions.len() * POSITION_BYTES + values.len()
                }
                Changes::Dense(bytes) => bytes.len(),
            })
            .sum();
        let mut bytes = Vec::with_capacity(total);
        let mut spilled = Vec::with_capacity(chunks.len());
        for chunk in chunks {
            let at = bytes.len() as u64;
            let positions = match chunk.changes {
                Changes::Sparse { positions, values } => {
                    bytes.extend(positions.iter().flat_map(|p| p.to_le_bytes()));
                    bytes.extend_from_slice(&values);
                    Some(positions.len())
                }
                Changes::Dense(dense) => {
                    bytes.extend_from_slice(&dense);
                    None
                }
            };
            spilled.push(SpilledChunk {
                range: ChunkRange {
                    tensor: chunk.tensor,
                    start: chunk.start,
                    len: chunk.len,
                },
                encoding: chunk.encoding,
                encoded_bytes: chunk.encoded_bytes,
                positions,
                spill: spill.clone(),
                at,
                len: bytes.len() - at as usize,
            });
        }
        if bytes.is_empty() {
            return Ok(SpilledChunks { chunks: spilled });
        }
        let start = spill.append(&bytes).map_err(|source| DeltaError::Spill {
            doing: format!("keeping {} bytes of changes", bytes.len()),
            source,
        })?;
        for chunk in &mut spilled {
            chunk.at += start;
        }
        Ok(SpilledChunks { chunks: spilled })
    }

    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }
}

/// A decoded and validated delta whose changes are in spills: what a receiver stages.
/// The counterpart of [`Patch`] that holds only where each chunk's changes are (a clone
/// shares the spills).
#[derive(Debug, Clone)]
pub struct SpilledPatch {
    header: DeltaHeader,
    /// Sorted by tensor, then start; ranges never overlap.
    chunks: Vec<SpilledChunk>,
}

impl SpilledPatch {
    /// Joins the segments' chunks, ordered, after the checks [`Patch::new`] makes.
    pub fn new(
        header: DeltaHeader,
        segments: impl IntoIterator<Item = SpilledChunks>,
    ) -> Result<SpilledPatch> {
        let mut chunks: Vec<SpilledChunk> = segments.into_iter().flat_map(|s| s.chunks).collect();
        chunks.sort_by_key(|c| (c.range.tensor, c.range.start));
        check_ranges(&header, chunks.iter().map(|c| c.range))?;
        Ok(SpilledPatch { header, chunks })
    }

    pub fn header(&self) -> &DeltaHeader {
        &self.header
    }

    /// See [`Patch::preserves_layout`].
    pub fn preserves_layout(&self) -> bool {
        preserves_layout(&self.header)
    }

    /// See [`Patch::changed_tensors`].
    pub fn changed_tensors(&self) -> Vec<String> {
        changed_tensors(&self.header, self.chunks.iter().map(|c| c.range.tensor))
    }

    /// What applying this patch changes, per tensor: with `elements`, the changed
    /// elements' flat indices and new values (read from the spill, O(changes)) for an
    /// engine that writes elements in place; otherwise, or when the patch changes the
    /// layout, whole tensors. Read before the patch is applied (which swaps the old
    /// values into the spill).
    pub fn change_set(&self, elements: bool) -> Result<ChangeSet> {
        if !elements || !self.preserves_layout() {
            return Ok(ChangeSet::whole(self.changed_tensors()));
        }
        let changes = self
            .chunks
            .par_iter()
            .map(|chunk| {
                let spec = self.header.tensors[chunk.range.tensor as usize]
                    .change
                    .target()
                    .expect("chunks belong to target tensors");
                chunk.element_changes(spec.dtype.size_bytes())
            })
            .collect::<Result<Vec<_>>>()?;
        let mut tensors: Vec<ChangedTensor> = Vec::new();
        for (chunk, changed) in self.chunks.iter().zip(changes) {
            let name = &self.header.tensors[chunk.range.tensor as usize].name;
            match tensors.last_mut() {
                Some(last) if &last.name == name => {
                    let elements = last
                        .elements
                        .as_mut()
                        .expect("element changes are collected per tensor");
                    elements.indices.extend(changed.indices);
                    elements.values.extend(changed.values);
                }
                _ => tensors.push(ChangedTensor {
                    name: name.clone(),
                    elements: Some(changed),
                }),
            }
        }
        Ok(ChangeSet { tensors })
    }

    /// Reads every change back into a [`Patch`]: for a delta that changes the layout,
    /// which is built into a new image rather than applied in place.
    pub fn load(self) -> Result<Patch> {
        let chunks = self
            .chunks
            .par_iter()
            .map(SpilledChunk::load)
            .collect::<Result<Vec<_>>>()?;
        Ok(Patch {
            header: self.header,
            chunks,
        })
    }

    /// The weights hash of `buffer` (laid out as `layout`) with this patch's changes laid
    /// over it, computed without writing `buffer`: the target's hash, checked before
    /// anything is applied (behind generation, while the staged patch waits for its
    /// Commit), so that applying needs no second look ([`SpilledPatch::swap_in`]).
    pub fn target_hash(&self, buffer: &[u8], layout: &[TensorLayout]) -> Result<Hash> {
        self.check_placed(buffer.len(), layout)?;
        let mut by_name: HashMap<&str, Vec<&SpilledChunk>> = HashMap::new();
        for chunk in &self.chunks {
            let name = self.header.tensors[chunk.range.tensor as usize]
                .name
                .as_str();
            by_name.entry(name).or_default().push(chunk);
        }
        let base = Checkpoint::from_layout(buffer, layout)?;
        let mut failure = None;
        let new_window = || vec![Vec::new(); OVERLAY_WINDOW_CHUNKS];
        let mut buffers = (new_window(), new_window());
        let hash = base.weights_hash_with(|tensor, hasher| {
            let Some(chunks) = by_name.get(tensor.name.as_str()) else {
                hash_bytes(hasher, tensor.data);
                return;
            };
            let element_bytes = tensor.dtype.size_bytes();
            let span = |chunk: &SpilledChunk| {
                let start = chunk.range.start as usize * element_bytes;
                (start, start + chunk.range.len as usize * element_bytes)
            };
            // A chunk's overlay (its bytes copied, its changes read from the spill and
            // swapped in) costs about what hashing it does: the next window's are built
            // on the pool while this one's are hashed, in order. The buffers are reused:
            // fresh ones of this size would be mapped and faulted in each time.
            let overlay = |window: &[&SpilledChunk], buffers: &mut [Vec<u8>]| -> Vec<Result<()>> {
                window
                    .par_iter()
                    .zip(buffers.par_iter_mut())
                    .map(|(chunk, bytes)| {
                        let (start, end) = span(chunk);
                        bytes.clear();
                        bytes.extend_from_slice(&tensor.data[start..end]);
                        chunk.load()?.changes.swap_into(bytes, element_bytes);
                        Ok(())
                    })
                    .collect()
            };
            let mut cursor = 0;
            let mut hash_window =
                |window: &[&SpilledChunk], buffers: &[Vec<u8>], laid: Vec<Result<()>>| {
                    for ((chunk, bytes), laid) in window.iter().zip(buffers).zip(laid) {
                        let (start, end) = span(chunk);
                        hash_bytes(hasher, &tensor.data[cursor..start]);
                        match laid {
                            Ok(()) => hash_bytes(hasher, bytes),
                            Err(error) => {
                                // The hash is void; it still covers as many bytes.
                                failure.get_or_insert(error);
                                hash_bytes(hasher, &tensor.data[start..end]);
                            }
                        }
                        cursor = end;
                    }
                };
            let mut windows = chunks.chunks(OVERLAY_WINDOW_CHUNKS);
            let (mut current, mut spare) = (buffers.0.as_mut_slice(), buffers.1.as_mut_slice());
            let mut window = windows.next();
            let mut laid = window.map(|window| overlay(window, current));
            while let (Some(this), Some(this_laid)) = (window, laid.take()) {
                let next = windows.next();
                let ((), next_laid) = rayon::join(
                    || hash_window(this, current, this_laid),
                    || next.map(|next| overlay(next, spare)),
                );
                std::mem::swap(&mut current, &mut spare);
                window = next;
                laid = next_laid;
            }
            hash_bytes(hasher, &tensor.data[cursor..]);
        });
        match failure {
            Some(error) => Err(error),
            None => Ok(hash),
        }
    }

    /// Fails, naming a tensor, unless the patch keeps every tensor's layout and each of its
    /// chunks lies within a buffer of `buffer_len` bytes laid out as `layout`.
    fn check_placed(&self, buffer_len: usize, layout: &[TensorLayout]) -> Result<()> {
        check_in_place(&self.header)?;
        placements(
            &self.header,
            self.chunks.iter().map(|c| c.range),
            buffer_len,
            layout,
        )
        .map(drop)
    }

    /// Writes the patch's changes into `buffer` without checking the result's hash: for
    /// a patch whose [`SpilledPatch::target_hash`] over the same buffer was checked.
    /// Every chunk is placed before the first write; a spill that fails midway restores
    /// the buffer.
    pub fn swap_in(self, buffer: &mut [u8], layout: &[TensorLayout]) -> Result<()> {
        self.check_placed(buffer.len(), layout)?;
        let batches = self.batches(BATCH_BYTES);
        self.swap_all(&batches, buffer, layout)
    }

    /// [`Patch::apply_in_place`], a batch of changes at a time: every chunk is placed
    /// before the first write, and on a target hash mismatch, or a spill that fails
    /// midway, what was swapped in is swapped back out. The patch is used up either way:
    /// after a failed write-back its spill no longer holds the target's values.
    pub fn apply_in_place(self, buffer: &mut [u8], layout: &[TensorLayout]) -> Result<Hash> {
        self.apply_in_batches(buffer, layout, BATCH_BYTES)
    }

    fn apply_in_batches(
        self,
        buffer: &mut [u8],
        layout: &[TensorLayout],
        batch_bytes: usize,
    ) -> Result<Hash> {
        self.check_placed(buffer.len(), layout)?;
        let batches = self.batches(batch_bytes);
        self.swap_all(&batches, buffer, layout)?;
        let actual = Checkpoint::from_layout(buffer, layout)?.weights_hash();
        if actual != self.header.target_hash {
            self.swap_all(&batches, buffer, layout)?;
            return Err(DeltaError::TargetMismatch {
                expected: self.header.target_hash,
                actual,
            });
        }
        Ok(actual)
    }

    /// Swaps every chunk's changes with the buffer's bytes, batch by batch; a batch that
    /// fails leaves the buffer as it found it, and the batches before it are swapped
    /// back.
    fn swap_all(
        &self,
        batches: &[Range<usize>],
        buffer: &mut [u8],
        layout: &[TensorLayout],
    ) -> Result<()> {
        for (done, batch) in batches.iter().enumerate() {
            let Err(error) = self.swap_batch(batch.clone(), buffer, layout) else {
                continue;
            };
            for batch in batches[..done].iter().rev() {
                if let Err(undo) = self.swap_batch(batch.clone(), buffer, layout) {
                    return Err(DeltaError::RestoreFailed {
                        error: Box::new(error),
                        undo: Box::new(undo),
                    });
                }
            }
            return Err(error);
        }
        Ok(())
    }

    /// Consecutive chunks of at most `batch_bytes` of changes (or one larger chunk).
    fn batches(&self, batch_bytes: usize) -> Vec<Range<usize>> {
        let mut batches = Vec::new();
        let (mut start, mut bytes) = (0, 0);
        for (index, chunk) in self.chunks.iter().enumerate() {
            if index > start && bytes + chunk.len > batch_bytes {
                batches.push(start..index);
                (start, bytes) = (index, 0);
            }
            bytes += chunk.len;
        }
        if start < self.chunks.len() {
            batches.push(start..self.chunks.len());
        }
        batches
    }

    fn swap_batch(
        &self,
        batch: Range<usize>,
        buffer: &mut [u8],
        layout: &[TensorLayout],
    ) -> Result<()> {
        let spilled = &self.chunks[batch];
        let mut loaded = spilled
            .par_iter()
            .map(SpilledChunk::load)
            .collect::<Result<Vec<_>>>()?;
        swap_chunks(&self.header, &mut loaded, buffer, layout, Threads::Pool)?;
        let stored = spilled
            .par_iter()
            .zip(&loaded)
            .try_for_each(|(spilled, chunk)| spilled.store_values(chunk));
        if let Err(error) = stored {
            // The loaded chunks hold the buffer's old values: swapping them in again
            // restores it.
            swap_chunks(&self.header, &mut loaded, buffer, layout, Threads::Pool)?;
            return Err(error);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::apply::{OwnedTensor, check_base, decode_segment, owned_checkpoint};
    use crate::checkpoint::safetensors_layout;
    use crate::codec::Encoding;
    use crate::dtype::Dtype;
    use crate::extract::{ExtractOptions, Extraction};
    use crate::format::DeltaFile;
    use crate::image::{Heap, ImageSpace};

    /// Sixteen BF16 tensors (a chunk each), and the same with about 2% of their elements
    /// nudged: a base image, the target's, and the delta between them in many segments.
    struct Case {
        base: Vec<u8>,
        target: Vec<u8>,
        delta: Vec<u8>,
    }

    fn case(encoding: Encoding) -> Case {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let base: Vec<OwnedTensor> = (0..16)
            .map(|index| OwnedTensor {
                name: format!("t{index:02}"),
                dtype: Dtype::Bf16,
                shape: vec![100, 100],
                data: (0..10_000)
                    .flat_map(|_| (0x3C00 + (next() % 0x400) as u16).to_le_bytes())
                    .collect(),
            })
            .collect();
        let mut target = base.clone();
        for tensor in &mut target {
            for element in tensor.data.chunks_exact_mut(2) {
                if next() % 50 == 0 {
                    element[0] ^= 1 + (next() % 3) as u8;
                }
            }
        }
        let (base_view, target_view) = (
            owned_checkpoint(&base).unwrap(),
            owned_checkpoint(&target).unwrap(),
        );
        let options = ExtractOptions {
            encoding,
            segment_target_bytes: 256,
            ..ExtractOptions::default()
        };
        let (_, delta) = Extraction::new(&base_view, &target_view, options)
            .unwrap()
            .to_bytes()
            .unwrap();
        Case {
            base: base_view.to_safetensors().unwrap(),
            target: target_view.to_safetensors().unwrap(),
            delta,
        }
    }

    /// Decodes every segment of `delta` against `base` into `spill`, last first.
    fn staged(delta: &DeltaFile<'_>, base: &[u8], spill: &Arc<dyn Spill>) -> SpilledPatch {
        let layout = safetensors_layout(base).unwrap();
        let view = Checkpoint::from_layout(base, &layout).unwrap();
        check_base(delta.header(), &view, None).unwrap();
        let segments = (0..delta.segment_count()).rev().map(|index| {
            let bytes = delta.verify_segment(index).unwrap();
            let chunks = decode_segment(delta.header(), index as u32, bytes, &view).unwrap();
            SpilledChunks::write(spill, chunks).unwrap()
        });
        SpilledPatch::new(delta.header().clone(), segments.collect::<Vec<_>>()).unwrap()
    }

    #[test]
    fn a_spilled_delta_applies_bit_exact_in_batches_of_any_size() {
        for encoding in [Encoding::Aurora, Encoding::Leb128, Encoding::Dense] {
            let case = case(encoding);
            let delta = DeltaFile::parse(&case.delta).unwrap();
            assert!(delta.segment_count() > 4, "{encoding:?}");
            for batch_bytes in [1, 4096, BATCH_BYTES] {
                let spill = Heap.spill().unwrap();
                let patch = staged(&delta, &case.base, &spill);
                assert_eq!(patch.changed_tensors().len(), 16);
                if batch_bytes == 1 {
                    assert_eq!(patch.batches(1).len(), patch.chunks.len());
                }
                let mut buffer = case.base.clone();
                let layout = safetensors_layout(&buffer).unwrap();
                let hash = patch
                    .apply_in_batches(&mut buffer, &layout, batch_bytes)
                    .unwrap();
                assert_eq!(hash, delta.header().target_hash, "{encoding:?}");
                assert!(buffer == case.target, "{encoding:?}, {batch_bytes}");
            }
        }
    }

    #[test]
    fn a_change_set_lists_exactly_the_elements_that_differ() {
        for encoding in [Encoding::Aurora, Encoding::Leb128, Encoding::Dense] {
            let case = case(encoding);
            let delta = DeltaFile::parse(&case.delta).unwrap();
            let patch = staged(&delta, &case.base, &Heap.spill().unwrap());
            let (base, target) = (
                safetensors_layout(&case.base).unwrap(),
                safetensors_layout(&case.target).unwrap(),
            );
            let names = patch.changed_tensors();
            assert_eq!(
                patch.change_set(false).unwrap(),
                ChangeSet::whole(names.clone())
            );
            let changes = patch.change_set(true).unwrap();
            assert_eq!(changes.names(), names, "{encoding:?}");
            for changed in &changes.tensors {
                let place = |layout: &[TensorLayout]| {
                    layout
                        .iter()
                        .find(|t| t.name == changed.name)
                        .unwrap()
                        .bytes
                        .clone()
                };
                let before = &case.base[place(&base)];
                let after = &case.target[place(&target)];
                let differ: Vec<u64> = (0..before.len() / 2)
                    .filter(|&i| before[2 * i..2 * i + 2] != after[2 * i..2 * i + 2])
                    .map(|i| i as u64)
                    .collect();
                let elements = changed.elements.as_ref().unwrap();
                let listed = &elements.indices;
                if encoding == Encoding::Dense {
                    // A dense chunk rewrites its whole range: a superset, in order.
                    assert!(listed.windows(2).all(|w| w[0] < w[1]));
                    assert!(differ.iter().all(|i| listed.binary_search(i).is_ok()));
                } else {
                    assert_eq!(listed, &differ, "{encoding:?} {}", changed.name);
                }
                // Each value is the target's element at its index.
                let values: Vec<u8> = listed
                    .iter()
                    .flat_map(|&i| after[2 * i as usize..2 * i as usize + 2].to_vec())
                    .collect();
                assert!(elements.values == values, "{encoding:?} {}", changed.name);
            }
        }
    }

    #[test]
    fn the_target_hash_over_the_base_is_the_hash_after_applying() {
        for encoding in [Encoding::Aurora, Encoding::Leb128, Encoding::Dense] {
            let case = case(encoding);
            let delta = DeltaFile::parse(&case.delta).unwrap();
            let patch = staged(&delta, &case.base, &Heap.spill().unwrap());
            let layout = safetensors_layout(&case.base).unwrap();
            let hash = patch.target_hash(&case.base, &layout).unwrap();
            assert_eq!(hash, delta.header().target_hash, "{encoding:?}");
            let mut buffer = case.base.clone();
            patch.swap_in(&mut buffer, &layout).unwrap();
            assert!(buffer == case.target, "{encoding:?}");
        }
        // Over other weights than its base, it is not the target's.
        let case = case(Encoding::Aurora);
        let delta = DeltaFile::parse(&case.delta).unwrap();
        let patch = staged(&delta, &case.base, &Heap.spill().unwrap());
        let mut other = case.base.clone();
        let layout = safetensors_layout(&other).unwrap();
        // An element the patch leaves alone, so its change shows through the overlay.
        let data = layout[0].bytes.clone();
        let unchanged = (data.start..data.end)
            .step_by(2)
            .find(|&at| case.base[at..at + 2] == case.target[at..at + 2])
            .unwrap();
        other[unchanged] ^= 1;
        assert_ne!(
            patch.target_hash(&other, &layout).unwrap(),
            delta.header().target_hash
        );
    }

    #[test]
    fn a_target_hash_mismatch_restores_the_base_batch_by_batch() {
        let case = case(Encoding::Aurora);
        let delta = DeltaFile::parse(&case.delta).unwrap();
        let mut patch = staged(&delta, &case.base, &Heap.spill().unwrap());
        patch.header.target_hash = crate::Hash::of(b"not the target");
        let mut buffer = case.base.clone();
        let layout = safetensors_layout(&buffer).unwrap();
        let error = patch
            .apply_in_batches(&mut buffer, &layout, 4096)
            .unwrap_err();
        assert!(
            matches!(error, DeltaError::TargetMismatch { .. }),
            "{error}"
        );
        assert!(buffer == case.base);
    }

    /// A spill whose one read, or one write back, fails: the one after as many
    /// successes as its count says.
    #[derive(Debug)]
    struct Failing {
        inner: Arc<dyn Spill>,
        reads_left: AtomicUsize,
        writes_left: AtomicUsize,
    }

    impl Failing {
        fn take(left: &AtomicUsize) -> std::io::Result<()> {
            match left.fetch_sub(1, Ordering::Relaxed) {
                0 => Err(std::io::Error::other("input/output error")),
                _ => Ok(()),
            }
        }
    }

    impl Spill for Failing {
        fn append(&self, bytes: &[u8]) -> std::io::Result<u64> {
            self.inner.append(bytes)
        }

        fn read_at(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
            Failing::take(&self.reads_left)?;
            self.inner.read_at(offset, out)
        }

        fn write_at(&self, offset: u64, bytes: &[u8]) -> std::io::Result<()> {
            Failing::take(&self.writes_left)?;
            self.inner.write_at(offset, bytes)
        }
    }

    #[test]
    fn a_spill_that_fails_midway_leaves_the_base_and_says_what_failed() {
        let case = case(Encoding::Aurora);
        let delta = DeltaFile::parse(&case.delta).unwrap();
        let chunks = staged(&delta, &case.base, &Heap.spill().unwrap())
            .chunks
            .len();
        // Failures in the first batch, in a later one, and in the last.
        for at in [0, chunks / 3, chunks - 1] {
            for (reads, writes, doing) in [
                (at, usize::MAX, "reading"),
                (usize::MAX, at, "writing back"),
            ] {
                let spill: Arc<dyn Spill> = Arc::new(Failing {
                    inner: Heap.spill().unwrap(),
                    reads_left: AtomicUsize::new(reads),
                    writes_left: AtomicUsize::new(writes),
                });
                let patch = staged(&delta, &case.base, &spill);
                let mut buffer = case.base.clone();
                let layout = safetensors_layout(&buffer).unwrap();
                let error = patch
                    .apply_in_batches(&mut buffer, &layout, 4096)
                    .unwrap_err();
                assert!(
                    matches!(
                        &error,
                        DeltaError::Spill { doing: what, source }
                            if what.starts_with(doing) && source.kind() == std::io::ErrorKind::Other
                    ),
                    "{error}"
                );
                assert!(buffer == case.base, "failing after {at}: {error}");
            }
        }
    }

    #[test]
    fn a_segment_staged_twice_is_refused_as_overlapping() {
        let case = case(Encoding::Aurora);
        let delta = DeltaFile::parse(&case.delta).unwrap();
        let layout = safetensors_layout(&case.base).unwrap();
        let view = Checkpoint::from_layout(&case.base, &layout).unwrap();
        let spill = Heap.spill().unwrap();
        let segment = || {
            let bytes = delta.verify_segment(0).unwrap();
            SpilledChunks::write(
                &spill,
                decode_segment(delta.header(), 0, bytes, &view).unwrap(),
            )
            .unwrap()
        };
        let error = SpilledPatch::new(delta.header().clone(), [segment(), segment()]).unwrap_err();
        assert!(
            error.to_string().contains("overlaps the previous chunk"),
            "{error}"
        );
    }

    #[test]
    fn a_spill_that_cannot_keep_a_segment_is_an_error_naming_its_size() {
        let case = case(Encoding::Dense);
        let delta = DeltaFile::parse(&case.delta).unwrap();
        let layout = safetensors_layout(&case.base).unwrap();
        let view = Checkpoint::from_layout(&case.base, &layout).unwrap();
        #[derive(Debug)]
        struct Full;
        impl Spill for Full {
            fn append(&self, _: &[u8]) -> std::io::Result<u64> {
                Err(std::io::Error::from(std::io::ErrorKind::StorageFull))
            }
            fn read_at(&self, _: u64, _: &mut [u8]) -> std::io::Result<()> {
                unreachable!("nothing was appended")
            }
            fn write_at(&self, _: u64, _: &[u8]) -> std::io::Result<()> {
                unreachable!("nothing was appended")
            }
        }
        let spill: Arc<dyn Spill> = Arc::new(Full);
        let chunks =
            decode_segment(delta.header(), 0, delta.verify_segment(0).unwrap(), &view).unwrap();
        let error = SpilledChunks::write(&spill, chunks).unwrap_err();
        assert!(
            matches!(
                &error,
                DeltaError::Spill { doing, source }
                    if doing.ends_with("bytes of changes")
                        && source.kind() == std::io::ErrorKind::StorageFull
            ),
            "{error}"
        );
    }
}
