//! Hostile artifacts that parse (their hashes are valid) but describe impossible
//! contents: every reader must refuse them with an error, never panic. The first cases
//! were found by the `delta_decode` fuzz target (fuzz/README.md).

use aurora_delta::{
    DeltaFile, DeltaHeader, Dtype, Encoding, Hash, TensorChange, TensorEntry, TensorSpec, assemble,
};

/// A delta whose header is valid but describes `tensors`, with `segments` as given.
fn artifact(tensors: &[(&str, Dtype, &[u64])], segments: &[Vec<u8>]) -> Vec<u8> {
    let header = DeltaHeader {
        base_version: 0,
        target_version: 1,
        base_hash: Hash([0; 32]),
        target_hash: Hash([0; 32]),
        encoding: Encoding::Leb128,
        tensors: tensors
            .iter()
            .map(|(name, dtype, shape)| TensorEntry {
                name: name.to_string(),
                change: TensorChange::Patched(TensorSpec {
                    dtype: *dtype,
                    shape: shape.to_vec(),
                }),
            })
            .collect(),
    };
    assemble(&header, segments).1
}

/// A chunk record (docs/delta-format.md §5).
fn chunk(tensor: u32, start: u64, len: u64, encoding: u8, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&tensor.to_le_bytes());
    out.extend_from_slice(&start.to_le_bytes());
    out.extend_from_slice(&len.to_le_bytes());
    out.push(encoding);
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(payload);
    out
}

/// `delta_stats` (behind `aurora delta inspect`) must report an error or numbers for any
/// artifact that parses, never panic.
/// `delta inspect` on hostile input: an error naming the problem, never a panic.
fn stats_reject(bytes: &[u8], needle: &str) {
    let delta = DeltaFile::parse(bytes).expect("the artifact parses");
    let error = aurora_delta::stats::delta_stats(&delta, bytes.len() as u64)
        .expect_err("hostile sizes are refused")
        .to_string();
    assert!(error.contains(needle), "{error}");
}

#[test]
fn stats_survive_tensor_sizes_that_sum_past_u64() {
    // Found by delta_decode: each tensor's size fits in u64 (as §4.3 requires), their sum
    // does not, and delta_stats adds them unchecked (stats.rs, `elements +=` and
    // `target_weights_bytes +=`).
    let bytes = artifact(
        &[("a", Dtype::U8, &[1 << 63]), ("b", Dtype::U8, &[1 << 63])],
        &[],
    );
    stats_reject(&bytes, "overflow 64 bits");
}

#[test]
fn stats_survive_leb128_change_counts_beyond_the_chunk() {
    // A leb128 payload states its change count; stats trust it without bounding it by
    // the chunk length, and sum two of them unchecked (ByteBreakdown::add).
    let count = [0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01]; // 2^63
    let segment = [chunk(0, 0, 1, 1, &count), chunk(0, 1, 1, 1, &count)].concat();
    let bytes = artifact(&[("a", Dtype::Bf16, &[2])], &[segment]);
    stats_reject(&bytes, "changes claimed");
}

#[test]
fn stats_survive_chunk_lengths_beyond_the_limit() {
    // Found by delta_decode: stats count every element of a dense chunk as changed
    // without bounding its length (§4.3 allows 2^24; decode checks it), then sum them
    // unchecked (ByteBreakdown::add).
    let segment = [
        chunk(0, 0, 1 << 63, 0, &[0x3F; 2]),
        chunk(0, 1 << 63, 1 << 63, 0, &[0x3F; 2]),
    ]
    .concat();
    let bytes = artifact(&[("a", Dtype::Bf16, &[2])], &[segment]);
    stats_reject(&bytes, "chunk length");
}

#[test]
fn extraction_refuses_what_a_reader_would_refuse() {
    let data = [0u8; 2];
    let long_name = "x".repeat(aurora_delta::MAX_NAME_BYTES + 1);
    let deep = [1u64; 9];
    for (name, shape) in [(long_name.as_str(), &[1u64][..]), ("deep", &deep[..])] {
        let view = aurora_delta::TensorView {
            name: name.to_string(),
            dtype: Dtype::Bf16,
            shape: shape.to_vec(),
            data: &data,
        };
        let checkpoint = aurora_delta::Checkpoint::new(vec![view]).unwrap();
        let error = aurora_delta::Extraction::new(
            &checkpoint,
            &checkpoint,
            aurora_delta::ExtractOptions::default(),
        )
        .err()
        .expect("refused");
        assert!(error.to_string().contains("limited to"), "{error}");
    }
}
