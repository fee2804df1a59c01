//! Tests that span the submodules: round trips through the encoder and the decoder
//! (dispatched and portable variants agreeing), hostile payloads, and the class search
//! against what the scan then finds.

use super::changes::{WINDOW_BLOCKS, find_changes};
use super::classes::choose_classes;
use super::decoder::decode_body;
use super::encoder::encode_body;
use super::locate::locate_body;
use super::*;
use crate::codec::entropy::{golomb_len, golomb_parameter};
use crate::codec::scan::with_threshold_count;
use crate::dtype::FloatLayout;
use proptest::prelude::*;

const BF16: FloatLayout = FloatLayout {
    exponent_mask: 0x7F80,
    exponent_shift: 7,
};

/// Exact Golomb cost of a class's gaps, for tests that check the cost model.
fn gap_bits(ranks: &[u64], m: u64) -> u64 {
    let mut previous: Option<u64> = None;
    ranks
        .iter()
        .map(|&r| {
            let gap = previous.map_or(r, |p| r - p - 1);
            previous = Some(r);
            golomb_len(gap, m)
        })
        .sum()
}

/// Base values spread over exponents like a real layer; changes are far more likely
/// for small magnitudes, and are mostly one step.
fn realistic(len: usize, seed: u64) -> (Vec<u8>, Vec<u8>, Vec<u32>) {
    let mut state = seed;
    let mut next = || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) as u32
    };
    let mut base = Vec::with_capacity(2 * len);
    let mut target = Vec::with_capacity(2 * len);
    let mut positions = Vec::new();
    for i in 0..len {
        let exponent = 110 + next() % 14;
        let word = ((next() & 1) << 15) as u16 | (exponent << 7) as u16 | (next() & 0x7F) as u16;
        let chance = 1u32 << (123 - exponent).min(12);
        let new = if next() % 4096 < chance {
            positions.push(i as u32);
            let up = next() % 2 == 0;
            let size = if next() % 10 == 0 { 2 } else { 1 };
            if up {
                word.wrapping_add(size)
            } else {
                word.wrapping_sub(size)
            }
        } else {
            word
        };
        base.extend_from_slice(&word.to_le_bytes());
        target.extend_from_slice(&new.to_le_bytes());
    }
    (base, target, positions)
}

fn round_trip(base: &[u8], target: &[u8], positions: &[u32]) -> usize {
    let mut payload = Vec::new();
    assert_eq!(
        encode::<u16>(base, target, BF16, &mut payload).is_some(),
        !positions.is_empty()
    );
    if positions.is_empty() {
        assert!(payload.is_empty());
        return 0;
    }
    let (decoded, values) = decode::<u16>(&payload, base, BF16).unwrap();
    assert_eq!(decoded, positions);
    // The portable variants, which this machine may not dispatch to, agree.
    let mut portable = Vec::new();
    encode_body::<u16, false>(base, target, BF16, &mut portable);
    assert_eq!(portable, payload, "portable encoder");
    let portable =
        decode_body::<u16>(&payload, base, BF16, locate_body::<u16, false, false>).unwrap();
    assert_eq!(
        portable,
        (decoded.clone(), values.clone()),
        "portable decoder"
    );
    for (i, &p) in decoded.iter().enumerate() {
        assert_eq!(
            values[2 * i..2 * i + 2],
            target[2 * p as usize..2 * p as usize + 2]
        );
    }
    payload.len()
}

#[test]
fn context_classes_beat_a_single_class_on_realistic_data() {
    let (base, target, positions) = realistic(1 << 18, 7);
    let bytes = round_trip(&base, &target, &positions);
    let (classes, _) = choose_classes::<u16, false>(&base, &target, base.len() / 2, BF16);
    assert!(
        classes.count() > 1,
        "expected several classes, got {classes:?}"
    );
    let ranks: Vec<u64> = positions.iter().map(|&p| u64::from(p)).collect();
    let single_class_gap_bytes = gap_bits(
        &ranks,
        golomb_parameter(ranks.len() as u64, (base.len() / 2) as u64),
    ) / 8;
    assert!(
        (bytes as u64) < single_class_gap_bytes,
        "{bytes} bytes with classes, {single_class_gap_bytes} for positions alone without"
    );
}

#[test]
fn class_search_predicts_the_changes_of_each_class() {
    let (base, dense_target, _) = realistic(1 << 21, 5);
    // The same chunk with about one change in 64 kept (about 0.3% of elements): too
    // few for the search's first pass, so it samples more.
    let mut sparse_target = base.clone();
    for (i, (old, new)) in base.chunks(2).zip(dense_target.chunks(2)).enumerate() {
        if old != new && (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 58 == 0 {
            sparse_target[2 * i..2 * i + 2].copy_from_slice(new);
        }
    }
    for target in [dense_target, sparse_target] {
        let len = base.len() / 2;
        let (classes, expected) = choose_classes::<u16, false>(&base, &target, len, BF16);
        let found = with_threshold_count!(classes.thresholds.len(), T => {
            find_changes::<u16, T, false>(&base, &target, len, &classes, &expected)
        });
        let total: usize = found.iter().map(Vec::len).sum();
        for (class, changes) in found.iter().enumerate() {
            let (actual, predicted) = (changes.len() as f64, expected[class] as f64);
            assert!(
                actual < 0.05 * total as f64 || (predicted / actual - 1.0).abs() < 0.3,
                "class {class} of thresholds {:?}: {predicted} changes predicted, {actual} found",
                classes.thresholds
            );
        }
    }
}

#[test]
fn round_trips_a_chunk_of_several_scan_windows() {
    // Two whole windows, a partial one, and a last block shorter than 64 elements.
    let len = (2 * WINDOW_BLOCKS + 100) * 64 + 37;
    let (base, target, positions) = realistic(len, 11);
    let window_elements = (WINDOW_BLOCKS * 64) as u32;
    assert!(positions.iter().any(|&p| p < window_elements));
    assert!(positions.iter().any(|&p| p >= 2 * window_elements));
    round_trip(&base, &target, &positions);
}

#[test]
fn hostile_payloads_are_rejected_not_panicked_on() {
    let (base, target, _) = realistic(8192, 3);
    let mut payload = Vec::new();
    assert!(encode::<u16>(&base, &target, BF16, &mut payload).is_some());
    for cut in 0..payload.len() {
        let _ = decode::<u16>(&payload[..cut], &base, BF16);
    }
    for i in 0..payload.len() {
        for flip in [1u8, 0x80] {
            let mut corrupt = payload.clone();
            corrupt[i] ^= flip;
            if let Ok((decoded, _)) = decode::<u16>(&corrupt, &base, BF16) {
                assert!(decoded.windows(2).all(|w| w[0] < w[1]));
                assert!(decoded.iter().all(|&p| (p as usize) < base.len() / 2));
            }
        }
    }
    assert!(decode::<u16>(&[0], &base, BF16).is_err());
    // Found by fuzzing: a chunk whose classes all declare zero changes.
    let empty = decode::<u16>(&[2, 120, 0, 0, 0], &base, BF16).unwrap_err();
    assert!(empty.to_string().contains("no changes"), "{empty}");
    assert!(decode::<u16>(&[9], &base, BF16).is_err());
}

proptest! {
    #[test]
    fn round_trips_any_changes(
        words in proptest::collection::vec(any::<u16>(), 1..3000),
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u16>()), 0..400),
    ) {
        let base: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        let mut target = base.clone();
        for (at, value) in &edits {
            let i = at.index(words.len());
            target[2 * i..2 * i + 2].copy_from_slice(&value.to_le_bytes());
        }
        let mut positions = Vec::new();
        super::super::scan::for_each_changed(&base, &target, 2, |i| positions.push(i as u32));
        round_trip(&base, &target, &positions);
    }

    #[test]
    fn round_trips_f32_steps(
        words in proptest::collection::vec(any::<u32>(), 1..500),
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u32>()), 0..100),
    ) {
        let layout = FloatLayout { exponent_mask: 0x7F80_0000, exponent_shift: 23 };
        let base: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        let mut target = base.clone();
        for (at, value) in &edits {
            let i = at.index(words.len());
            target[4 * i..4 * i + 4].copy_from_slice(&value.to_le_bytes());
        }
        let mut positions = Vec::new();
        super::super::scan::for_each_changed(&base, &target, 4, |i| positions.push(i as u32));
        let mut payload = Vec::new();
        prop_assert_eq!(encode::<u32>(&base, &target, layout, &mut payload).is_some(), !positions.is_empty());
        prop_assume!(!positions.is_empty());
        let (decoded, values) = decode::<u32>(&payload, &base, layout).unwrap();
        prop_assert_eq!(&decoded, &positions);
        for (i, &p) in decoded.iter().enumerate() {
            prop_assert_eq!(&values[4 * i..4 * i + 4], &target[4 * p as usize..4 * p as usize + 4]);
        }
    }
}
