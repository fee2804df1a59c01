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

/// A block of a checkpoint tensor held as runs at a regular stride: a tensor-parallel
/// shard of a row-parallel layer holds the same columns of every row
/// ([`ElementWrite::cut`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Runs {
    pub count: u64,
    /// From the start of one run to the next, in the tensor's elements.
    pub source_stride: u64,
    /// The same in the target's elements.
    pub target_stride: u64,
}

impl<'a> ElementWrite<'a> {
    /// The writes of a block of `runs`, the first `within` shifted by `shift`, each run
    /// `runs.source_stride` further in the tensor and `runs.target_stride` further in the
    /// target, cut from this write's indices and values: those of the whole tensor of
    /// `elements`, strictly ascending, each below `elements` (refused otherwise). Indices
    /// outside the runs are left to the targets that hold them (another rank's shard,
    /// another fused part). The cut is a pass over the indices; the caller hands every
    /// changed element and the core picks, rather than cutting each run apart.
    pub fn cut(self, runs: Runs, elements: u64, element_bytes: usize) -> Result<Vec<Self>> {
        let ElementWrite {
            label,
            indices,
            within,
            shift,
            values,
        } = self;
        let refused = |reason: String| DeltaError::ElementWrites(format!("{label}: {reason}"));
        if indices.len().checked_mul(element_bytes) != Some(values.len()) {
            return Err(refused(format!(
                "{} bytes of values for {} elements of {element_bytes} bytes",
                values.len(),
                indices.len()
            )));
        }
        let run = within.end.saturating_sub(within.start);
        let last_end = (runs.count.saturating_sub(1))
            .checked_mul(runs.source_stride)
            .and_then(|offset| within.start.checked_add(offset))
            .and_then(|start| start.checked_add(run));
        let disjoint =
            runs.count <= 1 || (run > 0 && runs.source_stride >= run && runs.target_stride >= run);
        if !disjoint || last_end.is_none_or(|end| end > elements) {
            return Err(refused(format!(
                "{} runs of elements {}..{}, {} apart in the tensor and {} in the target, are \
                 not disjoint blocks of its {elements} elements",
                runs.count, within.start, within.end, runs.source_stride, runs.target_stride
            )));
        }
        // In chunks, each with the index before it: rayon's windows are one task each.
        let unordered = (0..indices.len().div_ceil(TASK_INDICES))
            .into_par_iter()
            .find_map_first(|chunk| {
                let from = (chunk * TASK_INDICES).saturating_sub(1);
                let to = indices.len().min((chunk + 1) * TASK_INDICES);
                (indices[from..to].windows(2))
                    .position(|pair| pair[0] >= pair[1])
                    .map(|at| from + at)
            });
        if let Some(at) = unordered {
            return Err(refused(format!(
                "indices not strictly ascending at position {} ({} then {})",
                at + 1,
                indices[at],
                indices[at + 1]
            )));
        }
        if let Some(&beyond) = indices.last().filter(|&&last| last >= elements) {
            return Err(refused(format!(
                "index {beyond} is beyond its {elements} elements"
            )));
        }
        let step = runs.target_stride as i128 - runs.source_stride as i128;
        let mut rest = (indices, values);
        // Takes the first `count` indices left and their values.
        let take = |rest: &mut (&'a [u64], &'a mut [u8]), count: usize| {
            let (indices, later) = rest.0.split_at(count);
            let (values, later_values) =
                std::mem::take(&mut rest.1).split_at_mut(count * element_bytes);
            *rest = (later, later_values);
            (indices, values)
        };
        take(
            &mut rest,
            indices.partition_point(|&index| index < within.start),
        );
        // Only the runs an index falls in: as many writes as such runs, whatever the count.
        let mut writes = Vec::new();
        while let Some(&next) = rest.0.first() {
            // Checked above: `next` is past the first run's start, and the strides (where
            // there are several runs) not zero.
            let r = match runs.count {
                0 => break,
                1 => 0,
                _ => (next - within.start) / runs.source_stride,
            };
            if r >= runs.count {
                break;
            }
            // Within `last_end`, checked above.
            let start = within.start + r * runs.source_stride;
            let inside = rest.0.partition_point(|&index| index < start + run);
            if inside == 0 {
                // In the gap after run `r`: on to the next.
                if r + 1 == runs.count {
                    break;
                }
                let next_start = start + runs.source_stride;
                let before = rest.0.partition_point(|&index| index < next_start);
                take(&mut rest, before);
                continue;
            }
            let run_shift = i64::try_from(shift as i128 + r as i128 * step)
                .map_err(|_| refused(format!("run {r} lands beyond any target's elements")))?;
            let (indices, values) = take(&mut rest, inside);
            writes.push(ElementWrite {
                label,
                indices,
                within: start..start + run,
                shift: run_shift,
                values,
            });
        }
        Ok(writes)
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
mod tests;
