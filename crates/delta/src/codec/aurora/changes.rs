//! The encoder's scan: one pass over the chunk finds each change's class, rank and step.
//! Kept apart for its unchecked writes into reserved room.

use crate::codec::scan::{
    Classes, MAX_CLASSES, Word, changed_mask, count_ones, padded_block, step_value,
};

/// A changed element: its rank in its class and its step value (both fit 32 bits: ranks
/// are bounded by `MAX_CHUNK_ELEMENTS`, steps by the 32-bit word).
#[derive(Clone, Copy)]
pub(super) struct Change {
    pub(super) rank: u32,
    pub(super) step: u32,
}

/// Blocks [`find_changes`] scans between two checks of its change lists' room. The scan
/// writes each change without a capacity test: with `Vec::push`, whose growth is a call,
/// inside the loop, the compiler kept the loop's pointers and SIMD constants in memory
/// (extraction 5 to 6% slower).
pub(super) const WINDOW_BLOCKS: usize = 256;

/// One pass over the chunk finds each changed element, its class, rank and step while
/// its block is in cache. Returns the changes of each class in rank order.
#[inline(always)]
pub(super) fn find_changes<W: Word, const T: usize, const V3: bool>(
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
