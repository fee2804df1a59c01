//! Entropy coders of the `aurora` encoding (docs/delta-format.md §6.3).
//!
//! Hand-written because the codec is the project's own edge: a static rANS coder over a
//! 16-symbol alphabet for steps, and Golomb codes for gaps, whose optimal parameter for a
//! geometric source is known in closed form, so gap models cost no table bytes.

use crate::bits::{BitReader, BitWriter, ByteReader, write_leb128};
use crate::error::{DeltaError, Result};

/// Frequencies are normalised to 2^12: fine enough that quantisation costs far below a
/// hundredth of a bit per symbol for the skewed step distributions we see, small enough
/// that the decode table of a model is 4 KiB.
pub const SCALE_BITS: u32 = 12;
const TOTAL: u32 = 1 << SCALE_BITS;
/// rANS state lower bound; 16-bit renormalisation keeps the state in [2^16, 2^32).
const RANS_L: u32 = 1 << 16;
pub const ALPHABET: usize = 16;

/// A static model over [`ALPHABET`] symbols.
#[derive(Clone)]
pub struct Model {
    freq: [u16; ALPHABET],
    /// Everything the decoder needs for a slot in one load, so each symbol waits on one
    /// memory access instead of three dependent ones: the symbol's frequency (bits 16..),
    /// the symbol (bits 12..16) and the slot's offset from the symbol's start (bits 0..12).
    slots: Box<Slots>,
    encode: [EncodeSymbol; ALPHABET],
}

/// How the encoder pushes one symbol. The state update divides by the symbol's frequency,
/// and each update waits on the previous one, so a hardware divide would sit on the
/// encoder's critical path once per change: the division is a multiply by a 64-bit
/// reciprocal instead, exact for every 32-bit state (Lemire, Kaser and Kurz, "Faster
/// remainder by direct computation", 2019), with the update written as
/// `x + bias + q * complement` as in Giesen's rANS coders.
#[derive(Clone, Copy, Default)]
struct EncodeSymbol {
    /// States at or above this emit a word before the symbol is pushed.
    renormalise_at: u64,
    /// `ceil(2^64 / freq)`, or `2^64 - 1` for a frequency of 1 (the quotient then comes
    /// out one short, which `bias` makes up).
    reciprocal: u64,
    bias: u32,
    complement: u32,
}

impl EncodeSymbol {
    fn new(freq: u16, start: u16) -> EncodeSymbol {
        let freq = u32::from(freq);
        let (reciprocal, bias) = match freq {
            0 => return EncodeSymbol::default(),
            1 => (u64::MAX, u32::from(start) + TOTAL - 1),
            _ => (u64::MAX / u64::from(freq) + 1, u32::from(start)),
        };
        EncodeSymbol {
            renormalise_at: u64::from((RANS_L >> SCALE_BITS) << 16) * u64::from(freq),
            reciprocal,
            bias,
            complement: TOTAL - freq,
        }
    }
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model").field("freq", &self.freq).finish()
    }
}

impl Model {
    pub fn slots(&self) -> &Slots {
        &self.slots
    }

    /// Normalises symbol counts so every present symbol keeps a non-zero frequency.
    /// At least one count must be non-zero.
    pub fn from_counts(counts: &[u64; ALPHABET]) -> Model {
        let total: u64 = counts.iter().sum();
        assert!(total > 0, "a model needs at least one symbol");
        let mut freq = [0u16; ALPHABET];
        for (f, &c) in freq.iter_mut().zip(counts) {
            if c > 0 {
                *f = ((c * u64::from(TOTAL)) / total).max(1) as u16;
            }
        }
        // Hand the rounding error to the most frequent symbol, which can absorb it: it
        // holds at least TOTAL/ALPHABET while at most ALPHABET slots were forced to 1.
        let sum: i64 = freq.iter().map(|f| i64::from(*f)).sum();
        let largest = (0..ALPHABET).max_by_key(|&i| freq[i]).expect("non-empty");
        freq[largest] = (i64::from(freq[largest]) + i64::from(TOTAL) - sum) as u16;
        Model::from_freqs(freq).expect("normalised frequencies are valid")
    }

    fn from_freqs(freq: [u16; ALPHABET]) -> Result<Model> {
        let sum: u32 = freq.iter().map(|f| u32::from(*f)).sum();
        if sum != TOTAL {
            return Err(DeltaError::Malformed(format!(
                "step model frequencies sum to {sum}, not {TOTAL}"
            )));
        }
        let mut start = [0u16; ALPHABET];
        let mut slots = Box::new([0u32; TOTAL as usize]);
        let mut cumulative = 0u32;
        for symbol in 0..ALPHABET {
            start[symbol] = cumulative as u16;
            let end = cumulative + u32::from(freq[symbol]);
            for (offset, slot) in slots[cumulative as usize..end as usize]
                .iter_mut()
                .enumerate()
            {
                *slot = u32::from(freq[symbol]) << 16 | (symbol as u32) << 12 | offset as u32;
            }
            cumulative = end;
        }
        Ok(Model {
            freq,
            slots,
            encode: std::array::from_fn(|s| EncodeSymbol::new(freq[s], start[s])),
        })
    }

    /// Serialises as a presence bitmap and the frequencies of all present symbols but the
    /// last, which is implied by the total.
    pub fn write(&self, out: &mut Vec<u8>) {
        let present: u16 = (0..ALPHABET)
            .filter(|&s| self.freq[s] > 0)
            .fold(0, |mask, s| mask | (1 << s));
        out.extend_from_slice(&present.to_le_bytes());
        let last = 15 - present.leading_zeros() as usize;
        for symbol in 0..last {
            if self.freq[symbol] > 0 {
                write_leb128(out, u64::from(self.freq[symbol]));
            }
        }
    }

    pub fn read(reader: &mut ByteReader<'_>) -> Result<Model> {
        let present = reader.u16("step model bitmap")?;
        if present == 0 {
            return Err(DeltaError::Malformed("step model has no symbols".into()));
        }
        let last = 15 - present.leading_zeros() as usize;
        let mut freq = [0u16; ALPHABET];
        let mut sum = 0u64;
        for (symbol, f) in freq.iter_mut().enumerate().take(last) {
            if present & (1 << symbol) != 0 {
                let value = reader.leb128("step model frequency")?;
                if value == 0 || value >= u64::from(TOTAL) {
                    return Err(DeltaError::Malformed(format!(
                        "step model frequency {value} out of range"
                    )));
                }
                sum += value;
                *f = value as u16;
            }
        }
        if sum >= u64::from(TOTAL) {
            return Err(DeltaError::Malformed(
                "step model frequencies exceed the total".into(),
            ));
        }
        freq[last] = (u64::from(TOTAL) - sum) as u16;
        Model::from_freqs(freq)
    }
}

/// Encodes symbols in reverse order of decoding (rANS is last-in, first-out), into room
/// for a number of symbols fixed up front: `put` writes unchecked, for the same reasons
/// as [`BitWriter`], in the same loop.
pub struct RansEncoder {
    state: u32,
    /// Emitted words, valid up to `len`; the slot at `len` is scratch (see `put`).
    words: Vec<u16>,
    len: usize,
}

impl RansEncoder {
    /// An encoder for up to `symbols` symbols (at most one word each).
    pub fn new(symbols: usize) -> RansEncoder {
        RansEncoder {
            state: RANS_L,
            words: vec![0; symbols],
            len: 0,
        }
    }

    /// Pushes `symbol`; callers push the decode order reversed.
    ///
    /// # Safety
    /// Fewer symbols than the encoder was made for have been pushed before.
    #[inline(always)]
    pub unsafe fn put(&mut self, model: &Model, symbol: usize) {
        let coder = model.encode[symbol];
        debug_assert!(coder.renormalise_at > 0, "symbol {symbol} has no frequency");
        // Whether a word is emitted is as random as the data: the word is always stored
        // and kept only when emitted, so there is no branch to mispredict. At most one
        // word per symbol: a state shifted by 16 bits is below every threshold.
        let emit = u64::from(self.state) >= coder.renormalise_at;
        debug_assert!(self.len < self.words.len(), "room for the symbol");
        // SAFETY: each symbol before emitted at most one word, so `len` is below their
        // number, which the caller bounds by the length of `words`.
        unsafe { *self.words.as_mut_ptr().add(self.len) = self.state as u16 };
        self.len += usize::from(emit);
        let state = if emit { self.state >> 16 } else { self.state };
        let quotient = ((u128::from(state) * u128::from(coder.reciprocal)) >> 64) as u32;
        self.state = state + coder.bias + quotient * coder.complement;
    }

    pub fn finish(self) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(2 * self.len + 4);
        bytes.extend_from_slice(&((self.state >> 16) as u16).to_le_bytes());
        bytes.extend_from_slice(&(self.state as u16).to_le_bytes());
        for word in self.words[..self.len].iter().rev() {
            bytes.extend_from_slice(&word.to_le_bytes());
        }
        bytes
    }
}

#[derive(Clone)]
pub struct RansDecoder<'a> {
    state: u32,
    /// The stream as 16-bit words, the first two of them the initial state.
    words: &'a [[u8; 2]],
    /// Index of the next word to read; runs past the end in a stream cut short.
    position: usize,
}

/// A model's slot table: what [`RansDecoder::get`] reads per symbol.
pub type Slots = [u32; TOTAL as usize];

impl<'a> RansDecoder<'a> {
    pub fn new(bytes: &'a [u8]) -> Result<RansDecoder<'a>> {
        let (words, odd) = bytes.as_chunks::<2>();
        if words.len() < 2 || !odd.is_empty() {
            return Err(DeltaError::Malformed(format!(
                "rANS stream of {} bytes is not a whole number of words",
                bytes.len()
            )));
        }
        let state =
            u32::from(u16::from_le_bytes(words[0])) << 16 | u32::from(u16::from_le_bytes(words[1]));
        if state < RANS_L {
            return Err(DeltaError::Malformed(
                "rANS initial state out of range".into(),
            ));
        }
        Ok(RansDecoder {
            state,
            words,
            position: 2,
        })
    }

    /// The next symbol, from its model's slot table ([`Model::slots`]: taken directly, so
    /// a decoding loop holds the table's address rather than the model's). A stream that
    /// runs out keeps yielding symbols, reading its last word again, while the position
    /// counts on past the end, which [`RansDecoder::finish`] reports: no test per symbol
    /// for a stream cut short.
    #[inline]
    pub fn get(&mut self, slots: &Slots) -> usize {
        let entry = slots[(self.state & (TOTAL - 1)) as usize];
        let symbol = ((entry >> 12) & 0xF) as usize;
        self.state = (entry >> 16) * (self.state >> SCALE_BITS) + (entry & (TOTAL - 1));
        // One word brings any state back above the bound. Whether one is needed is as
        // random as the data, so the word is read either way and kept by a mask (a
        // conditional here compiles to a branch that mispredicts on one symbol in eight).
        let renormalise = self.state < RANS_L;
        // `new` checked that the stream holds at least two words.
        let word = u32::from(u16::from_le_bytes(
            self.words[self.position.min(self.words.len() - 1)],
        ));
        let keep = 0u32.wrapping_sub(u32::from(renormalise));
        self.state = (self.state << (16 & keep)) | (word & keep);
        self.position += usize::from(renormalise);
        symbol
    }

    /// A stream decoded to its end returns to the encoder's initial state with every word
    /// consumed, and no more; anything else means corruption.
    pub fn finish(self) -> Result<()> {
        if self.position > self.words.len() {
            return Err(DeltaError::Malformed("rANS stream ends early".into()));
        }
        if self.state != RANS_L || self.position != self.words.len() {
            return Err(DeltaError::Malformed(
                "rANS stream does not end where its symbols do".into(),
            ));
        }
        Ok(())
    }
}

/// The Golomb parameter that minimises the expected code length of a geometric source
/// with success probability `changed / population` (Gallager and Van Voorhis, 1975).
pub fn golomb_parameter(changed: u64, population: u64) -> u64 {
    if changed == 0 || population <= changed {
        return 1;
    }
    let p = changed as f64 / population as f64;
    let theta = 1.0 - p;
    let m = (-(1.0 + theta).ln() / theta.ln()).ceil();
    if m.is_finite() && m >= 1.0 {
        (m as u64).min(1 << 40)
    } else {
        1
    }
}

/// Writes Golomb codes with one parameter: quotient in unary, remainder in truncated
/// binary, high bits first so the decoder can tell the short codes from the long ones.
pub struct GolombEncoder {
    m: u64,
    /// `ceil(2^64 / m)` when `m` is in 2..2^32, so the quotient of a 32-bit value is a
    /// multiply-high (exact, see [`EncodeSymbol`]) instead of a divide per change;
    /// `2^64 - 1` for `m` = 1, with `bias` 1 making up the quotient it leaves one short
    /// (the densest classes take that parameter, and a divide per change there measured
    /// 5% of the encoder's time); zero otherwise.
    reciprocal: u64,
    bias: u64,
    /// Bits of the long remainder codes (zero when `m` is 1: no remainder).
    width: u32,
    short_codes: u64,
}

impl GolombEncoder {
    pub fn new(m: u64) -> GolombEncoder {
        let (width, short_codes) = truncated_binary(m);
        let (reciprocal, bias) = match m {
            1 => (u64::MAX, 1),
            2..0x1_0000_0000 => (u64::MAX / m + 1, 0),
            _ => (0, 0),
        };
        GolombEncoder {
            m,
            reciprocal,
            bias,
            width,
            short_codes,
        }
    }

    /// Most bits that codes of `count` values summing to at most `sum` take: room to
    /// reserve in the writer before [`GolombEncoder::write`]s.
    pub fn max_bits(&self, count: u64, sum: u64) -> u64 {
        sum / self.m + count * (1 + u64::from(self.width))
    }

    /// Writes the code of `value` ([`golomb_len`] bits).
    ///
    /// # Safety
    /// As for [`BitWriter::write`]: `writer` has room for the code.
    #[inline(always)]
    pub unsafe fn write(&self, writer: &mut BitWriter, value: u64) {
        let quotient = if self.reciprocal != 0 && value >> 32 == 0 {
            ((u128::from(value + self.bias) * u128::from(self.reciprocal)) >> 64) as u64
        } else {
            value / self.m
        };
        let remainder = value - quotient * self.m;
        // Short or long remainder code is as random as the data, so it is chosen
        // arithmetically; the long code's last bit goes on top of its high bits.
        let (code, code_bits) = if self.width == 0 {
            (0, 0)
        } else {
            let long = remainder >= self.short_codes;
            let long_code = remainder + self.short_codes;
            let short_bits = self.width - 1;
            let code = std::hint::select_unpredictable(
                long,
                (long_code >> 1) | ((long_code & 1) << short_bits),
                remainder,
            );
            (code, short_bits + u32::from(long))
        };
        // Most codes fit one write: the unary stop bit, then the remainder.
        // SAFETY (both arms): the code's bits, as the caller vouches.
        if quotient + 1 + u64::from(code_bits) <= 32 {
            unsafe {
                writer.write(
                    (1 << quotient) | (code << (quotient + 1)),
                    quotient as u32 + 1 + code_bits,
                );
            }
        } else {
            unsafe {
                writer.write_unary(quotient);
                writer.write(code, code_bits);
            }
        }
    }
}

/// Reads Golomb codes with one parameter, whose values must not exceed a bound.
pub struct GolombDecoder {
    m: u64,
    limit: u64,
    /// Bound on the unary quotient, `limit / m`, divided once rather than per code.
    quotient_limit: u64,
    /// Bits of the long remainder codes (zero when `m` is 1: no remainder).
    width: u32,
    short_codes: u64,
}

impl GolombDecoder {
    pub fn new(m: u64, limit: u64) -> GolombDecoder {
        let (width, short_codes) = truncated_binary(m);
        GolombDecoder {
            m,
            limit,
            quotient_limit: limit / m,
            width,
            short_codes,
        }
    }

    #[inline(always)]
    pub fn read(&self, reader: &mut BitReader<'_>) -> Result<u64> {
        // Nearly every code is a short unary prefix and its remainder inside the bits
        // already held: read from them directly, without the general unary loop. Its
        // quotient is below 64, so the value bound alone bounds it.
        let (held, available) = reader.fill();
        let quotient = held.trailing_zeros();
        if quotient + 1 + self.width <= available {
            // Two shifts: the stop bit may be the 64th bit held.
            let (remainder, bits) = self.remainder((held >> quotient) >> 1);
            reader.skip(quotient + 1 + bits);
            return self.bounded(u64::from(quotient) * self.m + remainder);
        }
        // The reader goes by value: were its address to reach a call that is not
        // inlined, it would live in memory in the caller's loop too.
        let (value, rest) = self.read_long(reader.clone())?;
        *reader = rest;
        Ok(value)
    }

    /// A code whose unary part runs beyond the bits held.
    #[cold]
    #[inline(never)]
    fn read_long<'a>(&self, mut reader: BitReader<'a>) -> Result<(u64, BitReader<'a>)> {
        let quotient = reader.read_unary(self.quotient_limit)?;
        let (remainder, bits) = self.remainder(reader.peek(self.width));
        reader.skip(bits);
        Ok((self.bounded(quotient * self.m + remainder)?, reader))
    }

    /// The truncated-binary remainder at the bottom of `code` (which holds at least
    /// `width` bits) and its length in bits.
    #[inline(always)]
    fn remainder(&self, code: u64) -> (u64, u32) {
        if self.width == 0 {
            return (0, 0);
        }
        // Short and long remainder codes are told apart arithmetically: which one comes
        // next is as random as the data, so a branch would mispredict half the time.
        let short_bits = self.width - 1;
        let high = code & ((1u64 << short_bits) - 1);
        let long = high >= self.short_codes;
        let long_value = ((high << 1) | ((code >> short_bits) & 1)).wrapping_sub(self.short_codes);
        (
            if long { long_value } else { high },
            short_bits + u32::from(long),
        )
    }

    #[inline(always)]
    fn bounded(&self, value: u64) -> Result<u64> {
        if value > self.limit {
            return Err(gap_beyond(value, self.limit));
        }
        Ok(value)
    }
}

/// Out of line, so a decoding loop keeps no values around for the message.
#[cold]
#[inline(never)]
fn gap_beyond(value: u64, limit: u64) -> DeltaError {
    DeltaError::Malformed(format!("gap {value} exceeds the chunk bound {limit}"))
}

/// (bits of the long codes, number of short codes) for a truncated binary code over
/// `m` values.
#[inline]
fn truncated_binary(m: u64) -> (u32, u64) {
    if m <= 1 {
        return (0, 0);
    }
    let width = 64 - (m - 1).leading_zeros();
    (width, (1u64 << width) - m)
}

/// Golomb code length in bits of `value`.
#[cfg(test)]
pub fn golomb_len(value: u64, m: u64) -> u64 {
    let (width, short_codes) = truncated_binary(m);
    let remainder_bits = if width == 0 {
        0
    } else if value % m < short_codes {
        u64::from(width - 1)
    } else {
        u64::from(width)
    };
    value / m + 1 + remainder_bits
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn golomb_parameter_matches_the_closed_form() {
        assert_eq!(golomb_parameter(1, 2), 1);
        assert_eq!(golomb_parameter(1, 100), 69);
        assert_eq!(golomb_parameter(0, 100), 1);
        assert_eq!(golomb_parameter(100, 100), 1);
    }

    #[test]
    fn model_serialisation_round_trips_and_rejects_garbage() {
        let mut counts = [0u64; ALPHABET];
        counts[0] = 900;
        counts[1] = 880;
        counts[3] = 30;
        counts[15] = 2;
        let model = Model::from_counts(&counts);
        let mut bytes = Vec::new();
        model.write(&mut bytes);
        let read = Model::read(&mut ByteReader::new(&bytes)).unwrap();
        assert_eq!(read.freq, model.freq);
        assert!(Model::read(&mut ByteReader::new(&[0, 0])).is_err());
        // Frequencies that overflow the total.
        let mut hostile = vec![0b111, 0];
        write_leb128(&mut hostile, 4000);
        write_leb128(&mut hostile, 200);
        assert!(Model::read(&mut ByteReader::new(&hostile)).is_err());
    }

    #[test]
    fn encoder_reciprocals_divide_exactly() {
        for f in 1..=TOTAL {
            // The last symbol of a model: the largest start its frequency allows.
            let start = (TOTAL - f) as u16;
            let coder = EncodeSymbol::new(f as u16, start);
            let renormalise_at = coder.renormalise_at.min(1 << 32);
            // States the encoder can hold before this symbol: [2^16, renormalise_at) once
            // renormalised; the extremes and a spread between them.
            let states = (0..64u64)
                .map(|i| RANS_L as u64 + (renormalise_at - 1 - RANS_L as u64) * i / 63)
                .chain([RANS_L as u64 + 1, renormalise_at - 2]);
            for x in states {
                let x = x as u32;
                let quotient = ((u128::from(x) * u128::from(coder.reciprocal)) >> 64) as u32;
                let fast = x + coder.bias + quotient * coder.complement;
                let exact = ((x / f) << SCALE_BITS) + x % f + u32::from(start);
                assert_eq!(fast, exact, "state {x}, frequency {f}");
            }
        }
    }

    #[test]
    fn rans_detects_corruption_at_the_end() {
        let mut counts = [0u64; ALPHABET];
        counts[0] = 10;
        counts[1] = 10;
        let model = Model::from_counts(&counts);
        let symbols: Vec<usize> = (0..1000).map(|i| (i * 7 % 3 == 0) as usize).collect();
        let mut encoder = RansEncoder::new(symbols.len());
        for &s in symbols.iter().rev() {
            // SAFETY: the encoder was made for every symbol.
            unsafe { encoder.put(&model, s) };
        }
        let bytes = encoder.finish();
        let decode = |bytes: &[u8]| {
            let mut decoder = RansDecoder::new(bytes).unwrap();
            let decoded: Vec<usize> = symbols.iter().map(|_| decoder.get(model.slots())).collect();
            (decoded, decoder.finish())
        };
        let (decoded, end) = decode(&bytes);
        assert_eq!(decoded, symbols);
        assert!(end.is_ok());
        let mut corrupt = bytes.clone();
        corrupt[10] ^= 0x40;
        let (decoded, end) = decode(&corrupt);
        assert!(decoded != symbols || end.is_err());
        // Cut short: the symbols keep coming, but the end reports the overrun.
        let (_, end) = decode(&bytes[..bytes.len() - 4]);
        let message = end.unwrap_err().to_string();
        assert!(message.contains("ends early"), "{message}");
    }

    #[test]
    fn golomb_bounds_hold_when_the_code_is_read_from_held_bits() {
        let encoder = GolombEncoder::new(4);
        let mut writer = BitWriter::new();
        writer.reserve(encoder.max_bits(8, 20));
        for value in [13, 1, 1, 1, 1, 1, 1, 1] {
            // SAFETY: room for the codes of values summing to 20 was reserved.
            unsafe { encoder.write(&mut writer, value) };
        }
        let bytes = writer.finish();
        let read = |limit| GolombDecoder::new(4, limit).read(&mut BitReader::new(&bytes));
        assert_eq!(read(13).unwrap(), 13);
        // The value bound, then the quotient bound (3 > 11 / 4).
        assert!(read(12).is_err());
        assert!(read(11).is_err());
    }

    #[test]
    fn golomb_codes_of_parameter_one_are_unary() {
        // Parameter 1 takes the multiply-high path with its bias.
        let values = [0, 1, 2, 7, 31, 32, 33, 63, 64, 1000];
        let mut writer = BitWriter::new();
        let encoder = GolombEncoder::new(1);
        writer.reserve(encoder.max_bits(1, 5));
        // SAFETY: room for the code was reserved.
        unsafe { encoder.write(&mut writer, 5) };
        assert_eq!(writer.finish(), [0b0010_0000]);
        golomb_round_trip(&values, 1, u64::MAX).unwrap();
    }

    proptest! {
        #[test]
        fn rans_round_trips(
            weights in proptest::collection::vec(0u64..1000, ALPHABET),
            picks in proptest::collection::vec(any::<u32>(), 1..2000),
        ) {
            let mut counts = [0u64; ALPHABET];
            let present: Vec<usize> = (0..ALPHABET).filter(|&s| weights[s] > 0).collect();
            prop_assume!(!present.is_empty());
            let symbols: Vec<usize> = picks.iter().map(|p| present[*p as usize % present.len()]).collect();
            for &s in &symbols {
                counts[s] += weights[s];
            }
            let model = Model::from_counts(&counts);
            let mut encoder = RansEncoder::new(symbols.len());
            for &s in symbols.iter().rev() {
                // SAFETY: the encoder was made for every symbol.
                unsafe { encoder.put(&model, s) };
            }
            let bytes = encoder.finish();
            let mut decoder = RansDecoder::new(&bytes).unwrap();
            for &s in &symbols {
                prop_assert_eq!(decoder.get(model.slots()), s);
            }
            prop_assert!(decoder.finish().is_ok());
        }

        #[test]
        fn golomb_round_trips_wide_values_and_parameters(
            values in proptest::collection::vec(any::<u64>(), 1..50),
            m_bits in 0u32..41,
            m_low in any::<u64>(),
        ) {
            // Parameters up to the format's 2^40 and values beyond 32 bits take the
            // encoder's divide path; the unary part stays short enough to write.
            let m = (1u64 << m_bits).max(m_low & ((1u64 << m_bits) - 1)).max(1);
            let values: Vec<u64> = values.iter().map(|v| v % (m.saturating_mul(64))).collect();
            golomb_round_trip(&values, m, u64::MAX)?;
        }

        #[test]
        fn golomb_round_trips(values in proptest::collection::vec(0u64..100_000, 1..300), m in 1u64..5000) {
            golomb_round_trip(&values, m, 100_000)?;
        }
    }

    /// Writes `values` with parameter `m` into the room its bound reserves (checking the
    /// predicted lengths against each other) and reads them back with a decoder that
    /// allows values up to `limit`.
    fn golomb_round_trip(values: &[u64], m: u64, limit: u64) -> Result<(), TestCaseError> {
        let mut writer = BitWriter::new();
        let mut bits = 0;
        let encoder = GolombEncoder::new(m);
        let bound = encoder.max_bits(values.len() as u64, values.iter().sum());
        writer.reserve(bound);
        for &v in values {
            // SAFETY: the bound covers every code, as the assertion below checks.
            unsafe { encoder.write(&mut writer, v) };
            bits += golomb_len(v, m);
        }
        prop_assert_eq!(writer.bit_len(), bits);
        prop_assert!(bits <= bound, "{bits} bits written, {bound} reserved");
        let bytes = writer.finish();
        let mut reader = BitReader::new(&bytes);
        let decoder = GolombDecoder::new(m, limit);
        for &v in values {
            prop_assert_eq!(decoder.read(&mut reader).unwrap(), v);
        }
        prop_assert!(reader.finish().is_ok());
        Ok(())
    }
}
