//! The fuzz checks on fixed inputs, without libFuzzer: every seed passes, and every crash
//! the fuzzer ever found stays fixed. `cargo test` in `fuzz/` runs them.

use aurora_fuzz::{
    check_chunk_roundtrip, check_delta_decode, reseal, seed_deltas, seed_roundtrips,
};

#[test]
fn seeds_decode_and_apply() {
    for (name, bytes) in seed_deltas() {
        let delta =
            aurora_delta::DeltaFile::parse(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
        aurora_delta::decode(&delta, &aurora_fuzz::base().checkpoint)
            .unwrap_or_else(|e| panic!("{name} does not reach the decoder: {e}"));
        // Resealing an intact artifact changes nothing.
        assert_eq!(reseal(&bytes).as_deref(), Some(&bytes[..]), "{name}");
        check_delta_decode(&bytes);
    }
}

#[test]
fn seeds_round_trip() {
    for (_, input) in seed_roundtrips() {
        check_chunk_roundtrip(&input);
    }
}

#[test]
fn damaged_seeds_never_panic() {
    // A cheap stand-in for the fuzzer: every single-byte flip of the smallest seeds.
    for (_, bytes) in seed_deltas().into_iter().filter(|(_, b)| b.len() < 4096) {
        for at in 0..bytes.len() {
            let mut damaged = bytes.clone();
            damaged[at] ^= 0x55;
            check_delta_decode(&damaged);
        }
    }
}

/// Inputs found by `cargo fuzz run`, in hex; see README.md.
/// Both overflow sums in `delta_stats` (see the `stats_survive_*` tests for minimal
/// versions); today `check_delta_decode` steps around them (`stats_known_to_panic`).
const DELTA_DECODE_CRASHES: &[&str] = &[
    // crash-ce7106e8e5b141eff1a7d8bfbeb05556cb8f2b15
    concat!(
        "894144454c54411a010000005d0100000000000000000000010000000000000025326bd1e75aac40",
        "b171b5668164d2fd436e1db85f3965d72316e292de9122671846e5afecf25bcf293ce29ff3f26f6d",
        "bde3ceedfb8558f4d05d817db14ef1f7020600000019006d6f64656c2e656d6265645f746f6b656e",
        "732e7765696768740107022000000000000000100000000000000025006d6f64656c2e6c61796572",
        "732e302e696e7075745f6c617965726e6f726d2e776569676874010a01100000000000002623006d",
        "6f64656c2e6c61796572732e302e6d6c702e646f776e5f70726f6a2e776569676874010602080000",
        "0000000000100000000000000a26006d6f64656c2e6c61796572732e302e73656c665f6174746e2e",
        "715f70726f6a2e7765696768740107021000000000000000100000000000000011006d6f64656c2e",
        "6e6f726d2e77656967687401070110000000000000000a006d6f64656c2e73746570010801040000",
        "0800000000000000000000000000000000000200000000000002290000000109271a80c703c7038e",
        "071986a189a2e44003980100e24780330070ed06001eeb00807809147965dd030000000000000000",
        "0000000001000000000000020e0000000102422800801002022e040000080100000069000000775a",
        "0a0e5099e24a535cd9d5f7bbd39eda2a97af757e288a6f7b8f489150bbbc2800000000000000d77f",
        "ccc236f69994c8dccc28ae3beeedbc3c981e3b1a46e7377ebe9fef7bf33b41444c54454e440a",
    ),
    // crash-e9e29a9b351245e62efafc7bfd90480061f6253f
    concat!(
        "894144454c54411a010000008e0100000000000000000000010000000000000025326bd1e75aac40",
        "b171b5668164d2fd436e1db85f3965d72316e292de9122670168842437851d5465fcb49f130635b9",
        "f4651f977225808bbc70d04f926fedbf020700000019006d6f64656c2e656d6265645f746f6b656e",
        "732e7765696768740107022000000000000000100000000000000012006d6f64656c2e6578747261",
        "2e776569676874020701080000000000000025006d6f64656c2e6c61796572732e302e696e707574",
        "5f6c617965726e6f726d2e776569676874040a011000000000000000070202000000000000000800",
        "00000000000023006d6f64656c2e6c61796572732e302e6d6c702e646f776e5f70726f6a2e776569",
        "6768740106020800000000000000100000000000000026006d6f64656c2e6c61796572732e302e73",
        "656c665f6174746e2e715f70726f6a2e776569676874010702100000000000000010000000000000",
        "0011006d6f64656c2e6e6f726d2e77656967687403070110000000000000000a006d6f64656c2e73",
        "74657001080104000000000000000000000000000000000000000002000000000000021e00000001",
        "0b203700dd08e805e805f4020ace3afdc23402a40fe3027101f29b878d0100000000000000000000",
        "00feffffffffffffff00100000003f3f3f3f3f3f3f3f3f3f3f3f3f3f3f3f02000000000000000000",
        "00001000000000000000002000000003107f3f470e803f44ef7f3f93947f3f1a597f3fc7fe7f3f6e",
        "fe883fca10803f0300000000000000000000008000000000000000020f00000001031d0600ab1503",
        "82f80006007fca040000000000000000000000000100000000000002130000000106162300aa0581",
        "100599d6b0c204ab0146e001000000ed0000003ff1b0236c0f0d68e8fad22a5a7faf2501c44fce5b",
        "cc725b90819a8ebf588499280000000000000039c8d04ec3277a3d33ff29119d69412f9ee9dc4def",
        "92d1920874984b2d2ace6141444c54454e440a",
    ),
];
const CHUNK_ROUNDTRIP_CRASHES: &[&str] = &[];

#[test]
fn fuzz_crashes_stay_fixed() {
    for input in DELTA_DECODE_CRASHES {
        check_delta_decode(&hex(input));
    }
    for input in CHUNK_ROUNDTRIP_CRASHES {
        check_chunk_roundtrip(&hex(input));
    }
}


fn hex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).expect("hex"))
        .collect()
}
