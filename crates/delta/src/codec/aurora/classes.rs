//! The class search: per-chunk boundaries between exponent classes, placed by dynamic
//! programming over a cost estimated from a sample of the chunk. Only the encoder runs
//! it; the decoder reads the boundaries from the header.

use super::ESCAPE;
use crate::bits::{exp_golomb_len, leb128_len};
use crate::codec::entropy::ALPHABET;
use crate::codec::scan::{Classes, MAX_CLASSES, Word, changed_mask, step_value};
use crate::dtype::FloatLayout;

/// The class search samples runs of this many consecutive 64-element blocks: a lone
/// block every few KiB costs a cache miss on each side, while a run lets the hardware
/// prefetcher stream.
const SAMPLE_RUN: usize = 64;
/// It first samples about this many blocks per chunk, but at most one run in
/// `COARSEST_SAMPLE_STRIDE`...
const SAMPLED_BLOCKS: usize = 512;
const COARSEST_SAMPLE_STRIDE: usize = 128;
/// ...then, while it has seen fewer changes than this, twice as many runs at a time, down
/// to one run in `FINEST_SAMPLE_STRIDE`: class boundaries are only as good as the changes
/// they are placed from, and the sparser the chunk, the more of it holds as many.
const ENOUGH_SAMPLED_CHANGES: u64 = 256;
const FINEST_SAMPLE_STRIDE: usize = 32;
/// Populations are a hundred times denser than changes, so they are counted in one run in
/// `POPULATION_RUNS * FINEST_SAMPLE_STRIDE` (in fewer only in chunks too short for it).
const POPULATION_RUNS: usize = 4;
const _: () = assert!(
    COARSEST_SAMPLE_STRIDE.is_power_of_two()
        && FINEST_SAMPLE_STRIDE.is_power_of_two()
        && COARSEST_SAMPLE_STRIDE <= POPULATION_RUNS * FINEST_SAMPLE_STRIDE
);
/// Relative size a chunk may give up for fewer classes (a faster decoder scan).
const CLASS_TOLERANCE: f64 = 0.01;
/// The size, in bits per element of a chunk, that one more class must save to pay for
/// its cost in the extraction and decoding scans.
const SCAN_BITS_PER_CLASS: f64 = 0.0007;
/// Exponent values are merged into at most this many bins before the class search, which
/// bounds its cost on chunks whose values span every exponent.
const MAX_BINS: usize = 24;

/// Per-exponent statistics of a chunk that the class search works from.
struct Bin {
    first_exponent: u32,
    population: u64,
    changed: u64,
    symbols: [u64; ALPHABET],
    escape_bits: u64,
}

/// Chooses class boundaries minimising the estimated coded size: positions cost the
/// binary entropy of the class's density, steps the empirical entropy of their symbols,
/// and each class pays for its header and table. Statistics come from a sample of
/// 64-element blocks (every block of small chunks), which is plenty to place boundaries
/// and keeps this pre-pass a fraction of the encoding pass. Returns the classes and the
/// number of changes the sample predicts in each.
pub(super) fn choose_classes<W: Word, const V3: bool>(
    base: &[u8],
    target: &[u8],
    len: usize,
    layout: FloatLayout,
) -> (Classes, [usize; MAX_CLASSES]) {
    let single = Classes::new(layout, Vec::new());
    let exponents = (layout.exponent_mask >> layout.exponent_shift) as usize + 1;
    let blocks = len.div_ceil(64);
    let runs = blocks.div_ceil(SAMPLE_RUN);
    // Powers of two: each refinement samples the runs halfway between those sampled, so
    // the sampled runs are always the multiples of the current stride.
    let wanted = (blocks / SAMPLED_BLOCKS).clamp(1, COARSEST_SAMPLE_STRIDE);
    let coarsest = 1 << wanted.ilog2();
    // A multiple of the coarsest stride (see the assertion beside the constants), so
    // populations are counted in the first pass only.
    let population_stride = POPULATION_RUNS * coarsest.min(FINEST_SAMPLE_STRIDE);
    // Counted per sampled element and scaled to the chunk at the end. Most elements share
    // a handful of exponents: four tables let consecutive increments of the same count
    // proceed without waiting on each other. Exponents fit a byte (see `Classes::new`).
    let mut populations = [[0u32; 256]; 4];
    let mut population_sampled = 0u64;
    let mut changed = vec![0u64; exponents];
    let mut symbols = vec![[0u64; ALPHABET]; exponents];
    let mut escape_bits = vec![0u64; exponents];
    // Samples a run and returns how many changes it holds.
    let mut sample_run = |run: usize| -> u64 {
        let first = run * SAMPLE_RUN * 64;
        let end = (first + SAMPLE_RUN * 64).min(len);
        if run.is_multiple_of(population_stride) {
            population_sampled += (end - first) as u64;
            let mut quads = base[first * W::BYTES..end * W::BYTES].chunks_exact(4 * W::BYTES);
            for quad in &mut quads {
                for (lane, counts) in populations.iter_mut().enumerate() {
                    counts[single.exponent(W::load(quad, lane)) as usize & 0xFF] += 1;
                }
            }
            for (lane, counts) in populations.iter_mut().enumerate() {
                if let Some(word) = quads
                    .remainder()
                    .get(lane * W::BYTES..(lane + 1) * W::BYTES)
                {
                    counts[single.exponent(W::load(word, 0)) as usize & 0xFF] += 1;
                }
            }
        }
        let mut found = 0;
        for block in (first..end).step_by(64) {
            let bytes = block * W::BYTES..(end.min(block + 64)) * W::BYTES;
            let mut mask = changed_mask::<W, V3>(&base[bytes.clone()], &target[bytes]);
            while mask != 0 {
                let position = block + mask.trailing_zeros() as usize;
                let exponent = single.exponent(W::load(base, position)) as usize;
                let step = step_value(W::load(base, position), W::load(target, position));
                changed[exponent] += 1;
                symbols[exponent][step.min(ESCAPE) as usize] += 1;
                if step >= ESCAPE {
                    escape_bits[exponent] += exp_golomb_len(step - ESCAPE);
                }
                found += 1;
                mask &= mask - 1;
            }
        }
        found
    };
    let mut stride = coarsest;
    let mut sampled_changes: u64 = (0..runs).step_by(stride).map(&mut sample_run).sum();
    while sampled_changes < ENOUGH_SAMPLED_CHANGES && stride > FINEST_SAMPLE_STRIDE {
        sampled_changes += (stride / 2..runs)
            .step_by(stride)
            .map(&mut sample_run)
            .sum::<u64>();
        stride /= 2;
    }
    let population: Vec<u64> = (0..exponents)
        .map(|e| {
            let sampled: u64 = populations.iter().map(|counts| u64::from(counts[e])).sum();
            sampled * len as u64 / population_sampled.max(1)
        })
        .collect();
    let weight = stride as u64;
    for e in 0..exponents {
        changed[e] *= weight;
        escape_bits[e] *= weight;
        for count in &mut symbols[e] {
            *count *= weight;
        }
    }
    // The sample's changes of each exponent, summed by class.
    let expected_changes = |classes: &Classes| {
        let mut expected = [0usize; MAX_CLASSES];
        for (exponent, &count) in changed.iter().enumerate() {
            expected[classes.class_of_exponent(exponent as u32)] += count as usize;
        }
        expected
    };
    // Classes only pay off with enough changes to amortise their headers.
    if sampled_changes * (stride as u64) < 64 || len < 4096 {
        let expected = expected_changes(&single);
        return (single, expected);
    }
    let present: Vec<usize> = (0..exponents)
        .filter(|&e| population[e] > 0 || changed[e] > 0)
        .collect();
    let per_bin = present.len().div_ceil(MAX_BINS).max(1);
    let bins: Vec<Bin> = present
        .chunks(per_bin)
        .map(|group| {
            let mut bin = Bin {
                first_exponent: group[0] as u32,
                population: 0,
                changed: 0,
                symbols: [0; ALPHABET],
                escape_bits: 0,
            };
            for &e in group {
                bin.population += population[e];
                bin.changed += changed[e];
                bin.escape_bits += escape_bits[e];
                for (total, count) in bin.symbols.iter_mut().zip(&symbols[e]) {
                    *total += count;
                }
            }
            bin.population = bin.population.max(bin.changed);
            bin
        })
        .collect();

    let n = bins.len();
    // cost[i][j]: bits of one class covering bins i..=j.
    let mut cost = vec![vec![f64::INFINITY; n]; n];
    for (i, row) in cost.iter_mut().enumerate() {
        let mut merged = Bin {
            first_exponent: 0,
            population: 0,
            changed: 0,
            symbols: [0; ALPHABET],
            escape_bits: 0,
        };
        for (j, bin) in bins.iter().enumerate().skip(i) {
            merged.population += bin.population;
            merged.changed += bin.changed;
            merged.escape_bits += bin.escape_bits;
            for (total, count) in merged.symbols.iter_mut().zip(&bin.symbols) {
                *total += count;
            }
            row[j] = class_cost_bits(&merged);
        }
    }
    // best[k][j]: cheapest cover of bins 0..=j by k+1 classes, with the start of the last.
    let mut best = vec![vec![(f64::INFINITY, 0usize); n]; MAX_CLASSES];
    for j in 0..n {
        best[0][j] = (cost[0][j], 0);
    }
    for k in 1..MAX_CLASSES {
        for j in k..n {
            for start in k..=j {
                let candidate = best[k - 1][start - 1].0 + cost[start][j] + 8.0;
                if candidate < best[k][j].0 {
                    best[k][j] = (candidate, start);
                }
            }
        }
    }
    // Every class adds work per element to both scans (a compare, a mask and a count per
    // 64 elements), so each is charged SCAN_BITS_PER_CLASS per element of the chunk,
    // then the fewest classes whose charged size is within CLASS_TOLERANCE of the best.
    let charged = |k: usize| best[k][n - 1].0 + (k * len) as f64 * SCAN_BITS_PER_CLASS;
    let smallest = (0..MAX_CLASSES).map(charged).fold(f64::INFINITY, f64::min);
    let classes_minus_one = (0..MAX_CLASSES)
        .find(|&k| charged(k) <= smallest * (1.0 + CLASS_TOLERANCE))
        .expect("the best class count qualifies");
    let mut thresholds = Vec::with_capacity(classes_minus_one);
    let mut end = n - 1;
    for k in (1..=classes_minus_one).rev() {
        let start = best[k][end].1;
        thresholds.push(bins[start].first_exponent);
        end = start - 1;
    }
    thresholds.reverse();
    let classes = Classes::new(layout, thresholds);
    let expected = expected_changes(&classes);
    (classes, expected)
}

fn class_cost_bits(bin: &Bin) -> f64 {
    if bin.changed == 0 {
        return 8.0;
    }
    let n = bin.population as f64;
    let c = bin.changed as f64;
    let positions = if bin.changed >= bin.population {
        c
    } else {
        c * (n / c).log2() + (n - c) * (n / (n - c)).log2()
    };
    let present = bin.symbols.iter().filter(|&&s| s > 0).count() as f64;
    let steps: f64 = bin
        .symbols
        .iter()
        .filter(|&&s| s > 0)
        .map(|&s| s as f64 * (c / s as f64).log2())
        .sum();
    let header = 8.0 * (leb128_len(bin.changed) as f64 + 2.0 + 2.0 + 1.5 * present);
    positions + steps + bin.escape_bits as f64 + header
}
