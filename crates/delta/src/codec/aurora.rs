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
    ALPHABET, GolombDecoder, GolombEncoder, Model, RansDecoder, RansEncoder, golomb_parameter,
};
#[cfg(target_arch = "x86_64")]
use super::scan::fast_pdep;
use super::scan::{
    Classes, MAX_CLASSES, Word, apply_step, changed_mask, count_ones, max_step_value, padded_block,
    select, step_value, with_threshold_count,
};
use std::ops::Range;

use crate::bits::{BitReader, BitWriter, ByteReader, exp_golomb_len, leb128_len, write_leb128};
use crate::dtype::FloatLayout;
use crate::error::{DeltaError, Result};
use crate::format::MAX_CHUNK_ELEMENTS;

/// Step values below this are rANS symbols; larger ones use the escape symbol plus an
/// exponential-Golomb remainder.
const ESCAPE: u64 = ALPHABET as u64 - 1;
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

/// Encodes the changes between two equally long ranges of a tensor, or returns `false`
/// (writing nothing) when nothing changed.
pub(crate) fn encode<W: Word>(
    base: &[u8],
    target: &[u8],
    layout: FloatLayout,
    out: &mut Vec<u8>,
) -> Option<Coded> {
    #[cfg(target_arch = "x86_64")]
    if x86_64_v3() {
        // SAFETY: the CPU supports every feature the variant is compiled for.
        return unsafe { encode_v3::<W>(base, target, layout, out) };
    }
    encode_body::<W, false>(base, target, layout, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,bmi1,bmi2,popcnt,lzcnt")]
unsafe fn encode_v3<W: Word>(
    base: &[u8],
    target: &[u8],
    layout: FloatLayout,
    out: &mut Vec<u8>,
) -> Option<Coded> {
    encode_body::<W, true>(base, target, layout, out)
}

/// `V3`: compiled for x86-64-v3 and running on it.
#[inline(always)]
fn encode_body<W: Word, const V3: bool>(
    base: &[u8],
    target: &[u8],
    layout: FloatLayout,
    out: &mut Vec<u8>,
) -> Option<Coded> {
    let len = base.len() / W::BYTES;
    let (classes, expected_changes) = choose_classes::<W, V3>(base, target, len, layout);
    let class_count = classes.count();

    let changes = with_threshold_count!(classes.thresholds.len(), T => {
        find_changes::<W, T, V3>(base, target, len, &classes, &expected_changes)
    });
    if changes.iter().all(Vec::is_empty) {
        return None;
    }

    out.push(class_count as u8);
    out.extend(classes.thresholds.iter().map(|&t| t as u8));
    let mut coders = Vec::with_capacity(class_count);
    let mut escapes = Vec::new();
    for class_changes in &changes {
        write_leb128(out, class_changes.len() as u64);
        let Some(last) = class_changes.last() else {
            continue;
        };
        // Gaps after a class's last change are never coded, so its density is measured
        // up to it.
        let parameter = golomb_parameter(class_changes.len() as u64, u64::from(last.rank) + 1);
        write_leb128(out, parameter);
        let model = Model::from_counts(&symbol_counts(class_changes, &mut escapes));
        model.write(out);
        coders.push(ClassCoder {
            changes: class_changes,
            golomb: GolombEncoder::new(parameter),
            model,
        });
    }
    let (mut bits, rans) = code_gaps_and_steps(&coders);
    // Streaks are counted only where the escapes alone could make a run: a pass over the
    // changes that ordinary ranges need not pay.
    let coded = Coded {
        may_hold_replaced_runs: escapes.len() >= DENSE_RUN_ELEMENTS
            && changes.iter().map(|c| streaked_changes(c)).sum::<usize>() >= DENSE_RUN_ELEMENTS / 2,
    };
    bits.reserve(escapes.iter().copied().map(exp_golomb_len).sum());
    for escape in escapes {
        // SAFETY: room for every escape's code was reserved just before.
        unsafe { bits.write_exp_golomb(escape) };
    }
    let bitstream = bits.finish();
    write_leb128(out, bitstream.len() as u64);
    out.extend_from_slice(&bitstream);
    out.extend_from_slice(&rans.finish());
    Some(coded)
}

/// The shortest run of replaced values worth a dense record of its own; a range is
/// searched for runs ([`escaped_runs`]) when it coded at least this many escaped steps
/// (steps beyond the rANS alphabet: values replaced rather than nudged, which cost about
/// twice their dense size) and half as many of its changes lie in streaks
/// ([`streaked_changes`]).
pub(crate) const DENSE_RUN_ELEMENTS: usize = 256;

/// What [`encode`] coded, beyond the bytes.
pub(crate) struct Coded {
    /// Whether the range may hold runs of replaced values (see [`DENSE_RUN_ELEMENTS`]).
    pub may_hold_replaced_runs: bool,
}

/// Changes of a class (in rank order) that lie in streaks of at least 32 consecutive
/// members of the class that all changed by escaped steps, counted in classes where at
/// most half the members changed. Where values were replaced wholesale every element
/// changed by a long step, so each class meets them as one streak; the changes of a
/// training step are spread and mostly short. (Measured on the 0.6B model's 10% step:
/// streaks of mere changes, escaped or not, reached 32 in 38 of its 272 ranges, since
/// neighbouring weights share gradients; a class of the smallest weights can change
/// almost everywhere by long steps, hence the density bound.) One pass over the
/// changes, which [`escaped_runs`], a pass over the range, is only worth after.
fn streaked_changes(changes: &[Change]) -> usize {
    const STREAK: usize = 32;
    let Some(last) = changes.last() else {
        return 0;
    };
    if 2 * changes.len() as u64 > u64::from(last.rank) + 1 {
        return 0;
    }
    let (mut total, mut length) = (0, 0);
    // The rank of the streak's last change, while a streak is open.
    let mut previous: Option<u32> = None;
    for change in changes {
        let escaped = u64::from(change.step) >= ESCAPE;
        if escaped && previous.is_some_and(|p| change.rank == p + 1) {
            length += 1;
        } else {
            total += if length >= STREAK { length } else { 0 };
            length = usize::from(escaped);
        }
        previous = escaped.then_some(change.rank);
    }
    total + if length >= STREAK { length } else { 0 }
}

/// Runs of at least [`DENSE_RUN_ELEMENTS`] elements whose changes are escaped steps
/// (values replaced rather than nudged, as in an embedding row re-initialised), allowing
/// a few other elements between them: candidates for dense coding. Ranges in elements,
/// ascending.
pub(crate) fn escaped_runs<W: Word>(base: &[u8], target: &[u8]) -> Vec<Range<usize>> {
    /// Elements that are not escaped changes a run may hold in a row (a replaced value
    /// can land near the old one).
    const MAX_INTERRUPTION: usize = 4;
    let len = base.len() / W::BYTES;
    let mut runs = Vec::new();
    let mut run: Option<Range<usize>> = None;
    for index in 0..len {
        let (old, new) = (W::load(base, index), W::load(target, index));
        if old == new || step_value(old, new) < ESCAPE {
            continue;
        }
        run = match run {
            Some(current) if index - current.end <= MAX_INTERRUPTION => {
                Some(current.start..index + 1)
            }
            finished => {
                runs.extend(finished.filter(|r| r.len() >= DENSE_RUN_ELEMENTS));
                Some(index..index + 1)
            }
        };
    }
    runs.extend(run.filter(|r| r.len() >= DENSE_RUN_ELEMENTS));
    runs
}

/// What codes the changes of a class that has some.
struct ClassCoder<'a> {
    changes: &'a [Change],
    golomb: GolombEncoder,
    model: Model,
}

/// Writes every class's gaps (first class first, each in rank order) and pushes every
/// class's steps to the rANS coder (last class first, each in reverse: rANS is last in,
/// first out), walking the two sequences from opposite ends in one loop. The rANS update
/// is a chain of dependent multiplies that leaves most of the core idle; in the same loop
/// the gap codes run in its shadow. On the 0.6B model's 1% step this loop takes 39 to 62
/// ms; in loops of their own the gaps took 29 to 42 and the steps about 33.
#[inline(always)]
fn code_gaps_and_steps(coders: &[ClassCoder<'_>]) -> (BitWriter, RansEncoder) {
    let total: usize = coders.iter().map(|c| c.changes.len()).sum();
    let mut bits = BitWriter::new();
    // A class's gaps sum to less than the elements up to its last change.
    let gap_bits = |c: &ClassCoder<'_>| {
        let population = c.changes.last().map_or(0, |last| u64::from(last.rank) + 1);
        c.golomb.max_bits(c.changes.len() as u64, population)
    };
    bits.reserve(coders.iter().map(gap_bits).sum());
    let mut rans = RansEncoder::new(total);
    // The gap side is at `gaps_done` changes into class `gap_class`, the step side has
    // `steps_left` changes of class `step_class` still to push.
    let (mut gap_class, mut gaps_done, mut next_rank) = (0, 0, 0);
    let mut step_class = coders.len().wrapping_sub(1);
    let mut steps_left = coders.last().map_or(0, |c| c.changes.len());
    let mut left = total;
    while left > 0 {
        if gaps_done == coders[gap_class].changes.len() {
            (gap_class, gaps_done, next_rank) = (gap_class + 1, 0, 0);
        }
        if steps_left == 0 {
            step_class -= 1;
            steps_left = coders[step_class].changes.len();
        }
        let (gap_coder, step_coder) = (&coders[gap_class], &coders[step_class]);
        let run = (gap_coder.changes.len() - gaps_done).min(steps_left);
        let gaps = &gap_coder.changes[gaps_done..gaps_done + run];
        let steps = &step_coder.changes[steps_left - run..steps_left];
        for (gap, step) in gaps.iter().zip(steps.iter().rev()) {
            // SAFETY: the room reserved covers every class's gaps (`gap_bits`), and the
            // rANS encoder was made for every change, each pushed once.
            unsafe {
                gap_coder
                    .golomb
                    .write(&mut bits, u64::from(gap.rank - next_rank));
                rans.put(&step_coder.model, u64::from(step.step).min(ESCAPE) as usize);
            }
            next_rank = gap.rank + 1;
        }
        (gaps_done, steps_left, left) = (gaps_done + run, steps_left - run, left - run);
    }
    (bits, rans)
}

/// A changed element: its rank in its class and its step value (both fit 32 bits: ranks
/// are bounded by `MAX_CHUNK_ELEMENTS`, steps by the 32-bit word).
#[derive(Clone, Copy)]
struct Change {
    rank: u32,
    step: u32,
}

/// Blocks [`find_changes`] scans between two checks of its change lists' room. The scan
/// writes each change without a capacity test: with `Vec::push`, whose growth is a call,
/// inside the loop, the compiler kept the loop's pointers and SIMD constants in memory
/// (extraction 5 to 6% slower).
const WINDOW_BLOCKS: usize = 256;

/// One pass over the chunk finds each changed element, its class, rank and step while
/// its block is in cache. Returns the changes of each class in rank order.
#[inline(always)]
fn find_changes<W: Word, const T: usize, const V3: bool>(
    base: &[u8],
    target: &[u8],
    len: usize,
    classes: &Classes,
    expected_changes: &[usize; MAX_CLASSES],
) -> Vec<Vec<Change>> {
    let mut found = FoundChanges {
        // Room for the changes the class search expects, a quarter more for its sampling
        // error, and the window `reserve` asks for: the lists then rarely grow, and a
        // growth copies a list (sizing them up front saved 1.5 and 3.7% of the extraction
        // in two runs).
        changes: std::array::from_fn(|class| {
            if class > T {
                return Vec::new();
            }
            let expected = expected_changes[class];
            Vec::with_capacity((expected + expected / 4 + WINDOW_BLOCKS * 64).min(len))
        }),
        at_least_before: [0; MAX_CLASSES + 1],
    };
    let block_bytes = 64 * W::BYTES;
    // The whole blocks, then the chunk's last, shorter block if it has one.
    let whole = len / 64 * block_bytes;
    let window_bytes = WINDOW_BLOCKS * block_bytes;
    for (old_window, new_window) in base[..whole]
        .chunks(window_bytes)
        .zip(target[..whole].chunks(window_bytes))
    {
        found.reserve::<T>(old_window.len() / W::BYTES);
        for (old, new) in old_window
            .chunks_exact(block_bytes)
            .zip(new_window.chunks_exact(block_bytes))
        {
            let changed = changed_mask::<W, V3>(old, new);
            let at_least = classes.at_least::<W, T, V3>(old);
            // SAFETY: the window's reservation has room for each of its elements.
            unsafe { found.block::<W, T, V3>(old, new, changed, &at_least, classes) };
        }
    }
    let (old_tail, new_tail) = (&base[whole..len * W::BYTES], &target[whole..len * W::BYTES]);
    if !old_tail.is_empty() {
        let ((old, valid), (new, _)) = (padded_block::<W>(old_tail), padded_block::<W>(new_tail));
        let (old, new) = (&old[..block_bytes], &new[..block_bytes]);
        let changed = changed_mask::<W, V3>(old, new);
        let at_least = classes.at_least::<W, T, V3>(old).map(|mask| mask & valid);
        found.reserve::<T>(64);
        // SAFETY: room for a whole block was reserved.
        unsafe { found.block::<W, T, V3>(old, new, changed, &at_least, classes) };
    }
    found.changes.into_iter().take(T + 1).collect()
}

/// The changes [`find_changes`] has found so far.
struct FoundChanges {
    changes: [Vec<Change>; MAX_CLASSES],
    /// Elements before the current block in each entry of `Classes::at_least`, so the
    /// members of class c before the block are the difference of entries c and c + 1.
    at_least_before: [u32; MAX_CLASSES + 1],
}

impl FoundChanges {
    /// Makes room in every class's list for `elements` more changes.
    fn reserve<const T: usize>(&mut self, elements: usize) {
        for changes in &mut self.changes[..=T] {
            changes.reserve(elements);
        }
    }

    /// Adds the changes of a block (old and new bytes, the mask of changed elements and
    /// the class masks of [`Classes::at_least`]) and moves past it.
    ///
    /// # Safety
    /// Every class's list has room for as many more changes as `changed` has set bits.
    #[inline(always)]
    unsafe fn block<W: Word, const T: usize, const V3: bool>(
        &mut self,
        old: &[u8],
        new: &[u8],
        mut changed: u64,
        at_least: &[u64; MAX_CLASSES + 1],
        classes: &Classes,
    ) {
        while changed != 0 {
            let bit = changed.trailing_zeros() as usize;
            let value = W::load(old, bit);
            // Classes are below MAX_CLASSES; the mask lets the compiler see it.
            let class = classes.class_of(value) & (MAX_CLASSES - 1);
            let below = (1u64 << bit) - 1;
            let from_class =
                self.at_least_before[class] + count_ones::<V3>(at_least[class] & below);
            let above_class =
                self.at_least_before[class + 1] + count_ones::<V3>(at_least[class + 1] & below);
            let change = Change {
                rank: from_class - above_class,
                step: step_value(value, W::load(new, bit)) as u32,
            };
            let changes = &mut self.changes[class];
            let count = changes.len();
            debug_assert!(count < changes.capacity(), "room reserved for the block");
            // SAFETY: the caller vouches for the room; the length grows over what was
            // written.
            unsafe {
                changes.as_mut_ptr().add(count).write(change);
                changes.set_len(count + 1);
            }
            changed &= changed - 1;
        }
        for (before, &mask) in self.at_least_before.iter_mut().zip(at_least).take(T + 1) {
            *before += count_ones::<V3>(mask);
        }
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
    let classes = Classes::new(layout, thresholds);

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
    // An encoder emits no chunk for a range without changes (§6.3).
    if total == 0 {
        return Err(bad("the chunk carries no changes".into()));
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
    #[cfg(target_arch = "x86_64")]
    if x86_64_v3() {
        // SAFETY: the CPU supports every feature the variant is compiled for.
        return unsafe { decode_v3::<W>(payload, base, layout) };
    }
    decode_body::<W>(payload, base, layout, locate_body::<W, false, false>)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,bmi1,bmi2,popcnt,lzcnt")]
unsafe fn decode_v3<W: Word>(
    payload: &[u8],
    base: &[u8],
    layout: FloatLayout,
) -> Result<(Vec<u32>, Vec<u8>)> {
    // The scan is a function of its own: inlined here it loses registers to the entropy
    // decoding and runs a quarter more instructions.
    let locate = if fast_pdep() {
        locate_v3::<W, true>
    } else {
        locate_v3::<W, false>
    };
    // SAFETY: the CPU supports every feature `locate_v3` is compiled for.
    decode_body::<W>(
        payload,
        base,
        layout,
        |base, len, classes, changes, starts| unsafe {
            locate(base, len, classes, changes, starts)
        },
    )
}

/// Reads both streams of a chunk, then hands the per-class changes to `locate`, which
/// maps ranks to positions (a variant of [`locate_body`]).
#[inline(always)]
fn decode_body<W: Word>(
    payload: &[u8],
    base: &[u8],
    layout: FloatLayout,
    locate: impl FnOnce(&[u8], usize, &Classes, &[ClassChange], &[usize]) -> Result<(Vec<u32>, Vec<u8>)>,
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
    let mut bits = BitReader::new(bitstream);

    // One flat list for all classes, each class's changes followed by a sentinel, so the
    // scan in `locate` needs no end-of-class test (see `ClassChange`).
    let total: usize = counts.iter().sum();
    let mut changes: Vec<ClassChange> = Vec::with_capacity(total + class_count);
    let mut starts = [0usize; MAX_CLASSES];
    let last_index = (len as u64).saturating_sub(1);
    // Gaps and steps come in the same order, class by class in rank order, so one loop
    // reads both streams: the bit reader's and the rANS state's dependency chains then
    // overlap instead of running one after the other.
    let mut rans = RansDecoder::new(rans_bytes)?;
    for class in 0..class_count {
        starts[class] = changes.len();
        if let Some(model) = &models[class] {
            let golomb = GolombDecoder::new(parameters[class], last_index);
            decode_class(
                &mut bits,
                &mut rans,
                &golomb,
                model,
                counts[class],
                last_index,
                &mut changes,
            )?;
        }
        changes.push(ClassChange::SENTINEL);
    }
    rans.finish()?;
    // Steps beyond the rANS alphabet are rare: their remainders follow every gap in the
    // bit stream, in the same order.
    for change in changes.iter_mut().filter(|c| c.step == ESCAPE as u32) {
        let step = ESCAPE.saturating_add(bits.read_exp_golomb()?);
        if step > max_step_value::<W>() {
            return Err(bad(format!("step value {step} too large for the dtype")));
        }
        change.step = step as u32;
    }
    bits.finish()?;

    locate(base, len, &classes, &changes, &starts[..class_count])
}

/// Appends the gaps and steps of a class's `count` changes to `changes`. Both decoders
/// are copied into locals for the loop and written back after it, and the loop keeps no
/// more state than it must: a decoder whose address reaches a call that is not inlined,
/// or that the register allocator runs short for, lives in memory, and its state was
/// then stored and reloaded on every code.
#[inline(always)]
fn decode_class(
    bits: &mut BitReader<'_>,
    rans: &mut RansDecoder<'_>,
    golomb: &GolombDecoder,
    model: &Model,
    count: usize,
    last_index: u64,
    changes: &mut Vec<ClassChange>,
) -> Result<()> {
    let (mut reader, mut state) = (bits.clone(), rans.clone());
    let slots = model.slots();
    let start = changes.len();
    changes.reserve(count);
    // Ranks only grow within a class, so bounding the last bounds them all; each gap is
    // bounded by the Golomb decoder, so the sum cannot overflow.
    let mut next_rank = 0u64;
    for slot in &mut changes.spare_capacity_mut()[..count] {
        let gap = golomb.read(&mut reader)?;
        next_rank += gap + 1;
        slot.write(ClassChange {
            gap: gap as u32,
            step: state.get(slots) as u32,
        });
    }
    if next_rank > last_index + 1 {
        return Err(bad(format!(
            "change rank {} beyond the chunk",
            next_rank - 1
        )));
    }
    // SAFETY: the loop initialised the `count` entries after `start`.
    unsafe { changes.set_len(start + count) };
    (*bits, *rans) = (reader, state);
    Ok(())
}

/// A decoded change of one class: its rank gap and step value (both fit 32 bits: ranks
/// are bounded by `MAX_CHUNK_ELEMENTS`, steps by the 32-bit word).
#[derive(Clone, Copy)]
struct ClassChange {
    gap: u32,
    step: u32,
}

impl ClassChange {
    /// Ends a class: its gap carries the class's next change beyond any chunk.
    const SENTINEL: ClassChange = ClassChange {
        gap: u32::MAX,
        step: 0,
    };
}

fn bad(reason: String) -> DeltaError {
    DeltaError::Malformed(reason)
}

/// The hot loops are compiled twice: for the baseline target and, selected at run time,
/// for x86-64-v3, whose POPCNT, TZCNT and AVX2 instructions they lean on.
#[cfg(target_arch = "x86_64")]
fn x86_64_v3() -> bool {
    use std::sync::OnceLock;
    static DETECTED: OnceLock<bool> = OnceLock::new();
    *DETECTED.get_or_init(|| {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("bmi1")
            && std::arch::is_x86_feature_detected!("bmi2")
            && std::arch::is_x86_feature_detected!("popcnt")
            && std::arch::is_x86_feature_detected!("lzcnt")
    })
}

/// A function of its own: inlined into the entropy decoding it loses registers to it and
/// runs a quarter more instructions.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,bmi1,bmi2,popcnt,lzcnt")]
#[inline(never)]
unsafe fn locate_v3<W: Word, const PDEP: bool>(
    base: &[u8],
    len: usize,
    classes: &Classes,
    changes: &[ClassChange],
    starts: &[usize],
) -> Result<(Vec<u32>, Vec<u8>)> {
    locate_body::<W, true, PDEP>(base, len, classes, changes, starts)
}

/// Maps per-class ranks to positions and computes each new value while the base block
/// holding it is in cache. Returns ascending positions and the new values' bytes. `V3`:
/// compiled for x86-64-v3 and running on it; `PDEP`: the CPU's PDEP is fast (see
/// [`select`]).
#[inline(always)]
fn locate_body<W: Word, const V3: bool, const PDEP: bool>(
    base: &[u8],
    len: usize,
    classes: &Classes,
    changes: &[ClassChange],
    starts: &[usize],
) -> Result<(Vec<u32>, Vec<u8>)> {
    // The scan's pointers rely on it (see `locate_classes`).
    assert!(len as u64 <= MAX_CHUNK_ELEMENTS, "chunk of {len} elements");
    let total = changes.len() - starts.len();
    let mut located = Located::<W>::new(total);
    if classes.count() == 1 {
        // One class: ranks are positions.
        let mut position = 0usize;
        for (block, changes) in changes[..total].chunks(64).enumerate() {
            located.check_room_for_block()?;
            for (index, change) in changes.iter().enumerate() {
                position += change.gap as usize + usize::from(block + index > 0);
                // SAFETY: at most 64 pushes since the room was checked.
                unsafe { located.push(base, position, change.step) };
            }
        }
        return Ok((located.positions, located.values));
    }
    with_threshold_count!(classes.thresholds.len(), T => {
        locate_classes::<W, T, V3, PDEP>(base, len, classes, changes, starts, &mut located)?
    });
    let missing = total - located.positions.len();
    if missing > 0 {
        return Err(bad(format!(
            "{missing} change ranks lie beyond their class's population"
        )));
    }
    Ok((located.positions, located.values))
}

/// Changes found so far: ascending positions and their new values' bytes.
struct Located<W: Word> {
    positions: Vec<u32>,
    values: Vec<u8>,
    /// Changes the chunk's header declared.
    declared: usize,
    word: std::marker::PhantomData<W>,
}

impl<W: Word> Located<W> {
    /// Room for the declared changes and one block more, so that a block that starts
    /// with at most the declared changes placed never writes past it.
    fn new(declared: usize) -> Self {
        Located {
            positions: Vec::with_capacity(declared + 64),
            values: Vec::with_capacity((declared + 64) * W::BYTES),
            declared,
            word: std::marker::PhantomData,
        }
    }

    /// Checked before each block of 64 elements, which places at most 64 changes (one
    /// per element): this, not the scan's sentinels, is what keeps [`push`] inside its
    /// room in a release build whatever the artifact says. One compare per block.
    ///
    /// [`push`]: Located::push
    #[inline(always)]
    fn check_room_for_block(&self) -> Result<()> {
        if self.positions.len() > self.declared {
            return Err(bad(format!(
                "more changes located than the {} declared",
                self.declared
            )));
        }
        Ok(())
    }

    /// Records the change at `position`, computing its value while the base is in cache.
    ///
    /// Writes straight into room reserved for every change the header declared:
    /// `Vec::push` and `extend_from_slice` test for growth and copy through a slice on
    /// every call, which measured a tenth of the decoder's time.
    ///
    /// # Safety
    /// At most 64 pushes since [`check_room_for_block`] last succeeded.
    ///
    /// [`check_room_for_block`]: Located::check_room_for_block
    #[inline(always)]
    unsafe fn push(&mut self, base: &[u8], position: usize, step: u32) {
        let value = apply_step(W::load(base, position), u64::from(step)).to_u64();
        let count = self.positions.len();
        debug_assert!(
            count < self.positions.capacity() && (count + 1) * W::BYTES <= self.values.capacity(),
            "more changes located than the room checked for"
        );
        // SAFETY: both writes land inside the room the caller vouches for, and the
        // lengths grow only over what was written.
        unsafe {
            self.positions
                .as_mut_ptr()
                .add(count)
                .write(position as u32);
            self.positions.set_len(count + 1);
            std::ptr::copy_nonoverlapping(
                value.to_le_bytes().as_ptr(),
                self.values.as_mut_ptr().add(count * W::BYTES),
                W::BYTES,
            );
            self.values.set_len((count + 1) * W::BYTES);
        }
    }
}

/// The scan of [`locate_body`] for `T` thresholds.
#[inline(always)]
fn locate_classes<W: Word, const T: usize, const V3: bool, const PDEP: bool>(
    base: &[u8],
    len: usize,
    classes: &Classes,
    changes: &[ClassChange],
    starts: &[usize],
    located: &mut Located<W>,
) -> Result<()> {
    // until[c]: members of class c to pass, counted from the current block's start,
    // before its next change; a sentinel pushes it beyond every chunk once the class has
    // none left, so the loops below test nothing but ranks.
    let mut until = [u64::MAX / 2; MAX_CLASSES];
    // next[c]: class c's next change. Pointers rather than indices: an index costs a
    // register for the list's base and a bounds check per change, and the scan is short
    // of registers. They stay inside the list because each class's run ends with a
    // sentinel whose gap lifts the rank 2^32 above any population of the rest of the
    // chunk (at most MAX_CHUNK_ELEMENTS), so no block ever passes it.
    const _: () = assert!(MAX_CHUNK_ELEMENTS < 1 << 31);
    let mut next = [changes.as_ptr(); MAX_CLASSES];
    for (class, &start) in starts.iter().enumerate() {
        until[class] = u64::from(changes[start].gap);
        next[class] = changes[start..].as_ptr();
    }
    // Steps of the current block's changes by bit; only bits found in the block are read.
    // One entry more than bits: a selected bit is a trailing-zero count, which the
    // compiler knows to be at most 64, so no index needs a bounds check.
    let mut steps = [0u32; 65];
    // Places the changes in the block starting at element `$start` with class masks
    // `$at_least`. A macro, so the scan's state stays in locals: held by a struct or
    // borrowed by a function, it lived in memory.
    macro_rules! block {
        ($start:expr, $at_least:expr) => {{
            let at_least: [u64; MAX_CLASSES + 1] = $at_least;
            located.check_room_for_block()?;
            // Changes are marked in the block's bit mask with their steps beside it, so
            // they come out in position order without sorting.
            let mut found = 0u64;
            // A branch per class: each class changes in few blocks, so it is well
            // predicted and a block costs a compare per class. (Selecting every class's
            // next bit without branches measured slower than the mispredictions.) The
            // classes are unrolled by hand: as a loop, `until` and `next` lived on the
            // stack and the loop's own branch mispredicted, 10% of the decoder's time.
            macro_rules! class {
                ($c:literal) => {
                    if $c < T + 1 {
                        let mask = at_least[$c] & !at_least[$c + 1];
                        let population = u64::from(mask.count_ones());
                        let mut rank = until[$c];
                        while rank < population {
                            let bit = select::<PDEP>(mask, rank as u32);
                            found |= 1 << bit;
                            // SAFETY: `next[$c]` is a change of the class, not its
                            // sentinel (its rank is below a population), so the one after
                            // it is in the list too (see `next`).
                            unsafe {
                                steps[bit as usize] = (*next[$c]).step;
                                next[$c] = next[$c].add(1);
                                rank += u64::from((*next[$c]).gap) + 1;
                            }
                        }
                        until[$c] = rank - population;
                    }
                };
            }
            class!(0);
            class!(1);
            class!(2);
            class!(3);
            class!(4);
            class!(5);
            class!(6);
            class!(7);
            const _: () = assert!(MAX_CLASSES == 8, "one `class!` per class");
            while found != 0 {
                let bit = found.trailing_zeros() as usize;
                // SAFETY: one push per bit of the block's mask, after the room check.
                unsafe { located.push(base, $start + bit, steps[bit]) };
                found &= found - 1;
            }
        }};
    }
    // Exactly the chunk, so each block is a whole one.
    let mut blocks = base[..len * W::BYTES].chunks_exact(64 * W::BYTES);
    // Every block is scanned, even after the last change: stopping there would keep the
    // count of changes to place in a register, which the scan cannot spare.
    //
    // A block's masks are computed one block ahead of placing its changes. Whether a
    // class changes in a block is as random as the data, so its branch mispredicts; had
    // the branch to wait for the block's loads and compares, each misprediction would
    // cost their latency on top of the refill. One block ahead, the masks are ready.
    let mut pending: Option<(usize, [u64; MAX_CLASSES + 1])> = None;
    for (index, bytes) in blocks.by_ref().enumerate() {
        let at_least = classes.at_least::<W, T, V3>(bytes);
        if let Some((start, previous)) = pending {
            block!(start, previous);
        }
        pending = Some((index * 64, at_least));
    }
    if let Some((start, previous)) = pending {
        block!(start, previous);
    }
    let tail = blocks.remainder();
    if !tail.is_empty() {
        let (padded, valid) = padded_block::<W>(tail);
        let at_least = classes.at_least::<W, T, V3>(&padded[..64 * W::BYTES]);
        // The last block: what it leaves in `until` is never read.
        #[allow(unused_assignments)]
        {
            block!(len / 64 * 64, at_least.map(|mask| mask & valid));
        }
    }
    Ok(())
}

/// Counts the step symbols of a class's changes, and appends the exponential-Golomb
/// values of its escaped steps to `escapes` in order (they follow every gap in the bit
/// stream), so the changes are read once for both.
fn symbol_counts(changes: &[Change], escapes: &mut Vec<u64>) -> [u64; ALPHABET] {
    // Most steps are one of two symbols: four tables let consecutive increments of the
    // same symbol proceed without waiting on each other.
    let mut counts = [[0u64; ALPHABET]; 4];
    let mut count = |table: &mut [u64; ALPHABET], change: &Change| {
        let step = u64::from(change.step);
        if step >= ESCAPE {
            escapes.push(step - ESCAPE);
        }
        table[step.min(ESCAPE) as usize] += 1;
    };
    let mut quads = changes.chunks_exact(4);
    for quad in &mut quads {
        for (table, change) in counts.iter_mut().zip(quad) {
            count(table, change);
        }
    }
    for change in quads.remainder() {
        count(&mut counts[0], change);
    }
    std::array::from_fn(|s| counts.iter().map(|table| table[s]).sum())
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
/// and each class pays for its header and table. Statistics come from a sample of
/// 64-element blocks (every block of small chunks), which is plenty to place boundaries
/// and keeps this pre-pass a fraction of the encoding pass. Returns the classes and the
/// number of changes the sample predicts in each.
fn choose_classes<W: Word, const V3: bool>(
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::entropy::golomb_len;
    use proptest::prelude::*;

    const BF16: FloatLayout = FloatLayout {
        exponent_mask: 0x7F80,
        exponent_shift: 7,
    };

    #[test]
    fn a_block_may_start_only_with_room_for_a_whole_block() {
        let base = [0u8; 2 * 130];
        let mut located = Located::<u16>::new(2);
        assert!(located.positions.capacity() >= 2 + 64);
        located.check_room_for_block().unwrap();
        for position in 0..2 {
            // SAFETY: two pushes since the check.
            unsafe { located.push(&base, position, 1) };
        }
        // Exactly the declared changes: a block may still place up to 64 more.
        located.check_room_for_block().unwrap();
        unsafe { located.push(&base, 2, 1) };
        let error = located.check_room_for_block().unwrap_err().to_string();
        assert!(
            error.contains("more changes located than the 2 declared"),
            "{error}"
        );
    }

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
}
