//! Block-scaled FP8 (E4M3FN) quantization of a BF16 matrix's changed elements: how an
//! actor whose engine serves FP8 rollout weights turns a version's BF16 changes into the
//! FP8 elements and scales they imply (the Python package's `aurora_rl.engines.fp8`). One
//! pass over the changes: each element's block, divided by the block's scale, clamped to
//! E4M3FN's range, rounded as torch rounds (`fp8e4m3fn_from_fp32_value`), so that these
//! elements equal the whole matrix quantized from scratch by torch; the blocks whose
//! largest magnitude a change may have moved (exceeded it, or changed the element that
//! held it) measured again; and the blocks whose scale moved quantized anew.

use rayon::prelude::*;

use crate::{DeltaError, Result};

/// The largest magnitude E4M3FN holds.
pub const E4M3FN_MAX: f32 = 448.0;

/// A `rows` x `columns` matrix cut into blocks of `block_rows` x `block_columns` (the last
/// row and column of blocks may be shorter), numbered row-major, one scale each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockGrid {
    pub rows: u64,
    pub columns: u64,
    pub block_rows: u64,
    pub block_columns: u64,
}

impl BlockGrid {
    /// The number of blocks.
    pub fn blocks(&self) -> u64 {
        self.rows.div_ceil(self.block_rows) * self.columns.div_ceil(self.block_columns)
    }

    /// The block of the element at flat (row-major) `index`.
    pub fn block_of(&self, index: u64) -> u64 {
        let (row, column) = (index / self.columns, index % self.columns);
        row / self.block_rows * self.columns.div_ceil(self.block_columns)
            + column / self.block_columns
    }

    /// The flat indices of block `block`'s elements, ascending.
    fn elements_of(&self, block: u64) -> impl Iterator<Item = u64> + '_ {
        let block_columns = self.columns.div_ceil(self.block_columns);
        let (first_row, first_column) = (
            block / block_columns * self.block_rows,
            block % block_columns * self.block_columns,
        );
        let rows = first_row..(first_row + self.block_rows).min(self.rows);
        let columns = first_column..(first_column + self.block_columns).min(self.columns);
        rows.flat_map(move |row| {
            columns
                .clone()
                .map(move |column| row * self.columns + column)
        })
    }

    /// Block `block`'s largest magnitude in `matrix` (BF16 bits) and the flat index of
    /// the first element holding it; NaN, where one is, as torch's `max` has it.
    fn largest_in(&self, matrix: &[u16], block: u64) -> (f32, u64) {
        let mut best = (f32::NEG_INFINITY, 0);
        for index in self.elements_of(block) {
            let magnitude = bf16(matrix[index as usize]).abs();
            if magnitude > best.0 || (magnitude.is_nan() && !best.0.is_nan()) {
                best = (magnitude, index);
            }
        }
        best
    }

    fn refusal(&self) -> Option<String> {
        // Blocks never outnumber elements: a count of elements that fits bounds both.
        (self.rows == 0
            || self.columns == 0
            || self.block_rows == 0
            || self.block_columns == 0
            || self.rows.checked_mul(self.columns).is_none())
        .then(|| {
            format!("{self:?} has no elements, empty blocks or more elements than a u64 counts")
        })
    }
}

/// `value` rounded to E4M3FN (bits), to nearest, ties to even; magnitudes from 480 up, and
/// NaN, become NaN (E4M3FN has no infinity). Bit for bit torch's conversion.
pub fn e4m3fn(value: f32) -> u8 {
    // 480: halfway between 448, the largest finite value, and the next step past it.
    const OVERFLOW: u32 = 1087 << 20;
    // 2^14: added to a magnitude below the smallest normal (2^-6), it leaves the
    // subnormal's mantissa, rounded by the addition, in the low bits.
    const SUBNORMAL: u32 = 141 << 23;
    let bits = value.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let magnitude = bits & 0x7fff_ffff;
    let rounded = if magnitude >= OVERFLOW {
        0x7f
    } else if magnitude < 121 << 23 {
        let shifted = (f32::from_bits(magnitude) + f32::from_bits(SUBNORMAL)).to_bits();
        shifted.wrapping_sub(SUBNORMAL) as u8
    } else {
        // Rebias the exponent (127 to 7) and round the 20 dropped mantissa bits to even.
        let odd = (magnitude >> 20) & 1;
        let rebiased = magnitude
            .wrapping_add((7u32.wrapping_sub(127)) << 23)
            .wrapping_add(0x7_ffff + odd);
        (rebiased >> 20) as u8
    };
    rounded | sign
}

/// A matrix's block statistics, kept current as versions come: each block's scale, its
/// largest magnitude and the flat index of an element holding it.
pub struct BlockStats<'a> {
    pub scales: &'a mut [f32],
    pub largest: &'a mut [f32],
    pub largest_at: &'a mut [u64],
}

/// What a version's changes to a BF16 matrix come to in its FP8 image.
#[derive(Debug, Default, PartialEq)]
pub struct Requantized {
    /// The blocks whose scale moved (ascending) and their new scales.
    pub rescaled: Vec<u64>,
    pub scales: Vec<f32>,
    /// Where a scale moved, every FP8 element to write: the changes, and the elements of
    /// the rescaled blocks whose FP8 value the new scale moves (ascending flat indices,
    /// E4M3FN bits). Empty where none moved: the changes' own are all.
    pub indices: Vec<u64>,
    pub values: Vec<u8>,
}

/// The scale of a block whose largest magnitude is `largest`, as quantizing from scratch
/// computes it (a block of zeros, or holding NaN, keeps scale 1).
pub fn scale_of(largest: f32) -> f32 {
    if largest > 0.0 {
        largest / E4M3FN_MAX
    } else {
        1.0
    }
}

fn quantize(value: f32, scale: f32) -> u8 {
    e4m3fn((value / scale).clamp(-E4M3FN_MAX, E4M3FN_MAX))
}

fn bf16(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// Takes a version's changes to the BF16 `matrix` (its new elements, whole: `values` at
/// the ascending flat `indices` are among them) into its FP8 image: each change quantized
/// under its block's scale into `quantized`; the blocks whose largest magnitude may have
/// moved measured again in `matrix`, updating `stats`; and, where a block's scale moved,
/// the block quantized anew, its elements whose FP8 value moves written (`Requantized`). The FP8 image then equals the matrix
/// quantized from scratch, bit for bit. Everything is checked before the first write.
pub fn requantize(
    grid: BlockGrid,
    matrix: &[u16],
    indices: &[u64],
    values: &[u16],
    stats: BlockStats<'_>,
    quantized: &mut [u8],
) -> Result<Requantized> {
    if grid.refusal().is_none() && matrix.len() as u64 != grid.rows * grid.columns {
        return Err(DeltaError::ElementWrites(format!(
            "a matrix of {} elements for {grid:?}",
            matrix.len()
        )));
    }
    let moved = quantize_changes(
        grid,
        indices,
        values,
        stats.scales,
        stats.largest,
        stats.largest_at,
        quantized,
    )?;
    let measured: Vec<(f32, u64)> = moved
        .par_iter()
        .map(|&block| grid.largest_in(matrix, block))
        .collect();
    let mut out = Requantized::default();
    let mut previous_scales = Vec::new();
    for (&block, (largest, at)) in moved.iter().zip(measured) {
        let block = block as usize;
        (stats.largest[block], stats.largest_at[block]) = (largest, at);
        let scale = scale_of(largest);
        if scale.to_bits() != stats.scales[block].to_bits() {
            previous_scales.push(stats.scales[block]);
            stats.scales[block] = scale;
            out.rescaled.push(block as u64);
            out.scales.push(scale);
        }
    }
    if out.rescaled.is_empty() {
        return Ok(out);
    }
    // In a rescaled block, the elements whose FP8 value the new scale moves: the image
    // holds every other one already (an unchanged element under the old scale; a changed
    // one as `quantized` has it, under the old scale too). A scale moves when its block's
    // largest element does, by little, so most of its elements keep their FP8 value.
    let mut rescaled: Vec<(u64, u8)> = out
        .rescaled
        .par_iter()
        .zip(&out.scales)
        .zip(&previous_scales)
        .flat_map_iter(|((&block, &scale), &previous)| {
            grid.elements_of(block).filter_map(move |index| {
                let value = bf16(matrix[index as usize]);
                let requantized = quantize(value, scale);
                (requantized != quantize(value, previous)).then_some((index, requantized))
            })
        })
        .collect();
    // Blocks side by side interleave by row.
    rescaled.par_sort_unstable_by_key(|(index, _)| *index);
    let total = indices.len() + rescaled.len();
    (out.indices, out.values) = (Vec::with_capacity(total), Vec::with_capacity(total));
    // Both ascending; where both hold an element, the new scale's value.
    let mut changes = indices.iter().zip(quantized.iter()).peekable();
    for (index, value) in rescaled {
        while let Some((&change, &quantized)) = changes.next_if(|(change, _)| **change <= index) {
            if change < index {
                out.indices.push(change);
                out.values.push(quantized);
            }
        }
        out.indices.push(index);
        out.values.push(value);
    }
    for (&change, &quantized) in changes {
        out.indices.push(change);
        out.values.push(quantized);
    }
    Ok(out)
}

/// Quantizes the BF16 `values` (bits) at `indices` (ascending flat indices of `grid`'s
/// matrix) under their blocks' `scales` into `quantized` (E4M3FN bits, one per value).
/// Returns the blocks (ascending, each once) whose largest magnitude may have moved: a
/// value exceeds the block's `largest` (or is NaN), or the element at the block's `largest_at` (the
/// flat index of an element holding it) changed. The caller measures those again, and
/// quantizes anew any whose scale moved. Everything is checked before the first write.
fn quantize_changes(
    grid: BlockGrid,
    indices: &[u64],
    values: &[u16],
    scales: &[f32],
    largest: &[f32],
    largest_at: &[u64],
    quantized: &mut [u8],
) -> Result<Vec<u64>> {
    let refuse = |reason: String| Err(DeltaError::ElementWrites(reason));
    if let Some(reason) = grid.refusal() {
        return refuse(reason);
    }
    let blocks = grid.blocks();
    if [scales.len(), largest.len(), largest_at.len()] != [blocks as usize; 3] {
        return refuse(format!(
            "{} scales, {} largest magnitudes and {} of their places for {blocks} blocks",
            scales.len(),
            largest.len(),
            largest_at.len()
        ));
    }
    if values.len() != indices.len() || quantized.len() != indices.len() {
        return refuse(format!(
            "{} indices, {} values and room for {} quantized",
            indices.len(),
            values.len(),
            quantized.len()
        ));
    }
    if let Some(at) = indices.windows(2).position(|pair| pair[0] >= pair[1]) {
        return refuse(format!(
            "indices not strictly ascending at position {}",
            at + 1
        ));
    }
    if let Some(&last) = indices.last()
        && last >= grid.rows * grid.columns
    {
        return refuse(format!(
            "index {last} beyond the matrix's {} elements",
            grid.rows * grid.columns
        ));
    }
    /// Changes per task: enough to amortise a task, few enough to share a large tensor.
    const TASK: usize = 1 << 12;
    let block_columns = grid.columns.div_ceil(grid.block_columns);
    // A block's width is a power of two in every FP8 checkpoint (128): a shift, where a
    // 64-bit division per element would cost more than the rest of the pass.
    let shift = grid.block_columns.trailing_zeros();
    let column_block = |column: u64| {
        if grid.block_columns.is_power_of_two() {
            column >> shift
        } else {
            column / grid.block_columns
        }
    };
    let mut moved: Vec<u64> = indices
        .par_chunks(TASK)
        .zip(values.par_chunks(TASK))
        .zip(quantized.par_chunks_mut(TASK))
        .flat_map_iter(|((indices, values), quantized)| {
            let mut moved = Vec::new();
            // Ascending indices: one division per row reached, not one per element.
            let (mut row_start, mut row_end, mut first_block) = (0, 0, 0);
            for ((&index, &value), out) in indices.iter().zip(values).zip(quantized.iter_mut()) {
                if index >= row_end {
                    let row = index / grid.columns;
                    (row_start, row_end) = (row * grid.columns, (row + 1) * grid.columns);
                    first_block = row / grid.block_rows * block_columns;
                }
                let block = (first_block + column_block(index - row_start)) as usize;
                let value = bf16(value);
                // NaN too: a block holding one has no largest magnitude (torch's max).
                let magnitude = value.abs();
                if magnitude > largest[block] || magnitude.is_nan() || largest_at[block] == index {
                    moved.push(block as u64);
                }
                *out = quantize(value, scales[block]);
            }
            moved
        })
        .collect();
    moved.sort_unstable();
    moved.dedup();
    Ok(moved)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `matrix` quantized from scratch: its FP8 image and its blocks' statistics.
    fn from_scratch(grid: BlockGrid, matrix: &[u16]) -> (Vec<u8>, Vec<f32>, Vec<f32>, Vec<u64>) {
        let blocks = grid.blocks();
        let measured: Vec<(f32, u64)> = (0..blocks).map(|b| grid.largest_in(matrix, b)).collect();
        let scales: Vec<f32> = measured
            .iter()
            .map(|(largest, _)| scale_of(*largest))
            .collect();
        let image = (0..matrix.len() as u64)
            .map(|i| quantize(bf16(matrix[i as usize]), scales[grid.block_of(i) as usize]))
            .collect();
        let (largest, at) = measured.into_iter().unzip();
        (image, scales, largest, at)
    }

    #[test]
    fn requantizing_changes_equals_quantizing_the_new_matrix_from_scratch() {
        let grid = BlockGrid {
            rows: 37,
            columns: 53,
            block_rows: 8,
            block_columns: 16,
        };
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut random = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let bf16_of = |x: f32| (x.to_bits() >> 16) as u16;
        let mut matrix: Vec<u16> = (0..37 * 53)
            .map(|_| bf16_of((random() % 2000) as f32 / 1000.0 - 1.0))
            .collect();
        let (mut image, mut scales, mut largest, mut largest_at) = from_scratch(grid, &matrix);
        for step in 0..20 {
            let mut changed = std::collections::BTreeMap::new();
            for _ in 0..40 {
                let index = random() % (37 * 53);
                let value = match random() % 10 {
                    // A new largest magnitude: the block's scale grows.
                    0 => bf16_of(5.0 + step as f32),
                    // A NaN anywhere: quantized from scratch, its block's scale is 1.
                    2 if step == 7 => 0x7fc0,
                    // The element holding a block's largest shrinks: its scale falls.
                    1 => {
                        let block = grid.block_of(index) as usize;
                        changed.insert(largest_at[block], bf16_of(0.001));
                        continue;
                    }
                    _ => bf16_of((random() % 2000) as f32 / 1000.0 - 1.0),
                };
                changed.insert(index, value);
            }
            for (&index, &value) in &changed {
                matrix[index as usize] = value;
            }
            let (indices, values): (Vec<u64>, Vec<u16>) = changed.into_iter().unzip();
            let mut quantized = vec![0; indices.len()];
            let stats = BlockStats {
                scales: &mut scales,
                largest: &mut largest,
                largest_at: &mut largest_at,
            };
            let out = requantize(grid, &matrix, &indices, &values, stats, &mut quantized).unwrap();
            if out.rescaled.is_empty() {
                for (index, value) in indices.iter().zip(&quantized) {
                    image[*index as usize] = *value;
                }
            } else {
                assert!(out.indices.windows(2).all(|pair| pair[0] < pair[1]));
                for (index, value) in out.indices.iter().zip(&out.values) {
                    image[*index as usize] = *value;
                }
            }
            let (expected, expected_scales, expected_largest, _) = from_scratch(grid, &matrix);
            assert_eq!(image, expected, "step {step}");
            let bits = |values: &[f32]| values.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&scales), bits(&expected_scales), "step {step}");
            assert_eq!(bits(&largest), bits(&expected_largest), "step {step}");
            for (block, &at) in largest_at.iter().enumerate() {
                let held = bf16(matrix[at as usize]).abs();
                assert_eq!(held.to_bits(), largest[block].to_bits(), "step {step}");
            }
        }
        let stats = BlockStats {
            scales: &mut scales,
            largest: &mut largest,
            largest_at: &mut largest_at,
        };
        let short = requantize(grid, &matrix[1..], &[], &[], stats, &mut []);
        assert!(short.unwrap_err().to_string().contains("a matrix of"));
    }

    #[test]
    fn e4m3fn_rounds_to_nearest_even_and_saturates_to_nan() {
        for (value, bits) in [
            (0.0, 0x00),
            (-0.0, 0x80),
            (1.0, 0x38),
            (-2.0, 0xc0),
            (448.0, 0x7e),
            (-448.0, 0xfe),
            (464.0, 0x7e), // below 480: rounds to 448
            (480.0, 0x7f), // NaN
            (f32::NAN, 0x7f),
            (1.0625, 0x38),        // halfway between 1 and 1.125: to the even mantissa
            (1.1875, 0x3a),        // halfway between 1.125 and 1.25: to the even 1.25
            (2f32.powi(-9), 0x01), // the smallest subnormal
            (2f32.powi(-10), 0x00), // half of it: to even, zero
            (3.0 * 2f32.powi(-10), 0x02),
        ] {
            assert_eq!(e4m3fn(value), bits, "{value}");
        }
    }

    #[test]
    fn changes_are_quantized_under_their_blocks_and_moved_largest_magnitudes_reported() {
        let grid = BlockGrid {
            rows: 3,
            columns: 5,
            block_rows: 2,
            block_columns: 2,
        };
        assert_eq!(grid.blocks(), 6);
        assert_eq!([0, 2, 5, 14].map(|i| grid.block_of(i)), [0, 1, 0, 5]);
        let bf16 = |x: f32| (x.to_bits() >> 16) as u16;
        let (scales, largest) = (
            [1.0, 2.0, 1.0, 1.0, 1.0, 4.0],
            [448.0, 896.0, 1.0, 1.0, 1.0, 1.0],
        );
        // Block 0's largest is at element 5, block 1's at element 3 (unchanged).
        let largest_at = [5, 3, 10, 12, 13, 9];
        let mut out = [0u8; 3];
        let moved = quantize_changes(
            grid,
            &[2, 5, 14],
            &[bf16(4.0), bf16(1.0), bf16(8.0)],
            &scales,
            &largest,
            &largest_at,
            &mut out,
        )
        .unwrap();
        assert_eq!(out, [e4m3fn(2.0), e4m3fn(1.0), e4m3fn(2.0)]);
        // Block 0: the element holding its largest changed; block 5: a value exceeds it.
        assert_eq!(moved, [0, 5]);
        for (indices, why) in [(&[5u64, 2][..], "ascending"), (&[15u64][..], "beyond")] {
            let error = quantize_changes(
                grid,
                indices,
                &vec![0; indices.len()],
                &scales,
                &largest,
                &largest_at,
                &mut vec![0; indices.len()],
            );
            assert!(error.unwrap_err().to_string().contains(why), "{why}");
        }
        assert!(
            quantize_changes(
                grid,
                &[0],
                &[0],
                &scales[..5],
                &largest,
                &largest_at,
                &mut [0]
            )
            .is_err()
        );
        let huge = BlockGrid {
            rows: u64::MAX,
            columns: 2,
            ..grid
        };
        let error = quantize_changes(huge, &[], &[], &[], &[], &[], &mut []).unwrap_err();
        assert!(error.to_string().contains("more elements"), "{error}");
    }
}
