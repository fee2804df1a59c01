//! Round trips through the public API: apply(base, diff(base, new)) is bit-identical to
//! new, for random checkpoints, every supported dtype, densities from 0 to 100% and
//! special values, and over many steps of realistic training.

use aurora_delta::{
    Checkpoint, DeltaError, DeltaFile, Dtype, Encoding, ExtractOptions, Extraction, Heap,
    OwnedTensor, Patch, Segment, TensorLayout, apply, check_base, decode, decode_segment,
    owned_checkpoint, safetensors_layout,
};
use proptest::prelude::*;

fn tensor(name: &str, dtype: Dtype, shape: &[u64], data: Vec<u8>) -> OwnedTensor {
    OwnedTensor {
        name: name.to_string(),
        dtype,
        shape: shape.to_vec(),
        data,
    }
}

fn extract(base: &[OwnedTensor], target: &[OwnedTensor], encoding: Encoding) -> Vec<u8> {
    let base = owned_checkpoint(base).unwrap();
    let target = owned_checkpoint(target).unwrap();
    let options = ExtractOptions {
        encoding,
        segment_target_bytes: 4096,
        ..ExtractOptions::default()
    };
    Extraction::new(&base, &target, options)
        .unwrap()
        .to_bytes()
        .unwrap()
        .1
}

fn round_trip(base: &[OwnedTensor], target: &[OwnedTensor], encoding: Encoding) -> Vec<u8> {
    let bytes = extract(base, target, encoding);
    let delta = DeltaFile::parse(&bytes).unwrap();
    let rebuilt = apply(&delta, &owned_checkpoint(base).unwrap(), None).unwrap();
    let mut expected = target.to_vec();
    expected.sort_by(|a, b| a.name.cmp(&b.name));
    assert_eq!(rebuilt, expected);
    bytes
}

/// Bit patterns worth special attention: zeros of both signs, subnormals, infinities,
/// NaNs with payloads, the largest finite values.
fn special_bf16() -> Vec<u16> {
    vec![
        0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0x7F7F,
        0xFF7F, 0x3F80, 0xBF80,
    ]
}

/// Each segment decodes alone, against the base only, in any order: a receiver can stage
/// segments as they arrive, and the chunks of all of them make the whole patch.
#[test]
fn every_segment_decodes_on_its_own_in_any_order() {
    let mut trainer = aurora_synth_like::Trainer::new(60_000, 9);
    let base = trainer.export();
    trainer.step();
    let target = trainer.export();
    let base_view = owned_checkpoint(&base).unwrap();
    let options = ExtractOptions {
        segment_target_bytes: 256,
        ..ExtractOptions::default()
    };
    let (_, bytes) = Extraction::new(&base_view, &owned_checkpoint(&target).unwrap(), options)
        .unwrap()
        .to_bytes()
        .unwrap();
    let delta = DeltaFile::parse(&bytes).unwrap();
    assert!(
        delta.segment_count() >= 4,
        "{} segments",
        delta.segment_count()
    );
    let mut chunks = Vec::new();
    for index in (0..delta.segment_count()).rev() {
        let segment = delta.verify_segment(index).unwrap();
        let decoded = decode_segment(delta.header(), index as u32, segment, &base_view).unwrap();
        assert!(!decoded.is_empty(), "segment {index} holds no chunk");
        chunks.extend(decoded);
    }
    let rebuilt = Patch::new(delta.header().clone(), chunks)
        .unwrap()
        .materialize(&base_view)
        .unwrap();
    let mut expected = target.clone();
    expected.sort_by(|a, b| a.name.cmp(&b.name));
    assert_eq!(rebuilt, expected);
}

/// Every ordered pair of special values, as an old value turning into a new one, in each
/// float dtype, amid ordinary weights (enough of them for `aurora` to code with exponent
/// classes): every transition round-trips bit for bit in both encodings.
#[test]
fn every_transition_between_special_values_round_trips() {
    let specials: [(Dtype, Vec<u64>); 3] = [
        (
            Dtype::Bf16,
            special_bf16().into_iter().map(u64::from).collect(),
        ),
        (
            Dtype::F16,
            vec![
                0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00,
                0x7E00, 0xFE01, 0x7C01, 0x3C00, 0xBC00,
            ],
        ),
        (
            Dtype::F32,
            vec![
                0x0000_0000,
                0x8000_0000,
                0x0000_0001,
                0x8000_0001,
                0x007F_FFFF,
                0x0080_0000,
                0x7F7F_FFFF,
                0xFF7F_FFFF,
                0x7F80_0000,
                0xFF80_0000,
                0x7FC0_0000,
                0xFFC0_0001,
                0x7F80_0001,
                0x3F80_0000,
                0xBF80_0000,
            ],
        ),
    ];
    for (dtype, values) in specials {
        let bytes = dtype.size_bytes();
        let word = |value: u64| value.to_le_bytes()[..bytes].to_vec();
        // Ordinary weights around 0.01, one ordinary step apart in the target.
        let ordinary = match dtype {
            Dtype::Bf16 => 0x3C23,
            Dtype::F16 => 0x211F,
            _ => 0x3C23_D70A,
        };
        let (mut old, mut new) = (Vec::new(), Vec::new());
        for (i, &from) in values.iter().enumerate() {
            for (j, &to) in values.iter().enumerate() {
                if i != j {
                    old.extend(word(from));
                    new.extend(word(to));
                }
                for k in 0..32u64 {
                    let weight = ordinary + (k * 7 + i as u64) % 64;
                    old.extend(word(weight));
                    new.extend(word(if k % 9 == 0 { weight + 1 } else { weight }));
                }
            }
        }
        let elements = (old.len() / bytes) as u64;
        assert!(elements >= 4096, "{dtype}: {elements} elements");
        let base = [tensor("w", dtype, &[elements], old)];
        let target = [tensor("w", dtype, &[elements], new)];
        for encoding in [Encoding::Aurora, Encoding::Leb128] {
            round_trip(&base, &target, encoding);
        }
    }
}

fn arbitrary_tensor_pair() -> impl Strategy<Value = (Dtype, Vec<u64>, Vec<u8>, Vec<u8>)> {
    let dtypes = prop::sample::select(vec![
        Dtype::Bf16,
        Dtype::F16,
        Dtype::F32,
        Dtype::I8,
        Dtype::I64,
    ]);
    (
        dtypes,
        prop::collection::vec(1u64..40, 1..4),
        0u32..=100,
        any::<u64>(),
        any::<bool>(),
    )
        .prop_map(|(dtype, shape, density_percent, seed, specials)| {
            let elements: u64 = shape.iter().product();
            let width = dtype.size_bytes();
            let mut state = seed;
            let mut next = move || {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                state >> 16
            };
            let specials_list = special_bf16();
            let mut base = Vec::with_capacity(elements as usize * width);
            let mut target = Vec::with_capacity(elements as usize * width);
            for _ in 0..elements {
                let mut value = next().to_le_bytes()[..width].to_vec();
                if specials && width == 2 && next() % 3 == 0 {
                    let special = specials_list[next() as usize % specials_list.len()];
                    value = special.to_le_bytes().to_vec();
                }
                let mut changed = value.clone();
                if (next() % 100) < u64::from(density_percent) {
                    // Mostly one step, sometimes anything at all.
                    if next() % 4 == 0 {
                        changed = next().to_le_bytes()[..width].to_vec();
                    } else {
                        changed[0] = changed[0].wrapping_add(if next() % 2 == 0 { 1 } else { 255 });
                    }
                }
                base.extend_from_slice(&value);
                target.extend_from_slice(&changed);
            }
            (dtype, shape, base, target)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn apply_of_diff_is_the_target(
        tensors in prop::collection::vec(arbitrary_tensor_pair(), 1..5),
        encoding in prop::sample::select(vec![Encoding::Aurora, Encoding::Leb128, Encoding::Dense]),
    ) {
        let mut base = Vec::new();
        let mut target = Vec::new();
        for (i, (dtype, shape, b, t)) in tensors.into_iter().enumerate() {
            base.push(tensor(&format!("t{i}"), dtype, &shape, b));
            target.push(tensor(&format!("t{i}"), dtype, &shape, t));
        }
        round_trip(&base, &target, encoding);
    }
}

#[test]
fn a_dense_delta_carries_every_element_even_unchanged_ones() {
    let base = vec![tensor(
        "same",
        Dtype::Bf16,
        &[4],
        vec![1, 2, 3, 4, 5, 6, 7, 8],
    )];
    let bytes = round_trip(&base, &base, Encoding::Dense);
    let delta = DeltaFile::parse(&bytes).unwrap();
    assert_eq!(delta.header().encoding, Encoding::Dense);
    assert_eq!(
        delta.segment_count(),
        1,
        "the unchanged tensor travels whole"
    );
    let sparse = round_trip(&base, &base, Encoding::Aurora);
    assert_eq!(DeltaFile::parse(&sparse).unwrap().segment_count(), 0);
}

#[test]
fn added_removed_renamed_and_reshaped_tensors_are_explicit() {
    let base = vec![
        tensor("keep", Dtype::Bf16, &[4], vec![1, 2, 3, 4, 5, 6, 7, 8]),
        tensor("old_name", Dtype::Bf16, &[2], vec![9, 9, 9, 9]),
        tensor("reshape", Dtype::Bf16, &[2, 2], vec![0; 8]),
        tensor("retype", Dtype::F32, &[2], vec![0; 8]),
    ];
    let target = vec![
        tensor("keep", Dtype::Bf16, &[4], vec![1, 2, 3, 4, 5, 7, 7, 8]),
        tensor("new_name", Dtype::Bf16, &[2], vec![9, 9, 9, 9]),
        tensor("reshape", Dtype::Bf16, &[4], vec![0; 8]),
        tensor("retype", Dtype::Bf16, &[2], vec![1, 2, 3, 4]),
    ];
    let bytes = round_trip(&base, &target, Encoding::Aurora);
    let delta = DeltaFile::parse(&bytes).unwrap();
    let kinds: Vec<String> = delta
        .header()
        .tensors
        .iter()
        .map(|e| format!("{} {}", e.name, serde_json_kind(&e.change)))
        .collect();
    assert_eq!(
        kinds,
        [
            "keep patched",
            "new_name added",
            "old_name removed",
            "reshape replaced",
            "retype replaced"
        ]
    );
    // A layout-changing delta refuses to apply in place, before touching anything.
    let base_image = image(&base);
    let mut buffer = base_image.clone();
    let layout = safetensors_layout(&buffer).unwrap();
    let mut patch = {
        let view = Checkpoint::from_layout(&buffer, &layout).unwrap();
        check_base(delta.header(), &view, None).unwrap();
        decode(&delta, &view).unwrap()
    };
    let error = patch.apply_in_place(&mut buffer, &layout).unwrap_err();
    assert!(matches!(error, DeltaError::Unsupported { .. }), "{error}");
    assert_eq!(buffer, base_image);

    // Materialised as tensors or straight into an image, the target is the same, and
    // the image has the bytes safetensors itself writes for those tensors.
    let view = Checkpoint::from_layout(&buffer, &layout).unwrap();
    let tensors = decode(&delta, &view).unwrap().materialize(&view).unwrap();
    let (written, written_layout) = decode(&delta, &view)
        .unwrap()
        .materialize_image(&view, &Heap)
        .unwrap();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|t| {
            let shape: Vec<usize> = t.shape.iter().map(|&d| d as usize).collect();
            let view =
                safetensors::tensor::TensorView::new(t.dtype.to_safetensors(), shape, &t.data)
                    .unwrap();
            (t.name.clone(), view)
        })
        .collect();
    assert!(
        *written == *safetensors::serialize(views, None).unwrap(),
        "byte for byte"
    );
    assert_eq!(
        Checkpoint::from_layout(&written, &written_layout)
            .unwrap()
            .weights_hash(),
        delta.header().target_hash
    );
    // A base whose patched tensor does not fit the delta is named, not materialised.
    let mut wrong = base.clone();
    wrong[0].shape = vec![2, 2];
    let wrong_image = image(&wrong);
    let wrong_layout = safetensors_layout(&wrong_image).unwrap();
    let wrong_view = Checkpoint::from_layout(&wrong_image, &wrong_layout).unwrap();
    let error = decode(&delta, &view)
        .unwrap()
        .materialize_image(&wrong_view, &Heap)
        .unwrap_err();
    assert!(error.to_string().contains("'keep'"), "{error}");
}

fn serde_json_kind(change: &aurora_delta::TensorChange) -> &'static str {
    match change {
        aurora_delta::TensorChange::Patched(_) => "patched",
        aurora_delta::TensorChange::Added(_) => "added",
        aurora_delta::TensorChange::Removed(_) => "removed",
        aurora_delta::TensorChange::Replaced { .. } => "replaced",
    }
}

/// A minimal safetensors image, written here so this crate's tests need no I/O crate.
fn image(tensors: &[OwnedTensor]) -> Vec<u8> {
    let mut header = String::from("{");
    let mut offset = 0;
    let mut sorted: Vec<&OwnedTensor> = tensors.iter().collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    for (i, t) in sorted.iter().enumerate() {
        if i > 0 {
            header.push(',');
        }
        let shape: Vec<String> = t.shape.iter().map(u64::to_string).collect();
        header.push_str(&format!(
            "\"{}\":{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}",
            t.name,
            t.dtype.name(),
            shape.join(","),
            offset,
            offset + t.data.len()
        ));
        offset += t.data.len();
    }
    header.push('}');
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    for t in sorted {
        out.extend_from_slice(&t.data);
    }
    out
}

#[test]
fn many_training_steps_stay_bit_exact_in_place() {
    let mut synth = aurora_synth_like::Trainer::new(20_000, 5);
    let mut actor = image(&synth.export());
    let layout = safetensors_layout(&actor).unwrap();
    for step in 1..=12u64 {
        let before = synth.export();
        synth.step();
        let after = synth.export();
        let bytes = extract(&before, &after, Encoding::Aurora);
        let delta = DeltaFile::parse(&bytes).unwrap();
        let mut patch = {
            let view = Checkpoint::from_layout(&actor, &layout).unwrap();
            check_base(delta.header(), &view, None).unwrap();
            decode(&delta, &view).unwrap()
        };
        let hash = patch.apply_in_place(&mut actor, &layout).unwrap();
        assert_eq!(
            hash,
            owned_checkpoint(&after).unwrap().weights_hash(),
            "step {step}"
        );
        assert_eq!(actor, image(&after), "step {step}");
    }
}

#[test]
fn a_layout_whose_tensors_overlap_is_refused_before_any_write() {
    let words =
        |seed: u16| -> Vec<u8> { (0..512u16).flat_map(|i| (i ^ seed).to_le_bytes()).collect() };
    let base = vec![
        tensor("a", Dtype::Bf16, &[512], words(0)),
        tensor("b", Dtype::Bf16, &[512], words(0x100)),
    ];
    let mut target = base.clone();
    for t in &mut target {
        for byte in t.data.iter_mut().step_by(14) {
            *byte ^= 1;
        }
    }
    let bytes = extract(&base, &target, Encoding::Aurora);
    let delta = DeltaFile::parse(&bytes).unwrap();
    let original = image(&base);
    let mut buffer = original.clone();
    let mut layout = safetensors_layout(&buffer).unwrap();
    let mut patch = decode(&delta, &Checkpoint::from_layout(&buffer, &layout).unwrap()).unwrap();
    // "b" moved half over "a": each range is in bounds, but they share bytes.
    let index_of =
        |layout: &[TensorLayout], name: &str| layout.iter().position(|l| l.name == name).unwrap();
    let (a, b) = (index_of(&layout, "a"), index_of(&layout, "b"));
    layout[b].bytes = layout[a].bytes.start + 512..layout[a].bytes.end + 512;
    let error = patch.swap_in_place(&mut buffer, &layout).unwrap_err();
    assert!(error.to_string().contains("overlaps"), "{error}");
    assert_eq!(buffer, original);
}

/// A small stand-in for a trainer: F32 master weights drifting by about one BF16 step
/// per hundred elements per step, exported as BF16 (round to nearest even).
mod aurora_synth_like {
    use super::*;

    pub struct Trainer {
        master: Vec<f32>,
        drift: Vec<f32>,
    }

    impl Trainer {
        pub fn new(len: usize, seed: u64) -> Trainer {
            let mut state = seed;
            let mut next = move || {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            };
            let master = (0..len).map(|_| next() * 0.1).collect();
            let drift = (0..len).map(|_| next() * 2e-6).collect();
            Trainer { master, drift }
        }

        pub fn step(&mut self) {
            for (w, d) in self.master.iter_mut().zip(&self.drift) {
                *w += d;
            }
        }

        /// 32 BF16 matrices and one F32 norm-like tensor, so extraction has many chunks.
        pub fn export(&self) -> Vec<OwnedTensor> {
            let bf16 = |values: &[f32]| -> Vec<u8> {
                values
                    .iter()
                    .flat_map(|v| {
                        let bits = v.to_bits();
                        let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16;
                        (rounded as u16).to_le_bytes()
                    })
                    .collect()
            };
            let norm_len = self.master.len() / 64;
            let (matrices, norm) = self.master.split_at(self.master.len() - norm_len);
            let per = matrices.len().div_ceil(32);
            let mut out: Vec<OwnedTensor> = matrices
                .chunks(per)
                .enumerate()
                .map(|(i, part)| {
                    tensor(
                        &format!("layer{i:02}.weight"),
                        Dtype::Bf16,
                        &[part.len() as u64],
                        bf16(part),
                    )
                })
                .collect();
            out.push(tensor(
                "norm",
                Dtype::F32,
                &[norm.len() as u64],
                norm.iter().flat_map(|v| v.to_le_bytes()).collect(),
            ));
            out
        }
    }
}

#[test]
fn extraction_streams_segments_in_order_before_it_finishes() {
    let mut trainer = aurora_synth_like::Trainer::new(400_000, 9);
    let base = trainer.export();
    trainer.step();
    let target = trainer.export();
    let (base_view, target_view) = (
        owned_checkpoint(&base).unwrap(),
        owned_checkpoint(&target).unwrap(),
    );
    let extraction = Extraction::new(
        &base_view,
        &target_view,
        ExtractOptions {
            segment_target_bytes: 1024,
            queue_segments: 1,
            ..ExtractOptions::default()
        },
    )
    .unwrap();
    let mut seen = Vec::new();
    let mut progress_at_first = None;
    let manifest = extraction
        .run(|segment: Segment| {
            progress_at_first.get_or_insert(extraction.input_done());
            seen.push(segment.index);
            Ok::<(), DeltaError>(())
        })
        .unwrap();
    assert!(seen.len() > 2, "{} segments", seen.len());
    assert_eq!(seen, (0..seen.len() as u32).collect::<Vec<_>>());
    assert_eq!(manifest.segments.len(), seen.len());
    // The first segment reached the consumer before all input was encoded.
    assert!(progress_at_first.unwrap() < extraction.input_bytes());

    // A consumer that fails stops extraction and gets its error back.
    let mut calls = 0;
    let error = extraction
        .run(|_| {
            calls += 1;
            Err(DeltaError::Cancelled)
        })
        .unwrap_err();
    assert!(matches!(error, DeltaError::Cancelled));
    assert_eq!(calls, 1);
}

#[test]
fn artifacts_do_not_depend_on_the_thread_count() {
    let mut trainer = aurora_synth_like::Trainer::new(300_000, 4);
    let base = trainer.export();
    trainer.step();
    let target = trainer.export();
    let with_threads = |threads| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(|| extract(&base, &target, Encoding::Aurora))
    };
    assert_eq!(with_threads(1), with_threads(3));
}

#[test]
fn a_wrong_or_damaged_base_is_named() {
    let base = vec![tensor("w", Dtype::Bf16, &[4], vec![1, 0, 2, 0, 3, 0, 4, 0])];
    let target = vec![tensor("w", Dtype::Bf16, &[4], vec![1, 0, 2, 0, 3, 0, 5, 0])];
    let bytes = extract(&base, &target, Encoding::Aurora);
    let delta = DeltaFile::parse(&bytes).unwrap();
    let check = |tensors: Vec<OwnedTensor>, needle: &str| {
        let view = owned_checkpoint(&tensors).unwrap();
        let error = apply(&delta, &view, None).unwrap_err().to_string();
        assert!(error.contains(needle), "{error}");
    };
    check(
        vec![tensor("w", Dtype::Bf16, &[4], vec![9; 8])],
        "wrong base",
    );
    check(
        vec![tensor(
            "w",
            Dtype::Bf16,
            &[2, 2],
            vec![1, 0, 2, 0, 3, 0, 4, 0],
        )],
        "tensor 'w' is BF16 [2, 2]",
    );
    check(
        vec![tensor("v", Dtype::Bf16, &[4], vec![0; 8])],
        "tensor 'w' is missing",
    );
    check(
        vec![
            tensor("w", Dtype::Bf16, &[4], vec![1, 0, 2, 0, 3, 0, 4, 0]),
            tensor("x", Dtype::Bf16, &[1], vec![0; 2]),
        ],
        "tensor 'x' is not in the delta's base",
    );
}

#[test]
fn a_delta_of_hugging_face_names_applies_to_fused_parameters() {
    // One layer with q/k/v and gate/up of different row counts, plus an unfused tensor.
    let mut trainer = aurora_synth_like::Trainer::new(4096, 21);
    let layer = |values: &[OwnedTensor]| -> Vec<OwnedTensor> {
        let bytes: Vec<u8> = values
            .iter()
            .filter(|t| t.dtype == Dtype::Bf16)
            .flat_map(|t| t.data.clone())
            .collect();
        let rows = [
            ("q_proj", 8u64),
            ("k_proj", 4),
            ("v_proj", 4),
            ("o_proj", 8),
        ];
        let mut out = Vec::new();
        let mut at = 0;
        for (name, count) in rows {
            let len = (count * 16 * 2) as usize;
            out.push(tensor(
                &format!("model.layers.0.self_attn.{name}.weight"),
                Dtype::Bf16,
                &[count, 16],
                bytes[at..at + len].to_vec(),
            ));
            at += len;
        }
        for (name, count) in [("gate_proj", 12u64), ("up_proj", 12)] {
            let len = (count * 16 * 2) as usize;
            out.push(tensor(
                &format!("model.layers.0.mlp.{name}.weight"),
                Dtype::Bf16,
                &[count, 16],
                bytes[at..at + len].to_vec(),
            ));
            at += len;
        }
        out
    };
    let base = layer(&trainer.export());
    for _ in 0..40 {
        trainer.step();
    }
    let target = layer(&trainer.export());
    let bytes = extract(&base, &target, Encoding::Aurora);
    let delta = DeltaFile::parse(&bytes).unwrap();
    assert!(delta.header().tensors.len() == 6);

    let fused_base = aurora_delta::fused::fuse(&owned_checkpoint(&base).unwrap()).unwrap();
    let fused_target = aurora_delta::fused::fuse(&owned_checkpoint(&target).unwrap()).unwrap();
    let names: Vec<&str> = fused_base.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "model.layers.0.mlp.gate_up_proj.weight",
            "model.layers.0.self_attn.o_proj.weight",
            "model.layers.0.self_attn.qkv_proj.weight"
        ]
    );
    let mut buffer = image(&fused_base);
    let fused_layout = safetensors_layout(&buffer).unwrap();
    let hf: Vec<_> = delta
        .header()
        .tensors
        .iter()
        .map(|e| (e.name.clone(), e.change.base().unwrap().clone()))
        .collect();
    let layout = aurora_delta::fused::hf_layout_in_fused(&fused_layout, &hf).unwrap();
    let mut patch = {
        let view = Checkpoint::from_layout(&buffer, &layout).unwrap();
        check_base(delta.header(), &view, None).unwrap();
        decode(&delta, &view).unwrap()
    };
    assert!(patch.changed_elements() > 0);
    patch.apply_in_place(&mut buffer, &layout).unwrap();
    assert_eq!(buffer, image(&fused_target));

    // A fused tensor whose size does not match its parts is refused, not misapplied.
    for name in ["qkv_proj", "o_proj"] {
        let mut short = fused_layout.clone();
        let tensor = short.iter_mut().find(|l| l.name.contains(name)).unwrap();
        tensor.bytes.end -= 2;
        assert!(
            aurora_delta::fused::hf_layout_in_fused(&short, &hf).is_err(),
            "{name}"
        );
    }
}

#[test]
fn composed_and_inverted_deltas_are_exact() {
    let mut trainer = aurora_synth_like::Trainer::new(60_000, 8);
    let mut versions = vec![trainer.export()];
    for _ in 0..4 {
        trainer.step();
        versions.push(trainer.export());
    }
    let chain_bytes: Vec<Vec<u8>> = versions
        .windows(2)
        .enumerate()
        .map(|(v, pair)| {
            let (base, target) = (
                owned_checkpoint(&pair[0]).unwrap(),
                owned_checkpoint(&pair[1]).unwrap(),
            );
            let options = ExtractOptions {
                base_version: v as u64,
                target_version: v as u64 + 1,
                ..ExtractOptions::default()
            };
            Extraction::new(&base, &target, options)
                .unwrap()
                .to_bytes()
                .unwrap()
                .1
        })
        .collect();
    let chain: Vec<DeltaFile<'_>> = chain_bytes
        .iter()
        .map(|b| DeltaFile::parse(b).unwrap())
        .collect();
    let first = owned_checkpoint(&versions[0]).unwrap();
    let last = owned_checkpoint(&versions[4]).unwrap();

    let (manifest, composed) =
        aurora_delta::compose(&first, &chain, ExtractOptions::default(), &Heap).unwrap();
    assert_eq!(
        (manifest.header.base_version, manifest.header.target_version),
        (0, 4)
    );
    let composed = DeltaFile::parse(&composed).unwrap();
    let rebuilt = apply(&composed, &first, None).unwrap();
    assert_eq!(
        owned_checkpoint(&rebuilt).unwrap().weights_hash(),
        last.weights_hash()
    );
    // Composition keeps only net changes: never more than the chain's sum.
    let chain_changes: u64 = chain
        .iter()
        .zip(&versions)
        .map(|(d, v)| {
            decode(d, &owned_checkpoint(v).unwrap())
                .unwrap()
                .changed_elements()
        })
        .sum();
    assert!(decode(&composed, &first).unwrap().changed_elements() < chain_changes);

    // Replaying the chain reaches the last version; a caller's word for the base hash
    // is checked against the chain, not trusted.
    let (replayed, layout) =
        aurora_delta::replay(&first, &chain, Some(first.weights_hash()), &Heap)
            .unwrap()
            .expect("a chain of four");
    assert_eq!(
        Checkpoint::from_layout(&replayed, &layout)
            .unwrap()
            .weights_hash(),
        last.weights_hash()
    );
    assert!(
        aurora_delta::replay(&first, &[], None, &Heap)
            .unwrap()
            .is_none()
    );
    let claimed = ExtractOptions {
        base_hash: Some(last.weights_hash()),
        ..ExtractOptions::default()
    };
    let error = aurora_delta::compose(&first, &chain, claimed, &Heap).unwrap_err();
    assert!(
        matches!(error, aurora_delta::DeltaError::WrongBase { .. }),
        "{error}"
    );

    // A gap in the chain is refused and named.
    let gapped = [chain[0].clone(), chain[2].clone()];
    let error =
        aurora_delta::compose(&first, &gapped, ExtractOptions::default(), &Heap).unwrap_err();
    assert!(error.to_string().contains("chain is broken"), "{error}");

    let (inverse_manifest, inverse) =
        aurora_delta::invert(&chain[0], &first, ExtractOptions::default(), &Heap).unwrap();
    assert_eq!(
        (
            inverse_manifest.header.base_hash,
            inverse_manifest.header.target_hash
        ),
        (chain[0].header().target_hash, chain[0].header().base_hash)
    );
    let inverse = DeltaFile::parse(&inverse).unwrap();
    let second = owned_checkpoint(&versions[1]).unwrap();
    let back = apply(&inverse, &second, None).unwrap();
    let mut expected = versions[0].clone();
    expected.sort_by(|a, b| a.name.cmp(&b.name));
    assert_eq!(back, expected);
}
