//! Every measured number the paper simulation rests on, in one place, each with the
//! record it came from. Nothing here is a simulated result: these are inputs, and the
//! model derives every printed figure from them.

/// A delta encoding the simulation prices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Encoding {
    /// A 4-byte index and the BF16 value per changed element (the paper's naive sparse
    /// format).
    Int32,
    /// LEB128 index gaps and BF16 values (the paper's own encoding, AuroraRL's).
    Leb128,
    /// aurora's own encoding (`delta::codec::aurora`).
    Aurora,
}

impl Encoding {
    /// Bytes per changed element at `density`: linear in log density between the
    /// measured points, the nearest point outside them.
    pub fn bytes_per_change(self, density: f64) -> f64 {
        let column = |point: &(f64, f64, f64, f64)| match self {
            Encoding::Int32 => point.1,
            Encoding::Leb128 => point.2,
            Encoding::Aurora => point.3,
        };
        let first = &BYTES_PER_CHANGE[0];
        let last = &BYTES_PER_CHANGE[BYTES_PER_CHANGE.len() - 1];
        if density <= first.0 {
            return column(first);
        }
        if density >= last.0 {
            return column(last);
        }
        let upper = BYTES_PER_CHANGE
            .iter()
            .position(|point| point.0 >= density)
            .unwrap_or(BYTES_PER_CHANGE.len() - 1);
        let (low, high) = (&BYTES_PER_CHANGE[upper - 1], &BYTES_PER_CHANGE[upper]);
        let weight = (density.ln() - low.0.ln()) / (high.0.ln() - low.0.ln());
        column(low) + weight * (column(high) - column(low))
    }
}

/// Measured bytes per changed element: (density, int32, LEB128, aurora). BENCHMARKS.md,
/// "Delta codec (issue 2)", "Size": the synthetic Qwen3-0.6B shape, one Adam-style step
/// per density, session 13 (`b8fe32d`), `aurora bench codec --preset 0.6b`.
const BYTES_PER_CHANGE: [(f64, f64, f64, f64); 4] = [
    (0.0030, 6.00, 3.652, 1.034),
    (0.0100, 6.00, 3.234, 0.885),
    (0.0301, 6.00, 3.018, 0.785),
    (0.0983, 6.00, 3.001, 0.701),
];

/// aurora extraction, GB of checkpoint per second on one core at 1%. BENCHMARKS.md,
/// "Throughput", session 14 (`1d66bef`).
pub const AURORA_EXTRACT_GBPS_PER_CORE: f64 = 4.88;
/// LEB128 extraction at 1% on two threads, halved. BENCHMARKS.md, "Throughput", the
/// `leb128` line, session 9 (`66bd5e7`): 6.28 GB/s on two threads.
#[allow(clippy::approx_constant, reason = "a measured 6.28 GB/s, not τ")]
pub const LEB128_EXTRACT_GBPS_PER_CORE: f64 = 6.28 / 2.0;
/// aurora decode+apply at 1%, GB of model per second on one core. BENCHMARKS.md,
/// "Throughput", session 14.
pub const AURORA_DECODE_GBPS_PER_CORE: f64 = 4.93;
/// aurora's activation into vLLM over a whole reload of the weights: it writes the
/// changed elements into the engine's parameters. BENCHMARKS.md, "Activation into vLLM",
/// the 0.6B shape at 1.2% on the CPU build: 0.48x.
pub const AURORA_ACTIVATION_SHARE_OF_RELOAD: f64 = 0.48;
/// What the second core adds to extraction (two threads 1.8x one: 0.9 per core).
/// BENCHMARKS.md, "Where the targets stand", issue 2.
pub const CODEC_PARALLEL_EFFICIENCY: f64 = 0.9;

/// One multi-stream TCP measurement of `aurora wan bench`: link rate (Mbps), RTT (ms),
/// loss, streams, goodput (Mbps).
pub type WanMeasurement = (f64, f64, f64, u32, f64);

/// CUBIC over lossy links. BENCHMARKS.md, "WAN emulation: raw TCP over the emulated
/// links (issue 3)", us-canada (30 ms, 0.1%) and lossy-50ms (50 ms, 0.1%), 2026-11-21
/// (`51128fb`), `aurora wan bench ... --cc cubic`.
pub const CUBIC_LOSSY: [WanMeasurement; 8] = [
    (1000.0, 30.0, 0.001, 1, 34.7),
    (1000.0, 30.0, 0.001, 4, 90.9),
    (1000.0, 30.0, 0.001, 8, 164.5),
    (1000.0, 30.0, 0.001, 16, 301.0),
    (1000.0, 50.0, 0.001, 1, 12.9),
    (1000.0, 50.0, 0.001, 4, 91.1),
    (1000.0, 50.0, 0.001, 8, 120.4),
    (1000.0, 50.0, 0.001, 16, 236.9),
];

/// BBR, one stream, no loss, 30 ms: the bandwidth sweep below the emulator's own cap
/// (it tops out near 5.5 Gbps). Same section and run as [`CUBIC_LOSSY`].
pub const BBR_SWEEP: [WanMeasurement; 4] = [
    (250.0, 30.0, 0.0, 1, 233.5),
    (500.0, 30.0, 0.0, 1, 465.3),
    (1000.0, 30.0, 0.0, 1, 926.4),
    (2500.0, 30.0, 0.0, 1, 2305.0),
];

/// Whole transfers of the segment transport that the TCP model is checked against:
/// (bytes, link Mbps, RTT ms, streams, seconds from publication to verified).
/// BENCHMARKS.md, "Per-step transfer time by encoding", 2026-11-21, session 3, BBR,
/// the 1,000 Mbps row (full checkpoint and `aurora` delta of the 0.6B shape).
pub const TRANSPORT_TRANSFERS: [(f64, f64, f64, u32, f64); 4] = [
    (5_148_885.0, 1000.0, 30.0, 1, 0.301),
    (5_148_885.0, 1000.0, 30.0, 4, 0.244),
    (1_192_134_566.0, 1000.0, 30.0, 1, 11.51),
    (1_192_134_566.0, 1000.0, 30.0, 4, 11.59),
];

/// Durable control-plane calls per second the hub sustains: 256 actors, 2,048 prompts,
/// every call journaled and fsynced. BENCHMARKS.md, "Control plane persistence",
/// 2026-11-21 (`1ca95e3`), `cargo bench -p aurora-hub --bench persistence`.
pub const HUB_DURABLE_CALLS_PER_S: f64 = 2_558.0;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_per_change_meet_the_measurements_and_lie_between_them() {
        assert_eq!(Encoding::Aurora.bytes_per_change(0.01), 0.885);
        assert_eq!(Encoding::Leb128.bytes_per_change(0.0983), 3.001);
        assert_eq!(Encoding::Int32.bytes_per_change(0.5), 6.00);
        assert_eq!(Encoding::Aurora.bytes_per_change(1e-5), 1.034);
        let between = Encoding::Aurora.bytes_per_change(0.02);
        assert!(between < 0.885 && between > 0.785, "{between}");
        // Halfway in log density between 1% and 3.01% is 1.735%.
        let halfway = Encoding::Leb128.bytes_per_change((0.01_f64 * 0.0301).sqrt());
        assert!((halfway - (3.234 + 3.018) / 2.0).abs() < 1e-9, "{halfway}");
    }
}
