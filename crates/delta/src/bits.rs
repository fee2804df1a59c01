//! Byte cursors, LEB128 varints and an LSB-first bit stream.
//!
//! Hand-written because they sit in the codec's inner loops and must treat every input
//! as hostile: a reader never panics and never reads past its slice.

use crate::error::{DeltaError, Result};

/// Appends `value` as unsigned LEB128 (7 bits per byte, low group first).
pub fn write_leb128(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

pub fn leb128_len(value: u64) -> usize {
    (64 - (value | 1).leading_zeros() as usize).div_ceil(7)
}

/// A bounds-checked reader over a byte slice.
#[derive(Debug, Clone)]
pub struct ByteReader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> ByteReader<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        ByteReader { bytes, pos: 0 }
    }

    pub fn position(&self) -> usize {
        self.pos
    }

    pub fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    pub fn is_empty(&self) -> bool {
        self.remaining() == 0
    }

    pub fn take(&mut self, len: usize, what: &'static str) -> Result<&'a [u8]> {
        if len > self.remaining() {
            return Err(DeltaError::Truncated {
                what,
                needed: len as u64,
                available: self.remaining() as u64,
            });
        }
        let out = &self.bytes[self.pos..self.pos + len];
        self.pos += len;
        Ok(out)
    }

    pub fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N]> {
        let bytes = self.take(N, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    pub fn u8(&mut self, what: &'static str) -> Result<u8> {
        Ok(self.array::<1>(what)?[0])
    }

    pub fn u16(&mut self, what: &'static str) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }

    pub fn u32(&mut self, what: &'static str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    pub fn u64(&mut self, what: &'static str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    pub fn rest(&mut self) -> &'a [u8] {
        let out = &self.bytes[self.pos..];
        self.pos = self.bytes.len();
        out
    }

    /// Reads an unsigned LEB128 value of at most 10 bytes that fits in 64 bits.
    pub fn leb128(&mut self, what: &'static str) -> Result<u64> {
        let mut value = 0u64;
        for index in 0..10 {
            let byte = self.u8(what)?;
            let bits = u64::from(byte & 0x7F);
            if index == 9 && bits > 1 {
                return Err(DeltaError::Malformed(format!(
                    "{what}: varint overflows 64 bits"
                )));
            }
            value |= bits << (7 * index);
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(DeltaError::Malformed(format!(
            "{what}: varint longer than 10 bytes"
        )))
    }
}

/// Writes bits least-significant first into bytes.
///
/// Writes go into room made beforehand with [`BitWriter::reserve`], unchecked: this sits
/// on the encoder's per-change path. With a growth check that may call the allocator in
/// the loop, the compiler kept the writer's state in memory, stored and reloaded on every
/// code; a bounds check per write still cost the gap and step loop (`aurora::encode`)
/// 7 to 15 ms of 47 to 73 on the 0.6B model's 1% step. Each write is now a few register
/// operations and one unaligned 8-byte store, with no branch on how full the accumulator
/// is. Every bound the writes rely on is tested against what is written.
#[derive(Debug, Default)]
pub struct BitWriter {
    /// Finished bytes up to `done`; after it, reserved room that the next stores land in
    /// (the byte at `done` already holds the bits of `acc`).
    bytes: Vec<u8>,
    done: usize,
    acc: u64,
    /// Bits held in `acc`; always below 8 between calls.
    filled: u32,
}

/// Bits one store can take: with fewer than 8 bits held, 56 more still fit the 64-bit
/// accumulator.
const STORE_BITS: u32 = 56;

impl BitWriter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes room for `bits` more bits of writes, counted from the bits written so far.
    pub fn reserve(&mut self, bits: u64) {
        // A store writes 8 bytes from the byte being filled.
        let needed = usize::try_from(bits.div_ceil(8))
            .ok()
            .and_then(|bytes| self.done.checked_add(bytes)?.checked_add(8))
            .expect("bit writer room fits in memory");
        if self.bytes.len() < needed {
            self.bytes.resize(needed.max(2 * self.bytes.len()), 0);
        }
    }

    /// Appends the low `count` bits of `value` (`count` up to 64).
    ///
    /// # Safety
    /// The last [`BitWriter::reserve`] made room for every bit written since, these
    /// included.
    #[inline]
    pub unsafe fn write(&mut self, value: u64, count: u32) {
        debug_assert!(count <= 64);
        // SAFETY (both arms): passed on from the caller.
        if count > STORE_BITS {
            unsafe {
                self.store(value & 0xFFFF_FFFF, 32);
                self.store(value >> 32, count - 32);
            }
        } else {
            unsafe { self.store(value, count) };
        }
    }

    /// # Safety
    /// As for [`BitWriter::write`].
    #[inline(always)]
    unsafe fn store(&mut self, value: u64, count: u32) {
        debug_assert!(count <= STORE_BITS && self.filled < 8);
        self.acc |= (value & ((1u64 << count) - 1)) << self.filled;
        self.filled += count;
        debug_assert!(self.done + 8 <= self.bytes.len(), "room reserved");
        // SAFETY: `reserve` left 8 bytes beyond the room it made, so a store at the byte
        // the reserved bits reach stays inside `bytes`.
        unsafe {
            std::ptr::write_unaligned(
                self.bytes.as_mut_ptr().add(self.done).cast::<u64>(),
                self.acc.to_le(),
            );
        }
        let whole = self.filled & !7;
        self.done += (whole / 8) as usize;
        self.acc >>= whole;
        self.filled -= whole;
    }

    /// Unary: `count` zero bits then a one bit.
    ///
    /// # Safety
    /// As for [`BitWriter::write`].
    #[inline]
    pub unsafe fn write_unary(&mut self, mut count: u64) {
        // SAFETY (both): passed on from the caller.
        while count >= u64::from(STORE_BITS) {
            unsafe { self.store(0, STORE_BITS) };
            count -= u64::from(STORE_BITS);
        }
        unsafe { self.store(1u64 << count, count as u32 + 1) };
    }

    /// Order-0 exponential Golomb code of `value` (any u64), [`exp_golomb_len`] bits.
    ///
    /// # Safety
    /// As for [`BitWriter::write`].
    pub unsafe fn write_exp_golomb(&mut self, value: u64) {
        let shifted = u128::from(value) + 1;
        let width = 128 - shifted.leading_zeros();
        // The leading one is implied by the unary prefix.
        let low = shifted & ((1u128 << (width - 1)) - 1);
        // SAFETY: passed on from the caller.
        unsafe {
            self.write_unary(u64::from(width - 1));
            self.write(low as u64, width - 1);
        }
    }

    #[cfg(test)]
    pub fn bit_len(&self) -> u64 {
        self.done as u64 * 8 + u64::from(self.filled)
    }

    pub fn finish(mut self) -> Vec<u8> {
        // The last store already put the held bits in place.
        self.bytes
            .truncate(self.done + self.filled.div_ceil(8) as usize);
        self.bytes
    }
}

/// Bits of [`BitWriter::write_exp_golomb`]'s code of `value`.
pub fn exp_golomb_len(value: u64) -> u64 {
    let width = 128 - (u128::from(value) + 1).leading_zeros() as u64;
    2 * width - 1
}

/// Reads a [`BitWriter`] stream. Reading past the end yields zero bits, which
/// [`BitReader::finish`] reports; loops driven by decoded values must
/// bound themselves, which the unary reader does.
#[derive(Debug, Clone)]
pub struct BitReader<'a> {
    bytes: &'a [u8],
    next_byte: usize,
    acc: u64,
    available: u32,
}

impl<'a> BitReader<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        BitReader {
            bytes,
            next_byte: 0,
            acc: 0,
            available: 0,
        }
    }

    #[inline(always)]
    fn refill(&mut self) {
        if self.next_byte + 8 <= self.bytes.len() {
            let word = u64::from_le_bytes(
                self.bytes[self.next_byte..self.next_byte + 8]
                    .try_into()
                    .expect("eight bytes"),
            );
            self.acc |= word << self.available;
            let taken = (63 - self.available) / 8;
            self.next_byte += taken as usize;
            self.available += taken * 8;
        } else {
            // By value, so the reader's address never leaves a hot loop (see
            // `GolombDecoder::read`).
            *self = self.clone().refill_tail();
        }
    }

    /// Refills byte by byte within the last eight bytes of the stream.
    #[cold]
    #[inline(never)]
    fn refill_tail(mut self) -> Self {
        while self.available <= 56 {
            let byte = match self.bytes.get(self.next_byte) {
                Some(byte) => *byte,
                None => {
                    // Past the end: count the shortfall as overrun once it is consumed.
                    self.available += 8;
                    self.next_byte += 1;
                    continue;
                }
            };
            self.acc |= u64::from(byte) << self.available;
            self.next_byte += 1;
            self.available += 8;
        }
        self
    }

    /// Reads `count` bits (up to 56) as an integer.
    #[inline]
    pub fn read(&mut self, count: u32) -> u64 {
        debug_assert!(count <= 56);
        if count == 0 {
            return 0;
        }
        if self.available < count {
            self.refill();
        }
        let value = self.acc & ((1u64 << count) - 1);
        self.acc >>= count;
        self.available -= count;
        value
    }

    /// The next `count` bits (up to 56) without consuming them; bits past the end of the
    /// stream read as zeros (consuming them is caught by [`BitReader::finish`]).
    #[inline]
    pub fn peek(&mut self, count: u32) -> u64 {
        debug_assert!(count <= 56);
        if self.available < count {
            self.refill();
        }
        self.acc & ((1u64 << count) - 1)
    }

    /// The bits held, at least 32 of them unless the stream is nearly exhausted, and
    /// how many there are; bits above that count are not part of the stream yet. Refilled
    /// only below 32 bits rather than to the full 56 each time: a refill costs a dozen
    /// instructions, and nearly every Golomb code takes far fewer bits (segment decoding
    /// 0.973 and 0.984 of the time, tools/codec-ab).
    #[inline(always)]
    pub fn fill(&mut self) -> (u64, u32) {
        if self.available < 32 {
            self.refill();
        }
        (self.acc, self.available)
    }

    /// Consumes `count` bits that a [`BitReader::peek`] or [`BitReader::fill`] of at least
    /// as many made available.
    #[inline]
    pub fn skip(&mut self, count: u32) {
        debug_assert!(count <= self.available);
        self.acc = self.acc.checked_shr(count).unwrap_or(0);
        self.available -= count;
    }

    pub fn read_wide(&mut self, count: u32) -> u64 {
        if count <= 56 {
            self.read(count)
        } else {
            let low = self.read(32);
            low | (self.read(count - 32) << 32)
        }
    }

    /// Reads a unary count, failing if it would exceed `limit`.
    #[inline]
    pub fn read_unary(&mut self, limit: u64) -> Result<u64> {
        let mut count = 0u64;
        loop {
            if self.available < 32 {
                self.refill();
            }
            // Bits above `available` are not yet counted as read; a one there is not the stop bit.
            let zeros = self.acc.trailing_zeros();
            if zeros < self.available {
                count += u64::from(zeros);
                // The stop bit may be the 64th bit held.
                self.acc = self.acc.checked_shr(zeros + 1).unwrap_or(0);
                self.available -= zeros + 1;
                break;
            }
            count += u64::from(self.available);
            self.acc = 0;
            self.available = 0;
            if count > limit || self.past_end() {
                return Err(DeltaError::Malformed(
                    "bitstream: unary code runs past its bound".into(),
                ));
            }
        }
        if count > limit {
            return Err(DeltaError::Malformed(
                "bitstream: unary code runs past its bound".into(),
            ));
        }
        Ok(count)
    }

    pub fn read_exp_golomb(&mut self) -> Result<u64> {
        let width = self.read_unary(64)?;
        if width >= 64 {
            let low = self.read_wide(64);
            return if width == 64 && low == 0 {
                Ok(u64::MAX)
            } else {
                Err(DeltaError::Malformed(
                    "bitstream: exp-Golomb value overflows".into(),
                ))
            };
        }
        let low = self.read_wide(width as u32);
        Ok(((1u64 << width) | low) - 1)
    }

    fn past_end(&self) -> bool {
        // Bytes beyond the input that have been pulled in are phantom zeros.
        self.next_byte > self.bytes.len()
    }

    /// Fails if more bits were consumed than the stream holds.
    pub fn finish(self) -> Result<()> {
        let phantom_bits = (self.next_byte.saturating_sub(self.bytes.len()) * 8) as u32;
        if phantom_bits > self.available {
            return Err(DeltaError::Malformed(
                "bitstream: read past the end of its bytes".into(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn leb128_matches_the_paper_example() {
        let mut out = Vec::new();
        write_leb128(&mut out, 198);
        assert_eq!(out, [0xC6, 0x01]);
        assert_eq!(leb128_len(198), 2);
        assert_eq!(leb128_len(0), 1);
        assert_eq!(leb128_len(127), 1);
        assert_eq!(leb128_len(u64::MAX), 10);
    }

    #[test]
    fn leb128_rejects_overlong_and_overflowing_input() {
        let overlong = [0x80u8; 11];
        assert!(ByteReader::new(&overlong).leb128("x").is_err());
        let overflow = [0xFFu8, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x02];
        assert!(ByteReader::new(&overflow).leb128("x").is_err());
        let truncated = [0x80u8];
        assert!(matches!(
            ByteReader::new(&truncated).leb128("x"),
            Err(DeltaError::Truncated { .. })
        ));
    }

    #[test]
    fn unary_bound_stops_hostile_runs_of_zeros() {
        let zeros = [0u8; 64];
        let mut reader = BitReader::new(&zeros);
        assert!(reader.read_unary(100).is_err());
    }

    #[test]
    fn reading_past_the_end_is_reported() {
        let mut writer = BitWriter::new();
        writer.reserve(3);
        // SAFETY: room for the 3 bits was reserved.
        unsafe { writer.write(0b101, 3) };
        let bytes = writer.finish();
        let mut reader = BitReader::new(&bytes);
        assert_eq!(reader.read(3), 0b101);
        assert!(BitReader::new(&bytes).finish().is_ok());
        reader.read(8);
        assert!(reader.finish().is_err());
    }

    proptest! {
        #[test]
        fn leb128_round_trips(values in proptest::collection::vec(any::<u64>(), 0..50)) {
            let mut out = Vec::new();
            for v in &values {
                write_leb128(&mut out, *v);
            }
            prop_assert_eq!(out.len(), values.iter().map(|v| leb128_len(*v)).sum::<usize>());
            let mut reader = ByteReader::new(&out);
            for v in &values {
                prop_assert_eq!(reader.leb128("v").unwrap(), *v);
            }
            prop_assert!(reader.is_empty());
        }

        #[test]
        fn bit_stream_round_trips(
            ops in proptest::collection::vec((0u8..3, any::<u64>(), 0u32..=64), 0..200)
        ) {
            let mut writer = BitWriter::new();
            let mut expected_bits = 0u64;
            let mut expected = Vec::new();
            for (kind, value, width) in &ops {
                // Room for each write just before it, so the buffer's growth is covered.
                match kind {
                    0 => {
                        writer.reserve(u64::from(*width));
                        let masked = if *width == 64 { *value } else { value & ((1u64 << width) - 1) };
                        // SAFETY (all three): room for the write was reserved just before.
                        unsafe { writer.write(masked, *width) };
                        expected_bits += u64::from(*width);
                        expected.push((0, masked, *width));
                    }
                    1 => {
                        let count = value % 200;
                        writer.reserve(count + 1);
                        unsafe { writer.write_unary(count) };
                        expected_bits += count + 1;
                        expected.push((1, count, 0));
                    }
                    _ => {
                        writer.reserve(exp_golomb_len(*value));
                        unsafe { writer.write_exp_golomb(*value) };
                        expected_bits += exp_golomb_len(*value);
                        expected.push((2, *value, 0));
                    }
                }
            }
            prop_assert_eq!(writer.bit_len(), expected_bits);
            let bytes = writer.finish();
            let mut reader = BitReader::new(&bytes);
            for (kind, value, width) in expected {
                match kind {
                    0 => prop_assert_eq!(reader.read_wide(width), value),
                    1 => prop_assert_eq!(reader.read_unary(1000).unwrap(), value),
                    _ => prop_assert_eq!(reader.read_exp_golomb().unwrap(), value),
                }
            }
            prop_assert!(reader.finish().is_ok());
        }
    }
}
