use proptest::prelude::*;

use super::*;
use crate::apply::{OwnedTensor, apply, owned_checkpoint};
use crate::dtype::Dtype;
use crate::format::{DeltaFile, assemble};

/// A deterministic generator (xorshift), so failures reproduce.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// A checkpoint of tensors from a few bytes (less than a BLAKE3 chunk) to several
/// hundred KiB (subtrees of many chunks), and the next version with about 2% of the
/// elements nudged.
fn versions(seed: u64) -> (Vec<OwnedTensor>, Vec<OwnedTensor>) {
    let mut rng = Rng(seed);
    let shapes: [(&str, Dtype, &[u64]); 6] = [
        ("model.embed_tokens.weight", Dtype::Bf16, &[1000, 96]),
        ("model.layers.0.input_layernorm.weight", Dtype::Bf16, &[96]),
        (
            "model.layers.0.mlp.down_proj.weight",
            Dtype::Bf16,
            &[96, 517],
        ),
        ("model.layers.0.self_attn.q_proj.bias", Dtype::F32, &[7]),
        ("model.norm.weight", Dtype::F32, &[96]),
        ("lm_head.weight", Dtype::Bf16, &[3001, 33]),
    ];
    let mut base = Vec::new();
    let mut target = Vec::new();
    for (name, dtype, shape) in shapes {
        let count: u64 = shape.iter().product();
        let size = dtype.size_bytes();
        let data: Vec<u8> = (0..count as usize * size)
            .map(|_| rng.next() as u8)
            .collect();
        let mut next = data.clone();
        for element in 0..count as usize {
            if rng.next().is_multiple_of(50) {
                // The low byte: a nudge of the last mantissa bits.
                next[element * size] = next[element * size].wrapping_add(1);
            }
        }
        let tensor = |data| OwnedTensor {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            data,
        };
        base.push(tensor(data));
        target.push(tensor(next));
    }
    (base, target)
}

fn table(tensors: &[OwnedTensor]) -> ShardTable {
    table_encoded(tensors, Encoding::Aurora)
}

fn table_encoded(tensors: &[OwnedTensor], encoding: Encoding) -> ShardTable {
    ShardTable::new(
        tensors
            .iter()
            .map(|t| {
                (
                    t.name.clone(),
                    TensorSpec {
                        dtype: t.dtype,
                        shape: t.shape.clone(),
                    },
                )
            })
            .collect(),
        encoding,
    )
    .unwrap()
}

/// The pieces rank `rank` of `ranks` holds as FSDP2 shards them.
fn fsdp_pieces<'a>(
    base: &'a [OwnedTensor],
    target: &'a [OwnedTensor],
    rank: u64,
    ranks: u64,
) -> Vec<ShardPiece<'a>> {
    base.iter()
        .zip(target)
        .filter_map(|(b, t)| {
            ShardPiece::dim0_shard(&t.name, &t.shape, &b.data, &t.data, rank, ranks)
        })
        .collect()
}

fn parts(base: &[OwnedTensor], target: &[OwnedTensor], ranks: u64) -> Vec<Vec<u8>> {
    let table = table(target);
    (0..ranks)
        .map(|rank| {
            table
                .extract(&fsdp_pieces(base, target, rank, ranks))
                .unwrap()
        })
        .collect()
}

/// The assembly's segments, and the artifact they make with the base's hash in its
/// header (the node names the base as published).
fn artifact(assembly: &ShardAssembly, base_hash: Hash) -> (Vec<Vec<u8>>, DeltaHeader, Vec<u8>) {
    let mut segments = Vec::new();
    let manifest = assembly
        .run(|segment: Segment| {
            segments.push(segment.bytes);
            Ok::<(), DeltaError>(())
        })
        .unwrap();
    let header = DeltaHeader {
        base_hash,
        ..manifest.header
    };
    let (_, bytes) = assemble(&header, &segments);
    (segments, header, bytes)
}

/// `target`, as applying `bytes` to `base` must give it (in name order).
fn assert_applies(bytes: &[u8], base: &[OwnedTensor], target: &[OwnedTensor]) {
    let applied = apply(
        &DeltaFile::parse(bytes).unwrap(),
        &owned_checkpoint(base).unwrap(),
        None,
    );
    let mut expected = target.to_vec();
    expected.sort_by(|a, b| a.name.cmp(&b.name));
    assert_eq!(applied.unwrap(), expected);
}

fn assembled(table: &ShardTable, parts: &[Vec<u8>]) -> Result<ShardAssembly> {
    table.assemble(
        4,
        Hash::ZERO,
        &parts.iter().map(Vec::as_slice).collect::<Vec<_>>(),
    )
}

#[test]
fn shards_assemble_into_the_gathered_delta_on_any_number_of_ranks() {
    let (base, target) = versions(7);
    let table = table(&target);
    let base_hash = owned_checkpoint(&base).unwrap().weights_hash();
    let target_hash = owned_checkpoint(&target).unwrap().weights_hash();
    for ranks in [1, 2, 3, 4, 8] {
        let assembly = assembled(&table, &parts(&base, &target, ranks)).unwrap();
        assert_eq!(assembly.parts_base_hash(), base_hash, "{ranks} ranks");
        assert_eq!(assembly.target_hash(), target_hash, "{ranks} ranks");
        let (_, header, bytes) = artifact(&assembly, base_hash);
        assert_eq!((header.base_version, header.target_version), (4, 5));
        assert_applies(&bytes, &base, &target);
    }
}

#[test]
fn a_rank_whose_shards_are_missing_or_given_twice_is_named() {
    let (base, target) = versions(8);
    let table = table(&target);
    let mut all = parts(&base, &target, 4);
    let missing = assembled(&table, &all[..3]).unwrap_err();
    assert!(
        matches!(&missing, DeltaError::ShardCoverage(m) if m.contains("no shard holds")),
        "{missing}"
    );
    all.push(all[1].clone());
    let twice = assembled(&table, &all).unwrap_err();
    assert!(
        matches!(&twice, DeltaError::ShardCoverage(m) if m.contains("overlap") || m.contains("two shards hold")),
        "{twice}"
    );
}

#[test]
fn a_part_of_another_table_or_damaged_is_refused_without_a_panic() {
    let (base, target) = versions(9);
    let all = parts(&base, &target, 2);
    let mut other = target.clone();
    other[0].shape = vec![500, 192];
    let foreign = assembled(&table(&other), &all).unwrap_err();
    assert!(
        matches!(&foreign, DeltaError::ShardPart { part: 0, reason } if reason.contains("another tensor table")),
        "{foreign}"
    );
    let table = table(&target);
    for cut in [0, 7, 10, 50, all[0].len() / 2, all[0].len() - 1] {
        let damaged = vec![all[0][..cut].to_vec(), all[1].clone()];
        assert!(
            matches!(
                assembled(&table, &damaged),
                Err(DeltaError::ShardPart { part: 0, .. })
            ),
            "cut at {cut}"
        );
    }
    let mut trailing = all.clone();
    trailing[1].push(0);
    assert!(matches!(
        assembled(&table, &trailing),
        Err(DeltaError::ShardPart { part: 1, .. })
    ));
}

#[test]
fn pieces_outside_their_tensor_or_overlapping_are_refused() {
    let (base, target) = versions(10);
    let table = table(&target);
    let norm = &target[4];
    let piece = |first, len: usize| ShardPiece {
        name: &norm.name,
        first,
        base: &base[4].data[..len],
        target: &norm.data[..len],
    };
    assert!(matches!(
        table.extract(&[piece(90, 40)]),
        Err(DeltaError::Checkpoint(_))
    ));
    assert!(matches!(
        table.extract(&[piece(0, 6)]),
        Err(DeltaError::Checkpoint(_))
    ));
    let overlapping = table.extract(&[piece(0, 40), piece(5, 40)]).unwrap_err();
    assert!(overlapping.to_string().contains("overlap"), "{overlapping}");
    let unknown = ShardPiece {
        name: "model.unknown",
        ..piece(0, 4)
    };
    assert!(matches!(
        table.extract(&[unknown]),
        Err(DeltaError::Checkpoint(_))
    ));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Any cut of a checkpoint's tensors into ranges, hashed by any number of holders,
    /// composes into §2's hash.
    #[test]
    fn hash_shares_of_any_cut_compose_into_the_weights_hash(
        seed in 1u64..u64::MAX,
        cuts in proptest::collection::vec(0.0f64..1.0, 0..12),
        holders in 1usize..5,
    ) {
        let (_, target) = versions(seed);
        let table = table(&target);
        let checkpoint = owned_checkpoint(&target).unwrap();
        let mut shares = vec![HashShare::default(); holders];
        for (index, tensor) in table.header.tensors.iter().enumerate() {
            let data = checkpoint.get(&tensor.name).unwrap().data;
            let mut points: Vec<usize> = cuts.iter().map(|c| (c * data.len() as f64) as usize).collect();
            points.extend([0, data.len()]);
            points.sort_unstable();
            points.dedup();
            let (at, _) = table.layout.data_range(index);
            for (n, range) in points.windows(2).enumerate() {
                let share = HashShare::of_range(at + range[0] as u64, &data[range[0]..range[1]]);
                shares[(n + index) % holders].merge(share);
            }
        }
        let composed = table.layout.compose(&shares.iter().collect::<Vec<_>>()).unwrap();
        prop_assert_eq!(composed, checkpoint.weights_hash());
    }
}

#[test]
fn a_checkpoint_smaller_than_a_chunk_composes_too() {
    let tiny = vec![OwnedTensor {
        name: "w".into(),
        dtype: Dtype::F32,
        shape: vec![3],
        data: vec![1; 12],
    }];
    let table = table(&tiny);
    let (at, _) = table.layout.data_range(0);
    let share = HashShare::of_range(at, &tiny[0].data);
    assert_eq!(
        table.layout.compose(&[&share]).unwrap(),
        owned_checkpoint(&tiny).unwrap().weights_hash()
    );
}

#[test]
fn a_dense_delta_from_shards_carries_every_element() {
    let (base, target) = versions(11);
    let table = table_encoded(&target, Encoding::Dense);
    let parts: Vec<Vec<u8>> = (0..3)
        .map(|rank| {
            table
                .extract(&fsdp_pieces(&base, &target, rank, 3))
                .unwrap()
        })
        .collect();
    let assembly = assembled(&table, &parts).unwrap();
    let base_hash = owned_checkpoint(&base).unwrap().weights_hash();
    let (segments, _, bytes) = artifact(&assembly, base_hash);
    let elements: u64 = target.iter().map(|t| t.shape.iter().product::<u64>()).sum();
    let mut covered = 0;
    for segment in &segments {
        let mut reader = ByteReader::new(segment);
        while !reader.is_empty() {
            let record = ChunkRecord::read(&mut reader).unwrap();
            assert_eq!(record.encoding, crate::codec::ChunkEncoding::Dense);
            covered += record.len;
        }
    }
    assert_eq!(covered, elements, "every element, changed or not");
    assert_applies(&bytes, &base, &target);
}

#[test]
fn a_share_from_offset_zero_takes_the_largest_aligned_subtrees() {
    for len in [1, 1023, 1024, 4094, 5000, 70_000] {
        let data = vec![7u8; len];
        let share = HashShare::of_range(0, &data);
        let mut at = 0;
        for (offset, size, _) in &share.subtrees {
            assert_eq!(*offset, at);
            assert!(size.is_power_of_two() && offset % size == 0);
            at += size;
        }
        let tail: u64 = share
            .edges
            .iter()
            .map(|(_, bytes)| bytes.len() as u64)
            .sum();
        assert_eq!(at + tail, len as u64, "{len} bytes");
    }
}
