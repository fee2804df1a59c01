//! Arbitrary bytes as a base tensor and its changes: the extracted delta must reproduce
//! the target bit for bit. See `aurora_fuzz::check_chunk_roundtrip`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| aurora_fuzz::check_chunk_roundtrip(data));
