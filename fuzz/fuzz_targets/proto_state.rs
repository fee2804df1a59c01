//! Arbitrary frames fed to the receiver or sender state machines: nothing may panic and
//! nothing unverified is delivered. See `aurora_fuzz::proto::check_state`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| aurora_fuzz::proto::check_state(data));
