//! The two full-tensor passes of the codec, kept as cheap as a memory scan:
//! finding changed elements (extraction) and computing exponent-class masks of the base
//! (both directions of the `aurora` encoding). Elements are read as unaligned
//! little-endian words, so tensors need no particular alignment inside a file.

use crate::dtype::FloatLayout;

/// A 16- or 32-bit element viewed as its raw bits.
pub(crate) trait Word: Copy + Eq + Send + Sync + std::fmt::Debug + 'static {
    const BYTES: usize;
    const BITS: u32;
    fn load(bytes: &[u8], index: usize) -> Self;
    fn store(self, bytes: &mut [u8], index: usize);
    fn to_u64(self) -> u64;
    fn from_u64(value: u64) -> Self;

    /// Maps float bits to an integer whose order is the float order (negative values
    /// reversed, -0 just below +0), so a change of one representable value is a step of
    /// one and adding steps is exact for every bit pattern, NaN included.
    fn ordered_key(self) -> u64 {
        let bits = self.to_u64();
        let (sign, all) = (1u64 << (Self::BITS - 1), (1u64 << Self::BITS) - 1);
        // Negative values flip every bit, others only the sign: chosen arithmetically,
        // because weight signs are random and a branch here mispredicts half the time.
        let negative = bits >> (Self::BITS - 1);
        bits ^ (sign | (0u64.wrapping_sub(negative) & all))
    }

    fn from_ordered_key(key: u64) -> Self {
        let (sign, all) = (1u64 << (Self::BITS - 1), (1u64 << Self::BITS) - 1);
        let negative = (key >> (Self::BITS - 1)) ^ 1;
        Self::from_u64(key ^ (sign | (0u64.wrapping_sub(negative) & all)))
    }
}

impl Word for u16 {
    const BYTES: usize = 2;
    const BITS: u32 = 16;
    #[inline(always)]
    fn load(bytes: &[u8], index: usize) -> Self {
        u16::from_le_bytes(bytes[2 * index..2 * index + 2].try_into().expect("2 bytes"))
    }
    #[inline(always)]
    fn store(self, bytes: &mut [u8], index: usize) {
        bytes[2 * index..2 * index + 2].copy_from_slice(&self.to_le_bytes());
    }
    #[inline(always)]
    fn to_u64(self) -> u64 {
        u64::from(self)
    }
    #[inline(always)]
    fn from_u64(value: u64) -> Self {
        value as u16
    }
}

impl Word for u32 {
    const BYTES: usize = 4;
    const BITS: u32 = 32;
    #[inline(always)]
    fn load(bytes: &[u8], index: usize) -> Self {
        u32::from_le_bytes(bytes[4 * index..4 * index + 4].try_into().expect("4 bytes"))
    }
    #[inline(always)]
    fn store(self, bytes: &mut [u8], index: usize) {
        bytes[4 * index..4 * index + 4].copy_from_slice(&self.to_le_bytes());
    }
    #[inline(always)]
    fn to_u64(self) -> u64 {
        u64::from(self)
    }
    #[inline(always)]
    fn from_u64(value: u64) -> Self {
        value as u32
    }
}

/// Step between two values in ordered-key space, as the symbol value the coder sees:
/// zigzag of the wrapping difference, minus one (a change is never zero).
#[inline]
pub(crate) fn step_value<W: Word>(old: W, new: W) -> u64 {
    let all = (1u64 << W::BITS) - 1;
    let difference = new.ordered_key().wrapping_sub(old.ordered_key()) & all;
    let sign = difference >> (W::BITS - 1);
    let zigzag = ((difference << 1) & all) ^ (0u64.wrapping_sub(sign) & all);
    debug_assert!(zigzag > 0, "step_value called on an unchanged element");
    zigzag - 1
}

/// Largest valid step value for a word: zigzag covers every non-zero difference.
pub(crate) fn max_step_value<W: Word>() -> u64 {
    (1u64 << W::BITS) - 2
}

/// Applies a step value to `old`; the caller has checked `value <= max_step_value`.
#[inline]
pub(crate) fn apply_step<W: Word>(old: W, value: u64) -> W {
    let all = (1u64 << W::BITS) - 1;
    let zigzag = value + 1;
    let difference = ((zigzag >> 1) ^ 0u64.wrapping_sub(zigzag & 1)) & all;
    W::from_ordered_key(old.ordered_key().wrapping_add(difference) & all)
}

/// Calls `found(index)` for every element that differs between `old` and `new`, in
/// ascending order. Elements are compared 64 at a time into a bit mask (SIMD for 16- and
/// 32-bit elements), so a 1%-dense scan runs at memory speed and only changed elements
/// cost more.
pub(crate) fn for_each_changed(
    old: &[u8],
    new: &[u8],
    element_bytes: usize,
    found: impl FnMut(usize),
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2.
        return unsafe { for_each_changed_avx2(old, new, element_bytes, found) };
    }
    for_each_changed_body::<false>(old, new, element_bytes, found)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn for_each_changed_avx2(
    old: &[u8],
    new: &[u8],
    element_bytes: usize,
    found: impl FnMut(usize),
) {
    for_each_changed_body::<true>(old, new, element_bytes, found)
}

#[inline(always)]
fn for_each_changed_body<const AVX2: bool>(
    old: &[u8],
    new: &[u8],
    element_bytes: usize,
    mut found: impl FnMut(usize),
) {
    debug_assert_eq!(old.len(), new.len());
    let len = old.len() / element_bytes;
    let mut first = 0;
    while first < len {
        let end = (first + 64).min(len);
        let bytes = first * element_bytes..end * element_bytes;
        let (old, new) = (&old[bytes.clone()], &new[bytes]);
        let mut mask = match element_bytes {
            2 => changed_mask::<u16, AVX2>(old, new),
            4 => changed_mask::<u32, AVX2>(old, new),
            _ => old
                .chunks(element_bytes)
                .zip(new.chunks(element_bytes))
                .enumerate()
                .filter(|(_, (a, b))| a != b)
                .fold(0u64, |mask, (i, _)| mask | (1 << i)),
        };
        while mask != 0 {
            found(first + mask.trailing_zeros() as usize);
            mask &= mask - 1;
        }
        first = end;
    }
}

/// Bit `i` set when element `i` of the block differs, for blocks of up to 64 elements
/// (`new` at least as long as `old`). `AVX2` is true only in code compiled for AVX2 and
/// run on a CPU that has it: it halves the instructions of the SSE2 compare, which the
/// encoder (compute-bound, unlike the plain scan) feels.
#[inline(always)]
pub(crate) fn changed_mask<W: Word, const AVX2: bool>(old: &[u8], new: &[u8]) -> u64 {
    let len = old.len() / W::BYTES;
    #[cfg(target_arch = "x86_64")]
    if len == 64 {
        let new = &new[..64 * W::BYTES];
        // SAFETY: SSE2 is part of the x86_64 baseline, AVX2 was checked by the caller;
        // both blocks are 64 elements long.
        return unsafe {
            if AVX2 {
                changed_mask_avx2(old, new, W::BYTES)
            } else {
                changed_mask_sse2(old, new, W::BYTES)
            }
        };
    }
    (0..len)
        .filter(|&i| W::load(old, i) != W::load(new, i))
        .fold(0u64, |mask, i| mask | (1 << i))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse2")]
#[inline]
unsafe fn changed_mask_sse2(old: &[u8], new: &[u8], element_bytes: usize) -> u64 {
    use std::arch::x86_64::*;
    debug_assert_eq!(old.len(), 64 * element_bytes);
    let load = |bytes: &[u8], at: usize| {
        // SAFETY: callers pass offsets whose 16 bytes lie inside the block.
        unsafe { _mm_loadu_si128(bytes.as_ptr().add(at) as *const __m128i) }
    };
    let mut equal = 0u64;
    if element_bytes == 2 {
        for j in 0..4 {
            let low = _mm_cmpeq_epi16(load(old, 32 * j), load(new, 32 * j));
            let high = _mm_cmpeq_epi16(load(old, 32 * j + 16), load(new, 32 * j + 16));
            let packed = _mm_packs_epi16(low, high);
            equal |= u64::from(_mm_movemask_epi8(packed) as u32 as u16) << (16 * j);
        }
    } else {
        for j in 0..4 {
            let lanes: [__m128i; 4] = std::array::from_fn(|k| {
                let at = 64 * j + 16 * k;
                _mm_cmpeq_epi32(load(old, at), load(new, at))
            });
            let packed = _mm_packs_epi16(
                _mm_packs_epi32(lanes[0], lanes[1]),
                _mm_packs_epi32(lanes[2], lanes[3]),
            );
            equal |= u64::from(_mm_movemask_epi8(packed) as u32 as u16) << (16 * j);
        }
    }
    !equal
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn changed_mask_avx2(old: &[u8], new: &[u8], element_bytes: usize) -> u64 {
    use std::arch::x86_64::*;
    debug_assert_eq!(old.len(), 64 * element_bytes);
    let load = |bytes: &[u8], at: usize| {
        // SAFETY: callers pass offsets whose 32 bytes lie inside the block.
        unsafe { _mm256_loadu_si256(bytes.as_ptr().add(at) as *const __m256i) }
    };
    let mut equal = 0u64;
    if element_bytes == 2 {
        for j in 0..2 {
            let low = _mm256_cmpeq_epi16(load(old, 64 * j), load(new, 64 * j));
            let high = _mm256_cmpeq_epi16(load(old, 64 * j + 32), load(new, 64 * j + 32));
            // packs interleaves 128-bit lanes; the permute restores element order.
            let packed = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi16(low, high));
            equal |= u64::from(_mm256_movemask_epi8(packed) as u32) << (32 * j);
        }
    } else {
        // Four compares of 8 elements, packed twice: within each 128-bit lane the bytes
        // come out as four runs of 4 elements, one per compare, elements 0-3 in the low
        // lane and 4-7 in the high one; the dword permute puts the eight runs in order.
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for j in 0..2 {
            let lanes: [__m256i; 4] = std::array::from_fn(|k| {
                let at = 128 * j + 32 * k;
                _mm256_cmpeq_epi32(load(old, at), load(new, at))
            });
            let packed = _mm256_packs_epi16(
                _mm256_packs_epi32(lanes[0], lanes[1]),
                _mm256_packs_epi32(lanes[2], lanes[3]),
            );
            let ordered = _mm256_permutevar8x32_epi32(packed, order);
            equal |= u64::from(_mm256_movemask_epi8(ordered) as u32) << (32 * j);
        }
    }
    !equal
}

/// Counts differing elements: the plain-scan floor the extraction benchmark compares
/// itself against.
pub fn count_changed(old: &[u8], new: &[u8], element_bytes: usize) -> u64 {
    let mut count = 0;
    for_each_changed(old, new, element_bytes, |_| count += 1);
    count
}

/// Exponent classes of one chunk: class `c` holds the elements whose base exponent lies
/// in `[thresholds[c-1], thresholds[c])`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Classes {
    pub layout: FloatLayout,
    pub thresholds: Vec<u32>,
    /// For 16-bit floats, `(word >> 7) & 0xFF` orders like the exponent (it is the
    /// exponent for BF16, the exponent and three mantissa bits for F16), so each threshold
    /// becomes one byte compare: 16 or 32 elements per SIMD instruction. Here each
    /// threshold is the signed bound of that compare, repeated across a 256-bit register:
    /// prepared once per chunk, so a block's compares read their bounds from memory
    /// instead of rebuilding them. Unused for 32-bit floats, whose masks are built element
    /// by element.
    bounds: ByteBounds,
    /// The class of each value of the byte below the sign bit, which holds the whole
    /// exponent in every float layout (and three mantissa bits in F16): a shift and one
    /// load per changed element instead of a compare per threshold.
    class_by_top_byte: [u8; 256],
}

#[derive(Debug, Clone, PartialEq, Eq)]
#[repr(align(32))]
struct ByteBounds([[u8; 32]; MAX_CLASSES]);

pub(crate) const MAX_CLASSES: usize = 8;

impl Classes {
    pub fn new(layout: FloatLayout, thresholds: Vec<u32>) -> Classes {
        let byte_shift = layout.exponent_shift.checked_sub(7);
        assert!(
            thresholds.len() < MAX_CLASSES,
            "at most {MAX_CLASSES} classes"
        );
        assert!(
            layout.exponent_mask >> layout.exponent_shift < 256,
            "exponents fit a byte"
        );
        let mut bounds = ByteBounds([[0; 32]; MAX_CLASSES]);
        if layout.exponent_mask <= 0xFFFF {
            let shift = byte_shift.expect("16-bit exponents lie above bit 7");
            // byte >= t as a signed compare (one instruction): byte ^ 0x80 > (t - 1) ^ 0x80;
            // thresholds are at least 1.
            for (bound, &t) in bounds.0.iter_mut().zip(&thresholds) {
                *bound = [((t << shift) as u8).wrapping_sub(1) ^ 0x80; 32];
            }
        }
        let mut classes = Classes {
            layout,
            thresholds,
            bounds,
            class_by_top_byte: [0; 256],
        };
        let top_byte_shift = 24 - layout.exponent_mask.leading_zeros();
        let class_by_top_byte = std::array::from_fn(|byte| {
            let exponent =
                ((byte as u32) << top_byte_shift & layout.exponent_mask) >> layout.exponent_shift;
            classes.class_of_exponent(exponent) as u8
        });
        classes.class_by_top_byte = class_by_top_byte;
        classes
    }

    pub fn count(&self) -> usize {
        self.thresholds.len() + 1
    }

    /// The class of values with this exponent: how many thresholds it reaches.
    pub fn class_of_exponent(&self, exponent: u32) -> usize {
        self.thresholds.iter().filter(|&&t| t <= exponent).count()
    }

    #[inline]
    pub fn exponent<W: Word>(&self, word: W) -> u32 {
        ((word.to_u64() as u32) & self.layout.exponent_mask) >> self.layout.exponent_shift
    }

    #[inline]
    pub fn class_of<W: Word>(&self, word: W) -> usize {
        debug_assert_eq!(W::BITS - 9, 24 - self.layout.exponent_mask.leading_zeros());
        usize::from(self.class_by_top_byte[(word.to_u64() >> (W::BITS - 9)) as usize & 0xFF])
    }

    /// Bit masks of a block of 64 elements: entry 0 marks every element, entry `k + 1`
    /// (k < T) those whose exponent is at least `thresholds[k]`, and the entries after T
    /// none, so class `c` is entry `c` without entry `c + 1`, and a class's count is the
    /// difference of two running counts. One compare per threshold. `T` is the number of
    /// thresholds, fixed at compile time (see [`with_threshold_count`]) so the loops over
    /// thresholds unroll and the masks stay in registers. `AVX2` is true only in code
    /// compiled for AVX2 and run on a CPU that has it (as for [`changed_mask`]); otherwise
    /// 16-bit blocks use SSE2, part of every x86-64. A chunk's last, shorter block is
    /// padded first (see [`padded_block`]).
    ///
    /// Nothing here is tested per block beyond the element width, known at compile time:
    /// in the scans' loops every test and the values it reads cost registers, and a
    /// register short there puts the scan's running state in memory.
    #[inline(always)]
    pub fn at_least<W: Word, const T: usize, const AVX2: bool>(
        &self,
        block: &[u8],
    ) -> [u64; MAX_CLASSES + 1] {
        debug_assert_eq!(T, self.thresholds.len());
        // The SIMD loads below rely on it; the scans' exact chunks let the compiler drop it.
        assert_eq!(block.len(), 64 * W::BYTES, "a block is 64 elements");
        #[cfg(target_arch = "x86_64")]
        if W::BYTES == 2 {
            // SAFETY: SSE2 is part of the x86_64 baseline, AVX2 is vouched for by the
            // caller; the block holds exactly 64 elements, and every 16-bit layout has
            // byte bounds (see `Classes::new`).
            return unsafe {
                if AVX2 {
                    at_least_avx2::<T>(block, &self.bounds)
                } else {
                    at_least_sse2::<T>(block, &self.bounds)
                }
            };
        }
        self.at_least_by_element::<W>(block)
    }

    /// [`Classes::at_least`] element by element: for 32-bit floats, and for 16-bit ones
    /// off x86-64.
    #[inline(always)]
    fn at_least_by_element<W: Word>(&self, block: &[u8]) -> [u64; MAX_CLASSES + 1] {
        let mut at_least = [0u64; MAX_CLASSES + 1];
        at_least[0] = u64::MAX;
        for bit in 0..64 {
            let exponent = self.exponent(W::load(block, bit));
            for (mask, &threshold) in at_least[1..].iter_mut().zip(&self.thresholds) {
                *mask |= u64::from(exponent >= threshold) << bit;
            }
        }
        at_least
    }
}

/// A chunk's last block when it holds fewer than 64 elements: its bytes zero-padded to a
/// whole block (64 elements of up to 4 bytes; the caller takes the first `64 * W::BYTES`),
/// and the mask of the elements that lie in the chunk. The scans take whole blocks only,
/// so their loops test nothing per block but their own state.
#[inline]
pub(crate) fn padded_block<W: Word>(tail: &[u8]) -> ([u8; 256], u64) {
    debug_assert!(tail.len() < 64 * W::BYTES);
    let mut padded = [0u8; 256];
    padded[..tail.len()].copy_from_slice(tail);
    (padded, (1u64 << (tail.len() / W::BYTES)) - 1)
}

/// Runs `$body` with `$t` bound to a compile-time constant equal to `$count` (0..=7), so
/// code generic over the threshold count is instantiated once per count.
macro_rules! with_threshold_count {
    ($count:expr, $t:ident => $body:expr) => {
        match $count {
            0 => {
                const $t: usize = 0;
                $body
            }
            1 => {
                const $t: usize = 1;
                $body
            }
            2 => {
                const $t: usize = 2;
                $body
            }
            3 => {
                const $t: usize = 3;
                $body
            }
            4 => {
                const $t: usize = 4;
                $body
            }
            5 => {
                const $t: usize = 5;
                $body
            }
            6 => {
                const $t: usize = 6;
                $body
            }
            7 => {
                const $t: usize = 7;
                $body
            }
            other => unreachable!("{other} thresholds, at most 7"),
        }
    };
}
pub(crate) use with_threshold_count;

/// `at_least[k + 1]` bit i: the exponent byte of element i is >= `thresholds[k]`, k < T;
/// `at_least[0]`: every element (see [`Classes::at_least`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse2")]
#[inline]
unsafe fn at_least_sse2<const T: usize>(
    block: &[u8],
    bounds: &ByteBounds,
) -> [u64; MAX_CLASSES + 1] {
    use std::arch::x86_64::*;
    debug_assert_eq!(block.len(), 128);
    // SAFETY: each bound is 32 bytes aligned to 32.
    let bounds: [__m128i; MAX_CLASSES] =
        std::array::from_fn(|k| unsafe { _mm_load_si128(bounds.0[k].as_ptr() as *const __m128i) });
    let bias = _mm_set1_epi8(i8::MIN);
    let mut at_least = [0u64; MAX_CLASSES + 1];
    at_least[0] = u64::MAX;
    for j in 0..4 {
        // SAFETY: 32 bytes at 32*j lie inside the 128-byte block.
        let (a, b) = unsafe {
            let at = block.as_ptr().add(32 * j);
            (
                _mm_loadu_si128(at as *const __m128i),
                _mm_loadu_si128(at.add(16) as *const __m128i),
            )
        };
        let byte = |v| _mm_srli_epi16::<8>(_mm_slli_epi16::<1>(v));
        let bytes = _mm_xor_si128(_mm_packus_epi16(byte(a), byte(b)), bias);
        for k in 0..T {
            let ge = _mm_cmpgt_epi8(bytes, bounds[k]);
            at_least[k + 1] |= u64::from(_mm_movemask_epi8(ge) as u32 as u16) << (16 * j);
        }
    }
    at_least
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn at_least_avx2<const T: usize>(
    block: &[u8],
    bounds: &ByteBounds,
) -> [u64; MAX_CLASSES + 1] {
    use std::arch::x86_64::*;
    debug_assert_eq!(block.len(), 128);
    // SAFETY: each bound is 32 bytes aligned to 32.
    let bounds: [__m256i; MAX_CLASSES] = std::array::from_fn(|k| unsafe {
        _mm256_load_si256(bounds.0[k].as_ptr() as *const __m256i)
    });
    let bias = _mm256_set1_epi8(i8::MIN);
    let mut at_least = [0u64; MAX_CLASSES + 1];
    at_least[0] = u64::MAX;
    for j in 0..2 {
        // SAFETY: 64 bytes at 64*j lie inside the 128-byte block.
        let (a, b) = unsafe {
            let at = block.as_ptr().add(64 * j);
            (
                _mm256_loadu_si256(at as *const __m256i),
                _mm256_loadu_si256(at.add(32) as *const __m256i),
            )
        };
        let byte = |v| _mm256_srli_epi16::<8>(_mm256_slli_epi16::<1>(v));
        // packus interleaves 128-bit lanes; the permute restores element order.
        let bytes = _mm256_xor_si256(
            _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi16(byte(a), byte(b))),
            bias,
        );
        for k in 0..T {
            let ge = _mm256_cmpgt_epi8(bytes, bounds[k]);
            at_least[k + 1] |= u64::from(_mm256_movemask_epi8(ge) as u32) << (32 * j);
        }
    }
    at_least
}

/// Set bits of `mask`. With `POPCNT` (true only in code that runs on a CPU with the
/// instruction) it is the instruction itself, out of the optimiser's sight: a few counts
/// added to neighbouring integers are otherwise turned into a vector popcount over the
/// masks stored to the stack and loaded back, several times slower than the scalar one.
#[inline(always)]
pub(crate) fn count_ones<const POPCNT: bool>(mask: u64) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if POPCNT {
        let mut count = mask;
        // SAFETY: the caller vouches for POPCNT; the instruction only writes its register
        // and the flags. Counting in place avoids the false dependency some Intel cores
        // have on the destination of POPCNT.
        unsafe {
            std::arch::asm!(
                "popcnt {count}, {count}",
                count = inout(reg) count,
                options(pure, nomem, nostack),
            );
        }
        return count as u32;
    }
    mask.count_ones()
}

/// Whether PDEP is a single fast instruction: on Intel since Haswell and on AMD since
/// Zen 3. Zen 1 and 2 (and Hygon's Dhyana) microcode it at up to hundreds of cycles.
#[cfg(target_arch = "x86_64")]
pub(crate) fn fast_pdep() -> bool {
    use std::sync::OnceLock;
    static FAST: OnceLock<bool> = OnceLock::new();
    *FAST.get_or_init(|| {
        // CPUID leaves 0 and 1 exist on every x86-64 processor.
        let vendor = std::arch::x86_64::__cpuid(0);
        let signature = std::arch::x86_64::__cpuid(1).eax;
        let base_family = (signature >> 8) & 0xF;
        let family = match base_family {
            0xF => base_family + ((signature >> 20) & 0xFF),
            _ => base_family,
        };
        // "GenuineIntel" and "AuthenticAMD", as CPUID spreads them over EBX, EDX, ECX.
        let intel = (vendor.ebx, vendor.edx, vendor.ecx) == (0x756E_6547, 0x4965_6E69, 0x6C65_746E);
        let amd = (vendor.ebx, vendor.edx, vendor.ecx) == (0x6874_7541, 0x6974_6E65, 0x444D_4163);
        std::arch::is_x86_feature_detected!("bmi2") && (intel || (amd && family >= 0x19))
    })
}

/// Position of the `rank`-th set bit of `mask`: one PDEP where that is fast, else the
/// portable [`select_bit`].
#[inline(always)]
pub(crate) fn select<const PDEP: bool>(mask: u64, rank: u32) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if PDEP {
        // SAFETY: callers pass `PDEP` true only on a CPU with BMI2 (see `fast_pdep`).
        return unsafe { std::arch::x86_64::_pdep_u64(1 << rank, mask) }.trailing_zeros();
    }
    select_bit(mask, rank)
}

/// Position of the `rank`-th set bit of `mask` (rank counted from zero). Narrows to a
/// byte by halving with popcounts (selected arithmetically, not by branches), then looks
/// the bit up in a table: constant time and branch-free on every x86-64, unlike PDEP,
/// which is slow on older AMD cores (see [`select`]).
#[inline(always)]
pub(crate) fn select_bit(mut mask: u64, mut rank: u32) -> u32 {
    let mut base = 0;
    for width in [32u32, 16, 8] {
        let low = (mask & ((1u64 << width) - 1)).count_ones();
        let skip = u32::from(rank >= low);
        rank -= low * skip;
        mask >>= width * skip;
        base += width * skip;
    }
    base + u32::from(SELECT_IN_BYTE[(mask & 0xFF) as usize * 8 + (rank & 7) as usize])
}

/// `SELECT_IN_BYTE[byte * 8 + rank]`: position of the `rank`-th set bit of `byte`.
static SELECT_IN_BYTE: [u8; 256 * 8] = {
    let mut table = [0u8; 256 * 8];
    let mut byte = 0;
    while byte < 256 {
        let mut rank = 0;
        let mut bit = 0;
        while bit < 8 {
            if byte & (1 << bit) != 0 {
                table[byte * 8 + rank] = bit as u8;
                rank += 1;
            }
            bit += 1;
        }
        byte += 1;
    }
    table
};

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const BF16: FloatLayout = FloatLayout {
        exponent_mask: 0x7F80,
        exponent_shift: 7,
    };

    #[test]
    fn ordered_key_follows_float_order_across_zero() {
        let values = [-2.0f32, -1.0, -0.0, 0.0, 1e-30, 1.0, 2.0];
        let keys: Vec<u64> = values
            .iter()
            .map(|v| ((v.to_bits() >> 16) as u16).ordered_key())
            .collect();
        assert!(keys.windows(2).all(|w| w[0] < w[1]), "{keys:?}");
        // -0 and +0 are one step apart.
        assert_eq!(keys[3] - keys[2], 1);
    }

    #[test]
    fn one_bf16_step_is_symbol_zero_or_one() {
        let one = (1.0f32.to_bits() >> 16) as u16;
        assert_eq!(step_value(one, one + 1), 1);
        assert_eq!(step_value(one, one - 1), 0);
        let minus_one = one | 0x8000;
        // More negative is one step down in key space.
        assert_eq!(step_value(minus_one, minus_one + 1), 0);
    }

    #[test]
    fn simd_masks_match_the_scalar_definition() {
        let f16 = FloatLayout {
            exponent_mask: 0x7C00,
            exponent_shift: 10,
        };
        for (layout, thresholds) in [
            (BF16, vec![100, 118, 121, 125, 200, 254, 255]),
            (f16, vec![3, 14, 15, 31]),
        ] {
            let classes = Classes::new(layout, thresholds);
            let words: Vec<u16> = (0..64u32)
                .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u16)
                .chain([0x7F80, 0xFF80, 0x0000, 0x8000, 0x7FFF, 0x7C00])
                .skip(6)
                .collect();
            let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
            let mut slow = [0u64; MAX_CLASSES + 1];
            for (bit, word) in words.iter().enumerate() {
                for mask in &mut slow[..=classes.class_of(*word)] {
                    *mask |= 1 << bit;
                }
            }
            let masks = |classes: &Classes, avx2: bool| {
                with_threshold_count!(classes.thresholds.len(), T => if avx2 {
                    classes.at_least::<u16, T, true>(&bytes)
                } else {
                    classes.at_least::<u16, T, false>(&bytes)
                })
            };
            assert_eq!(classes.at_least_by_element::<u16>(&bytes), slow, "scalar");
            #[cfg(target_arch = "x86_64")]
            {
                assert_eq!(masks(&classes, false), slow, "SSE2");
                if std::arch::is_x86_feature_detected!("avx2") {
                    assert_eq!(masks(&classes, true), slow, "AVX2");
                }
            }
        }
    }

    #[test]
    fn class_table_matches_the_thresholds() {
        let expected = |thresholds: &[u32], exponent: u32| {
            thresholds.iter().filter(|&&t| t <= exponent).count()
        };
        let classes = Classes::new(BF16, vec![100, 118, 121]);
        for exponent in 0..256u16 {
            let word = exponent << 7 | 0x8055;
            let want = expected(&[100, 118, 121], u32::from(exponent));
            assert_eq!(classes.class_of(word), want, "BF16 exponent {exponent}");
        }
        // F16 and F32: the byte below the sign holds the exponent with mantissa bits (F16)
        // or exactly (F32); every sign and mantissa pattern must give the exponent's class.
        let f16 = FloatLayout {
            exponent_mask: 0x7C00,
            exponent_shift: 10,
        };
        let classes = Classes::new(f16, vec![3, 14, 15]);
        for word in (0..=u16::MAX).step_by(7) {
            let want = expected(&[3, 14, 15], u32::from(word >> 10 & 0x1F));
            assert_eq!(classes.class_of(word), want, "F16 word {word:#06x}");
        }
        let f32 = FloatLayout {
            exponent_mask: 0x7F80_0000,
            exponent_shift: 23,
        };
        let classes = Classes::new(f32, vec![1, 120, 127, 200]);
        for word in (0..=u32::MAX).step_by(65_537) {
            let want = expected(&[1, 120, 127, 200], word >> 23 & 0xFF);
            assert_eq!(classes.class_of(word), want, "F32 word {word:#010x}");
        }
    }

    proptest! {
        #[test]
        fn steps_round_trip_for_every_bit_pattern(old in any::<u16>(), new in any::<u16>(), old32 in any::<u32>(), new32 in any::<u32>()) {
            prop_assume!(old != new && old32 != new32);
            let v = step_value(old, new);
            prop_assert!(v <= max_step_value::<u16>());
            prop_assert_eq!(apply_step(old, v), new);
            let v = step_value(old32, new32);
            prop_assert!(v <= max_step_value::<u32>());
            prop_assert_eq!(apply_step(old32, v), new32);
        }

        #[test]
        fn changed_scan_finds_exactly_the_differences(
            base in proptest::collection::vec(any::<u8>(), 0..1200),
            flips in proptest::collection::vec(any::<prop::sample::Index>(), 0..40),
            width in prop::sample::select(vec![1usize, 2, 4, 8]),
        ) {
            let len = base.len() / width * width;
            let old = &base[..len];
            let mut new = old.to_vec();
            if len > 0 {
                for flip in &flips {
                    let at = flip.index(len);
                    new[at] ^= 0x10;
                }
            }
            let expected: Vec<usize> = (0..len / width)
                .filter(|i| old[i * width..(i + 1) * width] != new[i * width..(i + 1) * width])
                .collect();
            // The dispatched scan (AVX2 where the CPU has it) and the SSE2 one.
            let mut found = Vec::new();
            for_each_changed(old, &new, width, |i| found.push(i));
            prop_assert_eq!(&found, &expected);
            let mut found = Vec::new();
            for_each_changed_body::<false>(old, &new, width, |i| found.push(i));
            prop_assert_eq!(&found, &expected);
        }

        #[test]
        fn select_bit_finds_the_rank(mask in 1u64.., pick in any::<prop::sample::Index>()) {
            let rank = pick.index(mask.count_ones() as usize) as u32;
            let bit = select_bit(mask, rank);
            prop_assert!(mask & (1 << bit) != 0);
            prop_assert_eq!((mask & ((1u64 << bit) - 1)).count_ones(), rank);
            prop_assert_eq!(select::<false>(mask, rank), bit);
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("bmi2") {
                prop_assert_eq!(select::<true>(mask, rank), bit);
            }
        }
    }
}
