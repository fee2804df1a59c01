//! The weights hash (§2) of a checkpoint that no process holds whole, from the shares of
//! its holders (§11.2).
//!
//! §2's hash is BLAKE3 over one byte stream, and BLAKE3 is a tree over 1 KiB chunks of
//! that stream. Whoever holds some of its bytes can compute the chaining values of the
//! whole subtrees inside them (`blake3::hazmat`); one process then merges those values
//! with the few bytes no holder could finish a subtree of (the edges of each range and
//! the tensors' framing) into the same hash as hashing the stream in one pass. So the
//! hash stays §2's, and no process reads the whole checkpoint.

use std::collections::{BTreeMap, HashMap};

use blake3::hazmat::{
    ChainingValue, HasherExt, Mode, left_subtree_len, merge_subtrees_non_root, merge_subtrees_root,
};
use blake3::{CHUNK_LEN, Hasher};
use rayon::prelude::*;

use crate::checkpoint::{Hash, WEIGHTS_HASH_DOMAIN, checked_byte_len, tensor_framing};
use crate::error::{DeltaError, Result};
use crate::format::TensorSpec;

const CHUNK: u64 = CHUNK_LEN as u64;

/// A subtree of at least this many bytes is hashed on the rayon pool.
const PARALLEL_SUBTREE_BYTES: usize = 1 << 20;

/// Where each tensor's data lies in the weights hash's input, for a checkpoint's tensor
/// table in canonical order.
#[derive(Debug, Clone)]
pub struct HashLayout {
    /// The input that is not tensor data: the domain string and each tensor's framing,
    /// at their offsets.
    framing: Vec<(u64, Vec<u8>)>,
    /// Each tensor's name and its data's offset and length, in canonical order.
    tensors: Vec<(String, u64, u64)>,
    total: u64,
}

impl HashLayout {
    /// The layout of `tensors`, which must be in canonical order (a delta header's);
    /// refused when the input would be longer than a u64 counts.
    pub fn new<'s>(
        tensors: impl IntoIterator<Item = (&'s str, &'s TensorSpec)>,
    ) -> Result<HashLayout> {
        let domain = WEIGHTS_HASH_DOMAIN;
        let mut offset = domain.len() as u64;
        let mut framing = vec![(0, domain.to_vec())];
        let mut placed = Vec::new();
        for (name, spec) in tensors {
            let len = checked_byte_len(spec.dtype, &spec.shape);
            let bytes = tensor_framing(name, spec.dtype, &spec.shape, len.unwrap_or(0));
            let data_at = offset.checked_add(bytes.len() as u64);
            let end = data_at.zip(len).and_then(|(at, len)| at.checked_add(len));
            let (Some(data_at), Some(len), Some(end)) = (data_at, len, end) else {
                return Err(DeltaError::Unsupported {
                    name: name.chars().take(80).collect(),
                    reason: "the checkpoint up to it is longer than a u64 counts".into(),
                });
            };
            framing.push((offset, bytes));
            placed.push((name.to_string(), data_at, len));
            offset = end;
        }
        Ok(HashLayout {
            framing,
            tensors: placed,
            total: offset,
        })
    }

    /// Where tensor `index`'s data starts in the input, and its length.
    pub fn data_range(&self, index: usize) -> (u64, u64) {
        let (_, at, len) = &self.tensors[index];
        (*at, *len)
    }

    /// The weights hash from the shares every holder computed, which must together cover
    /// each tensor's data exactly once.
    pub fn compose(&self, shares: &[&HashShare]) -> Result<Hash> {
        let mut bytes: BTreeMap<u64, &[u8]> = BTreeMap::new();
        let mut subtrees: HashMap<(u64, u64), ChainingValue> = HashMap::new();
        // (start, end) of every piece of the input, to prove they tile it.
        let mut spans = Vec::new();
        for (offset, framing) in &self.framing {
            bytes.insert(*offset, framing);
            spans.push((*offset, *offset + framing.len() as u64));
        }
        for share in shares {
            for (offset, edge) in share.edges.iter().filter(|(_, edge)| !edge.is_empty()) {
                bytes.insert(*offset, edge);
                spans.push((*offset, offset.saturating_add(edge.len() as u64)));
            }
            for (offset, len, cv) in &share.subtrees {
                if !len.is_power_of_two() || *len < CHUNK || !offset.is_multiple_of(*len) {
                    return Err(DeltaError::ShardCoverage(format!(
                        "a subtree of {len} bytes at input offset {offset} is no BLAKE3 subtree \
                         (a power of two of at least {CHUNK} bytes, at a multiple of it)"
                    )));
                }
                subtrees.insert((*offset, *len), *cv);
                spans.push((*offset, offset.saturating_add(*len)));
            }
        }
        spans.sort_unstable();
        let mut covered = 0;
        for (start, end) in spans {
            if start != covered {
                let (what, at) = if start > covered {
                    ("no shard holds", covered)
                } else {
                    ("two shards hold", start)
                };
                return Err(DeltaError::ShardCoverage(format!(
                    "{what} the data at {}",
                    self.locate(at)
                )));
            }
            covered = end;
        }
        if covered != self.total {
            return Err(DeltaError::ShardCoverage(format!(
                "no shard holds the data at {}",
                self.locate(covered)
            )));
        }
        let tree = Tree {
            bytes: &bytes,
            subtrees: &subtrees,
        };
        if self.total <= CHUNK {
            return Ok(Hash(*blake3::hash(&tree.gather(0, self.total)).as_bytes()));
        }
        let left = left_subtree_len(self.total);
        let (l, r) = rayon::join(
            || tree.chaining_value(0, left),
            || tree.chaining_value(left, self.total - left),
        );
        Ok(Hash(*merge_subtrees_root(&l, &r, Mode::Hash).as_bytes()))
    }

    /// Names the input offset `at` for an error: a tensor's element byte, or its framing.
    fn locate(&self, at: u64) -> String {
        match self
            .tensors
            .iter()
            .find(|(_, start, len)| at >= *start && at < start + len)
        {
            Some((name, start, _)) => format!("byte {} of tensor '{name}'", at - start),
            None => format!("input offset {at} (framing)"),
        }
    }
}

/// The pieces of a weights hash's input, as [`HashLayout::compose`] merges them.
struct Tree<'a> {
    bytes: &'a BTreeMap<u64, &'a [u8]>,
    subtrees: &'a HashMap<(u64, u64), ChainingValue>,
}

impl Tree<'_> {
    /// The chaining value of the (non-root) subtree of `len` bytes at `offset`: given by
    /// a holder, hashed from the bytes given, or merged from its two children.
    fn chaining_value(&self, offset: u64, len: u64) -> ChainingValue {
        if let Some(cv) = self.subtrees.get(&(offset, len)) {
            return *cv;
        }
        if len <= CHUNK {
            return Hasher::new()
                .set_input_offset(offset)
                .update(&self.gather(offset, len))
                .finalize_non_root();
        }
        let left = left_subtree_len(len);
        let (l, r) = if len >= 64 * CHUNK {
            rayon::join(
                || self.chaining_value(offset, left),
                || self.chaining_value(offset + left, len - left),
            )
        } else {
            (
                self.chaining_value(offset, left),
                self.chaining_value(offset + left, len - left),
            )
        };
        merge_subtrees_non_root(&l, &r, Mode::Hash)
    }

    /// The input's bytes `[offset, offset + len)`, from the pieces that hold them: the
    /// pieces tile the input (checked), and no piece a holder could not finish a subtree
    /// of is longer than a chunk's worth beyond it.
    fn gather(&self, offset: u64, len: u64) -> Vec<u8> {
        let end = offset + len;
        let mut out = Vec::with_capacity(len as usize);
        let first = self
            .bytes
            .range(..=offset)
            .next_back()
            .map_or(offset, |(at, _)| *at);
        for (at, piece) in self.bytes.range(first..end) {
            let piece_end = at + piece.len() as u64;
            let from = offset.max(*at);
            let to = end.min(piece_end);
            if from < to {
                out.extend_from_slice(&piece[(from - at) as usize..(to - at) as usize]);
            }
        }
        assert_eq!(
            out.len() as u64,
            len,
            "a chunk of the input is neither in a subtree nor in bytes, though the pieces tile it"
        );
        out
    }
}

/// One holder's share of a weights hash: the chaining values of the whole BLAKE3
/// subtrees inside the input ranges it holds, and the bytes at those ranges' edges.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HashShare {
    /// (input offset, length, chaining value).
    pub(crate) subtrees: Vec<(u64, u64, ChainingValue)>,
    /// (input offset, bytes).
    pub(crate) edges: Vec<(u64, Vec<u8>)>,
}

impl HashShare {
    /// The share of the input bytes `data`, which lie at input offset `offset`.
    pub fn of_range(offset: u64, data: &[u8]) -> HashShare {
        let end = offset + data.len() as u64;
        let first_whole = offset.next_multiple_of(CHUNK).min(end);
        let mut share = HashShare::default();
        let mut cuts = Vec::new();
        let mut at = first_whole;
        while end - at >= CHUNK {
            // The largest subtree that starts here (its size divides the offset) and
            // fits before the end.
            // At offset 0 any power of two is aligned: start from the largest one.
            let mut len = if at == 0 {
                1 << 63
            } else {
                1 << at.trailing_zeros()
            };
            while len > end - at {
                len /= 2;
            }
            cuts.push((at, len));
            at += len;
        }
        let slice =
            |from: u64, len: u64| &data[(from - offset) as usize..(from - offset + len) as usize];
        share.subtrees = cuts
            .into_par_iter()
            .map(|(at, len)| {
                let bytes = slice(at, len);
                let mut hasher = Hasher::new();
                hasher.set_input_offset(at);
                if bytes.len() >= PARALLEL_SUBTREE_BYTES {
                    hasher.update_rayon(bytes);
                } else {
                    hasher.update(bytes);
                }
                (at, len, hasher.finalize_non_root())
            })
            .collect();
        if first_whole > offset {
            share
                .edges
                .push((offset, slice(offset, first_whole - offset).to_vec()));
        }
        if at < end {
            share.edges.push((at, slice(at, end - at).to_vec()));
        }
        share
    }

    /// Adds `other`'s share (of other ranges) to this one.
    pub fn merge(&mut self, other: HashShare) {
        self.subtrees.extend(other.subtrees);
        self.edges.extend(other.edges);
    }
}
