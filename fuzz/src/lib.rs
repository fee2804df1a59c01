//! The checks behind the fuzz targets, shared with the regression tests
//! (`tests/regressions.rs`) and the seed generator (`examples/seeds.rs`).
//!
//! - [`check_delta_decode`]: arbitrary bytes as a delta artifact against a fixed small
//!   base checkpoint. Nothing may panic, and whatever is accepted must behave: an in-place
//!   apply either reaches the target hash and agrees with `materialize`, or leaves the
//!   buffer exactly as it was.
//! - [`check_chunk_roundtrip`]: arbitrary bytes as a base tensor and its changes; the
//!   extracted delta must reproduce the target bit for bit, in place and materialised,
//!   and swapping the patch back must restore the base.
//! - [`check_undo_journal`]: arbitrary bytes as the undo journal of an in-place apply to
//!   the base image: nothing may panic, a refused journal leaves the buffer alone, and an
//!   accepted one replays to the same bytes twice. (The journals an apply writes are
//!   checked in [`check_delta_decode`]: replaying one after the apply restores the base.)
//! - [`check_shard_part`]: arbitrary bytes as one rank's part of a delta extracted from
//!   shards (docs/delta-format.md §11), assembled with the other rank's genuine part:
//!   nothing panics, and whatever is accepted is a delta that parses, whose chunks lie
//!   inside their tensors and whose decoding against the base never panics.

pub mod proto;

use std::sync::OnceLock;

use aurora_delta::{
    Checkpoint, DeltaError, DeltaFile, Dtype, Encoding, ExtractOptions, Extraction, Hash,
    OwnedTensor, SegmentSource, ShardPiece, ShardTable, TensorLayout, TensorSpec, TensorView,
    apply, check_base, decode, owned_checkpoint, replay_undo_journal, stats,
};

/// Runs one fuzz input through the delta parser and decoders.
///
/// A mutated artifact almost never survives the manifest and segment hashes, which would
/// keep the fuzzer away from the header, chunk and codec decoders behind them. So every
/// input is tried twice: as given (the hash checks themselves are under test), and after
/// [`reseal`] has recomputed the hashes it covers, as a buggy or hostile writer would.
pub fn check_delta_decode(data: &[u8]) {
    let base = base();
    exercise_delta(data, base);
    if let Some(sealed) = reseal(data) {
        exercise_delta(&sealed, base);
    }
}

fn exercise_delta(bytes: &[u8], base: &Base) {
    let Ok(delta) = DeltaFile::parse(bytes) else {
        return;
    };
    let _ = stats::delta_stats(&delta, bytes.len() as u64);
    // `decode` and the patch do not re-check what `check_base` checks (it is their
    // documented precondition), so the two ways of applying must agree only when it holds.
    let base_matches = check_base(delta.header(), &base.checkpoint, None).is_ok();
    let Ok(patch) = decode(&delta, &base.checkpoint) else {
        return;
    };
    let _ = patch.changed_elements();
    let materialized = patch.clone().materialize(&base.checkpoint);
    if let Ok(tensors) = &materialized {
        let hash = owned_checkpoint(tensors).map(|c| c.weights_hash());
        assert_eq!(hash.ok(), Some(delta.header().target_hash));
    }
    if !patch.preserves_layout() {
        return;
    }
    let mut journal = Vec::new();
    if let Ok(undo) = patch.undo_journal(base.image, &base.layout, delta.id) {
        undo.write_to(&mut journal).expect("writing to memory");
    }
    let mut buffer = base.image.to_vec();
    let mut in_place = patch;
    match in_place.apply_in_place(&mut buffer, &base.layout) {
        Ok(hash) => {
            assert_eq!(hash, delta.header().target_hash);
            let mut undone = buffer.clone();
            replay_undo_journal(&journal, &mut undone).expect("the apply's own journal");
            assert!(
                undone == base.image,
                "the undo journal did not restore the base"
            );
            if base_matches {
                let target = Checkpoint::from_layout(&buffer, &base.layout).expect("same layout");
                let materialized = materialized.expect("in place reached the target, so must this");
                assert_same_tensors(&owned_checkpoint(&materialized).unwrap(), &target);
            }
        }
        Err(error) => {
            assert!(
                buffer == base.image,
                "a failed in-place apply left the buffer changed"
            );
            assert!(
                !(base_matches && materialized.is_ok()),
                "materialising reached the target but applying in place failed: {error}"
            );
        }
    }
}

/// Recomputes the segment hashes the table can locate and the manifest hash, leaving
/// every other byte as it was. `None` when the input is too short to hold a trailer.
pub fn reseal(bytes: &[u8]) -> Option<Vec<u8>> {
    const PREAMBLE: usize = 16;
    const TRAILER: usize = 48;
    let u32_at = |at: usize| -> Option<usize> {
        Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?) as usize)
    };
    let trailer = bytes.len().checked_sub(TRAILER)?;
    let head_end = PREAMBLE.checked_add(u32_at(12)?)?;
    let table_len = u32_at(trailer)?;
    let table_start = trailer.checked_sub(table_len)?;
    if head_end > table_start || table_len < 4 {
        return None;
    }
    let mut out = bytes.to_vec();
    let count = u32_at(table_start)?;
    let mut offset = head_end;
    for index in 0..count {
        let entry = table_start + 4 + 36 * index;
        if entry + 36 > trailer {
            break;
        }
        let Some(end) = offset.checked_add(u32_at(entry)?) else {
            break;
        };
        if end > table_start {
            break;
        }
        out[entry + 4..entry + 36].copy_from_slice(&Hash::of(&bytes[offset..end]).0);
        offset = end;
    }
    let mut manifest = out[..head_end].to_vec();
    manifest.extend_from_slice(&out[table_start..trailer]);
    out[trailer + 8..trailer + 40].copy_from_slice(&Hash::of(&manifest).0);
    Some(out)
}

/// The fixed base checkpoint of `delta_decode`: a handful of small tensors of every
/// dtype the `aurora` encoding handles, plus an integer one, with a realistic spread of
/// exponents and a few special bit patterns. The seed corpus is extracted against it,
/// so seeds reach the chunk decoders.
pub struct Base {
    pub image: &'static [u8],
    pub layout: Vec<TensorLayout>,
    pub checkpoint: Checkpoint<'static>,
}

pub fn base() -> &'static Base {
    static BASE: OnceLock<Base> = OnceLock::new();
    BASE.get_or_init(|| {
        let tensors = base_tensors();
        let mut image = Vec::new();
        let mut layout = Vec::new();
        for tensor in &tensors {
            let start = image.len();
            image.extend_from_slice(&tensor.data);
            layout.push(TensorLayout {
                name: tensor.name.clone(),
                dtype: tensor.dtype,
                shape: tensor.shape.clone(),
                bytes: start..image.len(),
            });
        }
        let image: &'static [u8] = Box::leak(image.into_boxed_slice());
        let checkpoint = Checkpoint::from_layout(image, &layout).expect("a valid base");
        Base {
            image,
            layout,
            checkpoint,
        }
    })
}

/// The tensors of [`base`], owned.
pub fn base_tensors() -> Vec<OwnedTensor> {
    let mut random = SplitMix(0x5eed);
    let mut tensors = vec![
        float_tensor(
            "model.embed_tokens.weight",
            Dtype::Bf16,
            &[32, 16],
            &mut random,
        ),
        float_tensor(
            "model.layers.0.input_layernorm.weight",
            Dtype::F32,
            &[16],
            &mut random,
        ),
        float_tensor(
            "model.layers.0.mlp.down_proj.weight",
            Dtype::F16,
            &[8, 16],
            &mut random,
        ),
        float_tensor(
            "model.layers.0.self_attn.q_proj.weight",
            Dtype::Bf16,
            &[16, 16],
            &mut random,
        ),
        float_tensor("model.norm.weight", Dtype::Bf16, &[16], &mut random),
        // Long enough for the `aurora` encoding's exponent classes (from 4096 elements).
        float_tensor(
            "model.layers.0.mlp.up_proj.weight",
            Dtype::Bf16,
            &[128, 64],
            &mut random,
        ),
    ];
    tensors.push(OwnedTensor {
        name: "model.step".into(),
        dtype: Dtype::I32,
        shape: vec![4],
        data: [7i32, -1, 0, 1 << 20]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
    });
    // Zeros of both signs, subnormals, infinities, NaNs and the largest finite values.
    let specials: [u16; 10] = [
        0x0000, 0x8000, 0x0001, 0x807F, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F7F, 0xFF7F,
    ];
    for (i, word) in specials.iter().enumerate() {
        tensors[0].data[2 * i * 7..2 * i * 7 + 2].copy_from_slice(&word.to_le_bytes());
    }
    tensors
}

fn float_tensor(name: &str, dtype: Dtype, shape: &[u64], random: &mut SplitMix) -> OwnedTensor {
    let elements: u64 = shape.iter().product();
    let mut data = Vec::with_capacity(elements as usize * dtype.size_bytes());
    for _ in 0..elements {
        // A magnitude spread over several binades, like a trained model's weights.
        let scale = (-((random.next() % 14) as f32) - 2.0).exp2();
        let value =
            (random.unit() * 2.0 - 1.0) * scale + if name.contains("norm") { 1.0 } else { 0.0 };
        match dtype {
            Dtype::F32 => data.extend_from_slice(&value.to_le_bytes()),
            Dtype::Bf16 => data.extend_from_slice(&((value.to_bits() >> 16) as u16).to_le_bytes()),
            Dtype::F16 => data.extend_from_slice(&f32_to_f16_bits(value).to_le_bytes()),
            other => unreachable!("no float tensor of {other}"),
        }
    }
    OwnedTensor {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
        data,
    }
}

/// Truncating conversion, good enough for test data (no rounding, flushes tiny values).
fn f32_to_f16_bits(value: f32) -> u16 {
    let bits = value.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let exponent = ((bits >> 23) & 0xFF) as i32 - 127 + 15;
    let mantissa = ((bits >> 13) & 0x3FF) as u16;
    match exponent {
        e if e <= 0 => sign,
        e if e >= 31 => sign | 0x7C00,
        e => sign | ((e as u16) << 10) | mantissa,
    }
}

/// The seed deltas for `delta_decode`, each extracted against [`base`]: sparse steps in
/// both encodings, a dense step, many small segments, no change at all, special values,
/// and added, removed and replaced tensors.
pub fn seed_deltas() -> Vec<(&'static str, Vec<u8>)> {
    let base = base_tensors();
    let extract = |target: &[OwnedTensor], encoding: Encoding, segment_target_bytes: usize| {
        let base = owned_checkpoint(&base).unwrap();
        let target = owned_checkpoint(target).unwrap();
        let options = ExtractOptions {
            encoding,
            segment_target_bytes,
            ..ExtractOptions::default()
        };
        Extraction::new(&base, &target, options)
            .unwrap()
            .to_bytes()
            .unwrap()
            .1
    };
    let sparse = stepped(&base, 1, 0.02);
    let mut seeds = vec![
        (
            "sparse-aurora",
            extract(&sparse, Encoding::Aurora, 256 << 10),
        ),
        (
            "sparse-leb128",
            extract(&sparse, Encoding::Leb128, 256 << 10),
        ),
        (
            "dense-aurora",
            extract(&stepped(&base, 2, 0.7), Encoding::Aurora, 256 << 10),
        ),
        (
            "segments-aurora",
            extract(&stepped(&base, 3, 0.1), Encoding::Aurora, 64),
        ),
        ("unchanged", extract(&base, Encoding::Aurora, 256 << 10)),
    ];

    let mut special = stepped(&base, 4, 0.01);
    for (i, word) in [0x7FC0u16, 0xFF80, 0x8000, 0x0001, 0x7F7F]
        .iter()
        .enumerate()
    {
        let at = 2 * (40 + 9 * i);
        special[0].data[at..at + 2].copy_from_slice(&word.to_le_bytes());
    }
    seeds.push((
        "specials-aurora",
        extract(&special, Encoding::Aurora, 256 << 10),
    ));

    let mut reshaped = stepped(&base, 5, 0.02);
    reshaped.retain(|t| t.name != "model.norm.weight");
    reshaped.push(OwnedTensor {
        name: "model.extra.weight".into(),
        dtype: Dtype::Bf16,
        shape: vec![8],
        data: vec![0x3F; 16],
    });
    let norm = reshaped
        .iter_mut()
        .find(|t| t.name == "model.layers.0.input_layernorm.weight")
        .unwrap();
    norm.dtype = Dtype::Bf16;
    norm.shape = vec![2, 8];
    norm.data.truncate(32);
    seeds.push((
        "reshaped-aurora",
        extract(&reshaped, Encoding::Aurora, 256 << 10),
    ));
    seeds
}

/// Seed inputs for `chunk_roundtrip`: the base tensors' words with about 2% of them
/// stepped, for each encoding and dtype (the input layout is described at
/// [`check_chunk_roundtrip`]).
pub fn seed_roundtrips() -> Vec<(String, Vec<u8>)> {
    let tensors = base_tensors();
    let mut seeds = Vec::new();
    for (dtype, flags) in [(Dtype::Bf16, 0u8), (Dtype::F16, 4), (Dtype::F32, 6)] {
        let words: Vec<u8> = tensors
            .iter()
            .filter(|t| t.dtype == dtype)
            .flat_map(|t| t.data.iter().copied())
            .collect();
        for encoding in [0u8, 1] {
            let mut random = SplitMix(u64::from(flags + encoding));
            let mut input = vec![flags | encoding, 100, 6];
            for word in words.chunks_exact(dtype.size_bytes()) {
                input.extend_from_slice(word);
                input.push(if random.unit() < 0.02 {
                    0xC0 + (random.next() % 8) as u8
                } else {
                    0
                });
            }
            let name = format!(
                "{}-{}",
                dtype.name(),
                ["aurora", "leb128"][usize::from(encoding)]
            );
            seeds.push((name, input));
        }
    }
    // Two BF16 tensors long enough for the class search (from 4096 elements a chunk may
    // have several exponent classes), with values over 14 exponents that change the more
    // often the smaller they are, as in training: about 3% of elements.
    let mut random = SplitMix(14);
    let mut input = vec![0, 128, 6];
    for _ in 0..12_288 {
        let exponent = 110 + random.next() % 14;
        let word = (random.next() & 0x807F | exponent << 7) as u16;
        input.extend_from_slice(&word.to_le_bytes());
        let chance = 0.2 / (1u32 << (exponent - 110)) as f32;
        input.push(if random.unit() < chance {
            0xC0 + (random.next() % 8) as u8
        } else {
            0
        });
    }
    seeds.push(("BF16-aurora-classes".into(), input));
    seeds
}

/// A training-like step: each float element changes with probability `density` by a
/// small number of representable values; the integer tensor counts up.
fn stepped(base: &[OwnedTensor], seed: u64, density: f64) -> Vec<OwnedTensor> {
    let mut random = SplitMix(seed);
    let mut target = base.to_vec();
    for tensor in &mut target {
        let width = tensor.dtype.size_bytes();
        let is_float = matches!(tensor.dtype, Dtype::Bf16 | Dtype::F16 | Dtype::F32);
        for element in tensor.data.chunks_exact_mut(width) {
            let word = read_word(element);
            // Small magnitudes change more often, as under Adam-style updates, so the
            // exponent classes of `aurora` pay off on tensors long enough for them.
            let weight = match tensor.dtype {
                Dtype::Bf16 => 124 - (word >> 7 & 0xFF) as i32,
                Dtype::F16 => 12 - (word >> 10 & 0x1F) as i32,
                Dtype::F32 => 124 - (word >> 23 & 0xFF) as i32,
                _ => 0,
            };
            if random.unit() as f64 >= density * 2f64.powi((weight / 2).clamp(-3, 3)) {
                continue;
            }
            let new = if is_float {
                let step = 1 + random.next() % 3;
                let step = if random.next().is_multiple_of(2) {
                    step
                } else {
                    step.wrapping_neg()
                };
                step_word(word, width, step)
            } else {
                word.wrapping_add(1)
            };
            write_word(element, new);
        }
    }
    target
}

/// Runs one fuzz input through extraction and both ways of applying.
///
/// Input: a flags byte (bit 0: encoding, bits 1-2: dtype, BF16 twice as likely as F16
/// and F32), a byte choosing where the elements split into two tensors, a byte choosing
/// the segment size, then per element its base word followed by one change byte: below
/// 0xC0 the element is unchanged, below 0xF8 it moves by a small step in the ordered key
/// space (docs/delta-format.md §6.3), and above it flips bits of the base word.
pub fn check_chunk_roundtrip(data: &[u8]) {
    let Some((&[flags, split, segment], rest)) = data.split_first_chunk::<3>() else {
        return;
    };
    let encoding = if flags & 1 == 0 {
        Encoding::Aurora
    } else {
        Encoding::Leb128
    };
    let dtype = [Dtype::Bf16, Dtype::Bf16, Dtype::F16, Dtype::F32][usize::from(flags >> 1 & 3)];
    let width = dtype.size_bytes();
    let elements = rest.len() / (width + 1);
    if elements == 0 {
        return;
    }
    let mut base = Vec::with_capacity(elements * width);
    let mut target = Vec::with_capacity(elements * width);
    for record in rest.chunks_exact(width + 1) {
        let (word_bytes, &[change]) = record.split_at(width) else {
            unreachable!("records are width + 1 bytes")
        };
        base.extend_from_slice(word_bytes);
        let word = read_word(word_bytes);
        let new = match change {
            0x00..0xC0 => word,
            0xC0..0xF8 => {
                let step = u64::from(change - 0xC0) / 2 + 1;
                step_word(
                    word,
                    width,
                    if change % 2 == 0 {
                        step
                    } else {
                        step.wrapping_neg()
                    },
                )
            }
            _ => word ^ (u64::from(change) << (8 * width as u32 - 8)) ^ u64::from(change),
        };
        let mut bytes = [0u8; 4];
        write_word(&mut bytes[..width], new);
        target.extend_from_slice(&bytes[..width]);
    }

    let split = usize::from(split) * elements / 256;
    let tensors = |bytes: &[u8]| -> Vec<OwnedTensor> {
        let (first, second) = bytes.split_at(split * width);
        [("a", first), ("b", second)]
            .into_iter()
            .map(|(name, data)| OwnedTensor {
                name: name.into(),
                dtype,
                shape: vec![(data.len() / width) as u64],
                data: data.to_vec(),
            })
            .collect()
    };
    let base_tensors = tensors(&base);
    let target_tensors = tensors(&target);
    let base_view = owned_checkpoint(&base_tensors).unwrap();
    let target_view = owned_checkpoint(&target_tensors).unwrap();
    let options = ExtractOptions {
        encoding,
        segment_target_bytes: 16 << (segment % 16),
        ..ExtractOptions::default()
    };
    let (_, bytes) = Extraction::new(&base_view, &target_view, options)
        .expect("extraction plans any pair of checkpoints")
        .to_bytes()
        .expect("extraction encodes any pair of checkpoints");
    let delta = DeltaFile::parse(&bytes).expect("an extracted delta parses");

    let rebuilt = apply(&delta, &base_view, None).expect("an extracted delta applies");
    assert_same_tensors(&owned_checkpoint(&rebuilt).unwrap(), &target_view);

    let layout: Vec<TensorLayout> = base_tensors
        .iter()
        .scan(0, |start, t| {
            let bytes = *start..*start + t.data.len();
            *start = bytes.end;
            Some(TensorLayout {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                bytes,
            })
        })
        .collect();
    let mut buffer = base.clone();
    let mut patch = decode(&delta, &base_view).expect("an extracted delta decodes");
    let hash = patch
        .apply_in_place(&mut buffer, &layout)
        .expect("an extracted delta applies in place");
    assert_eq!(hash, target_view.weights_hash());
    assert!(buffer == target, "in-place apply differs from the target");
    patch.swap_in_place(&mut buffer, &layout).unwrap();
    assert!(
        buffer == base,
        "swapping the patch back did not restore the base"
    );
}

/// Asserts two checkpoints hold the same tensors, bit for bit.
fn assert_same_tensors(actual: &Checkpoint<'_>, expected: &Checkpoint<'_>) {
    let describe = |c: &Checkpoint<'_>| -> Vec<(String, Dtype, Vec<u64>)> {
        c.tensors()
            .iter()
            .map(|t: &TensorView<'_>| (t.name.clone(), t.dtype, t.shape.clone()))
            .collect()
    };
    assert_eq!(describe(actual), describe(expected));
    for (a, e) in actual.tensors().iter().zip(expected.tensors()) {
        assert!(a.data == e.data, "tensor '{}' differs", a.name);
    }
    assert_eq!(actual.weights_hash(), expected.weights_hash());
}

/// Moves a float word by `step` (two's complement) in the ordered key space, where keys
/// order like the floats they encode (docs/delta-format.md §6.3). Never returns `word`
/// unless `step` is a multiple of 2^bits.
fn step_word(word: u64, width: usize, step: u64) -> u64 {
    let bits = 8 * width as u32;
    let mask = if bits == 64 {
        u64::MAX
    } else {
        (1 << bits) - 1
    };
    let sign = 1 << (bits - 1);
    let key = if word & sign == 0 {
        word | sign
    } else {
        !word & mask
    };
    let key = key.wrapping_add(step) & mask;
    if key & sign != 0 {
        key & !sign
    } else {
        !key & mask
    }
}

fn read_word(bytes: &[u8]) -> u64 {
    let mut word = [0u8; 8];
    word[..bytes.len()].copy_from_slice(bytes);
    u64::from_le_bytes(word)
}

fn write_word(bytes: &mut [u8], word: u64) {
    let len = bytes.len();
    bytes.copy_from_slice(&word.to_le_bytes()[..len]);
}

/// A tiny counter-based generator, so fixtures never change with a dependency.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// Runs one fuzz input as an undo journal over the base image, as given and with its
/// trailing hash recomputed (so the fuzzer reaches the region parser behind the hash).
pub fn check_undo_journal(data: &[u8]) {
    let image = base().image;
    let mut sealed = data.to_vec();
    if let Some(body) = data.len().checked_sub(32) {
        let hash = Hash::of(&data[..body]);
        sealed[body..].copy_from_slice(&hash.0);
    }
    for journal in [data, &sealed[..]] {
        let mut buffer = image.to_vec();
        match replay_undo_journal(journal, &mut buffer) {
            Ok(_) => {
                let mut again = buffer.clone();
                replay_undo_journal(journal, &mut again).expect("accepted once");
                assert!(
                    again == buffer,
                    "replaying a journal twice differs from once"
                );
            }
            Err(_) => assert!(buffer == image, "a refused journal changed the buffer"),
        }
    }
}

/// Undo journals of the seed deltas' in-place applies to the base.
pub fn seed_journals() -> Vec<(String, Vec<u8>)> {
    let base = base();
    seed_deltas()
        .into_iter()
        .filter_map(|(name, bytes)| {
            let delta = DeltaFile::parse(&bytes).ok()?;
            let patch = decode(&delta, &base.checkpoint).ok()?;
            let undo = patch
                .undo_journal(base.image, &base.layout, delta.id)
                .ok()?;
            let mut journal = Vec::new();
            undo.write_to(&mut journal).ok()?;
            Some((name.to_string(), journal))
        })
        .collect()
}

/// The fuzz base's shard table and the genuine parts of two ranks, each holding half the
/// rows of every tensor, of a step at 2% density.
pub fn shard_fixture() -> &'static (ShardTable, Vec<Vec<u8>>) {
    static FIXTURE: OnceLock<(ShardTable, Vec<Vec<u8>>)> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let base = base_tensors();
        let target = stepped(&base, 6, 0.02);
        let specs = target
            .iter()
            .map(|t| {
                let spec = TensorSpec {
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                };
                (t.name.clone(), spec)
            })
            .collect();
        let table = ShardTable::new(specs, Encoding::Aurora).expect("a valid table");
        let parts = (0..2)
            .map(|rank| {
                let pieces: Vec<ShardPiece<'_>> = base
                    .iter()
                    .zip(&target)
                    .filter_map(|(b, t)| {
                        ShardPiece::dim0_shard(&t.name, &t.shape, &b.data, &t.data, rank, 2)
                    })
                    .collect();
                table.extract(&pieces).expect("genuine pieces")
            })
            .collect();
        (table, parts)
    })
}

/// Runs one fuzz input as either rank's part, beside the other's genuine one.
pub fn check_shard_part(data: &[u8]) {
    let (table, parts) = shard_fixture();
    for position in 0..parts.len() {
        let mut inputs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        inputs[position] = data;
        let Ok(assembly) = table.assemble(0, Hash::ZERO, &inputs) else {
            continue;
        };
        let mut segments = Vec::new();
        let manifest = assembly
            .run(|segment| {
                segments.push(segment.bytes);
                Ok::<(), DeltaError>(())
            })
            .expect("an assembly streams");
        let (_, bytes) = aurora_delta::assemble(&manifest.header, &segments);
        let delta = DeltaFile::parse(&bytes).expect("an accepted assembly is a delta");
        for index in 0..delta.segment_count() {
            delta.verify_segment(index).expect("its segments verify");
        }
        // The node checks chunks' places, not their payloads: decoding may refuse one, but
        // never panic.
        let _ = decode(&delta, &base().checkpoint);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_move_through_the_ordered_keys() {
        // +0 up one is the smallest positive subnormal; -0 up one is +0.
        assert_eq!(step_word(0x0000, 2, 1), 0x0001);
        assert_eq!(step_word(0x8000, 2, 1), 0x0000);
        assert_eq!(step_word(0x0000, 2, 1u64.wrapping_neg()), 0x8000);
        // 1.0 down one in BF16 is the largest value below it.
        assert_eq!(step_word(0x3F80, 2, 1u64.wrapping_neg()), 0x3F7F);
        assert_eq!(step_word(0xBF80, 2, 1), 0xBF7F);
        assert_eq!(step_word(0x3F80_0000, 4, 1), 0x3F80_0001);
    }
}
