//! Arbitrary bytes as a delta artifact, decoded against a small fixed base: nothing may
//! panic, and an accepted delta must apply transactionally. See `aurora_fuzz::check_delta_decode`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| aurora_fuzz::check_delta_decode(data));
