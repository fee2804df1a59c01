//! Decoding and applying deltas, transactionally (docs/delta-format.md §7).
//!
//! Applying is split in two so that nothing is written before everything is checked:
//! [`decode`] verifies the base, every segment hash and every chunk, and produces a
//! [`Patch`]; only then does [`Patch::apply_in_place`] or [`Patch::materialize`] touch
//! weights. The target weights hash is checked after writing; on a mismatch the writes
//! are undone (a patch swaps old values in as it writes new ones, so the undo is the same
//! operation again).

use std::collections::HashMap;

use rayon::prelude::*;

use crate::bits::ByteReader;
use crate::checkpoint::{Checkpoint, Hash, TensorLayout, TensorView};
use crate::codec::{Changes, ChunkEncoding, ChunkRecord, decode_changes};
use crate::error::{DeltaError, Result};
use crate::format::{
    DeltaFile, DeltaHeader, MAX_CHUNK_ELEMENTS, TensorChange, TensorEntry, TensorSpec,
};
use crate::image::{Image, ImageSpace, InitialTensor, safetensors_image};

/// The decoded changes of one chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PatchChunk {
    pub tensor: u32,
    pub start: u64,
    pub len: u64,
    pub encoding: ChunkEncoding,
    /// Size of the chunk record in the artifact, for statistics.
    pub encoded_bytes: usize,
    pub changes: Changes,
}

/// Where a chunk of a [`Patch`] lies in the buffer it applies to.
pub(crate) struct Placement {
    /// Index of the chunk in [`Patch::chunks`].
    pub chunk: usize,
    pub bytes: std::ops::Range<usize>,
    pub element_bytes: usize,
}

/// A fully decoded and validated delta.
#[derive(Debug, Clone)]
pub struct Patch {
    pub header: DeltaHeader,
    /// Sorted by tensor, then start; ranges never overlap.
    pub chunks: Vec<PatchChunk>,
}

/// A tensor owning its bytes, the result of materialising a delta.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnedTensor {
    pub name: String,
    pub dtype: crate::Dtype,
    pub shape: Vec<u64>,
    pub data: Vec<u8>,
}

impl OwnedTensor {
    pub fn view(&self) -> TensorView<'_> {
        TensorView {
            name: self.name.clone(),
            dtype: self.dtype,
            shape: self.shape.clone(),
            data: &self.data,
        }
    }
}

/// Views owned tensors as a checkpoint.
pub fn owned_checkpoint(tensors: &[OwnedTensor]) -> Result<Checkpoint<'_>> {
    Checkpoint::new(tensors.iter().map(OwnedTensor::view).collect())
}

/// Checks that `base` is the checkpoint the delta was taken from: the same tensors with the
/// same dtypes and shapes, and the same weights hash (computed unless `known_hash` is
/// given by a caller that has already verified it).
pub fn check_base(
    header: &DeltaHeader,
    base: &Checkpoint<'_>,
    known_hash: Option<Hash>,
) -> Result<()> {
    let mut expected = 0;
    for entry in &header.tensors {
        let Some(spec) = entry.change.base() else {
            continue;
        };
        expected += 1;
        let tensor = base.get(&entry.name).ok_or_else(|| {
            DeltaError::BaseMismatch(format!("tensor '{}' is missing", entry.name))
        })?;
        ensure_spec(&entry.name, tensor.dtype, &tensor.shape, spec)?;
    }
    if base.tensors().len() != expected {
        let extra = base
            .tensors()
            .iter()
            .find(|t| {
                header
                    .tensors
                    .binary_search_by(|e| e.name.as_str().cmp(&t.name))
                    .is_err()
            })
            .map(|t| t.name.clone())
            .unwrap_or_default();
        return Err(DeltaError::BaseMismatch(format!(
            "tensor '{extra}' is not in the delta's base"
        )));
    }
    let actual = known_hash.unwrap_or_else(|| base.weights_hash());
    if actual != header.base_hash {
        return Err(DeltaError::WrongBase {
            expected: header.base_hash,
            actual,
        });
    }
    Ok(())
}

fn ensure_spec(name: &str, dtype: crate::Dtype, shape: &[u64], spec: &TensorSpec) -> Result<()> {
    if dtype != spec.dtype || shape != spec.shape {
        return Err(DeltaError::BaseMismatch(format!(
            "tensor '{name}' is {dtype} {shape:?}, the delta expects {} {:?}",
            spec.dtype, spec.shape
        )));
    }
    Ok(())
}

/// Decodes one segment against the base. Usable on its own, so a receiver can decode and
/// stage each segment as it arrives; its chunks are decoded in parallel.
pub fn decode_segment(
    header: &DeltaHeader,
    index: u32,
    bytes: &[u8],
    base: &Checkpoint<'_>,
) -> Result<Vec<PatchChunk>> {
    segment_records(index, bytes)?
        .par_iter()
        .map(|(record, encoded_bytes)| decode_chunk(header, record, *encoded_bytes, base))
        .collect()
}

/// Splits a segment into its chunk records (and each record's size in bytes).
fn segment_records(index: u32, bytes: &[u8]) -> Result<Vec<(ChunkRecord<'_>, usize)>> {
    let mut reader = ByteReader::new(bytes);
    let mut records = Vec::new();
    while !reader.is_empty() {
        let offset = reader.position();
        let record = ChunkRecord::read(&mut reader).map_err(|e| DeltaError::SegmentMalformed {
            index,
            reason: format!("chunk record at byte {offset}: {e}"),
        })?;
        records.push((record, reader.position() - offset));
    }
    Ok(records)
}

/// Checks a chunk record against the tensor table (§5): the tensor exists and has a
/// target side, new tensors are dense, and the range is non-empty, bounded and inside
/// the tensor. Returns the tensor's entry and target spec, and the range's end.
pub(crate) fn checked_record<'h>(
    header: &'h DeltaHeader,
    record: &ChunkRecord<'_>,
) -> Result<(&'h TensorEntry, &'h TensorSpec, u64)> {
    let entry = header.tensors.get(record.tensor as usize).ok_or_else(|| {
        DeltaError::Malformed(format!(
            "chunk names tensor {} of a table with {}",
            record.tensor,
            header.tensors.len()
        ))
    })?;
    let fail = |reason: String| DeltaError::ChunkMalformed {
        tensor: entry.name.clone(),
        start: record.start,
        reason,
    };
    let spec = entry
        .change
        .target()
        .ok_or_else(|| fail("the tensor is removed, it cannot have chunks".into()))?;
    let dense_only = !matches!(entry.change, TensorChange::Patched(_));
    if dense_only && record.encoding != ChunkEncoding::Dense {
        return Err(fail(format!(
            "a new tensor must be dense, not {}",
            record.encoding.name()
        )));
    }
    if record.len == 0 || record.len > MAX_CHUNK_ELEMENTS {
        return Err(fail(format!(
            "chunk length {} not in 1..={MAX_CHUNK_ELEMENTS}",
            record.len
        )));
    }
    let end = record
        .start
        .checked_add(record.len)
        .filter(|&end| end <= spec.element_count())
        .ok_or_else(|| {
            fail(format!(
                "range of {} elements exceeds the tensor's {}",
                record.len,
                spec.element_count()
            ))
        })?;
    Ok((entry, spec, end))
}

fn decode_chunk(
    header: &DeltaHeader,
    record: &ChunkRecord<'_>,
    encoded_bytes: usize,
    base: &Checkpoint<'_>,
) -> Result<PatchChunk> {
    let (entry, spec, end) = checked_record(header, record)?;
    let fail = |reason: String| DeltaError::ChunkMalformed {
        tensor: entry.name.clone(),
        start: record.start,
        reason,
    };
    let dense_only = !matches!(entry.change, TensorChange::Patched(_));
    let element_bytes = spec.dtype.size_bytes() as u64;
    let base_range = if dense_only {
        None
    } else {
        let tensor = base.get(&entry.name).ok_or_else(|| {
            DeltaError::BaseMismatch(format!("tensor '{}' is missing", entry.name))
        })?;
        ensure_spec(&entry.name, tensor.dtype, &tensor.shape, spec)?;
        Some(&tensor.data[(record.start * element_bytes) as usize..(end * element_bytes) as usize])
    };
    let changes = decode_changes(
        record.encoding,
        spec.dtype,
        record.len,
        record.payload,
        base_range,
    )
    .map_err(|e| fail(e.to_string()))?;
    Ok(PatchChunk {
        tensor: record.tensor,
        start: record.start,
        len: record.len,
        encoding: record.encoding,
        encoded_bytes,
        changes,
    })
}

/// Verifies every segment and decodes the whole delta against `base`, which must already
/// have passed [`check_base`]. Segments are verified, and chunks decoded, in parallel.
pub fn decode(delta: &DeltaFile<'_>, base: &Checkpoint<'_>) -> Result<Patch> {
    let header = delta.header();
    let segments: Vec<Vec<(ChunkRecord<'_>, usize)>> = (0..delta.segment_count())
        .into_par_iter()
        .map(|index| segment_records(index as u32, delta.verify_segment(index)?))
        .collect::<Result<_>>()?;
    let chunks = segments
        .into_iter()
        .flatten()
        .collect::<Vec<_>>()
        .par_iter()
        .map(|(record, encoded_bytes)| decode_chunk(header, record, *encoded_bytes, base))
        .collect::<Result<Vec<_>>>()?;
    Patch::new(header.clone(), chunks)
}

impl Patch {
    /// Orders the chunks and checks that they neither overlap nor leave a new tensor
    /// partly undefined.
    pub fn new(header: DeltaHeader, mut chunks: Vec<PatchChunk>) -> Result<Patch> {
        chunks.sort_by_key(|c| (c.tensor, c.start));
        check_ranges(&header, chunks.iter().map(PatchChunk::range))?;
        Ok(Patch { header, chunks })
    }

    /// Whether the target has exactly the base's tensors, dtypes and shapes, so the
    /// delta can be applied in place.
    pub fn preserves_layout(&self) -> bool {
        preserves_layout(&self.header)
    }

    /// The names of the target's tensors whose values this patch changes (every target
    /// tensor when it changes the layout), in name order: what an engine must reload.
    pub fn changed_tensors(&self) -> Vec<String> {
        changed_tensors(&self.header, self.chunks.iter().map(|c| c.tensor))
    }

    pub fn changed_elements(&self) -> u64 {
        self.chunks
            .iter()
            .map(|c| {
                let spec = self.header.tensors[c.tensor as usize]
                    .change
                    .target()
                    .expect("chunks belong to target tensors");
                c.changes.changed_elements(spec.dtype.size_bytes())
            })
            .sum()
    }

    /// Applies the patch to `buffer`, whose tensors sit where `layout` says (the base's
    /// safetensors image, or the fused parameters of an inference engine). On success the
    /// patch holds the old values, so applying it again rolls back. If the result's
    /// weights hash is not the target's, the buffer is restored and an error returned.
    pub fn apply_in_place(&mut self, buffer: &mut [u8], layout: &[TensorLayout]) -> Result<Hash> {
        self.swap_in_place(buffer, layout)?;
        let actual = Checkpoint::from_layout(buffer, layout)?.weights_hash();
        if actual != self.header.target_hash {
            self.swap_in_place(buffer, layout)?;
            return Err(DeltaError::TargetMismatch {
                expected: self.header.target_hash,
                actual,
            });
        }
        Ok(actual)
    }

    /// Writes the patch's values into `buffer` and keeps the values they replace, without
    /// checking the result: calling it twice restores the buffer. All placement checks
    /// happen before the first write.
    pub fn swap_in_place(&mut self, buffer: &mut [u8], layout: &[TensorLayout]) -> Result<()> {
        self.check_in_place()?;
        self.swap_into_target_layout(buffer, layout)
    }

    /// Fails, naming a tensor, unless the patch keeps every tensor's name, dtype and
    /// shape ([`Patch::preserves_layout`]), as writing into the base's buffer needs.
    pub fn check_in_place(&self) -> Result<()> {
        check_in_place(&self.header)
    }

    /// [`Patch::swap_in_place`] into a buffer whose tensors have the target's names,
    /// dtypes and shapes, whatever the base's were.
    fn swap_into_target_layout(
        &mut self,
        buffer: &mut [u8],
        layout: &[TensorLayout],
    ) -> Result<()> {
        swap_chunks(
            &self.header,
            &mut self.chunks,
            buffer,
            layout,
            Threads::Pool,
        )
    }

    /// Where each chunk lies in a buffer of `buffer_len` bytes (see [`placements`]).
    pub(crate) fn placements(
        &self,
        buffer_len: usize,
        layout: &[TensorLayout],
    ) -> Result<Vec<Placement>> {
        placements(
            &self.header,
            self.chunks.iter().map(PatchChunk::range),
            buffer_len,
            layout,
        )
    }

    /// Builds the target as a safetensors image, the same bytes `safetensors::serialize`
    /// writes for the target's tensors (what an engine loads), for deltas that change
    /// the layout: each tensor is written into the image once, from the base (patched)
    /// or as zeros (added, reshaped), then the changes go in place. One copy of the
    /// model, not tensors and then their image. Checks the image's weights hash.
    pub fn materialize_image(
        mut self,
        base: &Checkpoint<'_>,
        space: &dyn ImageSpace,
    ) -> Result<(Image, Vec<TensorLayout>)> {
        let initial = self
            .header
            .tensors
            .iter()
            .filter_map(|entry| entry.change.target().map(|spec| (entry, spec)))
            .map(|(entry, spec)| initial_tensor(entry, spec, initial_data(entry, base)?))
            .collect::<Result<Vec<_>>>()?;
        let (mut image, layout) = safetensors_image(space, initial)?;
        self.finish_target(&mut image, &layout)?;
        Ok((image, layout))
    }

    /// Builds the target in `buffer`, whose tensors sit where `layout` says with the
    /// target's names, dtypes and shapes (as [`DeltaHeader::target_layout`] places
    /// them): every byte of each tensor is written, from the base (patched) or as zeros
    /// (added, reshaped), then the changes go in place. The base is only read, so a
    /// binding can build the target in memory its own framework owns. Checks the target
    /// weights hash and returns it.
    ///
    /// [`DeltaHeader::target_layout`]: crate::DeltaHeader::target_layout
    pub fn materialize_into(
        mut self,
        base: &Checkpoint<'_>,
        buffer: &mut [u8],
        layout: &[TensorLayout],
    ) -> Result<Hash> {
        let by_name: HashMap<&str, &TensorLayout> =
            layout.iter().map(|l| (l.name.as_str(), l)).collect();
        for entry in &self.header.tensors {
            let Some(spec) = entry.change.target() else {
                continue;
            };
            let place = by_name.get(entry.name.as_str()).ok_or_else(|| {
                DeltaError::Checkpoint(format!(
                    "tensor '{}' has no place in the buffer",
                    entry.name
                ))
            })?;
            ensure_spec(&entry.name, place.dtype, &place.shape, spec)?;
            let out = buffer
                .get_mut(place.bytes.clone())
                .filter(|out| out.len() as u64 == spec.byte_len())
                .ok_or_else(|| {
                    DeltaError::Checkpoint(format!(
                        "tensor '{}' has no room of its size in the buffer",
                        entry.name
                    ))
                })?;
            match initial_data(entry, base)? {
                Some(data) => out.copy_from_slice(data),
                None => out.fill(0),
            }
        }
        self.finish_target(buffer, layout)
    }

    /// Swaps the changes into a buffer holding the target's initial values and checks the
    /// result's weights hash.
    fn finish_target(&mut self, buffer: &mut [u8], layout: &[TensorLayout]) -> Result<Hash> {
        self.swap_into_target_layout(buffer, layout)?;
        let actual = Checkpoint::from_layout(buffer, layout)?.weights_hash();
        if actual != self.header.target_hash {
            return Err(DeltaError::TargetMismatch {
                expected: self.header.target_hash,
                actual,
            });
        }
        Ok(actual)
    }

    /// Builds the target checkpoint from `base` (copying it), for deltas that change the
    /// layout or when the base must stay untouched. Checks the target weights hash.
    pub fn materialize(mut self, base: &Checkpoint<'_>) -> Result<Vec<OwnedTensor>> {
        let mut tensors = Vec::new();
        let mut chunks = std::mem::take(&mut self.chunks).into_iter().peekable();
        for (index, entry) in self.header.tensors.iter().enumerate() {
            let Some(spec) = entry.change.target() else {
                continue;
            };
            let mut data = match initial_data(entry, base)? {
                Some(data) => data.to_vec(),
                None => vec![0u8; spec.byte_len() as usize],
            };
            let element_bytes = spec.dtype.size_bytes();
            while let Some(mut chunk) = chunks.next_if(|c| c.tensor as usize == index) {
                let start = chunk.start as usize * element_bytes;
                let end = start + chunk.len as usize * element_bytes;
                chunk
                    .changes
                    .swap_into(&mut data[start..end], element_bytes);
            }
            tensors.push(OwnedTensor {
                name: entry.name.clone(),
                dtype: spec.dtype,
                shape: spec.shape.clone(),
                data,
            });
        }
        let actual = owned_checkpoint(&tensors)?.weights_hash();
        if actual != self.header.target_hash {
            return Err(DeltaError::TargetMismatch {
                expected: self.header.target_hash,
                actual,
            });
        }
        Ok(tensors)
    }
}

/// The tensor and element range a chunk covers.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ChunkRange {
    pub tensor: u32,
    pub start: u64,
    pub len: u64,
}

impl PatchChunk {
    pub(crate) fn range(&self) -> ChunkRange {
        ChunkRange {
            tensor: self.tensor,
            start: self.start,
            len: self.len,
        }
    }
}

/// Checks the chunks of a delta, sorted by tensor then start: none overlaps the one
/// before, and no new tensor is left partly undefined.
pub(crate) fn check_ranges(
    header: &DeltaHeader,
    sorted: impl Iterator<Item = ChunkRange>,
) -> Result<()> {
    let mut covered: HashMap<u32, u64> = HashMap::new();
    let mut previous: Option<ChunkRange> = None;
    for range in sorted {
        if let Some(previous) = previous
            && previous.tensor == range.tensor
            && previous.start + previous.len > range.start
        {
            return Err(DeltaError::ChunkMalformed {
                tensor: header.tensors[range.tensor as usize].name.clone(),
                start: range.start,
                reason: "overlaps the previous chunk".into(),
            });
        }
        *covered.entry(range.tensor).or_default() += range.len;
        previous = Some(range);
    }
    for (index, entry) in header.tensors.iter().enumerate() {
        if let TensorChange::Added(spec) | TensorChange::Replaced { target: spec, .. } =
            &entry.change
        {
            let have = covered.get(&(index as u32)).copied().unwrap_or(0);
            if have != spec.element_count() {
                return Err(DeltaError::Malformed(format!(
                    "new tensor '{}' has {have} of its {} elements",
                    entry.name,
                    spec.element_count()
                )));
            }
        }
    }
    Ok(())
}

/// Whether the delta keeps every tensor's name, dtype and shape.
pub(crate) fn preserves_layout(header: &DeltaHeader) -> bool {
    header
        .tensors
        .iter()
        .all(|e| matches!(e.change, TensorChange::Patched(_)))
}

/// Fails, naming a tensor, unless the delta keeps every tensor's name, dtype and shape.
pub(crate) fn check_in_place(header: &DeltaHeader) -> Result<()> {
    match header
        .tensors
        .iter()
        .find(|e| !matches!(e.change, TensorChange::Patched(_)))
    {
        Some(entry) => Err(DeltaError::Unsupported {
            name: entry.name.clone(),
            reason: "the delta adds, removes or reshapes tensors, so it cannot be applied in place"
                .into(),
        }),
        None => Ok(()),
    }
}

/// The target tensors an engine must reload after a delta whose chunks are in
/// `touched`, in name order: every one when the delta changes the layout.
pub(crate) fn changed_tensors(
    header: &DeltaHeader,
    touched: impl Iterator<Item = u32>,
) -> Vec<String> {
    let layout_changes = !preserves_layout(header);
    let mut changed = vec![false; header.tensors.len()];
    for tensor in touched {
        changed[tensor as usize] = true;
    }
    header
        .tensors
        .iter()
        .zip(changed)
        .filter(|(entry, changed)| entry.change.target().is_some() && (*changed || layout_changes))
        .map(|(entry, _)| entry.name.clone())
        .collect()
}

/// Swaps `chunks`, which belong to the delta `header` describes, into `buffer` (laid
/// out as `layout`), on the current rayon pool or on the calling thread alone. Every
/// chunk is placed before the first write.
pub(crate) fn swap_chunks(
    header: &DeltaHeader,
    chunks: &mut [PatchChunk],
    buffer: &mut [u8],
    layout: &[TensorLayout],
    threads: Threads,
) -> Result<()> {
    let placements = placements(
        header,
        chunks.iter().map(PatchChunk::range),
        buffer.len(),
        layout,
    )?;
    // Chunks cover disjoint ranges, so the buffer splits into one slice per chunk and
    // the swaps run on the current rayon pool: a large model's commit is then bound by
    // memory bandwidth rather than one core.
    let mut chunks: Vec<Option<&mut PatchChunk>> = chunks.iter_mut().map(Some).collect();
    let mut jobs = Vec::with_capacity(placements.len());
    let (mut rest, mut rest_start) = (buffer, 0);
    for placement in placements {
        let chunk = chunks[placement.chunk]
            .take()
            .expect("each chunk is placed once");
        let (slice, tail) = std::mem::take(&mut rest)[placement.bytes.start - rest_start..]
            .split_at_mut(placement.bytes.len());
        jobs.push((chunk, slice, placement.element_bytes));
        (rest, rest_start) = (tail, placement.bytes.end);
    }
    let swap = |(chunk, slice, element_bytes): (&mut PatchChunk, &mut [u8], usize)| {
        chunk.changes.swap_into(slice, element_bytes)
    };
    match threads {
        Threads::Pool => jobs.into_par_iter().for_each(swap),
        Threads::Caller => jobs.into_iter().for_each(swap),
    }
    Ok(())
}

/// Where each chunk range (in the order given: a placement's `chunk` is its index) lies
/// in a buffer of `buffer_len` bytes whose tensors sit where `layout` says (with the
/// target's names, dtypes and shapes), in buffer order; checks that every chunk lies
/// inside the buffer and that no two overlap.
pub(crate) fn placements(
    header: &DeltaHeader,
    ranges: impl Iterator<Item = ChunkRange>,
    buffer_len: usize,
    layout: &[TensorLayout],
) -> Result<Vec<Placement>> {
    let by_name: HashMap<&str, &TensorLayout> =
        layout.iter().map(|l| (l.name.as_str(), l)).collect();
    let mut placements = Vec::with_capacity(ranges.size_hint().0);
    let mut tensors = Vec::with_capacity(ranges.size_hint().0);
    for (index, range) in ranges.enumerate() {
        let entry = &header.tensors[range.tensor as usize];
        let spec = entry
            .change
            .target()
            .expect("chunks belong to target tensors");
        let place = by_name.get(entry.name.as_str()).ok_or_else(|| {
            DeltaError::BaseMismatch(format!("tensor '{}' is not in the buffer", entry.name))
        })?;
        ensure_spec(&entry.name, place.dtype, &place.shape, spec)?;
        let element_bytes = spec.dtype.size_bytes();
        let start = place.bytes.start + range.start as usize * element_bytes;
        let end = start + range.len as usize * element_bytes;
        if end > place.bytes.end || place.bytes.end > buffer_len {
            return Err(DeltaError::BaseMismatch(format!(
                "tensor '{}' lies outside the buffer",
                entry.name
            )));
        }
        placements.push(Placement {
            chunk: index,
            bytes: start..end,
            element_bytes,
        });
        tensors.push(range.tensor);
    }
    placements.sort_unstable_by_key(|p| p.bytes.start);
    for pair in placements.windows(2) {
        if pair[1].bytes.start < pair[0].bytes.end {
            return Err(DeltaError::BaseMismatch(format!(
                "tensor '{}' overlaps another in the buffer",
                header.tensors[tensors[pair[1].chunk] as usize].name
            )));
        }
    }
    Ok(placements)
}

/// Where a swap runs.
#[derive(Clone, Copy)]
pub(crate) enum Threads {
    /// The current rayon pool.
    Pool,
    /// The calling thread alone.
    Caller,
}

/// The target of a layout-changing artifact that starts from nothing (a snapshot: every
/// tensor added), built segment by segment as they are decoded: a [`Patch`] would hold
/// every decoded chunk (the whole model, again) until the last one arrived, and then
/// build the image beside them. Here the image is the only copy. Chunks are placed
/// exactly as [`Patch::materialize_image`] places them; what was never written, or
/// written from bytes that were not the trainer's, fails the weights hash at
/// [`TargetImage::finish`].
pub struct TargetImage {
    header: DeltaHeader,
    image: Image,
    layout: Vec<TensorLayout>,
}

impl TargetImage {
    /// The target's safetensors image in `space`, every tensor zero, for an artifact
    /// whose every target tensor is new.
    pub fn new(header: DeltaHeader, space: &dyn ImageSpace) -> Result<TargetImage> {
        let initial = header
            .tensors
            .iter()
            .filter_map(|entry| entry.change.target().map(|spec| (entry, spec)))
            .map(|(entry, spec)| {
                if let TensorChange::Patched(_) = entry.change {
                    return Err(DeltaError::BaseMismatch(format!(
                        "tensor '{}' is patched: only an artifact whose tensors are all new \
                         builds a target from nothing",
                        entry.name
                    )));
                }
                initial_tensor(entry, spec, None)
            })
            .collect::<Result<Vec<_>>>()?;
        let (image, layout) = safetensors_image(space, initial)?;
        Ok(TargetImage {
            header,
            image,
            layout,
        })
    }

    pub fn header(&self) -> &DeltaHeader {
        &self.header
    }

    /// Writes one segment's decoded chunks in place (each checked to lie inside its
    /// tensor, none overlapping another of the segment), on the calling thread alone:
    /// the caller may hold a lock around it, and a rayon worker waiting inside a lock
    /// can take another task that waits on the same lock.
    pub fn write(&mut self, mut chunks: Vec<PatchChunk>) -> Result<()> {
        swap_chunks(
            &self.header,
            &mut chunks,
            &mut self.image,
            &self.layout,
            Threads::Caller,
        )
    }

    /// The finished image and its layout, once its weights hash is `target_hash`: the
    /// artifact's, from its Seal (the header it was built from may have left it
    /// pending, docs/wire-protocol.md §4.4).
    pub fn finish(self, target_hash: Hash) -> Result<(Image, Vec<TensorLayout>, Hash)> {
        let actual = Checkpoint::from_layout(&self.image, &self.layout)?.weights_hash();
        if actual != target_hash {
            return Err(DeltaError::TargetMismatch {
                expected: target_hash,
                actual,
            });
        }
        Ok((self.image, self.layout, actual))
    }

    /// Every target tensor's name: an engine reloads all of them.
    pub fn tensor_names(&self) -> Vec<String> {
        self.layout
            .iter()
            .map(|tensor| tensor.name.clone())
            .collect()
    }
}

/// What a target tensor starts from before its changes: the base's values for a patched
/// tensor (checked against the delta's spec: a patch may reach here without
/// `check_base`), zeros (`None`) for one added or reshaped.
fn initial_data<'a>(entry: &TensorEntry, base: &Checkpoint<'a>) -> Result<Option<&'a [u8]>> {
    let TensorChange::Patched(spec) = &entry.change else {
        return Ok(None);
    };
    let tensor = base
        .get(&entry.name)
        .ok_or_else(|| DeltaError::BaseMismatch(format!("tensor '{}' is missing", entry.name)))?;
    ensure_spec(&entry.name, tensor.dtype, &tensor.shape, spec)?;
    Ok(Some(tensor.data))
}

/// A target tensor of an image being built, from `data` or zeros.
fn initial_tensor<'a>(
    entry: &TensorEntry,
    spec: &TensorSpec,
    data: Option<&'a [u8]>,
) -> Result<InitialTensor<'a>> {
    let len = usize::try_from(spec.byte_len()).map_err(|_| DeltaError::LimitExceeded {
        what: "tensor size in bytes",
        value: spec.byte_len(),
        limit: usize::MAX as u64,
    })?;
    Ok(InitialTensor {
        name: entry.name.clone(),
        dtype: spec.dtype,
        shape: spec.shape.clone(),
        data,
        len,
    })
}

/// Verifies, decodes and materialises `delta` on top of `base` in one call.
pub fn apply(
    delta: &DeltaFile<'_>,
    base: &Checkpoint<'_>,
    known_base_hash: Option<Hash>,
) -> Result<Vec<OwnedTensor>> {
    check_base(delta.header(), base, known_base_hash)?;
    decode(delta, base)?.materialize(base)
}
