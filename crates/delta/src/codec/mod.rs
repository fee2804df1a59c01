//! Chunk encodings and the chunk record (docs/delta-format.md §5 and §6).
//!
//! A chunk carries the changes of one element range of one tensor and decodes on its own
//! given the base values of that range, which is what lets a receiver decode and stage a
//! segment while later segments are still in flight.

pub(crate) mod aurora;
pub(crate) mod elements;
pub(crate) mod entropy;
pub(crate) mod scan;

use crate::bits::{ByteReader, write_leb128};
use crate::dtype::Dtype;
use crate::error::{DeltaError, Result};
use crate::format::MAX_CHUNK_ELEMENTS;
use scan::{Word, for_each_changed};

/// How the payload of one chunk is coded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[repr(u8)]
pub enum ChunkEncoding {
    /// The target bytes of the whole range.
    Dense = 0,
    /// The published design: LEB128 index gaps and raw new values.
    Leb128 = 1,
    /// Exponent-context classes, Golomb-coded rank gaps and rANS-coded steps.
    Aurora = 2,
}

impl ChunkEncoding {
    pub fn from_code(code: u8) -> Result<ChunkEncoding> {
        match code {
            0 => Ok(ChunkEncoding::Dense),
            1 => Ok(ChunkEncoding::Leb128),
            2 => Ok(ChunkEncoding::Aurora),
            other => Err(DeltaError::Malformed(format!(
                "unknown chunk encoding {other}"
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ChunkEncoding::Dense => "dense",
            ChunkEncoding::Leb128 => "leb128",
            ChunkEncoding::Aurora => "aurora",
        }
    }
}

/// Fixed bytes of a chunk record before its payload.
pub const CHUNK_HEADER_BYTES: usize = 4 + 8 + 8 + 1 + 4;

/// A chunk as it sits inside a segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkRecord<'a> {
    pub tensor: u32,
    pub start: u64,
    pub len: u64,
    pub encoding: ChunkEncoding,
    pub payload: &'a [u8],
}

impl<'a> ChunkRecord<'a> {
    /// Bytes a record adds to its payload (docs/delta-format.md §5).
    pub const OVERHEAD_BYTES: usize = 4 + 8 + 8 + 1 + 4;

    pub fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.tensor.to_le_bytes());
        out.extend_from_slice(&self.start.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
        out.push(self.encoding as u8);
        out.extend_from_slice(&(self.payload.len() as u32).to_le_bytes());
        out.extend_from_slice(self.payload);
    }

    pub fn read(reader: &mut ByteReader<'a>) -> Result<ChunkRecord<'a>> {
        let tensor = reader.u32("chunk tensor index")?;
        let start = reader.u64("chunk start")?;
        let len = reader.u64("chunk length")?;
        let encoding = ChunkEncoding::from_code(reader.u8("chunk encoding")?)?;
        let payload_len = reader.u32("chunk payload length")?;
        let payload = reader.take(payload_len as usize, "chunk payload")?;
        Ok(ChunkRecord {
            tensor,
            start,
            len,
            encoding,
            payload,
        })
    }
}

/// Decoded changes of one chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Changes {
    /// Ascending positions relative to the chunk start, and the new values' bytes.
    Sparse {
        positions: Vec<u32>,
        values: Vec<u8>,
    },
    /// The new bytes of the whole range.
    Dense(Vec<u8>),
}

impl Changes {
    pub fn changed_elements(&self, element_bytes: usize) -> u64 {
        match self {
            Changes::Sparse { positions, .. } => positions.len() as u64,
            Changes::Dense(bytes) => (bytes.len() / element_bytes) as u64,
        }
    }

    /// Writes the changes into `range`, the chunk's bytes; for sparse changes the old
    /// values are swapped into `self`, so applying twice restores the original.
    pub fn swap_into(&mut self, range: &mut [u8], element_bytes: usize) {
        match self {
            Changes::Sparse { positions, values } => match element_bytes {
                2 => swap_words::<u16>(range, positions, values),
                4 => swap_words::<u32>(range, positions, values),
                _ => {
                    for (i, &p) in positions.iter().enumerate() {
                        let at = p as usize * element_bytes;
                        range[at..at + element_bytes].swap_with_slice(
                            &mut values[i * element_bytes..(i + 1) * element_bytes],
                        );
                    }
                }
            },
            Changes::Dense(bytes) => range.swap_with_slice(bytes),
        }
    }
}

fn swap_words<W: Word>(range: &mut [u8], positions: &[u32], values: &mut [u8]) {
    swap_words_at::<W, u32>(range, positions, |p| p as usize, values);
}

/// Swaps `values` with the words of `range` at `positions`, each mapped to a word
/// index by `at`.
pub(crate) fn swap_words_at<W: Word, P: Copy>(
    range: &mut [u8],
    positions: &[P],
    at: impl Fn(P) -> usize,
    values: &mut [u8],
) {
    /// Changes are sparse and irregular, so the hardware prefetcher misses them; asking
    /// for lines this many changes ahead hides most of the memory latency.
    const AHEAD: usize = 16;
    for (i, &p) in positions.iter().enumerate() {
        #[cfg(target_arch = "x86_64")]
        if let Some(&ahead) = positions.get(i + AHEAD) {
            let ahead = (at(ahead) * W::BYTES).min(range.len() - 1);
            // SAFETY: prefetching is a hint; the address lies inside `range`.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    range.as_ptr().add(ahead) as *const i8,
                )
            };
        }
        let p = at(p);
        let old = W::load(range, p);
        W::load(values, i).store(range, p);
        old.store(values, i);
    }
}

/// Which encoding extraction uses for tensors present on both sides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize)]
pub enum Encoding {
    /// Every chunk dense, changed or not: the whole target checkpoint in delta form, so
    /// dense synchronisation (the baseline deltas are measured against) travels, verifies
    /// and activates through exactly the same path as a sparse delta.
    Dense,
    /// The published baseline, always sparse.
    Leb128,
    /// Context-modelled, falling back per chunk to dense or `leb128` when smaller.
    #[default]
    Aurora,
}

impl Encoding {
    pub fn code(self) -> u8 {
        match self {
            Encoding::Dense => 0,
            Encoding::Leb128 => 1,
            Encoding::Aurora => 2,
        }
    }

    pub fn from_code(code: u8) -> Result<Encoding> {
        match code {
            0 => Ok(Encoding::Dense),
            1 => Ok(Encoding::Leb128),
            2 => Ok(Encoding::Aurora),
            other => Err(DeltaError::Malformed(format!(
                "unknown delta encoding {other}"
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Encoding::Dense => "dense",
            Encoding::Leb128 => "leb128",
            Encoding::Aurora => "aurora",
        }
    }
}

/// Encodes one chunk on its own, as one record: the codec without the artifact around it
/// (extraction cuts tensors into such ranges, may cut a range further around runs of
/// replaced values, see `encode_range`, and packs the payloads into segments), for
/// benchmarks and tools that time or inspect the codec alone. `base` and `target` are the same range
/// of one tensor, at most `MAX_CHUNK_ELEMENTS` elements. `None` when nothing changed.
pub fn encode_chunk(
    encoding: Encoding,
    dtype: Dtype,
    base: &[u8],
    target: &[u8],
) -> Result<Option<(ChunkEncoding, Vec<u8>)>> {
    let element_bytes = dtype.size_bytes();
    if base.len() != target.len() || !base.len().is_multiple_of(element_bytes) {
        return Err(DeltaError::Checkpoint(format!(
            "a chunk's base and target must be equally long whole {} elements ({} and {} bytes)",
            dtype.name(),
            base.len(),
            target.len()
        )));
    }
    let elements = (base.len() / element_bytes) as u64;
    if elements > MAX_CHUNK_ELEMENTS {
        return Err(DeltaError::LimitExceeded {
            what: "chunk elements",
            value: elements,
            limit: MAX_CHUNK_ELEMENTS,
        });
    }
    Ok(encode_changes(encoding, dtype, base, target))
}

/// Encodes the changes between two equally long ranges of one tensor as one record's
/// payload, or returns `None` when nothing changed.
pub(crate) fn encode_changes(
    encoding: Encoding,
    dtype: Dtype,
    base: &[u8],
    target: &[u8],
) -> Option<(ChunkEncoding, Vec<u8>)> {
    encode_whole(encoding, dtype, base, target).map(|(encoding, payload, _)| (encoding, payload))
}

/// [`encode_changes`], and whether `aurora` coded enough escaped steps in streaks for
/// the range to hold runs of replaced values (see [`encode_range`]).
fn encode_whole(
    encoding: Encoding,
    dtype: Dtype,
    base: &[u8],
    target: &[u8],
) -> Option<(ChunkEncoding, Vec<u8>, bool)> {
    let element_bytes = dtype.size_bytes();
    let mut payload = Vec::new();
    let (encoded, runs_likely) = match (encoding, dtype.float_layout(), element_bytes) {
        (Encoding::Aurora, Some(layout), 2) => (
            ChunkEncoding::Aurora,
            aurora::encode::<u16>(base, target, layout, &mut payload)?.may_hold_replaced_runs,
        ),
        (Encoding::Aurora, Some(layout), 4) => (
            ChunkEncoding::Aurora,
            aurora::encode::<u32>(base, target, layout, &mut payload)?.may_hold_replaced_runs,
        ),
        _ => (
            encode_leb128(base, target, element_bytes, &mut payload)
                .then_some(ChunkEncoding::Leb128)?,
            false,
        ),
    };
    // The published baseline stays itself; ours falls back to dense when that is smaller.
    if encoding == Encoding::Aurora && payload.len() >= target.len() {
        return Some((ChunkEncoding::Dense, target.to_vec(), false));
    }
    Some((encoded, payload, runs_likely))
}

/// The records of an encoded range: elements `[start, start + len)` of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EncodedPiece {
    pub start: u64,
    pub len: u64,
    pub encoding: ChunkEncoding,
    pub payload: Vec<u8>,
}

/// Encodes the changes between two equally long ranges of one tensor as one or more
/// records (none when nothing changed). With `aurora`, values replaced wholesale (an
/// embedding row re-initialised, say) cost their step's escape code, about twice their
/// dense size; a range with many escapes, many changes in streaks, is therefore cut
/// around its runs of escapes, which go dense, if that makes it smaller. Escapes alone
/// do not tell: a training step's changes to the smallest weights are many steps long,
/// but scattered.
pub(crate) fn encode_range(
    encoding: Encoding,
    dtype: Dtype,
    base: &[u8],
    target: &[u8],
) -> Vec<EncodedPiece> {
    let element_bytes = dtype.size_bytes();
    let len = base.len() / element_bytes;
    let piece = |range: std::ops::Range<usize>, (encoding, payload, _)| EncodedPiece {
        start: range.start as u64,
        len: range.len() as u64,
        encoding,
        payload,
    };
    let Some(whole) = encode_whole(encoding, dtype, base, target) else {
        return Vec::new();
    };
    let runs_likely = whole.2;
    let whole = piece(0..len, whole);
    if !runs_likely {
        return vec![whole];
    }
    let runs = match element_bytes {
        2 => aurora::escaped_runs::<u16>(base, target),
        4 => aurora::escaped_runs::<u32>(base, target),
        _ => unreachable!("escapes are coded for 16- and 32-bit floats only"),
    };
    let bytes =
        |range: &std::ops::Range<usize>| range.start * element_bytes..range.end * element_bytes;
    let mut pieces = Vec::with_capacity(2 * runs.len() + 1);
    let sparse = |range: std::ops::Range<usize>, pieces: &mut Vec<EncodedPiece>| {
        if let Some(coded) = encode_whole(
            encoding,
            dtype,
            &base[bytes(&range)],
            &target[bytes(&range)],
        ) {
            pieces.push(piece(range, coded));
        }
    };
    let mut done = 0;
    for run in runs {
        sparse(done..run.start, &mut pieces);
        pieces.push(piece(
            run.clone(),
            (ChunkEncoding::Dense, target[bytes(&run)].to_vec(), false),
        ));
        done = run.end;
    }
    sparse(done..len, &mut pieces);
    let cost = |pieces: &[EncodedPiece]| {
        pieces
            .iter()
            .map(|p| p.payload.len() + ChunkRecord::OVERHEAD_BYTES)
            .sum::<usize>()
    };
    if cost(&pieces) < cost(std::slice::from_ref(&whole)) {
        pieces
    } else {
        vec![whole]
    }
}

/// Decodes a chunk's payload. `base` holds the base bytes of the chunk's range and is
/// required by every encoding but dense.
pub(crate) fn decode_changes(
    encoding: ChunkEncoding,
    dtype: Dtype,
    len: u64,
    payload: &[u8],
    base: Option<&[u8]>,
) -> Result<Changes> {
    let element_bytes = dtype.size_bytes();
    let range_bytes = len
        .checked_mul(element_bytes as u64)
        .ok_or_else(|| DeltaError::Malformed("chunk length overflows".into()))?;
    if let Some(base) = base {
        debug_assert_eq!(base.len() as u64, range_bytes);
    }
    match encoding {
        ChunkEncoding::Dense => {
            if payload.len() as u64 != range_bytes {
                return Err(DeltaError::Malformed(format!(
                    "dense payload has {} bytes, the range needs {range_bytes}",
                    payload.len()
                )));
            }
            Ok(Changes::Dense(payload.to_vec()))
        }
        ChunkEncoding::Leb128 => {
            let (positions, values) = decode_leb128(payload, len, element_bytes)?;
            Ok(Changes::Sparse { positions, values })
        }
        ChunkEncoding::Aurora => {
            let base = base.ok_or_else(|| {
                DeltaError::Malformed("sparse chunk for a tensor without a base".into())
            })?;
            let (positions, values) = match (dtype.float_layout(), element_bytes) {
                (Some(layout), 2) => aurora::decode::<u16>(payload, base, layout)?,
                (Some(layout), 4) => aurora::decode::<u32>(payload, base, layout)?,
                _ => {
                    return Err(DeltaError::Malformed(format!(
                        "aurora encoding is not defined for {dtype}"
                    )));
                }
            };
            Ok(Changes::Sparse { positions, values })
        }
    }
}

fn encode_leb128(base: &[u8], target: &[u8], element_bytes: usize, out: &mut Vec<u8>) -> bool {
    let mut positions = Vec::new();
    for_each_changed(base, target, element_bytes, |i| positions.push(i as u64));
    if positions.is_empty() {
        return false;
    }
    write_leb128(out, positions.len() as u64);
    let mut previous = 0u64;
    for &p in &positions {
        write_leb128(out, p - previous);
        previous = p;
    }
    for &p in &positions {
        let at = p as usize * element_bytes;
        out.extend_from_slice(&target[at..at + element_bytes]);
    }
    true
}

fn decode_leb128(payload: &[u8], len: u64, element_bytes: usize) -> Result<(Vec<u32>, Vec<u8>)> {
    let mut reader = ByteReader::new(payload);
    let count = reader.leb128("leb128 change count")?;
    if count > len {
        return Err(DeltaError::Malformed(format!(
            "{count} changes claimed in a chunk of {len} elements"
        )));
    }
    // Each gap takes at least one byte, so a count the payload cannot hold is hostile.
    if count > reader.remaining() as u64 {
        return Err(DeltaError::Truncated {
            what: "leb128 gaps",
            needed: count,
            available: reader.remaining() as u64,
        });
    }
    let mut positions = Vec::with_capacity(count as usize);
    let mut position = 0u64;
    for i in 0..count {
        let gap = reader.leb128("leb128 gap")?;
        if i > 0 && gap == 0 {
            return Err(DeltaError::Malformed(
                "leb128 gap of zero repeats an index".into(),
            ));
        }
        position = position
            .checked_add(gap)
            .filter(|&p| p < len)
            .ok_or_else(|| DeltaError::Malformed("leb128 index beyond the chunk".into()))?;
        positions.push(position as u32);
    }
    let values = reader.take(count as usize * element_bytes, "leb128 values")?;
    if !reader.is_empty() {
        return Err(DeltaError::Malformed(format!(
            "{} trailing bytes after leb128 values",
            reader.remaining()
        )));
    }
    Ok((positions, values.to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A BF16 range of small weights with about 1% nudged by one step, and `rows` rows of
    /// 1,024 elements replaced by unrelated values.
    fn nudged_with_replaced_rows(rows: &[usize]) -> (Vec<u8>, Vec<u8>) {
        let mut state = 3u64;
        let mut next = move || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) as u32
        };
        let base: Vec<u16> = (0..64 * 1024)
            .map(|_| 0x3A00 + (next() % 1024) as u16)
            .collect();
        let mut target: Vec<u16> = base
            .iter()
            .map(|&w| if next() % 100 == 0 { w ^ 1 } else { w })
            .collect();
        for &row in rows {
            for w in &mut target[row * 1024..(row + 1) * 1024] {
                *w = 0x3000 + (next() % 0x1000) as u16;
            }
        }
        let bytes = |words: &[u16]| words.iter().flat_map(|w| w.to_le_bytes()).collect();
        (bytes(&base), bytes(&target))
    }

    /// Decodes pieces against `base` and writes them into a copy of it.
    fn apply_pieces(pieces: &[EncodedPiece], base: &[u8]) -> Vec<u8> {
        let mut out = base.to_vec();
        for piece in pieces {
            let range = 2 * piece.start as usize..2 * (piece.start + piece.len) as usize;
            let mut changes = decode_changes(
                piece.encoding,
                Dtype::Bf16,
                piece.len,
                &piece.payload,
                Some(&base[range.clone()]),
            )
            .unwrap();
            changes.swap_into(&mut out[range], 2);
        }
        out
    }

    #[test]
    fn rows_replaced_wholesale_are_cut_out_dense() {
        let (base, target) = nudged_with_replaced_rows(&[5, 6, 40]);
        let pieces = encode_range(Encoding::Aurora, Dtype::Bf16, &base, &target);
        let dense: Vec<_> = pieces
            .iter()
            .filter(|p| p.encoding == ChunkEncoding::Dense)
            .map(|p| p.start..p.start + p.len)
            .collect();
        // Each run may reach a few elements beyond its rows, where a nudged value happened
        // to be an escape too; it covers them whole.
        assert_eq!(dense.len(), 2, "{dense:?}");
        assert!(
            dense[0].start <= 5 * 1024 && dense[0].end >= 7 * 1024,
            "{dense:?}"
        );
        assert!(
            dense[1].start <= 40 * 1024 && dense[1].end >= 41 * 1024,
            "{dense:?}"
        );
        assert_eq!(apply_pieces(&pieces, &base), target);
        let (_, whole) = encode_changes(Encoding::Aurora, Dtype::Bf16, &base, &target).unwrap();
        let split: usize = pieces
            .iter()
            .map(|p| p.payload.len() + ChunkRecord::OVERHEAD_BYTES)
            .sum();
        // 3,072 replaced elements: about 6 KB dense, about twice that as escapes.
        assert!(
            split + 4096 < whole.len(),
            "split {split} bytes, whole {}",
            whole.len()
        );
    }

    /// Many escaped steps alone (a training step moves the smallest weights by many
    /// steps, here one element in 64) do not make a range worth searching for runs; the
    /// same escapes in rows do.
    #[test]
    fn only_escapes_in_streaks_start_the_search_for_runs() {
        let (base, mut target) = nudged_with_replaced_rows(&[]);
        for at in (0..target.len() / 2).step_by(64) {
            target[2 * at + 1] ^= 0x08;
        }
        let (encoding, _, runs_likely) =
            encode_whole(Encoding::Aurora, Dtype::Bf16, &base, &target).unwrap();
        assert_eq!(encoding, ChunkEncoding::Aurora);
        assert!(!runs_likely);
        let (base, target) = nudged_with_replaced_rows(&[9]);
        let (_, _, runs_likely) =
            encode_whole(Encoding::Aurora, Dtype::Bf16, &base, &target).unwrap();
        assert!(runs_likely);
    }

    #[test]
    fn nudged_values_alone_stay_in_one_record() {
        let (base, target) = nudged_with_replaced_rows(&[]);
        let pieces = encode_range(Encoding::Aurora, Dtype::Bf16, &base, &target);
        assert_eq!(pieces.len(), 1);
        assert_eq!(pieces[0].encoding, ChunkEncoding::Aurora);
        assert_eq!((pieces[0].start, pieces[0].len), (0, 64 * 1024));
        assert_eq!(apply_pieces(&pieces, &base), target);
        // The published baseline is never cut.
        let (base, target) = nudged_with_replaced_rows(&[5]);
        let pieces = encode_range(Encoding::Leb128, Dtype::Bf16, &base, &target);
        assert_eq!(pieces.len(), 1);
        assert_eq!(pieces[0].encoding, ChunkEncoding::Leb128);
    }

    #[test]
    fn a_chunk_encoded_alone_is_checked_and_matches_extraction() {
        let base = vec![0u8; 2 * 300];
        let mut target = base.clone();
        target[2 * 7] = 1;
        assert_eq!(
            encode_chunk(Encoding::Aurora, Dtype::Bf16, &base, &target).unwrap(),
            encode_changes(Encoding::Aurora, Dtype::Bf16, &base, &target)
        );
        assert_eq!(
            encode_chunk(Encoding::Aurora, Dtype::Bf16, &base, &base).unwrap(),
            None
        );
        let uneven = encode_chunk(Encoding::Aurora, Dtype::Bf16, &base, &target[1..]);
        assert!(
            matches!(uneven, Err(DeltaError::Checkpoint(_))),
            "{uneven:?}"
        );
        let long = vec![0u8; MAX_CHUNK_ELEMENTS as usize + 1];
        let too_long = encode_chunk(Encoding::Aurora, Dtype::U8, &long, &long);
        assert!(
            matches!(
                too_long,
                Err(DeltaError::LimitExceeded {
                    what: "chunk elements",
                    ..
                })
            ),
            "{too_long:?}"
        );
    }

    #[test]
    fn leb128_chunk_matches_the_published_layout() {
        let base = vec![0u8; 2 * 300];
        let mut target = base.clone();
        target[2 * 198..2 * 198 + 2].copy_from_slice(&[0x80, 0x3F]);
        target[2 * 200..2 * 200 + 2].copy_from_slice(&[0x00, 0x40]);
        let (encoding, payload) =
            encode_changes(Encoding::Leb128, Dtype::Bf16, &base, &target).unwrap();
        assert_eq!(encoding, ChunkEncoding::Leb128);
        assert_eq!(payload, [2, 0xC6, 0x01, 2, 0x80, 0x3F, 0x00, 0x40]);
        let decoded = decode_changes(encoding, Dtype::Bf16, 300, &payload, Some(&base)).unwrap();
        assert_eq!(
            decoded,
            Changes::Sparse {
                positions: vec![198, 200],
                values: vec![0x80, 0x3F, 0x00, 0x40]
            }
        );
    }

    #[test]
    fn dense_fallback_when_everything_changed() {
        let base = vec![1u8; 64];
        let target = vec![2u8; 64];
        let (encoding, payload) =
            encode_changes(Encoding::Aurora, Dtype::Bf16, &base, &target).unwrap();
        assert_eq!(encoding, ChunkEncoding::Dense);
        assert_eq!(payload, target);
        assert!(encode_changes(Encoding::Aurora, Dtype::Bf16, &base, &base).is_none());
    }

    #[test]
    fn hostile_leb128_payloads_are_rejected() {
        let check = |payload: &[u8], needle: &str| {
            let error = decode_changes(ChunkEncoding::Leb128, Dtype::Bf16, 10, payload, None)
                .unwrap_err()
                .to_string();
            assert!(error.contains(needle), "{error}");
        };
        check(&[11], "11 changes claimed");
        check(&[2, 1, 0, 0, 0, 0, 0], "gap of zero");
        check(&[1, 10, 0, 0], "beyond the chunk");
        check(&[1, 1, 0], "truncated");
        check(&[1, 1, 0, 0, 9], "trailing");
    }

    #[test]
    fn swapping_twice_restores_the_range() {
        let original = vec![1u8, 2, 3, 4, 5, 6];
        let mut range = original.clone();
        let mut changes = Changes::Sparse {
            positions: vec![1],
            values: vec![9, 9],
        };
        changes.swap_into(&mut range, 2);
        assert_eq!(range, [1, 2, 9, 9, 5, 6]);
        changes.swap_into(&mut range, 2);
        assert_eq!(range, original);
    }
}
