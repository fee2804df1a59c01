//! `aurora bench codec`: delta sizes and codec throughput, each next to its baseline;
//! `aurora bench control`: scheduling in the deterministic simulator; `aurora bench
//! scale`: the whole path at a model's real size (`bench_scale.rs`).
//!
//! For every density: bytes per changed element of int32 indices, the published `leb128`
//! encoding, ours, and the empirical information floor given the base exponent; extraction
//! throughput next to a plain scan that only compares the two checkpoints; and
//! decode+apply throughput on one core next to the weights-hash pass that verifies it.

use std::time::Instant;

use anyhow::{Context, Result};
use aurora_delta::{
    ArtifactKind, Checkpoint, DeltaFile, Encoding, ExtractOptions, Extraction, OwnedTensor,
    Statement, TargetHash, check_base, count_changed, decode, owned_checkpoint, safetensors_layout,
};
use aurora_synth::{ModelShape, Synth, SynthConfig, preset};
use clap::Subcommand;
use rayon::prelude::*;
use serde::Serialize;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Delta sizes and codec throughput on synthetic checkpoints.
    Codec {
        #[arg(long, default_value = "0.6b")]
        preset: String,
        /// Target densities in percent; the learning rate is scaled to reach each.
        #[arg(long, value_delimiter = ',', default_value = "0.3,1,3,10")]
        densities: Vec<f64>,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Also write the results as JSON here.
        #[arg(long)]
        json: Option<std::path::PathBuf>,
    },
    /// Scheduling in the deterministic simulator: proportional against uniform split on
    /// an A100 + L40 pool, and the throughput timeline through a preemption and a rejoin.
    Control {
        #[arg(long, default_value_t = 42)]
        seed: u64,
    },
    /// The whole path at a model's real size: a hub publishing a synthetic chain, two
    /// actors joining by snapshot over the wire and following every delta through a relay,
    /// as processes; time, peak anonymous memory per node and bytes on the wire per phase.
    Scale(crate::bench_scale::ScaleArgs),
}

#[derive(Serialize)]
struct CodecResult {
    preset: String,
    target_density_percent: f64,
    learning_rate: f32,
    elements: u64,
    changed: u64,
    density_percent: f64,
    checkpoint_bytes: u64,
    bytes_int32: u64,
    bytes_leb128: u64,
    bytes_aurora: u64,
    floor_bytes: f64,
    per_changed_int32: f64,
    per_changed_leb128: f64,
    per_changed_aurora: f64,
    per_changed_floor: f64,
    scan_gbps_1: f64,
    scan_gbps_2: f64,
    extract_aurora_gbps_1: f64,
    extract_aurora_gbps_2: f64,
    extract_leb128_gbps_2: f64,
    decode_apply_gbps_1: f64,
    decode_apply_changed_per_s_1: f64,
    decode_apply_gbps_2: f64,
    weights_hash_gbps_2: f64,
    /// The trainer signing the aurora delta's statement, and a receiver verifying it
    /// (docs/security.md): once per artifact, whatever its size.
    sign_artifact_us: f64,
    verify_artifact_us: f64,
}

/// (learning rate, BF16 density in percent) measured on the synthetic 0.6B model at seed 0;
/// density grows sublinearly with the rate. Used only to aim at a target density: the
/// benchmark measures and reports the density it actually got.
const DENSITY_BY_LEARNING_RATE: [(f64, f64); 4] = [
    (2.64e-7, 0.40),
    (8.8e-7, 1.09),
    (2.64e-6, 2.59),
    (8.8e-6, 6.36),
];

/// Log-log interpolation (and extrapolation from the nearest segment) of the table.
fn learning_rate_for(density_percent: f64) -> f64 {
    let table = DENSITY_BY_LEARNING_RATE;
    let segment = table
        .windows(2)
        .find(|w| density_percent <= w[1].1)
        .unwrap_or(&table[table.len() - 2..]);
    let ((lr0, d0), (lr1, d1)) = (segment[0], segment[1]);
    let slope = (d1 / d0).ln() / (lr1 / lr0).ln();
    lr0 * ((density_percent / d0).ln() / slope).exp()
}

pub fn run(command: BenchCommand) -> Result<()> {
    match command {
        BenchCommand::Codec {
            preset,
            densities,
            seed,
            json,
        } => codec(&preset, &densities, seed, json),
        BenchCommand::Control { seed } => control(seed),
        BenchCommand::Scale(args) => crate::bench_scale::run(args),
    }
}

fn control(seed: u64) -> Result<()> {
    use aurora_sim as sim;
    let comparison = sim::compare_split_policies(seed)
        .map_err(|violation| anyhow::anyhow!("simulation violated an invariant: {violation:?}"))?;
    println!("A100 + L40 pool (2 of each), seed {seed}: Algorithm 1 against an equal split");
    println!("  split          mean step s   idle share   accepted per actor");
    for (name, outcome) in [
        ("proportional", &comparison.proportional),
        ("uniform", &comparison.uniform),
    ] {
        let accepted: Vec<String> = outcome
            .actors
            .iter()
            .map(|a| format!("{} {}", a.label, a.accepted))
            .collect();
        println!(
            "  {name:<14} {:>11.2} {:>11.1}%   {}",
            outcome.mean_step_ms as f64 / 1e3,
            100.0 * outcome.idle_fraction,
            accepted.join(", ")
        );
    }
    let speedup =
        comparison.uniform.mean_step_ms as f64 / comparison.proportional.mean_step_ms.max(1) as f64;
    println!(
        "  proportional steps are {:.0}% shorter",
        100.0 * (1.0 - 1.0 / speedup)
    );

    let timeline = sim::preemption_timeline(seed)
        .map_err(|violation| anyhow::anyhow!("simulation violated an invariant: {violation:?}"))?;
    println!(
        "\nPreemption of an A100 at {} s, rejoin at {} s (two A100s and an L40):",
        sim::Scenario::PREEMPTION_AT_MS / 1000,
        sim::Scenario::REJOIN_AT_MS / 1000
    );
    println!("  step   opened s   step s   live actors   goodput tokens/s");
    for step in &timeline {
        println!(
            "  {:>4} {:>10.1} {:>8.1} {:>13} {:>18.0}",
            step.step.0,
            step.opened_at.0 as f64 / 1e3,
            step.step_ms() as f64 / 1e3,
            step.live_actors,
            step.goodput_tokens_per_s()
        );
    }
    Ok(())
}

fn codec(
    preset_name: &str,
    densities: &[f64],
    seed: u64,
    json: Option<std::path::PathBuf>,
) -> Result<()> {
    let shape = preset(preset_name).with_context(|| format!("unknown preset '{preset_name}'"))?;
    let mut results = Vec::new();
    for &density in densities {
        let (base, target, learning_rate) = checkpoint_pair(shape, density, seed);
        let result = measure(preset_name, density, learning_rate, &base, &target)?;
        print_result(&result);
        results.push(result);
    }
    if let Some(path) = json {
        std::fs::write(&path, serde_json::to_string_pretty(&results)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// A synthetic base checkpoint and one Adam-style step from it, at the learning rate
/// that aims at `density_percent` of the BF16 elements changing; returns that rate too.
pub(crate) fn checkpoint_pair(
    shape: ModelShape,
    density_percent: f64,
    seed: u64,
) -> (Vec<OwnedTensor>, Vec<OwnedTensor>, f32) {
    let learning_rate = learning_rate_for(density_percent) as f32;
    tracing::info!(
        parameters = shape.parameters(),
        density_percent,
        learning_rate,
        "generating base and target"
    );
    let mut synth = Synth::new(SynthConfig {
        learning_rate,
        ..SynthConfig::new(shape, seed)
    });
    let base = synth.export();
    synth.step();
    let target = synth.export();
    (base, target, learning_rate)
}

fn pool(threads: usize) -> Result<rayon::ThreadPool> {
    Ok(rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()?)
}

/// Runs of each measurement; the best counts.
const ROUNDS: usize = 5;

/// Seconds of one run of `f`, and its result.
fn timed<T>(f: &mut impl FnMut() -> Result<T>) -> Result<(f64, T)> {
    let started = Instant::now();
    let value = f()?;
    Ok((started.elapsed().as_secs_f64(), value))
}

/// Best of [`ROUNDS`] runs, in seconds, and the last result.
fn best_of<T>(mut f: impl FnMut() -> Result<T>) -> Result<(f64, T)> {
    let (mut best, mut value) = timed(&mut f)?;
    for _ in 1..ROUNDS {
        let (seconds, last) = timed(&mut f)?;
        (best, value) = (best.min(seconds), last);
    }
    Ok((best, value))
}

/// Best of [`ROUNDS`] runs of each of `f` and `g`, taking turns, and their last results.
/// A figure compared with its baseline is measured this way: this machine's speed drifts
/// by tens of percent over seconds, and runs taken one after the other would compare
/// two different machines.
fn best_of_both<T, U>(
    mut f: impl FnMut() -> Result<T>,
    mut g: impl FnMut() -> Result<U>,
) -> Result<((f64, T), (f64, U))> {
    let (mut first, mut second) = (timed(&mut f)?, timed(&mut g)?);
    for _ in 1..ROUNDS {
        let (seconds, value) = timed(&mut f)?;
        first = (first.0.min(seconds), value);
        let (seconds, value) = timed(&mut g)?;
        second = (second.0.min(seconds), value);
    }
    Ok((first, second))
}

fn measure(
    preset_name: &str,
    target_density: f64,
    learning_rate: f32,
    base: &[OwnedTensor],
    target: &[OwnedTensor],
) -> Result<CodecResult> {
    let base_view = owned_checkpoint(base)?;
    let target_view = owned_checkpoint(target)?;
    let checkpoint_bytes = target_view.total_bytes();
    let gbps = |seconds: f64| checkpoint_bytes as f64 / seconds / 1e9;
    let elements: u64 = target
        .iter()
        .map(|t| t.data.len() as u64 / t.dtype.size_bytes() as u64)
        .sum();

    let scan = |threads: usize| -> Result<u64> {
        Ok(pool(threads)?.install(|| {
            base.par_iter()
                .zip(target)
                .flat_map(|(b, t)| {
                    let bytes = b.dtype.size_bytes();
                    b.data
                        .par_chunks(1 << 22)
                        .zip(t.data.par_chunks(1 << 22))
                        .map(move |(x, y)| count_changed(x, y, bytes))
                })
                .sum::<u64>()
        }))
    };
    let (base_hash, target_hash) = (base_view.weights_hash(), target_view.weights_hash());
    let extract = |encoding: Encoding, threads: usize| -> Result<Vec<u8>> {
        let options = ExtractOptions {
            encoding,
            base_hash: Some(base_hash),
            target_hash: TargetHash::Known(target_hash),
            ..ExtractOptions::default()
        };
        pool(threads)?.install(|| {
            Ok(Extraction::new(&base_view, &target_view, options.clone())?
                .to_bytes()?
                .1)
        })
    };
    // The extraction against the scan it is compared with, in alternating runs.
    let ((scan_1, changed), (extract_aurora_1, aurora)) =
        best_of_both(|| scan(1), || extract(Encoding::Aurora, 1))?;
    let ((scan_2, _), (extract_aurora_2, _)) =
        best_of_both(|| scan(2), || extract(Encoding::Aurora, 2))?;
    let (extract_leb128_2, leb128) = best_of(|| extract(Encoding::Leb128, 2))?;

    let image = aurora_checkpoint::safetensors_bytes(base).map_err(anyhow::Error::msg)?;
    let layout = safetensors_layout(&image)?;
    let delta = DeltaFile::parse(&aurora)?;
    let decode_apply = |threads: usize| -> Result<f64> {
        let pool = pool(threads)?;
        let mut buffer = image.clone();
        let mut best = f64::INFINITY;
        for _ in 0..ROUNDS {
            let started = Instant::now();
            let mut patch = pool.install(|| -> Result<_> {
                let mut patch = {
                    let view = Checkpoint::from_layout(&buffer, &layout)?;
                    check_base(delta.header(), &view, Some(base_hash))?;
                    decode(&delta, &view)?
                };
                patch.swap_in_place(&mut buffer, &layout)?;
                Ok(patch)
            })?;
            best = best.min(started.elapsed().as_secs_f64());
            // Untimed: swapping again restores the base for the next run.
            patch.swap_in_place(&mut buffer, &layout)?;
        }
        Ok(best)
    };
    let decode_apply_1 = decode_apply(1)?;
    let decode_apply_2 = decode_apply(2)?;
    let (hash_2, hash) = {
        let pool = pool(2)?;
        best_of(|| Ok(pool.install(|| target_view.weights_hash())))?
    };
    anyhow::ensure!(hash == target_hash, "weights hash is not deterministic");
    let (sign_artifact_us, verify_artifact_us) = signing_cost(&delta)?;

    let floor_bytes = information_floor(&base_view, &target_view);
    let per = |bytes: f64| bytes / changed.max(1) as f64;
    let bytes_int32 = changed * 4 + target_bytes_of_changes(&base_view, &target_view);
    Ok(CodecResult {
        preset: preset_name.to_string(),
        target_density_percent: target_density,
        learning_rate,
        elements,
        changed,
        density_percent: 100.0 * changed as f64 / elements as f64,
        checkpoint_bytes,
        bytes_int32,
        bytes_leb128: leb128.len() as u64,
        bytes_aurora: aurora.len() as u64,
        floor_bytes,
        per_changed_int32: per(bytes_int32 as f64),
        per_changed_leb128: per(leb128.len() as f64),
        per_changed_aurora: per(aurora.len() as f64),
        per_changed_floor: per(floor_bytes),
        scan_gbps_1: gbps(scan_1),
        scan_gbps_2: gbps(scan_2),
        extract_aurora_gbps_1: gbps(extract_aurora_1),
        extract_aurora_gbps_2: gbps(extract_aurora_2),
        extract_leb128_gbps_2: gbps(extract_leb128_2),
        decode_apply_gbps_1: gbps(decode_apply_1),
        decode_apply_changed_per_s_1: changed as f64 / decode_apply_1,
        decode_apply_gbps_2: gbps(decode_apply_2),
        weights_hash_gbps_2: gbps(hash_2),
        sign_artifact_us,
        verify_artifact_us,
    })
}

/// Microseconds to sign the statement of `delta` and to verify it, each the best of
/// [`ROUNDS`] runs of [`SIGNATURES_PER_RUN`] (one is too short to time alone). The
/// statement's id is the one extraction computed already: this is the added cost.
fn signing_cost(delta: &DeltaFile<'_>) -> Result<(f64, f64)> {
    const SIGNATURES_PER_RUN: u32 = 200;
    let key = aurora_delta::SigningKey::from_bytes(&[7; 32]);
    let run = aurora_delta::RunId([7; 16]);
    let statement = Statement::artifact(ArtifactKind::Delta, delta.id, delta.header());
    let (sign_s, signature) = best_of(|| {
        let mut signature = None;
        for _ in 0..SIGNATURES_PER_RUN {
            signature = Some(aurora_delta::sign(&key, &run, &statement));
        }
        Ok(signature)
    })?;
    let public = key.verifying_key();
    let (verify_s, ()) = best_of(|| {
        for _ in 0..SIGNATURES_PER_RUN {
            aurora_delta::verify(&public, &run, &statement, signature.as_ref())?;
        }
        Ok(())
    })?;
    let per_signature_us = |seconds: f64| seconds * 1e6 / f64::from(SIGNATURES_PER_RUN);
    Ok((per_signature_us(sign_s), per_signature_us(verify_s)))
}

/// Bytes of the new values of all changed elements (what an int32-index encoding sends
/// beside its indices).
fn target_bytes_of_changes(base: &Checkpoint<'_>, target: &Checkpoint<'_>) -> u64 {
    base.tensors()
        .iter()
        .zip(target.tensors())
        .map(|(b, t)| {
            let bytes = b.dtype.size_bytes();
            count_changed(b.data, t.data, bytes) * bytes as u64
        })
        .sum()
}

/// Empirical entropy of the changes given the base value's exponent, in bytes: for each
/// (dtype, exponent) context, the binary entropy of "changed" over its elements plus the
/// entropy of the step sizes among its changes. Ignores model costs, so no real coder
/// reaches it; it is the yardstick.
fn information_floor(base: &Checkpoint<'_>, target: &Checkpoint<'_>) -> f64 {
    use std::collections::HashMap;
    let mut population: HashMap<(u8, u32), u64> = HashMap::new();
    let mut steps: HashMap<(u8, u32), HashMap<i64, u64>> = HashMap::new();
    for (b, t) in base.tensors().iter().zip(target.tensors()) {
        let (mask, shift, bytes) = match b.dtype {
            aurora_delta::Dtype::Bf16 => (0x7F80u32, 7, 2),
            aurora_delta::Dtype::F32 => (0x7F80_0000, 23, 4),
            _ => continue,
        };
        let mut counts = vec![0u64; 256];
        for (old, new) in b.data.chunks_exact(bytes).zip(t.data.chunks_exact(bytes)) {
            let word = |c: &[u8]| {
                c.iter()
                    .rev()
                    .fold(0u32, |acc, &x| (acc << 8) | u32::from(x))
            };
            let o = word(old);
            let exponent = (o & mask) >> shift;
            counts[exponent as usize] += 1;
            if old != new {
                let key = |w: u32| -> i64 {
                    let sign = 1u32 << (8 * bytes as u32 - 1);
                    let w = i64::from(w);
                    if w & i64::from(sign) != 0 {
                        i64::from(sign) - 1 - (w - i64::from(sign))
                    } else {
                        w + i64::from(sign)
                    }
                };
                *steps
                    .entry((b.dtype as u8, exponent))
                    .or_default()
                    .entry(key(word(new)) - key(o))
                    .or_default() += 1;
            }
        }
        for (e, c) in counts.into_iter().enumerate() {
            if c > 0 {
                *population.entry((b.dtype as u8, e as u32)).or_default() += c;
            }
        }
    }
    let mut bits = 0.0;
    for (context, n) in population {
        let Some(histogram) = steps.get(&context) else {
            continue;
        };
        let c: u64 = histogram.values().sum();
        let (n, c) = (n as f64, c as f64);
        if c < n {
            bits += c * (n / c).log2() + (n - c) * (n / (n - c)).log2();
        }
        bits += histogram
            .values()
            .map(|&k| k as f64 * (c / k as f64).log2())
            .sum::<f64>();
    }
    bits / 8.0
}

fn print_result(r: &CodecResult) {
    println!(
        "\n{} at {:.2}% density (lr {:.2e}): {} of {} elements changed, checkpoint {:.1} MB",
        r.preset,
        r.density_percent,
        r.learning_rate,
        r.changed,
        r.elements,
        r.checkpoint_bytes as f64 / 1e6
    );
    println!("  size               total MB   bytes/changed");
    for (name, bytes, per) in [
        ("int32 + values", r.bytes_int32 as f64, r.per_changed_int32),
        (
            "leb128 (paper)",
            r.bytes_leb128 as f64,
            r.per_changed_leb128,
        ),
        ("aurora", r.bytes_aurora as f64, r.per_changed_aurora),
        ("floor (exp ctx)", r.floor_bytes, r.per_changed_floor),
    ] {
        println!("  {name:<16} {:>10.3} {:>15.3}", bytes / 1e6, per);
    }
    println!("  throughput (GB/s of checkpoint)   1 thread   2 threads");
    println!(
        "  plain scan (floor)              {:>10.2} {:>11.2}",
        r.scan_gbps_1, r.scan_gbps_2
    );
    println!(
        "  extract aurora                  {:>10.2} {:>11.2}",
        r.extract_aurora_gbps_1, r.extract_aurora_gbps_2
    );
    println!(
        "  extract leb128                  {:>10} {:>11.2}",
        "", r.extract_leb128_gbps_2
    );
    println!(
        "  decode+apply aurora             {:>10.2} {:>11.2}   ({:.1} M changed elements/s on 1 thread)",
        r.decode_apply_gbps_1,
        r.decode_apply_gbps_2,
        r.decode_apply_changed_per_s_1 / 1e6
    );
    println!(
        "  weights hash (verify target)    {:>10} {:>11.2}",
        "", r.weights_hash_gbps_2
    );
    println!(
        "  per artifact: sign {:.1} µs, verify {:.1} µs (ed25519 over its statement)",
        r.sign_artifact_us, r.verify_artifact_us
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn learning_rate_interpolates_the_measured_points() {
        for (lr, density) in DENSITY_BY_LEARNING_RATE {
            assert!((learning_rate_for(density) / lr - 1.0).abs() < 1e-9);
        }
        assert!(learning_rate_for(0.3) < 2.64e-7);
        assert!(learning_rate_for(10.0) > 8.8e-6);
    }
}
