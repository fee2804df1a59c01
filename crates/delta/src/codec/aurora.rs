//! The `aurora` sparse encoding (docs/delta-format.md §6.3).
//!
//! Why it is small: whether an element changes in one low-learning-rate step depends
//! mostly on the spacing of BF16 values around it, that is on the exponent of its base
//! value, which the receiver already holds. Elements are split into up to eight classes by
//! base exponent (boundaries chosen per chunk by dynamic programming over an estimated
//! cost), and within each class the changed elements are coded as gaps between their ranks
//! with a Golomb code tuned to the class's density. The change itself is coded as a step in
//! ordered-integer space (mostly +-1) with a per-class static rANS model. Applying a step
//! is an integer addition, so reconstruction is exact for every bit pattern.
//!
//! Why it is fast: both encoder and decoder map ranks to positions with one pass of
//! 64-element SIMD exponent masks over the base; everything else costs per changed
//! element.

use super::entropy::{
    ALPHABET, Model, RansDecoder, RansEncoder, golomb_parameter, read_golomb, write_golomb,
};
use super::scan::{Classes, MAX_CLASSES, Word, apply_step, max_step_value, select_bit, step_value};
use crate::bits::{BitReader, BitWriter, ByteReader, leb128_len, write_leb128};
use crate::dtype::FloatLayout;
use crate::error::{DeltaError, Result};

/// Step values below this are rANS symbols; larger ones use the escape symbol plus an
/// exponential-Golomb remainder.
const ESCAPE: u64 = ALPHABET as u64 - 1;
/// The encoder estimates class populations from every SAMPLE-th element.
const SAMPLE: usize = 16;
/// Exponent values are merged into at most this many bins before the class search, which
/// bounds its cost on chunks whose values span every exponent.
const MAX_BINS: usize = 64;

/// Encodes the changes of one chunk. `positions` are the ascending indices of changed
/// elements, relative to the chunk.
pub(crate) fn encode<W: Word>(
    base: &[u8],
    target: &[u8],
    layout: FloatLayout,
    positions: &[u32],
    out: &mut Vec<u8>,
) {
    let len = base.len() / W::BYTES;
    let steps: Vec<u64> = positions
        .iter()
        .map(|&p| step_value(W::load(base, p as usize), W::load(target, p as usize)))
        .collect();
    let classes = choose_classes::<W>(base, len, layout, positions, &steps);
    let class_count = classes.count();

    let mut ranks: Vec<Vec<u64>> = vec![Vec::new(); class_count];
    let mut class_steps: Vec<Vec<u64>> = vec![Vec::new(); class_count];
    let mut populations = [0u64; MAX_CLASSES];
    if class_count == 1 {
        ranks[0] = positions.iter().map(|&p| u64::from(p)).collect();
        class_steps[0] = steps;
        populations[0] = positions.last().map_or(0, |&p| u64::from(p) + 1);
    } else {
        let mut next = 0;
        let mut block = 0;
        while next < positions.len() {
            let block_len = (len - block).min(64);
            let masks = classes.masks::<W>(base, block, block_len);
            while next < positions.len() && (positions[next] as usize) < block + block_len {
                let position = positions[next] as usize;
                let class = classes.class_of(W::load(base, position));
                let below = (1u64 << (position - block)) - 1;
                ranks[class]
                    .push(populations[class] + u64::from((masks[class] & below).count_ones()));
                class_steps[class].push(steps[next]);
                next += 1;
            }
            for (population, mask) in populations.iter_mut().zip(masks) {
                *population += u64::from(mask.count_ones());
            }
            block += block_len;
        }
    }

    out.push(class_count as u8);
    out.extend(classes.thresholds.iter().map(|&t| t as u8));
    let mut models = Vec::with_capacity(class_count);
    let mut parameters = Vec::with_capacity(class_count);
    for class in 0..class_count {
        write_leb128(out, ranks[class].len() as u64);
        if ranks[class].is_empty() {
            models.push(None);
            parameters.push(1);
            continue;
        }
        let parameter = golomb_parameter(ranks[class].len() as u64, populations[class]);
        write_leb128(out, parameter);
        let model = Model::from_counts(&symbol_counts(&class_steps[class]));
        model.write(out);
        models.push(Some(model));
        parameters.push(parameter);
    }

    let mut bits = BitWriter::new();
    for class in 0..class_count {
        let mut previous: Option<u64> = None;
        for &rank in &ranks[class] {
            let gap = previous.map_or(rank, |p| rank - p - 1);
            write_golomb(&mut bits, gap, parameters[class]);
            previous = Some(rank);
        }
    }
    for steps in &class_steps {
        for &step in steps.iter().filter(|&&s| s >= ESCAPE) {
            bits.write_exp_golomb(step - ESCAPE);
        }
    }
    let mut rans = RansEncoder::default();
    for class in (0..class_count).rev() {
        if let Some(model) = &models[class] {
            for &step in class_steps[class].iter().rev() {
                rans.put(model, step.min(ESCAPE) as usize);
            }
        }
    }
    let bitstream = bits.finish();
    write_leb128(out, bitstream.len() as u64);
    out.extend_from_slice(&bitstream);
    if !positions.is_empty() {
        out.extend_from_slice(&rans.finish());
    }
}

/// The header of an `aurora` payload and its two streams.
pub(crate) struct Parsed<'a> {
    classes: Classes,
    counts: Vec<usize>,
    parameters: Vec<u64>,
    models: Vec<Option<Model>>,
    pub header_bytes: usize,
    pub bitstream: &'a [u8],
    pub rans: &'a [u8],
}

impl Parsed<'_> {
    pub fn changed(&self) -> u64 {
        self.counts.iter().map(|&c| c as u64).sum()
    }
}

/// Parses and bounds-checks the payload header of a chunk of `len` elements.
pub(crate) fn parse(payload: &[u8], layout: FloatLayout, len: u64) -> Result<Parsed<'_>> {
    let mut reader = ByteReader::new(payload);
    let class_count = reader.u8("class count")? as usize;
    if !(1..=MAX_CLASSES).contains(&class_count) {
        return Err(bad(format!(
            "class count {class_count} not in 1..={MAX_CLASSES}"
        )));
    }
    let max_exponent = layout.exponent_mask >> layout.exponent_shift;
    let mut thresholds = Vec::with_capacity(class_count - 1);
    for _ in 1..class_count {
        let threshold = u32::from(reader.u8("class threshold")?);
        let above_previous = thresholds.last().is_none_or(|&p| threshold > p);
        if threshold == 0 || threshold > max_exponent || !above_previous {
            return Err(bad(format!(
                "class threshold {threshold} out of order or range"
            )));
        }
        thresholds.push(threshold);
    }
    let classes = Classes { layout, thresholds };

    let mut counts = Vec::with_capacity(class_count);
    let mut parameters = Vec::with_capacity(class_count);
    let mut models = Vec::with_capacity(class_count);
    let mut total = 0u64;
    for _ in 0..class_count {
        let count = reader.leb128("class change count")?;
        total = total.saturating_add(count);
        if total > len {
            return Err(bad(format!(
                "{total} changes claimed in a chunk of {len} elements"
            )));
        }
        counts.push(count as usize);
        if count == 0 {
            parameters.push(1);
            models.push(None);
            continue;
        }
        let parameter = reader.leb128("Golomb parameter")?;
        if parameter == 0 || parameter > 1 << 40 {
            return Err(bad(format!("Golomb parameter {parameter} out of range")));
        }
        parameters.push(parameter);
        models.push(Some(Model::read(&mut reader)?));
    }
    let bitstream_len = reader.leb128("bitstream length")?;
    if bitstream_len > reader.remaining() as u64 {
        return Err(bad(format!(
            "bitstream of {bitstream_len} bytes but {} remain",
            reader.remaining()
        )));
    }
    let header_bytes = reader.position();
    let bitstream = reader.take(bitstream_len as usize, "bitstream")?;
    Ok(Parsed {
        classes,
        counts,
        parameters,
        models,
        header_bytes,
        bitstream,
        rans: reader.rest(),
    })
}

/// Decodes a chunk against its base, returning changed positions (ascending, relative to
/// the chunk) and the new values as little-endian bytes.
pub(crate) fn decode<W: Word>(
    payload: &[u8],
    base: &[u8],
    layout: FloatLayout,
) -> Result<(Vec<u32>, Vec<u8>)> {
    let len = base.len() / W::BYTES;
    let Parsed {
        classes,
        counts,
        parameters,
        models,
        bitstream,
        rans: rans_bytes,
        ..
    } = parse(payload, layout, len as u64)?;
    let class_count = classes.count();
    let total: usize = counts.iter().sum();
    let mut bits = BitReader::new(bitstream);

    let last_index = (len as u64).saturating_sub(1);
    let mut ranks: Vec<Vec<u64>> = Vec::with_capacity(class_count);
    for class in 0..class_count {
        let mut class_ranks = Vec::with_capacity(counts[class]);
        let mut next_rank = 0u64;
        for _ in 0..counts[class] {
            let gap = read_golomb(&mut bits, parameters[class], last_index)?;
            let rank = next_rank + gap;
            if rank > last_index {
                return Err(bad(format!("change rank {rank} beyond the chunk")));
            }
            class_ranks.push(rank);
            next_rank = rank + 1;
        }
        ranks.push(class_ranks);
    }

    let mut steps: Vec<Vec<u64>> = Vec::with_capacity(class_count);
    if total > 0 {
        let mut rans = RansDecoder::new(rans_bytes)?;
        for class in 0..class_count {
            let mut class_steps = Vec::with_capacity(counts[class]);
            if let Some(model) = &models[class] {
                for _ in 0..counts[class] {
                    class_steps.push(rans.get(model)? as u64);
                }
            }
            steps.push(class_steps);
        }
        rans.finish()?;
        for step in steps.iter_mut().flatten().filter(|s| **s >= ESCAPE) {
            *step = ESCAPE.saturating_add(bits.read_exp_golomb()?);
            if *step > max_step_value::<W>() {
                return Err(bad(format!("step value {step} too large for the dtype")));
            }
        }
    } else if !rans_bytes.is_empty() {
        return Err(bad("trailing bytes after an empty chunk".into()));
    }
    bits.finish()?;

    let located = locate::<W>(base, len, &classes, &ranks)?;
    let mut values = vec![0u8; located.len() * W::BYTES];
    let mut positions = Vec::with_capacity(located.len());
    for (i, &(position, class, index)) in located.iter().enumerate() {
        let old = W::load(base, position as usize);
        apply_step(old, steps[class as usize][index as usize]).store(&mut values, i);
        positions.push(position);
    }
    Ok((positions, values))
}

fn bad(reason: String) -> DeltaError {
    DeltaError::Malformed(reason)
}

/// Maps per-class ranks to positions: (position, class, index within the class).
fn locate<W: Word>(
    base: &[u8],
    len: usize,
    classes: &Classes,
    ranks: &[Vec<u64>],
) -> Result<Vec<(u32, u8, u32)>> {
    let total: usize = ranks.iter().map(Vec::len).sum();
    let mut out = Vec::with_capacity(total);
    if classes.count() == 1 {
        out.extend(
            ranks[0]
                .iter()
                .enumerate()
                .map(|(i, &r)| (r as u32, 0, i as u32)),
        );
        return Ok(out);
    }
    let mut next = [0usize; MAX_CLASSES];
    let mut seen = [0u64; MAX_CLASSES];
    let mut remaining = total;
    let mut block = 0;
    while remaining > 0 && block < len {
        let block_len = (len - block).min(64);
        let masks = classes.masks::<W>(base, block, block_len);
        let block_first = out.len();
        for class in 0..classes.count() {
            let mask = masks[class];
            let population = u64::from(mask.count_ones());
            let class_ranks = &ranks[class];
            while next[class] < class_ranks.len()
                && class_ranks[next[class]] < seen[class] + population
            {
                let bit = select_bit(mask, (class_ranks[next[class]] - seen[class]) as u32);
                out.push((
                    (block + bit as usize) as u32,
                    class as u8,
                    next[class] as u32,
                ));
                next[class] += 1;
                remaining -= 1;
            }
            seen[class] += population;
        }
        if out.len() - block_first > 1 {
            out[block_first..].sort_unstable_by_key(|entry| entry.0);
        }
        block += block_len;
    }
    if remaining > 0 {
        return Err(bad(format!(
            "{remaining} change ranks lie beyond their class's population"
        )));
    }
    Ok(out)
}

fn symbol_counts(steps: &[u64]) -> [u64; ALPHABET] {
    let mut counts = [0u64; ALPHABET];
    for &step in steps {
        counts[step.min(ESCAPE) as usize] += 1;
    }
    counts
}

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
/// and each class pays for its header and table.
fn choose_classes<W: Word>(
    base: &[u8],
    len: usize,
    layout: FloatLayout,
    positions: &[u32],
    steps: &[u64],
) -> Classes {
    let single = Classes {
        layout,
        thresholds: Vec::new(),
    };
    let exponents = (layout.exponent_mask >> layout.exponent_shift) as usize + 1;
    // Classes only pay off with enough changes to amortise their headers.
    if positions.len() < 64 || len < 4096 {
        return single;
    }
    let mut population = vec![0u64; exponents];
    let mut index = 0;
    while index < len {
        population[single.exponent(W::load(base, index)) as usize] += SAMPLE as u64;
        index += SAMPLE;
    }
    let mut changed = vec![0u64; exponents];
    let mut symbols = vec![[0u64; ALPHABET]; exponents];
    let mut escape_bits = vec![0u64; exponents];
    for (&position, &step) in positions.iter().zip(steps) {
        let exponent = single.exponent(W::load(base, position as usize)) as usize;
        changed[exponent] += 1;
        symbols[exponent][step.min(ESCAPE) as usize] += 1;
        if step >= ESCAPE {
            escape_bits[exponent] += exp_golomb_len(step - ESCAPE);
        }
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
    for i in 0..n {
        let mut merged = Bin {
            first_exponent: 0,
            population: 0,
            changed: 0,
            symbols: [0; ALPHABET],
            escape_bits: 0,
        };
        for j in i..n {
            merged.population += bins[j].population;
            merged.changed += bins[j].changed;
            merged.escape_bits += bins[j].escape_bits;
            for (total, count) in merged.symbols.iter_mut().zip(&bins[j].symbols) {
                *total += count;
            }
            cost[i][j] = class_cost_bits(&merged);
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
    let (classes_minus_one, _) = (0..MAX_CLASSES)
        .map(|k| (k, best[k][n - 1].0))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .expect("at least one class count");
    let mut thresholds = Vec::with_capacity(classes_minus_one);
    let mut end = n - 1;
    for k in (1..=classes_minus_one).rev() {
        let start = best[k][end].1;
        thresholds.push(bins[start].first_exponent);
        end = start - 1;
    }
    thresholds.reverse();
    Classes { layout, thresholds }
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

fn exp_golomb_len(value: u64) -> u64 {
    let width = 128 - (u128::from(value) + 1).leading_zeros() as u64;
    2 * width - 1
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::entropy::golomb_len;
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
            let word =
                ((next() & 1) << 15) as u16 | (exponent << 7) as u16 | (next() & 0x7F) as u16;
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
        encode::<u16>(base, target, BF16, positions, &mut payload);
        let (decoded, values) = decode::<u16>(&payload, base, BF16).unwrap();
        assert_eq!(decoded, positions);
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
        let steps: Vec<u64> = positions
            .iter()
            .map(|&p| step_value(u16::load(&base, p as usize), u16::load(&target, p as usize)))
            .collect();
        let classes = choose_classes::<u16>(&base, base.len() / 2, BF16, &positions, &steps);
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
    fn hostile_payloads_are_rejected_not_panicked_on() {
        let (base, target, positions) = realistic(8192, 3);
        let mut payload = Vec::new();
        encode::<u16>(&base, &target, BF16, &positions, &mut payload);
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
            encode::<u32>(&base, &target, layout, &positions, &mut payload);
            let (decoded, values) = decode::<u32>(&payload, &base, layout).unwrap();
            prop_assert_eq!(&decoded, &positions);
            for (i, &p) in decoded.iter().enumerate() {
                prop_assert_eq!(&values[4 * i..4 * i + 4], &target[4 * p as usize..4 * p as usize + 4]);
            }
        }
    }
}
