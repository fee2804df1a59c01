//! Deltas extracted where the model is sharded (docs/delta-format.md §11).
//!
//! A trainer whose ranks each hold a shard of every parameter (FSDP2's dim-0 shards)
//! publishes without gathering: each rank encodes the chunks of the element ranges it
//! holds and its share of both weights hashes into a [`ShardTable::extract`] part; the
//! trainer node puts the parts together with [`ShardTable::assemble`] into one delta,
//! whose segments are the parts' and whose hashes are §2's, composed from the shares.

mod hash;
#[cfg(test)]
mod tests;

pub use hash::{HashLayout, HashShare};

use crate::apply::checked_record;
use crate::bits::ByteReader;
use crate::checkpoint::{Hash, checked_byte_len};
use crate::codec::{ChunkRecord, Encoding};
use crate::error::{DeltaError, Result};
use crate::extract::{ExtractOptions, Extraction, Segment, SegmentSource, TargetHash};
use crate::format::{
    DeltaHeader, MAX_DIMS, MAX_NAME_BYTES, MAX_SEGMENT_BYTES, MAX_SEGMENTS, MAX_TENSORS, Manifest,
    SegmentEntry, TensorChange, TensorEntry, TensorSpec,
};

/// The first bytes of a shard part (§11.1).
pub const SHARD_PART_MAGIC: [u8; 8] = *b"\x89ASHARD\x1a";
pub const SHARD_PART_VERSION: u16 = 1;

/// One element range of one tensor that a rank holds, on both sides of the delta.
#[derive(Debug, Clone, Copy)]
pub struct ShardPiece<'a> {
    pub name: &'a str,
    /// The range's first element in the tensor (row-major).
    pub first: u64,
    pub base: &'a [u8],
    pub target: &'a [u8],
}

impl<'a> ShardPiece<'a> {
    /// Rank `rank` of `ranks`'s share of a tensor as FSDP2 shards it along dimension 0
    /// (`torch.chunk`'s split: `ceil(rows / ranks)` rows each, the last ranks fewer or
    /// none), from the tensor's whole bytes on both sides; None for a rank that holds none
    /// (or for sides of different lengths, or bytes that are not whole rows).
    pub fn dim0_shard(
        name: &'a str,
        shape: &[u64],
        base: &'a [u8],
        target: &'a [u8],
        rank: u64,
        ranks: u64,
    ) -> Option<ShardPiece<'a>> {
        let rows = shape.first().copied().unwrap_or(1).max(1);
        let row_bytes = target.len() as u64 / rows;
        if base.len() != target.len() || row_bytes * rows != target.len() as u64 {
            return None;
        }
        let per_rank = rows.div_ceil(ranks.max(1));
        let first = rank.saturating_mul(per_rank).min(rows);
        let end = rank.saturating_add(1).saturating_mul(per_rank).min(rows);
        let row_elements = shape.iter().skip(1).product::<u64>();
        let bytes = (first * row_bytes) as usize..(end * row_bytes) as usize;
        (first < end).then(|| ShardPiece {
            name,
            first: first * row_elements,
            base: &base[bytes.clone()],
            target: &target[bytes],
        })
    }
}

/// What every rank and the assembling node agree on: the tensors' names, dtypes and
/// shapes (the same on both sides: sharded training does not reshape) and the encoding.
#[derive(Debug, Clone)]
pub struct ShardTable {
    /// Versions 0 and hashes zero: the table as the parts name it.
    header: DeltaHeader,
    layout: HashLayout,
    digest: Hash,
}

impl ShardTable {
    pub fn new(mut tensors: Vec<(String, TensorSpec)>, encoding: Encoding) -> Result<ShardTable> {
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        if tensors.len() as u64 > u64::from(MAX_TENSORS) {
            return Err(DeltaError::LimitExceeded {
                what: "tensor count",
                value: tensors.len() as u64,
                limit: u64::from(MAX_TENSORS),
            });
        }
        for (index, (name, spec)) in tensors.iter().enumerate() {
            let reason = if index > 0 && tensors[index - 1].0 == *name {
                Some("the name is given twice".to_string())
            } else if name.len() > MAX_NAME_BYTES || spec.shape.len() > MAX_DIMS {
                Some(format!(
                    "names are limited to {MAX_NAME_BYTES} bytes and shapes to {MAX_DIMS} dimensions"
                ))
            } else if checked_byte_len(spec.dtype, &spec.shape).is_none() {
                Some("its size overflows a u64".to_string())
            } else {
                None
            };
            if let Some(reason) = reason {
                return Err(DeltaError::Unsupported {
                    name: name.chars().take(80).collect(),
                    reason,
                });
            }
        }
        let header = DeltaHeader {
            base_version: 0,
            target_version: 0,
            base_hash: Hash::ZERO,
            target_hash: Hash::ZERO,
            encoding,
            tensors: tensors
                .into_iter()
                .map(|(name, spec)| TensorEntry {
                    name,
                    change: TensorChange::Patched(spec),
                })
                .collect(),
        };
        let layout = HashLayout::new(
            header
                .tensors
                .iter()
                .map(|entry| (entry.name.as_str(), spec_of(entry))),
        )?;
        let digest = Hash::of(&header.encode());
        Ok(ShardTable {
            header,
            layout,
            digest,
        })
    }

    /// The part of a rank that holds `pieces` (which must not overlap): the delta's
    /// chunks of those ranges, in segments, and its share of the base's and the target's
    /// weights hashes. Encodes and hashes on the current rayon pool.
    pub fn extract(&self, pieces: &[ShardPiece<'_>]) -> Result<Vec<u8>> {
        let mut located = Vec::with_capacity(pieces.len());
        for piece in pieces {
            located.push((self.locate(piece)?, piece));
        }
        located.sort_by_key(|((tensor, offset), _)| (*tensor, *offset));
        for pair in located.windows(2) {
            let ((tensor, offset), piece) = pair[0];
            if pair[1].0.0 == tensor && offset + piece.target.len() as u64 > pair[1].0.1 {
                return Err(DeltaError::Checkpoint(format!(
                    "the shard pieces of tensor '{}' from elements {} and {} overlap",
                    piece.name, piece.first, pair[1].1.first
                )));
            }
        }
        // A dense delta carries every element of every range, changed or not (§6.1).
        let dense = self.header.encoding == Encoding::Dense;
        let extraction = Extraction::of_pieces(
            self.header.clone(),
            located.iter().map(|((tensor, _), piece)| {
                (
                    *tensor,
                    piece.first,
                    (!dense).then_some(piece.base),
                    piece.target,
                )
            }),
            ExtractOptions {
                encoding: self.header.encoding,
                target_hash: TargetHash::Later,
                base_hash: Some(Hash::ZERO),
                ..ExtractOptions::default()
            },
        );
        let share = |target: bool| {
            use rayon::prelude::*;
            located
                .par_iter()
                .map(|((tensor, offset), piece)| {
                    let (data_at, _) = self.layout.data_range(*tensor as usize);
                    HashShare::of_range(
                        data_at + offset,
                        if target { piece.target } else { piece.base },
                    )
                })
                .reduce(HashShare::default, |mut all, part| {
                    all.merge(part);
                    all
                })
        };
        let (segments, (base_share, target_share)) = rayon::join(
            || {
                let mut segments = Vec::new();
                extraction.run(|segment: Segment| {
                    segments.push(segment.bytes);
                    Ok::<(), DeltaError>(())
                })?;
                Ok::<_, DeltaError>(segments)
            },
            || rayon::join(|| share(false), || share(true)),
        );
        Ok(encode_part(
            &self.digest,
            &segments?,
            &base_share,
            &target_share,
        ))
    }

    /// The delta from version `base_version` to the next assembled from every rank's
    /// part: refused when a part is malformed or names another table, when a chunk lies
    /// outside its tensor or overlaps another, and when the parts do not cover every
    /// tensor exactly once. Its header names `base_hash`, the base as published; the
    /// hash the parts compose for their base is [`ShardAssembly::parts_base_hash`], for
    /// the caller to check against it.
    pub fn assemble(
        &self,
        base_version: u64,
        base_hash: Hash,
        parts: &[&[u8]],
    ) -> Result<ShardAssembly> {
        let mut segments = Vec::new();
        let mut base_shares = Vec::with_capacity(parts.len());
        let mut target_shares = Vec::with_capacity(parts.len());
        let mut chunks = Vec::new();
        for (index, bytes) in parts.iter().enumerate() {
            let invalid = |reason: String| DeltaError::ShardPart {
                part: index,
                reason,
            };
            let part = decode_part(bytes).map_err(|error| invalid(error.to_string()))?;
            if part.table != self.digest {
                return Err(invalid(
                    "it was extracted against another tensor table (names, dtypes, shapes \
                     or encoding differ from this one)"
                        .into(),
                ));
            }
            for segment in &part.segments {
                let mut reader = ByteReader::new(segment);
                while !reader.is_empty() {
                    let record = ChunkRecord::read(&mut reader)
                        .map_err(|error| invalid(error.to_string()))?;
                    // What every reader of the delta checks of a chunk (§5).
                    checked_record(&self.header, &record)
                        .map_err(|error| invalid(error.to_string()))?;
                    chunks.push((record.tensor, record.start, record.len, index));
                }
            }
            segments.extend(part.segments.into_iter().map(<[u8]>::to_vec));
            base_shares.push(part.base);
            target_shares.push(part.target);
        }
        if segments.len() as u64 > u64::from(MAX_SEGMENTS) {
            return Err(DeltaError::LimitExceeded {
                what: "segment count",
                value: segments.len() as u64,
                limit: u64::from(MAX_SEGMENTS),
            });
        }
        let target_version = base_version
            .checked_add(1)
            .ok_or_else(|| DeltaError::Malformed(format!("no version follows {base_version}")))?;
        chunks.sort_unstable();
        for pair in chunks.windows(2) {
            let (tensor, start, len, part) = pair[0];
            if pair[1].0 == tensor && start + len > pair[1].1 {
                return Err(DeltaError::ShardCoverage(format!(
                    "chunks of tensor '{}' from parts {part} and {} overlap at element {}",
                    self.header.tensors[tensor as usize].name, pair[1].3, pair[1].1
                )));
            }
        }
        let (parts_base_hash, target_hash) = rayon::join(
            || self.layout.compose(&base_shares.iter().collect::<Vec<_>>()),
            || {
                self.layout
                    .compose(&target_shares.iter().collect::<Vec<_>>())
            },
        );
        Ok(ShardAssembly {
            header: DeltaHeader {
                base_version,
                target_version,
                base_hash,
                target_hash: target_hash?,
                ..self.header.clone()
            },
            parts_base_hash: parts_base_hash?,
            segments,
        })
    }

    /// The tensor index of `piece` and the byte offset of its range in the tensor, once
    /// the range is checked to lie inside the tensor.
    fn locate(&self, piece: &ShardPiece<'_>) -> Result<(u32, u64)> {
        let index = self
            .header
            .tensors
            .binary_search_by(|entry| entry.name.as_str().cmp(piece.name))
            .map_err(|_| {
                DeltaError::Checkpoint(format!("tensor '{}' is not in the shard table", piece.name))
            })?;
        let spec = spec_of(&self.header.tensors[index]);
        let size = spec.dtype.size_bytes() as u64;
        let len = piece.target.len() as u64;
        let fits = piece.base.len() as u64 == len
            && len.is_multiple_of(size)
            && piece
                .first
                .checked_add(len / size)
                .is_some_and(|end| end <= spec.element_count());
        if !fits {
            return Err(DeltaError::Checkpoint(format!(
                "the shard piece of tensor '{}' from element {} ({} base and {} target bytes \
                 of {:?} elements) does not lie inside its {} elements",
                piece.name,
                piece.first,
                piece.base.len(),
                len,
                spec.dtype,
                spec.element_count()
            )));
        }
        Ok((index as u32, piece.first * size))
    }
}

fn spec_of(entry: &TensorEntry) -> &TensorSpec {
    entry
        .change
        .target()
        .expect("a shard table's tensors are patched")
}

/// A delta assembled from the parts of every rank: the parts' segments in order.
#[derive(Debug)]
pub struct ShardAssembly {
    header: DeltaHeader,
    parts_base_hash: Hash,
    segments: Vec<Vec<u8>>,
}

impl ShardAssembly {
    /// The weights hash of the base that the parts compose.
    pub fn parts_base_hash(&self) -> Hash {
        self.parts_base_hash
    }

    /// The weights hash of the target that the parts compose.
    pub fn target_hash(&self) -> Hash {
        self.header.target_hash
    }
}

impl SegmentSource for ShardAssembly {
    fn header(&self) -> &DeltaHeader {
        &self.header
    }

    fn run<E: From<DeltaError> + Send>(
        &self,
        mut sink: impl FnMut(Segment) -> std::result::Result<(), E> + Send,
    ) -> std::result::Result<Manifest, E> {
        let mut entries = Vec::with_capacity(self.segments.len());
        for (index, bytes) in self.segments.iter().enumerate() {
            let segment = Segment {
                index: index as u32,
                hash: Hash::of(bytes),
                bytes: bytes.clone(),
            };
            entries.push(SegmentEntry {
                len: bytes.len() as u32,
                hash: segment.hash,
            });
            sink(segment)?;
        }
        Ok(Manifest {
            header: self.header.clone(),
            segments: entries,
        })
    }
}

/// A rank's part as read back (§11.1).
struct Part<'a> {
    table: Hash,
    segments: Vec<&'a [u8]>,
    base: HashShare,
    target: HashShare,
}

fn encode_part(
    table: &Hash,
    segments: &[Vec<u8>],
    base: &HashShare,
    target: &HashShare,
) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&SHARD_PART_MAGIC);
    out.extend_from_slice(&SHARD_PART_VERSION.to_le_bytes());
    out.extend_from_slice(&table.0);
    out.extend_from_slice(&(segments.len() as u32).to_le_bytes());
    for segment in segments {
        out.extend_from_slice(&(segment.len() as u32).to_le_bytes());
        out.extend_from_slice(segment);
    }
    for share in [base, target] {
        out.extend_from_slice(&(share.subtrees.len() as u32).to_le_bytes());
        for (offset, len, cv) in &share.subtrees {
            out.extend_from_slice(&offset.to_le_bytes());
            out.extend_from_slice(&len.to_le_bytes());
            out.extend_from_slice(cv);
        }
        out.extend_from_slice(&(share.edges.len() as u32).to_le_bytes());
        for (offset, bytes) in &share.edges {
            out.extend_from_slice(&offset.to_le_bytes());
            out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
            out.extend_from_slice(bytes);
        }
    }
    out
}

fn decode_part(bytes: &[u8]) -> Result<Part<'_>> {
    let mut reader = ByteReader::new(bytes);
    if reader.array::<8>("shard part magic")? != SHARD_PART_MAGIC {
        return Err(DeltaError::Malformed(
            "not a shard part: bad magic bytes".into(),
        ));
    }
    let version = reader.u16("shard part version")?;
    if version != SHARD_PART_VERSION {
        return Err(DeltaError::Malformed(format!(
            "shard part version {version} (this build reads version {SHARD_PART_VERSION})"
        )));
    }
    let table = Hash(reader.array("tensor table digest")?);
    // Every count is bounded by what its entries' fixed bytes leave room for.
    let count = |reader: &mut ByteReader<'_>, what: &'static str, entry_bytes: usize| {
        let count = reader.u32(what)? as usize;
        if count > reader.remaining() / entry_bytes {
            return Err(DeltaError::Truncated {
                what,
                needed: (count * entry_bytes) as u64,
                available: reader.remaining() as u64,
            });
        }
        Ok(count)
    };
    let segment_count = count(&mut reader, "segment count", 4)?;
    let mut segments = Vec::with_capacity(segment_count);
    for _ in 0..segment_count {
        let len = reader.u32("segment length")?;
        if len > MAX_SEGMENT_BYTES {
            return Err(DeltaError::LimitExceeded {
                what: "segment length",
                value: u64::from(len),
                limit: u64::from(MAX_SEGMENT_BYTES),
            });
        }
        segments.push(reader.take(len as usize, "segment")?);
    }
    let mut shares = [HashShare::default(), HashShare::default()];
    for share in &mut shares {
        let subtrees = count(&mut reader, "subtree count", 48)?;
        for _ in 0..subtrees {
            share.subtrees.push((
                reader.u64("subtree offset")?,
                reader.u64("subtree length")?,
                reader.array("subtree chaining value")?,
            ));
        }
        let edges = count(&mut reader, "edge count", 12)?;
        for _ in 0..edges {
            let offset = reader.u64("edge offset")?;
            let len = reader.u32("edge length")?;
            share
                .edges
                .push((offset, reader.take(len as usize, "edge bytes")?.to_vec()));
        }
    }
    if !reader.is_empty() {
        return Err(DeltaError::Malformed(format!(
            "{} unexpected bytes at the end of a shard part",
            reader.remaining()
        )));
    }
    let [base, target] = shares;
    Ok(Part {
        table,
        segments,
        base,
        target,
    })
}
