//! The fuzz checks on fixed inputs, without libFuzzer: every seed passes, and every crash
//! the fuzzer ever found stays fixed. `cargo test` in `fuzz/` runs them.

use aurora_fuzz::{
    check_chunk_roundtrip, check_delta_decode, check_shard_part, reseal, seed_deltas,
    seed_roundtrips, shard_fixture,
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

#[test]
fn genuine_shard_parts_assemble_and_damaged_ones_never_panic() {
    let (table, parts) = shard_fixture();
    let inputs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
    let assembly = table
        .assemble(0, aurora_delta::Hash::ZERO, &inputs)
        .expect("genuine parts");
    assert_eq!(
        assembly.parts_base_hash(),
        aurora_fuzz::base().checkpoint.weights_hash()
    );
    for part in parts {
        check_shard_part(part);
        // Every byte of the header and the first segment's start, and a sample after.
        for at in (0..part.len()).filter(|at| *at < 512 || at % 61 == 0) {
            let mut damaged = part.clone();
            damaged[at] ^= 0x55;
            check_shard_part(&damaged);
        }
        for cut in 0..part.len().min(512) {
            check_shard_part(&part[..cut]);
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
    // An aurora chunk whose classes all declare zero changes (decoder indexed empty steps).
    "894144454c54411a010000005d0100000000000000000000010000000000000025326bd1e75aac40b171b566816452fd436e1db85f3965d72316e292de912267667f805bbe42fda925b75a5dc419825031a5a103d9db295c8b67741e4beb0757020600000019006d6f64656c2e656d6265645f746f6b656e732e7765696768740107022000000000000000100000000000000025006d6f64656c2e6c61796572732e302e696e7075745f6c617965726e6f726d2e776569676874010a01100000000000000023006d6f64656c2e6c61796572732e302e6d6c702e646f776e5f70726f6a2e7765696768740106020800000000000000100000000000000026006d6f64656c2e6c61796572732e302e73656c665f6174746e2e715f70726f6a2e7765696768740107021000000000000000100000000000000011006d6f64656c2e6e6f726d2e77656967687401070110000000000000000a006d6f64656c2e737465700108010400000000000000000000000000000000000000000200000000000002440000000137063f00a902b306be03e805fd06200d3c7aea6f84459a4a9b7a44a5880ae54f3b327a51e8aabb887c33bb161e8a022902edb086d6de43749cd206e0d5b579b08eab490100000000000000000000001000000000000000020e00000001000b28d5070a022303060010c00200000000000000000000008000000000000000021b00000006f6092f0099039903b306e80c072e89a44e2cf60325005c3582f40300000000000000000000000001000000000000022300000001100b3f00800680088002800480080b60061efaabbdd738b7476b9800d4083af2006d0400000000000000000000001000000000000000020c000000010205010002fe0101000000030000005d000000d6e291f6fea55864321f0268dcf9cb769a9c445b394cb4c2938896cd65c6bdca5b0000009e90d54a90118345cae7e46d7b275c9889e402b5e32c0f9f4b96ed77e31dcded6100000015efc63fc6c694702b363fe6660f3ffcb5ce8388a8cbc0249e6218c8e8d7d3297000000000000000ea72619829356445ee7aa04991ee00d31ff3a705947ac9983ec5c996fe9385aa41444c54454e440a",
];
const CHUNK_ROUNDTRIP_CRASHES: &[&str] = &[];

#[test]
fn seed_journals_replay_and_damaged_ones_never_panic() {
    let journals = aurora_fuzz::seed_journals();
    assert!(journals.len() >= 3, "{} seed journals", journals.len());
    for (_, journal) in journals {
        aurora_fuzz::check_undo_journal(&journal);
        for cut in [0, 1, journal.len() / 2, journal.len() - 1] {
            aurora_fuzz::check_undo_journal(&journal[..cut]);
        }
        for at in (0..journal.len()).step_by(7) {
            let mut flipped = journal.clone();
            flipped[at] ^= 0x5A;
            aurora_fuzz::check_undo_journal(&flipped);
        }
    }
}

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
