//! Read-only views of checkpoints and the weights hash (docs/delta-format.md §2).

use std::ops::Range;

use crate::dtype::Dtype;
use crate::error::{DeltaError, Result};

/// A BLAKE3 digest: segment hashes, weights hashes and artifact ids.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Hash(pub [u8; 32]);

impl Hash {
    /// All zero: no BLAKE3 digest of anything in practice, so it marks a hash not known
    /// yet (an Offer's pending target hash, wire-protocol §4.4) or no weights at all.
    pub const ZERO: Hash = Hash([0; 32]);

    pub fn of(bytes: &[u8]) -> Hash {
        Hash(*blake3::hash(bytes).as_bytes())
    }

    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    pub fn from_hex(text: &str) -> Option<Hash> {
        if text.len() != 64 || !text.is_ascii() {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(Hash(out))
    }
}

impl std::fmt::Display for Hash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl std::fmt::Debug for Hash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Hash({})", &self.to_hex()[..16])
    }
}

impl serde::Serialize for Hash {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.to_hex())
    }
}

/// One tensor of a checkpoint: metadata plus its little-endian bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorView<'a> {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub data: &'a [u8],
}

impl TensorView<'_> {
    pub fn element_count(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// A tensor of a [`Checkpoint`] as `safetensors` serialises it
/// ([`Checkpoint::safetensors_views`]).
pub struct SafetensorsView<'a> {
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    data: &'a [u8],
}

impl safetensors::View for SafetensorsView<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(self.data)
    }

    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// What an activation changed, per tensor, in the delta's tensor order: what an engine
/// must load to run the new version.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChangeSet {
    pub tensors: Vec<ChangedTensor>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChangedTensor {
    pub name: String,
    /// The changed elements; `None`: the whole tensor (a snapshot, a delta that changes
    /// the layout, or an engine that loads tensors whole).
    pub elements: Option<ChangedElements>,
}

/// A tensor's changed elements: what an engine writes in place, without reading the
/// new weights' image.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChangedElements {
    /// Flat indices, ascending.
    pub indices: Vec<u64>,
    /// The new values' little-endian bytes, in the order of `indices`.
    pub values: Vec<u8>,
}

impl ChangeSet {
    /// Every tensor named, whole.
    pub fn whole(names: Vec<String>) -> ChangeSet {
        ChangeSet {
            tensors: names
                .into_iter()
                .map(|name| ChangedTensor {
                    name,
                    elements: None,
                })
                .collect(),
        }
    }

    pub fn names(&self) -> Vec<String> {
        self.tensors.iter().map(|t| t.name.clone()).collect()
    }

    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }
}

/// Where a tensor lives inside a larger byte buffer (a safetensors file image, or a fused
/// parameter of an inference engine). Used to patch weights in place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorLayout {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub bytes: Range<usize>,
}

/// A checkpoint as a name-sorted list of tensor views. Sorting by name (bytewise) is the
/// canonical order of the weights hash and of the delta's tensor table.
#[derive(Debug, Clone, Default)]
pub struct Checkpoint<'a> {
    tensors: Vec<TensorView<'a>>,
}

impl<'a> Checkpoint<'a> {
    /// Builds a checkpoint from views, checking that names are unique and that every
    /// tensor's byte length matches its dtype and shape.
    pub fn new(mut tensors: Vec<TensorView<'a>>) -> Result<Checkpoint<'a>> {
        tensors.sort_by(|a, b| a.name.cmp(&b.name));
        for pair in tensors.windows(2) {
            if pair[0].name == pair[1].name {
                return Err(DeltaError::Checkpoint(format!(
                    "tensor '{}' appears twice",
                    pair[0].name
                )));
            }
        }
        for tensor in &tensors {
            let expected = checked_byte_len(tensor.dtype, &tensor.shape).ok_or_else(|| {
                DeltaError::Checkpoint(format!("tensor '{}' has an overflowing shape", tensor.name))
            })?;
            if expected != tensor.data.len() as u64 {
                return Err(DeltaError::Checkpoint(format!(
                    "tensor '{}' has {} bytes but {} {:?} needs {}",
                    tensor.name,
                    tensor.data.len(),
                    tensor.dtype,
                    tensor.shape,
                    expected
                )));
            }
        }
        Ok(Checkpoint { tensors })
    }

    /// Parses a safetensors file image without copying tensor data.
    pub fn from_safetensors(bytes: &'a [u8]) -> Result<Checkpoint<'a>> {
        let layouts = safetensors_layout(bytes)?;
        Checkpoint::from_layout(bytes, &layouts)
    }

    /// Views the tensors that `layouts` places inside `buffer`.
    pub fn from_layout(buffer: &'a [u8], layouts: &[TensorLayout]) -> Result<Checkpoint<'a>> {
        let tensors = layouts
            .iter()
            .map(|layout| {
                let data = buffer.get(layout.bytes.clone()).ok_or_else(|| {
                    DeltaError::Checkpoint(format!(
                        "tensor '{}' lies outside the buffer",
                        layout.name
                    ))
                })?;
                Ok(TensorView {
                    name: layout.name.clone(),
                    dtype: layout.dtype,
                    shape: layout.shape.clone(),
                    data,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Checkpoint::new(tensors)
    }

    pub fn tensors(&self) -> &[TensorView<'a>] {
        &self.tensors
    }

    pub fn get(&self, name: &str) -> Option<&TensorView<'a>> {
        self.tensors
            .binary_search_by(|t| t.name.as_str().cmp(name))
            .ok()
            .map(|i| &self.tensors[i])
    }

    pub fn total_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.data.len() as u64).sum()
    }

    /// The checkpoint as a safetensors file image: the bytes `safetensors::serialize`
    /// writes for these tensors (one copy of their data).
    pub fn to_safetensors(&self) -> Result<Vec<u8>> {
        safetensors::serialize(self.safetensors_views(), None)
            .map_err(|e| DeltaError::Checkpoint(format!("writing a safetensors image: {e}")))
    }

    /// Every tensor as `safetensors` serialises it, borrowing the data: what writes a
    /// checkpoint to a file tensor by tensor, never as one image in memory.
    pub fn safetensors_views(&self) -> impl Iterator<Item = (&str, SafetensorsView<'_>)> {
        self.tensors.iter().map(|t| {
            let view = SafetensorsView {
                dtype: t.dtype.to_safetensors(),
                shape: t.shape.iter().map(|&d| d as usize).collect(),
                data: t.data,
            };
            (t.name.as_str(), view)
        })
    }

    /// The weights hash: BLAKE3 over every tensor in name order (docs/delta-format.md §2).
    pub fn weights_hash(&self) -> Hash {
        self.weights_hash_with(|tensor, hasher| hash_bytes(hasher, tensor.data))
    }

    /// The weights hash with each tensor's data fed by `data` (which must feed exactly
    /// `tensor.data.len()` bytes): the hash of other contents under the same names,
    /// dtypes and shapes, such as these tensors with a patch laid over them.
    pub fn weights_hash_with(
        &self,
        mut data: impl FnMut(&TensorView<'a>, &mut blake3::Hasher),
    ) -> Hash {
        let mut hasher = blake3::Hasher::new();
        hasher.update(WEIGHTS_HASH_DOMAIN);
        for tensor in &self.tensors {
            hasher.update(&tensor_framing(
                &tensor.name,
                tensor.dtype,
                &tensor.shape,
                tensor.data.len() as u64,
            ));
            data(tensor, &mut hasher);
        }
        Hash(*hasher.finalize().as_bytes())
    }
}

/// Feeds `bytes` to `hasher`: multi-threaded hashing pays off only on large inputs.
pub(crate) fn hash_bytes(hasher: &mut blake3::Hasher, bytes: &[u8]) {
    if bytes.len() >= 1 << 20 {
        hasher.update_rayon(bytes);
    } else {
        hasher.update(bytes);
    }
}

/// Domain separation so a weights hash can never collide with a hash of other content.
pub(crate) const WEIGHTS_HASH_DOMAIN: &[u8] = b"aurora weights v1\0";

/// What precedes a tensor's data in the weights hash's input (§2).
pub(crate) fn tensor_framing(name: &str, dtype: Dtype, shape: &[u64], data_len: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + name.len() + 2 + 8 * shape.len() + 8);
    out.extend_from_slice(&(name.len() as u32).to_le_bytes());
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(&[dtype as u8, shape.len() as u8]);
    for dim in shape {
        out.extend_from_slice(&dim.to_le_bytes());
    }
    out.extend_from_slice(&data_len.to_le_bytes());
    out
}

pub(crate) fn checked_byte_len(dtype: Dtype, shape: &[u64]) -> Option<u64> {
    shape
        .iter()
        .try_fold(dtype.size_bytes() as u64, |acc, dim| acc.checked_mul(*dim))
}

/// Reads where each tensor of a safetensors image lives, validating the header with the
/// `safetensors` crate (capped header size, bounds and overlap checks).
pub fn safetensors_layout(bytes: &[u8]) -> Result<Vec<TensorLayout>> {
    let parsed = safetensors::SafeTensors::deserialize(bytes)
        .map_err(|e| DeltaError::Checkpoint(format!("not a valid safetensors file: {e}")))?;
    let base = bytes.as_ptr() as usize;
    parsed
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let start = view.data().as_ptr() as usize - base;
            Ok(TensorLayout {
                dtype: Dtype::from_safetensors(view.dtype())?,
                shape: view.shape().iter().map(|d| *d as u64).collect(),
                bytes: start..start + view.data().len(),
                name,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view<'a>(name: &str, dtype: Dtype, shape: &[u64], data: &'a [u8]) -> TensorView<'a> {
        TensorView {
            name: name.to_string(),
            dtype,
            shape: shape.to_vec(),
            data,
        }
    }

    /// The test vector of docs/delta-format.md §2, and its preimage built from the spec's
    /// table by hand, so the hash cannot drift from what peers recompute.
    #[test]
    fn weights_hash_matches_the_specified_test_vector() {
        let norm = [0u8, 0, 128, 63, 0, 0, 0, 64]; // F32 1.0, 2.0
        let weight = [0x80u8, 0x3F, 0x00, 0xC0, 0x80, 0x7F]; // BF16 1.0, -2.0, +inf
        let checkpoint = Checkpoint::new(vec![
            view("model.norm.weight", Dtype::F32, &[2], &norm),
            view("lm_head.weight", Dtype::Bf16, &[3, 1], &weight),
        ])
        .unwrap();
        let mut preimage = b"aurora weights v1\0".to_vec();
        // Dtype codes from the table of §3: BF16 is 7, F32 is 10.
        for (name, code, dims, data) in [
            ("lm_head.weight", 7u8, &[3u64, 1][..], &weight[..]),
            ("model.norm.weight", 10u8, &[2u64][..], &norm[..]),
        ] {
            preimage.extend((name.len() as u32).to_le_bytes());
            preimage.extend(name.as_bytes());
            preimage.push(code);
            preimage.push(dims.len() as u8);
            dims.iter().for_each(|d| preimage.extend(d.to_le_bytes()));
            preimage.extend((data.len() as u64).to_le_bytes());
            preimage.extend(data);
        }
        assert_eq!(
            checkpoint.weights_hash(),
            Hash(*blake3::hash(&preimage).as_bytes())
        );
        assert_eq!(
            checkpoint.weights_hash().to_hex(),
            "6d6fd1b46cdaf8ce756b154913974fda6fd349cdaab578a61fb99a41cd983d4c"
        );
    }

    #[test]
    fn hash_hex_round_trips() {
        let hash = Hash::of(b"abc");
        assert_eq!(Hash::from_hex(&hash.to_hex()), Some(hash));
        assert_eq!(Hash::from_hex("zz"), None);
    }

    #[test]
    fn weights_hash_ignores_input_order_but_sees_every_field() {
        let a = [1u8, 2, 3, 4];
        let b = [5u8, 6];
        let forward = Checkpoint::new(vec![
            view("a", Dtype::Bf16, &[2], &a),
            view("b", Dtype::Bf16, &[1], &b),
        ])
        .unwrap();
        let backward = Checkpoint::new(vec![
            view("b", Dtype::Bf16, &[1], &b),
            view("a", Dtype::Bf16, &[2], &a),
        ])
        .unwrap();
        assert_eq!(forward.weights_hash(), backward.weights_hash());

        let reshaped = Checkpoint::new(vec![
            view("a", Dtype::Bf16, &[1, 2], &a),
            view("b", Dtype::Bf16, &[1], &b),
        ])
        .unwrap();
        let retyped = Checkpoint::new(vec![
            view("a", Dtype::F16, &[2], &a),
            view("b", Dtype::F16, &[1], &b),
        ])
        .unwrap();
        let renamed = Checkpoint::new(vec![
            view("c", Dtype::Bf16, &[2], &a),
            view("b", Dtype::Bf16, &[1], &b),
        ])
        .unwrap();
        for other in [&reshaped, &retyped, &renamed] {
            assert_ne!(forward.weights_hash(), other.weights_hash());
        }
    }

    #[test]
    fn rejects_duplicates_and_wrong_sizes() {
        let a = [0u8; 4];
        let dup = Checkpoint::new(vec![
            view("a", Dtype::Bf16, &[2], &a),
            view("a", Dtype::Bf16, &[2], &a),
        ]);
        assert!(dup.unwrap_err().to_string().contains("appears twice"));
        let short = Checkpoint::new(vec![view("a", Dtype::F32, &[2], &a)]);
        assert!(short.unwrap_err().to_string().contains("needs 8"));
        let overflow = Checkpoint::new(vec![view("a", Dtype::F32, &[u64::MAX, 2], &a)]);
        assert!(overflow.unwrap_err().to_string().contains("overflowing"));
    }
}
