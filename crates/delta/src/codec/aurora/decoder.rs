//! The decoder's front half: parsing and bounds-checking the header, then reading the
//! gap and step streams into per-class changes for [`locate`](super::locate) to place.

use super::locate::locate_body;
#[cfg(target_arch = "x86_64")]
use super::locate::locate_v3;
#[cfg(target_arch = "x86_64")]
use super::x86_64_v3;
use super::{ESCAPE, bad};
use crate::bits::{BitReader, ByteReader};
use crate::codec::entropy::{GolombDecoder, Model, RansDecoder};
#[cfg(target_arch = "x86_64")]
use crate::codec::scan::fast_pdep;
use crate::codec::scan::{Classes, MAX_CLASSES, Word, max_step_value};
use crate::dtype::FloatLayout;
use crate::error::Result;

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
pub(super) fn decode_body<W: Word>(
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
pub(super) struct ClassChange {
    pub(super) gap: u32,
    pub(super) step: u32,
}

impl ClassChange {
    /// Ends a class: its gap carries the class's next change beyond any chunk.
    const SENTINEL: ClassChange = ClassChange {
        gap: u32::MAX,
        step: 0,
    };
}
