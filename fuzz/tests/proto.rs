//! The segment-protocol fuzz checks on fixed inputs, without libFuzzer.

use aurora_fuzz::proto::{check_frames, check_state, frames, seed_streams};

#[test]
fn seeds_drive_the_state_machines() {
    for (name, bytes) in seed_streams() {
        assert!(frames(&bytes[1..]).len() >= 4, "{name} decodes");
        check_frames(&bytes[1..]);
        check_state(&bytes);
    }
}

#[test]
fn damaged_seeds_never_panic() {
    for (_, bytes) in seed_streams() {
        for at in 0..bytes.len() {
            let mut damaged = bytes.clone();
            damaged[at] ^= 0x55;
            check_frames(&damaged[1..]);
            check_state(&damaged);
        }
    }
}

/// Inputs found by `cargo fuzz run proto_state`, in hex; see README.md.
const STATE_CRASHES: &[&[&str]] = &[
    // crash-f774d9a61071797a3a052e6253c0abed9673b84f: two Hellos, then a Nack whose
    // index sized the sender's segment table (30 GB).
    &[
        "0151000000014155524f52410001010000000301610466757a7a0466757a7a090000000000000000",
        "02010000000000000000000000000000000000000000000000000000000000000000000000000000",
        "00000000000051000000014155524f52410001010000000301610466757a7a0466757a7a09000000",
        "00000000010201000000000000000000000000000000000000000000000000000000000000000000",
        "00000000000000000000003800000004010000000000000001000000000000000300000000000000",
        "020100000001000000010100000000000000010100000001000000ffff00000d0000000801000000",
        "00000000257ff6e4432a000000000000",
    ],
];

#[test]
fn fuzz_findings_stay_fixed() {
    for crash in STATE_CRASHES {
        let hex: String = crash.concat();
        let bytes: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        check_state(&bytes);
    }
}
