//! Element writes into an engine's parameter memory: a version's changed elements swapped
//! in place, with the undo in hand, also where a CPU kernel packed the matrix.

use std::ops::Range;

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

/// A [`ElementLayout::RowBlocks`] matrix's shape.
#[derive(Clone, Copy)]
struct RowBlocks {
    rows: u64,
    columns: u64,
    block: u64,
    group: u64,
}

impl RowBlocks {
    /// Where each of `indices` shifted by `shift` (ascending, within one task's runs)
    /// lies, less `first`. Incremental: one division per row reached, not three per
    /// element.
    fn positions(self, indices: &[u64], shift: i64, first: usize) -> Vec<usize> {
        let RowBlocks {
            rows,
            columns,
            block,
            group,
        } = self;
        let mut positions = Vec::with_capacity(indices.len());
        let (mut row_start, mut row_end, mut base, mut group_stride) = (0, 0, 0, 0);
        for &index in indices {
            let index = shifted(index, shift);
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
}

impl ElementLayout {
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

/// A checkpoint tensor's element index as a target's: checked to land inside the target
/// before any write, so wrapping never shows; it only keeps absurd inputs from panicking.
fn shifted(index: u64, shift: i64) -> u64 {
    index.wrapping_add_signed(shift)
}

/// One parameter's memory and the writes of a version that land in it
/// ([`swap_elements`]).
#[derive(Debug)]
pub struct ElementTarget<'a> {
    /// What the memory is (a parameter's name), for refusals.
    pub label: &'a str,
    pub memory: &'a mut [u8],
    pub element_bytes: usize,
    /// How the memory stores the elements the writes' shifted indices name.
    pub layout: ElementLayout,
    /// Each a block of a checkpoint tensor held here (a whole tensor, a fused part, a
    /// shard's rows): no two blocks may share an element.
    pub writes: Vec<ElementWrite<'a>>,
}

/// A checkpoint tensor's changed elements within the block of it a target holds.
#[derive(Debug)]
pub struct ElementWrite<'a> {
    /// Whose elements these are (a checkpoint tensor's name), for refusals.
    pub label: &'a str,
    /// Flat element indices of the tensor, strictly ascending, each within `within`.
    pub indices: &'a [u64],
    pub within: Range<u64>,
    /// Added to an index to give the target's element.
    pub shift: i64,
    /// One new value per index: afterwards the value each replaced.
    pub values: &'a mut [u8],
}

impl ElementWrite<'_> {
    /// The target elements the block lies on.
    fn lands_on(&self) -> Range<i128> {
        let shift = self.shift as i128;
        self.within.start as i128 + shift..self.within.end as i128 + shift
    }

    /// Why the indices from `at` (at most `count`) cannot be written: not ascending (also
    /// from the one before `at`) or outside `within`.
    fn index_refusal(&self, at: usize, count: usize) -> Option<String> {
        let indices = &self.indices[at.saturating_sub(1)..at + count];
        if let Some(pair) = indices.windows(2).position(|pair| pair[0] >= pair[1]) {
            return Some(format!(
                "indices not strictly ascending at position {} ({} then {})",
                at.saturating_sub(1) + pair + 1,
                indices[pair],
                indices[pair + 1]
            ));
        }
        indices
            .iter()
            .find(|index| !self.within.contains(index))
            .map(|index| {
                format!(
                    "index {index} is outside elements {}..{}, the part of it this target holds",
                    self.within.start, self.within.end
                )
            })
    }
}

impl ElementTarget<'_> {
    /// Why this target's writes cannot land, from their shapes (the indices are checked
    /// apart, in parallel): the write it concerns, if one, and the refusal.
    fn refusal(&self) -> Option<(Option<usize>, String)> {
        let element_bytes = self.element_bytes;
        if element_bytes == 0 || !self.memory.len().is_multiple_of(element_bytes) {
            return Some((
                None,
                format!(
                    "a target of {} bytes is not made of {element_bytes}-byte elements",
                    self.memory.len()
                ),
            ));
        }
        let elements = (self.memory.len() / element_bytes) as u64;
        if let Some(reason) = self.layout.refusal(elements) {
            return Some((None, reason));
        }
        for (at, write) in self.writes.iter().enumerate() {
            let refuse = |reason: String| Some((Some(at), reason));
            if write.indices.len().checked_mul(element_bytes) != Some(write.values.len()) {
                return refuse(format!(
                    "{} bytes of values for {} elements of {element_bytes} bytes",
                    write.values.len(),
                    write.indices.len()
                ));
            }
            let lands = write.lands_on();
            if !write.within.is_empty() && (lands.start < 0 || lands.end > elements as i128) {
                return refuse(format!(
                    "elements {}..{} shifted by {} fall outside the target's {elements} elements",
                    write.within.start, write.within.end, write.shift
                ));
            }
        }
        let mut blocks: Vec<(Range<i128>, usize)> = (self.writes.iter().enumerate())
            .filter(|(_, write)| !write.within.is_empty())
            .map(|(at, write)| (write.lands_on(), at))
            .collect();
        blocks.sort_by_key(|(lands, _)| lands.start);
        blocks
            .windows(2)
            .find(|pair| pair[0].0.end > pair[1].0.start)
            .map(|pair| {
                (
                    Some(pair[1].1),
                    format!(
                        "its block shares elements with {}'s",
                        self.writes[pair[0].1].label
                    ),
                )
            })
    }
}

/// Indices per task: enough to amortise a task, few enough to share out a version's
/// writes into a few hundred parameters over every core.
const TASK_INDICES: usize = 1 << 14;

/// Swaps each write's values with its target's elements at its shifted indices:
/// afterwards the targets hold the new values and the values the ones they replaced, so
/// the same call again undoes it. This is how an engine's parameter memory takes a
/// version's changed elements in place ([`ChangedElements`](crate::ChangedElements)),
/// with the undo in hand, also where the engine packed it. Everything is checked before
/// the first write lands (a refusal names the write and its target by their labels); the writes
/// into every target are shared out over the thread pool together, since the pass over
/// memory is the whole cost.
pub fn swap_elements(targets: Vec<ElementTarget<'_>>) -> Result<()> {
    let refused = |target: usize, write: Option<usize>, reason: String| {
        let target = &targets[target];
        DeltaError::ElementWrites(match write {
            Some(write) => format!(
                "{} into {}: {reason}",
                target.writes[write].label, target.label
            ),
            None => format!("{}: {reason}", target.label),
        })
    };
    if let Some((at, (write, reason))) = (targets.iter().enumerate())
        .find_map(|(at, target)| target.refusal().map(|refusal| (at, refusal)))
    {
        return Err(refused(at, write, reason));
    }
    let checks: Vec<(usize, usize, usize)> = (targets.iter().enumerate())
        .flat_map(|(t, target)| {
            (target.writes.iter().enumerate()).flat_map(move |(w, write)| {
                (0..write.indices.len())
                    .step_by(TASK_INDICES)
                    .map(move |first| (t, w, first))
            })
        })
        .collect();
    if let Some((t, w, reason)) = checks
        .into_par_iter()
        .filter_map(|(t, w, first)| {
            let write = &targets[t].writes[w];
            let count = TASK_INDICES.min(write.indices.len() - first);
            write
                .index_refusal(first, count)
                .map(|reason| (t, w, reason))
        })
        .min_by_key(|(t, w, _)| (*t, *w))
    {
        return Err(refused(t, Some(w), reason));
    }
    let mut tasks = Vec::new();
    for target in targets {
        split_into_tasks(target, &mut tasks);
    }
    tasks.into_par_iter().for_each(Task::run);
    Ok(())
}

/// Part of a write: indices (shifted, ascending) and their values.
struct Segment<'a> {
    indices: &'a [u64],
    shift: i64,
    values: &'a mut [u8],
}

impl<'a> Segment<'a> {
    fn shifted(&self, at: usize) -> u64 {
        shifted(self.indices[at], self.shift)
    }

    fn split_at(self, count: usize, element_bytes: usize) -> (Segment<'a>, Segment<'a>) {
        let (indices, later_indices) = self.indices.split_at(count);
        let (values, later_values) = self.values.split_at_mut(count * element_bytes);
        let segment = |indices, values| Segment {
            indices,
            shift: self.shift,
            values,
        };
        (
            segment(indices, values),
            segment(later_indices, later_values),
        )
    }
}

/// A stretch of one target and the writes that land in it.
struct Task<'a> {
    stretch: &'a mut [u8],
    /// The target element the stretch starts at.
    first: usize,
    element_bytes: usize,
    layout: ElementLayout,
    segments: Vec<Segment<'a>>,
}

/// Cuts a checked target's writes into tasks of about `TASK_INDICES` each. The blocks
/// are disjoint, so the writes in the order of their blocks are one ascending stream of
/// target elements; each task takes a stretch of the target that ends with the run of
/// positions its last element lies in, so that no two tasks write one stretch.
fn split_into_tasks<'a>(target: ElementTarget<'a>, tasks: &mut Vec<Task<'a>>) {
    let ElementTarget {
        memory,
        element_bytes,
        layout,
        mut writes,
        ..
    } = target;
    writes.sort_by_key(|write| write.lands_on().start);
    let mut pending: std::collections::VecDeque<Segment<'a>> = writes
        .into_iter()
        .filter(|write| !write.indices.is_empty())
        .map(|write| Segment {
            indices: write.indices,
            shift: write.shift,
            values: write.values,
        })
        .collect();
    let (mut rest, mut rest_start) = (memory, 0usize);
    while !pending.is_empty() {
        let (mut segments, mut budget) = (Vec::new(), TASK_INDICES);
        while budget > 0
            && let Some(segment) = pending.pop_front()
        {
            let count = budget.min(segment.indices.len());
            let (now, later) = segment.split_at(count, element_bytes);
            budget -= count;
            segments.push(now);
            if !later.indices.is_empty() {
                pending.push_front(later);
            }
        }
        let last = segments.last().expect("a task takes at least one index");
        let run_end = layout.run_end(last.shifted(last.indices.len() - 1));
        // The rest of the last element's run, whichever writes it holds.
        while let Some(segment) = pending.pop_front() {
            let count = segment
                .indices
                .partition_point(|&index| shifted(index, segment.shift) < run_end);
            let (now, later) = segment.split_at(count, element_bytes);
            if !now.indices.is_empty() {
                segments.push(now);
            }
            if !later.indices.is_empty() {
                pending.push_front(later);
                break;
            }
        }
        let end = run_end as usize * element_bytes;
        let (stretch, after) = std::mem::take(&mut rest).split_at_mut(end - rest_start);
        tasks.push(Task {
            stretch,
            first: rest_start / element_bytes,
            element_bytes,
            layout,
            segments,
        });
        (rest, rest_start) = (after, end);
    }
}

impl Task<'_> {
    fn run(self) {
        let Task {
            stretch,
            first,
            element_bytes,
            layout,
            segments,
        } = self;
        for Segment {
            indices,
            shift,
            values,
        } in segments
        {
            match layout {
                ElementLayout::RowMajor => swap_at(
                    stretch,
                    element_bytes,
                    indices,
                    |index| shifted(index, shift) as usize - first,
                    values,
                ),
                ElementLayout::RowBlocks {
                    rows,
                    columns,
                    block,
                    group,
                } => {
                    let blocks = RowBlocks {
                        rows,
                        columns,
                        block,
                        group,
                    };
                    let positions = blocks.positions(indices, shift, first);
                    swap_at(
                        stretch,
                        element_bytes,
                        &positions,
                        |position| position,
                        values,
                    )
                }
            }
        }
    }
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
    use super::{ElementLayout, ElementTarget, ElementWrite, swap_elements};
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
            let error =
                swap_one(&mut target, element_bytes, indices, &mut values, layout).unwrap_err();
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
}
