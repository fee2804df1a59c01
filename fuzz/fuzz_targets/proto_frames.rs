//! Arbitrary bytes as a stream of segment-protocol frames: nothing may panic and every
//! decoded frame is canonical. See `aurora_fuzz::proto::check_frames`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| aurora_fuzz::proto::check_frames(data));
