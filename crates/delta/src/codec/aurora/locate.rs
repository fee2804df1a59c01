//! The decoder's scan: per-class ranks mapped back to positions over the base's exponent
//! masks. Holds the `unsafe` writes and the room check that keeps them in bounds.

use super::bad;
use super::decoder::ClassChange;
use crate::codec::scan::{
    Classes, MAX_CLASSES, Word, apply_step, padded_block, select, with_threshold_count,
};
use crate::error::Result;
use crate::format::MAX_CHUNK_ELEMENTS;

/// A function of its own: inlined into the entropy decoding it loses registers to it and
/// runs a quarter more instructions.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,bmi1,bmi2,popcnt,lzcnt")]
#[inline(never)]
pub(super) unsafe fn locate_v3<W: Word, const PDEP: bool>(
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
pub(super) fn locate_body<W: Word, const V3: bool, const PDEP: bool>(
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
