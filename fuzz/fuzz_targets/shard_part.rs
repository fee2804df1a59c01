//! Arbitrary bytes as one rank's part of a delta extracted from shards: nothing may
//! panic, and what is accepted is a delta. See `aurora_fuzz::check_shard_part`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| aurora_fuzz::check_shard_part(data));
