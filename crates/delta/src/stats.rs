//! What a delta is made of, per tensor: the numbers behind `aurora delta inspect`.
//!
//! Computed from the artifact alone (no base needed): the `aurora` and `leb128` payloads
//! state their change counts; a dense chunk counts every element of its range as changed.

use std::collections::BTreeMap;

use crate::apply::checked_record;
use crate::bits::{ByteReader, leb128_len};
use crate::checkpoint::Hash;
use crate::codec::{CHUNK_HEADER_BYTES, ChunkEncoding, ChunkRecord, aurora};
use crate::error::{DeltaError, Result};
use crate::format::{DeltaFile, TensorChange};

#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ByteBreakdown {
    pub changed: u64,
    pub positions: u64,
    pub values: u64,
    pub overhead: u64,
}

impl ByteBreakdown {
    pub fn total(&self) -> u64 {
        self.positions
            .saturating_add(self.values)
            .saturating_add(self.overhead)
    }

    pub fn bytes_per_changed(&self) -> Option<f64> {
        (self.changed > 0).then(|| self.total() as f64 / self.changed as f64)
    }

    fn add(&mut self, other: &ByteBreakdown) {
        self.changed = self.changed.saturating_add(other.changed);
        self.positions = self.positions.saturating_add(other.positions);
        self.values = self.values.saturating_add(other.values);
        self.overhead = self.overhead.saturating_add(other.overhead);
    }
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct TensorStats {
    pub name: String,
    pub change: &'static str,
    pub dtype: String,
    pub elements: u64,
    pub density: f64,
    /// Chunks per encoding used.
    pub encodings: BTreeMap<&'static str, u64>,
    pub bytes: ByteBreakdown,
    pub bytes_per_changed: Option<f64>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct DeltaStats {
    pub id: Hash,
    pub base_version: u64,
    pub target_version: u64,
    pub base_hash: Hash,
    pub target_hash: Hash,
    pub encoding: &'static str,
    pub segments: usize,
    pub file_bytes: u64,
    /// Bytes of the target weights: what a dense checkpoint transfer would send.
    pub target_weights_bytes: u64,
    pub elements: u64,
    pub density: f64,
    pub bytes: ByteBreakdown,
    pub bytes_per_changed: Option<f64>,
    pub tensors: Vec<TensorStats>,
}

/// Breaks every chunk of `file` down into bytes for positions, values and overhead.
/// Segment hashes are verified on the way.
pub fn delta_stats(file: &DeltaFile<'_>, file_bytes: u64) -> Result<DeltaStats> {
    let header = file.header();
    let mut per_tensor: Vec<(BTreeMap<&'static str, u64>, ByteBreakdown)> =
        vec![(BTreeMap::new(), ByteBreakdown::default()); header.tensors.len()];
    for index in 0..file.segment_count() {
        let mut reader = ByteReader::new(file.verify_segment(index)?);
        while !reader.is_empty() {
            let record = ChunkRecord::read(&mut reader)?;
            let (_, spec, _) = checked_record(header, &record)?;
            let mut breakdown = chunk_breakdown(&record, spec.dtype)?;
            breakdown.overhead += CHUNK_HEADER_BYTES as u64;
            let (encodings, total) = &mut per_tensor[record.tensor as usize];
            *encodings.entry(record.encoding.name()).or_default() += 1;
            total.add(&breakdown);
        }
    }
    let mut totals = ByteBreakdown::default();
    let mut elements = 0u64;
    let mut target_weights_bytes = 0u64;
    let overflow = || DeltaError::Malformed("the tensor table's sizes overflow 64 bits".into());
    let tensors = header
        .tensors
        .iter()
        .zip(per_tensor)
        .map(|(entry, (encodings, bytes))| {
            let spec = entry
                .change
                .target()
                .or(entry.change.base())
                .expect("a side");
            let tensor_elements = entry.change.target().map_or(0, |s| s.element_count());
            elements = elements.checked_add(tensor_elements).ok_or_else(overflow)?;
            target_weights_bytes = target_weights_bytes
                .checked_add(entry.change.target().map_or(0, |s| s.byte_len()))
                .ok_or_else(overflow)?;
            totals.add(&bytes);
            Ok(TensorStats {
                name: entry.name.clone(),
                change: match entry.change {
                    TensorChange::Patched(_) => "patched",
                    TensorChange::Added(_) => "added",
                    TensorChange::Removed(_) => "removed",
                    TensorChange::Replaced { .. } => "replaced",
                },
                dtype: spec.dtype.to_string(),
                elements: tensor_elements,
                density: ratio(bytes.changed, tensor_elements),
                encodings,
                bytes_per_changed: bytes.bytes_per_changed(),
                bytes,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(DeltaStats {
        id: file.id,
        base_version: header.base_version,
        target_version: header.target_version,
        base_hash: header.base_hash,
        target_hash: header.target_hash,
        encoding: header.encoding.name(),
        segments: file.segment_count(),
        file_bytes,
        target_weights_bytes,
        elements,
        density: ratio(totals.changed, elements),
        bytes_per_changed: totals.bytes_per_changed(),
        bytes: totals,
        tensors,
    })
}

fn ratio(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}

fn chunk_breakdown(record: &ChunkRecord<'_>, dtype: crate::Dtype) -> Result<ByteBreakdown> {
    let payload = record.payload.len() as u64;
    let element_bytes = dtype.size_bytes() as u64;
    Ok(match record.encoding {
        ChunkEncoding::Dense => ByteBreakdown {
            changed: record.len,
            positions: 0,
            values: payload,
            overhead: 0,
        },
        ChunkEncoding::Leb128 => {
            let changed = ByteReader::new(record.payload).leb128("leb128 change count")?;
            if changed > record.len {
                return Err(DeltaError::Malformed(format!(
                    "{changed} changes claimed in a chunk of {} elements",
                    record.len
                )));
            }
            let count_bytes = leb128_len(changed) as u64;
            let values = changed
                .saturating_mul(element_bytes)
                .min(payload - count_bytes);
            ByteBreakdown {
                changed,
                positions: payload - count_bytes - values,
                values,
                overhead: count_bytes,
            }
        }
        ChunkEncoding::Aurora => {
            let layout = dtype
                .float_layout()
                .ok_or_else(|| DeltaError::Malformed(format!("aurora chunk for {dtype} tensor")))?;
            let parsed = aurora::parse(record.payload, layout, record.len)?;
            ByteBreakdown {
                changed: parsed.changed(),
                positions: parsed.bitstream.len() as u64,
                values: parsed.rans.len() as u64,
                overhead: parsed.header_bytes as u64,
            }
        }
    })
}
