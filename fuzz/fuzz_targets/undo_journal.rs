//! Arbitrary bytes as the undo journal of an in-place apply: nothing may panic, and a
//! refused journal leaves the weights alone. See `aurora_fuzz::check_undo_journal`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| aurora_fuzz::check_undo_journal(data));
