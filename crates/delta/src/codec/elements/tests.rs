use super::{ElementLayout, ElementTarget, ElementWrite, Runs, TASK_INDICES, swap_elements};
use crate::DeltaError;
use proptest::prelude::*;

/// A batch of one write over the whole target.
fn swap_one(
    target: &mut [u8],
    element_bytes: usize,
    indices: &[u64],
    values: &mut [u8],
    layout: ElementLayout,
) -> crate::Result<()> {
    let elements = (target.len() / element_bytes.max(1)) as u64;
    swap_elements(vec![ElementTarget {
        label: "target",
        memory: target,
        element_bytes,
        layout,
        writes: vec![ElementWrite {
            label: "tensor",
            indices,
            within: 0..elements,
            shift: 0,
            values,
        }],
    }])
}

/// Where each element of a row-major `rows` x `columns` matrix goes when packed in
/// row blocks of `block`, `group` columns at a time, computed the way the packing
/// kernel copies it (an oracle independent of `ElementLayout::positions`).
fn packed_positions(rows: usize, columns: usize, block: usize, group: usize) -> Vec<usize> {
    let mut positions = vec![0; rows * columns];
    let mut next = 0;
    for start in (0..rows).step_by(block) {
        let height = block.min(rows - start);
        for first in (0..columns).step_by(group) {
            for row in start..start + height {
                for d in 0..group {
                    positions[row * columns + first + d] = next;
                    next += 1;
                }
            }
        }
    }
    positions
}

proptest! {
    /// Writes land exactly where asked (as index_copy_ would, through the layout's
    /// packing), the values come back as the replaced ones, and the same call again
    /// restores the target: for every element width, row-major and packed, and for
    /// writes large enough to be split into tasks.
    #[test]
    fn a_swap_writes_exactly_the_indices_and_a_second_one_undoes_it(
        element_bytes in prop::sample::select(vec![1usize, 2, 4, 8]),
        rows in 1usize..600,
        half_columns in 1usize..250,
        packing in prop::sample::select(vec![None, Some(1usize), Some(2), Some(16), Some(32)]),
        group in 1usize..=2,
        density in 0.0f64..1.0,
        seed in any::<u64>(),
    ) {
        let columns = half_columns * 2;
        let elements = rows * columns;
        let (layout, positions) = match packing {
            None => (ElementLayout::RowMajor, (0..elements).collect()),
            Some(block) => (
                ElementLayout::RowBlocks {
                    rows: rows as u64,
                    columns: columns as u64,
                    block: block as u64,
                    group: group as u64,
                },
                packed_positions(rows, columns, block, group),
            ),
        };
        let mut state = seed | 1;
        let mut next = move || { state ^= state << 13; state ^= state >> 7; state ^= state << 17; state };
        let original: Vec<u8> = (0..elements * element_bytes).map(|_| next() as u8).collect();
        let threshold = (density * u64::MAX as f64) as u64;
        let indices: Vec<u64> = (0..elements as u64).filter(|_| next() <= threshold).collect();
        let new: Vec<u8> = (0..indices.len() * element_bytes).map(|_| next() as u8).collect();
        let mut target = original.clone();
        let mut values = new.clone();
        swap_one(&mut target, element_bytes, &indices, &mut values, layout).unwrap();
        let mut expected = original.clone();
        for (i, &index) in indices.iter().enumerate() {
            let (at, from) = (positions[index as usize] * element_bytes, i * element_bytes);
            expected[at..at + element_bytes].copy_from_slice(&new[from..from + element_bytes]);
            prop_assert_eq!(&values[from..from + element_bytes], &original[at..at + element_bytes]);
        }
        prop_assert!(target == expected);
        swap_one(&mut target, element_bytes, &indices, &mut values, layout).unwrap();
        prop_assert!(target == original);
        prop_assert!(values == new);
    }
}

proptest! {
    /// A matrix split by columns into `ranks` blocks (a row-parallel layer's shards),
    /// each written from every changed element of the matrix cut into its rows' runs,
    /// into one target that holds the matrix `lead` elements in and its rows `pad`
    /// elements apart: the blocks' runs interleave there, and each element lands where
    /// the layout puts it, nothing else written; the same cuts swapped again restore it.
    /// A split by rows (one run each) does the same.
    #[test]
    fn the_runs_of_every_block_take_exactly_their_elements(
        rows in 1u64..300,
        block_columns in 1u64..40,
        ranks in 1u64..4,
        by_columns in any::<bool>(),
        lead in 0u64..50,
        pad in 0u64..5,
        density in 0.0f64..1.0,
        seed in any::<u64>(),
    ) {
        let (columns, elements) = (block_columns * ranks, rows * block_columns * ranks);
        let pad = if by_columns { pad } else { 0 };
        let position = |index: u64| (lead + index / columns * (columns + pad) + index % columns) as usize;
        let mut state = seed | 1;
        let mut next = move || { state ^= state << 13; state ^= state >> 7; state ^= state << 17; state };
        let threshold = (density * u64::MAX as f64) as u64;
        let indices: Vec<u64> = (0..elements).filter(|_| next() <= threshold).collect();
        let new: Vec<u8> = (0..indices.len() * 2).map(|_| next() as u8).collect();
        let original: Vec<u8> = (0..(lead + rows * (columns + pad) + 7) * 2).map(|_| next() as u8).collect();
        let mut expected = original.clone();
        for (i, &index) in indices.iter().enumerate() {
            expected[position(index) * 2..][..2].copy_from_slice(&new[i * 2..][..2]);
        }
        let block_elements = elements / ranks;
        let mut target = original.clone();
        let mut keeps: Vec<Vec<u8>> = (0..ranks).map(|_| new.clone()).collect();
        let cut_swap = |target: &mut [u8], keeps: &mut [Vec<u8>]| {
            let mut writes = Vec::new();
            for (rank, keep) in (0..ranks).zip(keeps.iter_mut()) {
                let (within, runs) = match by_columns {
                    true => (
                        rank * block_columns..(rank + 1) * block_columns,
                        Runs { count: rows, source_stride: columns, target_stride: columns + pad },
                    ),
                    false => (
                        rank * block_elements..(rank + 1) * block_elements,
                        Runs { count: 1, source_stride: 0, target_stride: 0 },
                    ),
                };
                let write = ElementWrite { label: "matrix", indices: &indices, within, shift: lead as i64, values: keep };
                writes.extend(write.cut(runs, elements, 2).unwrap());
            }
            swap_elements(vec![ElementTarget {
                label: "parameter",
                memory: target,
                element_bytes: 2,
                layout: ElementLayout::RowMajor,
                writes,
            }])
            .unwrap();
        };
        cut_swap(&mut target, &mut keeps);
        prop_assert!(target == expected);
        cut_swap(&mut target, &mut keeps);
        prop_assert!(target == original);
    }
}

#[test]
fn a_cut_refuses_indices_it_could_not_place_by_name() {
    let runs = Runs {
        count: 3,
        source_stride: 4,
        target_stride: 2,
    };
    // Out of order across the boundary of two of the check's chunks.
    let mut long: Vec<u64> = (0..TASK_INDICES as u64 + 10).collect();
    long.swap(TASK_INDICES - 1, TASK_INDICES);
    let long_order = format!(
        "indices not strictly ascending at position {TASK_INDICES} ({} then {})",
        TASK_INDICES,
        TASK_INDICES - 1
    );
    let huge = Runs {
        count: u64::MAX,
        source_stride: 2,
        target_stride: 2,
    };
    let cases: [(&[u64], Runs, u64, &str); 8] = [
        (
            &[1, 6, 6],
            runs,
            12,
            "indices not strictly ascending at position 2 (6 then 6)",
        ),
        (&long, Runs { count: 1, ..runs }, 1 << 20, &long_order),
        (&[1, 12], runs, 12, "index 12 is beyond its 12 elements"),
        (
            &[1],
            Runs {
                source_stride: 1,
                ..runs
            },
            12,
            "3 runs of elements 0..2, 1 apart in the tensor and 2 in the target, are not disjoint",
        ),
        (
            &[1],
            Runs {
                target_stride: 1,
                ..runs
            },
            12,
            "1 in the target, are not disjoint",
        ),
        (
            &[1],
            runs,
            9,
            "3 runs of elements 0..2, 4 apart in the tensor and 2 in the target, are not disjoint blocks of its 9",
        ),
        (&[1], huge, u64::MAX, "are not disjoint blocks"),
        (&[1, 2], runs, 12, "3 bytes of values for 2 elements"),
    ];
    for (indices, runs, elements, expected) in cases {
        let mut values = vec![0u8; indices.len() * 2 - usize::from(expected.contains("3 bytes"))];
        let write = ElementWrite {
            label: "o_proj",
            indices,
            within: 0..2,
            shift: 0,
            values: &mut values,
        };
        let refusal = write.cut(runs, elements, 2).unwrap_err().to_string();
        assert!(
            refusal.contains("o_proj: ") && refusal.contains(expected),
            "{refusal}"
        );
    }
}

#[test]
fn writes_that_do_not_fit_are_refused_by_name_and_nothing_is_written() {
    let original: Vec<u8> = (0..64).collect();
    let packed = ElementLayout::RowBlocks {
        rows: 4,
        columns: 9,
        block: 2,
        group: 2,
    };
    let cases: [(&[u64], usize, usize, ElementLayout, &str); 6] = [
        (
            &[1, 5, 5],
            2,
            6,
            ElementLayout::RowMajor,
            "not strictly ascending at position 2 (5 then 5)",
        ),
        (
            &[7, 3],
            2,
            4,
            ElementLayout::RowMajor,
            "not strictly ascending at position 1 (7 then 3)",
        ),
        (
            &[3, 32],
            2,
            4,
            ElementLayout::RowMajor,
            "index 32 is outside elements 0..32, the part of it this target holds",
        ),
        (
            &[3, 4],
            2,
            3,
            ElementLayout::RowMajor,
            "3 bytes of values for 2 elements of 2 bytes",
        ),
        (
            &[3],
            3,
            3,
            ElementLayout::RowMajor,
            "a target of 64 bytes is not made of 3-byte elements",
        ),
        (
            &[3],
            2,
            2,
            packed,
            "a 4 x 9 matrix in row blocks of 2, 2 columns at a time, is not a target of 32 elements",
        ),
    ];
    for (indices, element_bytes, value_bytes, layout, reason) in cases {
        let mut target = original.clone();
        let mut values = vec![0xFF; value_bytes];
        let error = swap_one(&mut target, element_bytes, indices, &mut values, layout).unwrap_err();
        assert!(matches!(&error, DeltaError::ElementWrites(_)), "{error}");
        // A refusal names the write, or the target where the target itself is wrong.
        assert!(
            error.to_string().contains(": tensor into target: ")
                || error.to_string().contains(": target: "),
            "{error}"
        );
        assert!(error.to_string().contains(reason), "{error}");
        assert_eq!(target, original, "{reason}");
    }
}

proptest! {
    /// Blocks of several source tensors shifted into one target (fused parts,
    /// shards; cut anywhere, also inside a packed row block) and a second target,
    /// written in one batch, land as element-by-element copies would, and the same
    /// batch again undoes it; the writes are large enough to be split into tasks.
    #[test]
    fn a_batch_of_shifted_blocks_lands_where_each_belongs_and_undoes(
        rows in 1usize..300,
        half_columns in 1usize..120,
        block in prop::sample::select(vec![None, Some(16usize), Some(32)]),
        cuts in prop::collection::vec(0.0f64..1.0, 0..4),
        density in 0.0f64..1.0,
        seed in any::<u64>(),
    ) {
        let mut state = seed | 1;
        let mut next = move || { state ^= state << 13; state ^= state >> 7; state ^= state << 17; state };
        let columns = half_columns * 2;
        let elements = rows * columns;
        let (layout, positions) = match block {
            None => (ElementLayout::RowMajor, (0..elements).collect()),
            Some(block) => (
                ElementLayout::RowBlocks { rows: rows as u64, columns: columns as u64, block: block as u64, group: 2 },
                packed_positions(rows, columns, block, 2),
            ),
        };
        // The target's elements cut into blocks, each from a source tensor whose
        // block starts at its own offset there.
        let mut bounds: Vec<usize> = cuts.iter().map(|cut| (cut * elements as f64) as usize).collect();
        bounds.extend([0, elements]);
        bounds.sort();
        bounds.dedup();
        let threshold = (density * u64::MAX as f64) as u64;
        let mut blocks = Vec::new();
        for pair in bounds.windows(2) {
            let (start, end) = (pair[0], pair[1]);
            let offset = (next() % 1000) as usize;
            let indices: Vec<u64> =
                ((offset as u64)..(offset + end - start) as u64).filter(|_| next() <= threshold).collect();
            let values: Vec<u8> = (0..indices.len() * 2).map(|_| next() as u8).collect();
            blocks.push((indices, values, offset, start, end));
        }
        let original: Vec<u8> = (0..elements * 2).map(|_| next() as u8).collect();
        let other_original: Vec<u8> = (0..64).map(|_| next() as u8).collect();
        let other_indices: Vec<u64> = vec![3, 9, 31];
        let mut expected = original.clone();
        for (indices, values, offset, start, _) in &blocks {
            for (i, &index) in indices.iter().enumerate() {
                let at = positions[index as usize - offset + start] * 2;
                expected[at..at + 2].copy_from_slice(&values[i * 2..i * 2 + 2]);
            }
        }
        let new_values: Vec<Vec<u8>> = blocks.iter().map(|block| block.1.clone()).collect();
        let (mut target, mut other) = (original.clone(), other_original.clone());
        let mut other_values = vec![7u8; 6];
        for round in 0..2 {
            let writes = blocks
                .iter_mut()
                .rev()
                .map(|(indices, values, offset, start, end)| ElementWrite {
                    label: "block",
                    indices,
                    within: *offset as u64..(*offset + *end - *start) as u64,
                    shift: *start as i64 - *offset as i64,
                    values,
                })
                .collect();
            swap_elements(vec![
                ElementTarget { label: "other", memory: &mut other, element_bytes: 2, layout: ElementLayout::RowMajor, writes: vec![
                    ElementWrite { label: "other's", indices: &other_indices, within: 0..32, shift: 0, values: &mut other_values },
                ] },
                ElementTarget { label: "fused", memory: &mut target, element_bytes: 2, layout, writes },
            ]).unwrap();
            if round == 0 {
                prop_assert!(target == expected);
                prop_assert!(other[6..8] == [7, 7] && other[62..64] == [7, 7]);
            }
        }
        prop_assert!(target == original);
        prop_assert!(other == other_original);
        for (block, values) in blocks.iter().zip(&new_values) {
            prop_assert!(&block.1 == values);
        }
    }
}

#[test]
fn a_batch_is_refused_whole_naming_the_target_and_write_that_do_not_fit() {
    let (mut first, mut second) = (vec![0u8; 32], vec![0u8; 32]);
    let (mut a, mut b, mut c) = (vec![1u8; 4], vec![1u8; 2], vec![1u8; 4]);
    let cases: [(&[u64], std::ops::Range<u64>, i64, &str); 3] = [
        (
            &[20],
            10..30,
            -4,
            "v into qkv: elements 10..30 shifted by -4 fall outside the target's 16 elements",
        ),
        (
            &[2],
            0..8,
            4,
            "v into qkv: its block shares elements with k's",
        ),
        (
            &[12, 12],
            10..14,
            0,
            "v into qkv: indices not strictly ascending at position 1 (12 then 12)",
        ),
    ];
    for (indices, within, shift, reason) in cases {
        let error = swap_elements(vec![
            ElementTarget {
                label: "o",
                memory: &mut first,
                element_bytes: 2,
                layout: ElementLayout::RowMajor,
                writes: vec![ElementWrite {
                    label: "o",
                    indices: &[3, 4],
                    within: 0..16,
                    shift: 0,
                    values: &mut a,
                }],
            },
            ElementTarget {
                label: "qkv",
                memory: &mut second,
                element_bytes: 2,
                layout: ElementLayout::RowMajor,
                writes: vec![
                    ElementWrite {
                        label: "k",
                        indices: &[5],
                        within: 0..8,
                        shift: 0,
                        values: &mut b,
                    },
                    ElementWrite {
                        label: "v",
                        indices,
                        within,
                        shift,
                        values: &mut c[..indices.len() * 2],
                    },
                ],
            },
        ])
        .unwrap_err();
        assert!(error.to_string().contains(reason), "{error}");
        assert_eq!(
            (&first, &second),
            (&vec![0u8; 32], &vec![0u8; 32]),
            "nothing written: {reason}"
        );
    }
}
