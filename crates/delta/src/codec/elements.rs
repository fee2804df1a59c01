//! Element writes into an engine's parameter memory: a version's changed elements swapped
//! in place, with the undo in hand, also where a CPU kernel packed the matrix.

use super::swap_words_at;
use crate::error::{DeltaError, Result};
use rayon::prelude::*;

/// How a target stores the elements its flat (row-major) indices name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ElementLayout {
    /// Element `i` at position `i`.
    RowMajor,
    /// A `rows` x `columns` matrix packed for a CPU's kernels: rows in blocks of `block`
    /// (the last may be shorter), each block stored `group` columns at a time, as
    /// `[columns / group, block rows, group]`. Group 2 is the VNNI-2 layout AMX multiplies
    /// from (SGLang's linear layers, vLLM's experts with AMX); group 1, column by column
    /// (vLLM's experts on CPUs without AMX).
    RowBlocks {
        rows: u64,
        columns: u64,
        block: u64,
        group: u64,
    },
}

impl ElementLayout {
    /// Where each of `indices` (ascending, within one task's runs) lies, less `first`.
    /// Incremental: one division per row reached, not three per element.
    fn positions(self, indices: &[u64], first: usize) -> Vec<usize> {
        let Self::RowBlocks {
            rows,
            columns,
            block,
            group,
        } = self
        else {
            return indices
                .iter()
                .map(|&index| index as usize - first)
                .collect();
        };
        let mut positions = Vec::with_capacity(indices.len());
        let (mut row_start, mut row_end, mut base, mut group_stride) = (0, 0, 0, 0);
        for &index in indices {
            if index >= row_end {
                let row = index / columns;
                let start = row - row % block;
                (row_start, row_end) = (row * columns, row * columns + columns);
                base = start * columns + (row - start) * group;
                group_stride = block.min(rows - start) * group;
            }
            let column = index - row_start;
            positions
                .push((base + column / group * group_stride + column % group) as usize - first);
        }
        positions
    }

    /// The first index after the run of positions `index`'s lies in (a run is stored in
    /// one stretch, and the writes of two tasks must not share one).
    fn run_end(self, index: u64) -> u64 {
        match self {
            Self::RowMajor => index + 1,
            Self::RowBlocks {
                rows,
                columns,
                block,
                ..
            } => {
                let row = index / columns;
                (row - row % block + block).min(rows) * columns
            }
        }
    }

    fn refusal(self, elements: u64) -> Option<String> {
        match self {
            Self::RowMajor => None,
            Self::RowBlocks {
                rows,
                columns,
                block,
                group,
            } => (rows.checked_mul(columns) != Some(elements)
                || block == 0
                || group == 0
                || !columns.is_multiple_of(group))
            .then(|| {
                format!(
                    "a {rows} x {columns} matrix in row blocks of {block}, {group} columns at a \
                     time, is not a target of {elements} elements"
                )
            }),
        }
    }
}

/// Swaps `values` (one element of `element_bytes` each) with the elements of `target`
/// at `indices`, strictly ascending flat element indices, stored as `layout` says:
/// afterwards `target` holds the new values and `values` the ones they replaced, so the
/// same call again undoes it. This is how an engine's parameter memory takes a version's
/// changed elements in place ([`ChangedElements`](crate::ChangedElements)), with the undo
/// in hand, also where the engine packed it. Everything is checked before the first
/// write; large writes are split over the thread pool.
pub fn swap_elements(
    target: &mut [u8],
    element_bytes: usize,
    indices: &[u64],
    values: &mut [u8],
    layout: ElementLayout,
) -> Result<()> {
    let refuse = |reason: String| Err(DeltaError::ElementWrites(reason));
    if element_bytes == 0 || !target.len().is_multiple_of(element_bytes) {
        return refuse(format!(
            "a target of {} bytes is not made of {element_bytes}-byte elements",
            target.len()
        ));
    }
    if values.len() != indices.len() * element_bytes {
        return refuse(format!(
            "{} bytes of values for {} elements of {element_bytes} bytes",
            values.len(),
            indices.len()
        ));
    }
    let elements = (target.len() / element_bytes) as u64;
    if let Some(reason) = layout.refusal(elements) {
        return refuse(reason);
    }
    if let Some(at) = indices.windows(2).position(|pair| pair[0] >= pair[1]) {
        return refuse(format!(
            "indices not strictly ascending at position {} ({} then {})",
            at + 1,
            indices[at],
            indices[at + 1]
        ));
    }
    if let Some(&last) = indices.last()
        && last >= elements
    {
        return refuse(format!(
            "index {last} beyond the target's {elements} elements"
        ));
    }
    /// Indices per task: enough to amortise a task, few enough to share a large write.
    const TASK_INDICES: usize = 1 << 16;
    // Ascending indices give each task its own stretch of the target: whole runs of
    // positions, so that no two tasks write one.
    let mut tasks = Vec::with_capacity(indices.len().div_ceil(TASK_INDICES));
    let (mut rest, mut rest_start) = (target, 0usize);
    let (mut indices, mut values) = (indices, values);
    while !indices.is_empty() {
        let run_end = layout.run_end(indices[TASK_INDICES.min(indices.len()) - 1]);
        let count = indices.partition_point(|&index| index < run_end);
        let (task_indices, later_indices) = indices.split_at(count);
        let (task_values, later_values) =
            std::mem::take(&mut values).split_at_mut(count * element_bytes);
        let end = run_end as usize * element_bytes;
        let (stretch, after) = std::mem::take(&mut rest).split_at_mut(end - rest_start);
        tasks.push((
            stretch,
            rest_start / element_bytes,
            task_indices,
            task_values,
        ));
        (rest, rest_start) = (after, end);
        (indices, values) = (later_indices, later_values);
    }
    tasks
        .into_par_iter()
        .for_each(|(stretch, first, indices, values)| match layout {
            ElementLayout::RowMajor => swap_at(
                stretch,
                element_bytes,
                indices,
                |index| index as usize - first,
                values,
            ),
            ElementLayout::RowBlocks { .. } => {
                let positions = layout.positions(indices, first);
                swap_at(
                    stretch,
                    element_bytes,
                    &positions,
                    |position| position,
                    values,
                )
            }
        });
    Ok(())
}

/// Swaps `values` with the elements of `stretch` at `positions`, each mapped to an
/// element index by `at`.
fn swap_at<P: Copy>(
    stretch: &mut [u8],
    element_bytes: usize,
    positions: &[P],
    at: impl Fn(P) -> usize,
    values: &mut [u8],
) {
    match element_bytes {
        2 => swap_words_at::<u16, P>(stretch, positions, at, values),
        4 => swap_words_at::<u32, P>(stretch, positions, at, values),
        _ => {
            for (&position, value) in positions.iter().zip(values.chunks_exact_mut(element_bytes)) {
                let start = at(position) * element_bytes;
                stretch[start..start + element_bytes].swap_with_slice(value);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{ElementLayout, swap_elements};
    use crate::DeltaError;
    use proptest::prelude::*;

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
            swap_elements(&mut target, element_bytes, &indices, &mut values, layout).unwrap();
            let mut expected = original.clone();
            for (i, &index) in indices.iter().enumerate() {
                let (at, from) = (positions[index as usize] * element_bytes, i * element_bytes);
                expected[at..at + element_bytes].copy_from_slice(&new[from..from + element_bytes]);
                prop_assert_eq!(&values[from..from + element_bytes], &original[at..at + element_bytes]);
            }
            prop_assert!(target == expected);
            swap_elements(&mut target, element_bytes, &indices, &mut values, layout).unwrap();
            prop_assert!(target == original);
            prop_assert!(values == new);
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
                "index 32 beyond the target's 32 elements",
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
            let error = swap_elements(&mut target, element_bytes, indices, &mut values, layout)
                .unwrap_err();
            assert!(matches!(&error, DeltaError::ElementWrites(_)), "{error}");
            assert!(error.to_string().contains(reason), "{error}");
            assert_eq!(target, original, "{reason}");
        }
    }
}
