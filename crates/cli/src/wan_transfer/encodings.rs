//! `encodings`: one step's transfer time for each encoding at every rate of the sweep,
//! beside the paper's reference scaled to this checkpoint.

use crate::fleet;
use anyhow::{Context, Result};
use aurora_delta::{Encoding, ExtractOptions, Extraction, owned_checkpoint};
use aurora_transport::DEFAULT_CONGESTION;
use bytes::Bytes;
use serde::Serialize;

use super::setup::PointToPoint;
use super::{CommonArgs, checkpoint_pair, load_average, mbps, write_json};
use crate::wan_cmd::load_scaled;

/// The AuroraRL paper's reference, Qwen3-8B over a link of about 1 Gbps, in seconds: a
/// full checkpoint, and its `leb128` delta over 1 and over 4 streams.
const PAPER_FULL_S: f64 = 128.0;
const PAPER_LEB128_1_STREAM_S: f64 = 4.71;
const PAPER_LEB128_4_STREAMS_S: f64 = 2.90;

/// The synthetic step D(0 -> 1) in each of `encodings` (`Encoding::Dense` is the full
/// checkpoint), and the bytes of the target checkpoint.
fn artifacts(common: &CommonArgs, encodings: &[Encoding]) -> Result<(u64, Vec<Bytes>)> {
    let (base, target) = checkpoint_pair(common)?;
    let (base, target) = (owned_checkpoint(&base)?, owned_checkpoint(&target)?);
    let mut artifacts = Vec::new();
    for &encoding in encodings {
        let options = ExtractOptions {
            encoding,
            ..ExtractOptions::default()
        };
        let (_, bytes) = Extraction::new(&base, &target, options)?
            .to_bytes()
            .with_context(|| format!("extracting the {} artifact", encoding_name(encoding)))?;
        artifacts.push(Bytes::from(bytes));
    }
    Ok((target.total_bytes(), artifacts))
}

fn encoding_name(encoding: Encoding) -> &'static str {
    match encoding {
        Encoding::Dense => "full",
        Encoding::Leb128 => "leb128",
        Encoding::Aurora => "aurora",
    }
}

#[derive(Serialize)]
struct EncodingRow {
    scenario: String,
    link_mbps: Option<f64>,
    streams: u8,
    encoding: &'static str,
    bytes: u64,
    seconds: f64,
    goodput_mbps: f64,
}

#[derive(Serialize)]
struct EncodingsOutput {
    preset: String,
    density_percent: f64,
    checkpoint_bytes: u64,
    congestion: &'static str,
    /// Our checkpoint's bytes over the paper's (Qwen3-8B in BF16).
    paper_scale: f64,
    paper_scaled_full_s: f64,
    paper_scaled_leb128_1_stream_s: f64,
    paper_scaled_leb128_4_streams_s: f64,
    load_before: String,
    load_after: String,
    rows: Vec<EncodingRow>,
}

pub(super) fn encodings(common: &CommonArgs, streams: &[u8]) -> Result<()> {
    let scenario = load_scaled(&common.scenario, common.rate_scale)?;
    let load_before = load_average();
    let encodings = [Encoding::Dense, Encoding::Leb128, Encoding::Aurora];
    let (checkpoint_bytes, bytes) = artifacts(common, &encodings)?;
    let artifacts: Vec<(&str, Bytes)> = encodings
        .map(encoding_name)
        .into_iter()
        .zip(bytes)
        .collect();
    let paper_bytes = 2 * aurora_synth::preset("8b")
        .expect("the 8b preset exists")
        .parameters();
    let scale = checkpoint_bytes as f64 / paper_bytes as f64;
    crate::print_stdout(&format!(
        "{} at {}% density, load average {load_before}; congestion control: the transport's \
         default ({DEFAULT_CONGESTION}); one transfer per row and encoding, hub to the second \
         region\n{}\n",
        common.preset,
        common.density,
        artifacts
            .iter()
            .map(|(name, bytes)| format!("{name} {} bytes", bytes.len()))
            .collect::<Vec<_>>()
            .join(", "),
    ))?;
    let points = match scenario.sweep_points() {
        points if points.is_empty() => vec![scenario],
        points => points,
    };
    let main = crate::runtime(Some(1))?;
    let mut rows = Vec::new();
    for point in &points {
        let net = PointToPoint::up(point)?;
        for &count in streams {
            for (name, artifact) in &artifacts {
                tracing::info!(
                    scenario = point.name,
                    encoding = name,
                    streams = count,
                    "transfer"
                );
                let report = main
                    .block_on(fleet::transfer(net.spec(artifact, count)?))
                    .with_context(|| format!("{name} over {count} streams in {}", point.name))?;
                let seconds = report.elapsed.as_secs_f64();
                rows.push(EncodingRow {
                    scenario: point.name.clone(),
                    link_mbps: net.link_mbps,
                    streams: count,
                    encoding: name,
                    bytes: report.artifact_bytes,
                    seconds,
                    goodput_mbps: mbps(report.delivered_bytes(), seconds),
                });
            }
        }
        net.down()?;
    }
    let output = EncodingsOutput {
        preset: common.preset.clone(),
        density_percent: common.density,
        checkpoint_bytes,
        congestion: DEFAULT_CONGESTION,
        paper_scale: scale,
        paper_scaled_full_s: PAPER_FULL_S * scale,
        paper_scaled_leb128_1_stream_s: PAPER_LEB128_1_STREAM_S * scale,
        paper_scaled_leb128_4_streams_s: PAPER_LEB128_4_STREAMS_S * scale,
        load_after: load_average(),
        load_before,
        rows,
    };
    print_encodings(&output)?;
    write_json(common.json.as_deref(), &output)
}

fn print_encodings(output: &EncodingsOutput) -> Result<()> {
    let mut text = format!(
        "{:>10} {:>7} {:>10} {:>10} {:>10} {:>11} {:>11} {:>11}\n",
        "link Mbps",
        "streams",
        "full s",
        "leb128 s",
        "aurora s",
        "full Mbps",
        "leb128 Mbps",
        "aurora Mbps"
    );
    // Rows come in groups of the three encodings, in the order above.
    for group in output.rows.chunks(3) {
        let link = group[0]
            .link_mbps
            .map_or("-".to_string(), |rate| format!("{rate}"));
        text += &format!(
            "{link:>10} {:>7} {:>10.3} {:>10.3} {:>10.3} {:>11.1} {:>11.1} {:>11.1}\n",
            group[0].streams,
            group[0].seconds,
            group[1].seconds,
            group[2].seconds,
            group[0].goodput_mbps,
            group[1].goodput_mbps,
            group[2].goodput_mbps,
        );
    }
    text += &format!(
        "paper (Qwen3-8B, about 1 Gbps) scaled by {:.4} (this checkpoint's {} bytes over \
         Qwen3-8B's BF16): full {:.2} s, leb128 {:.3} s on 1 stream, {:.3} s on 4 streams\n\
         load average after: {}\n",
        output.paper_scale,
        output.checkpoint_bytes,
        output.paper_scaled_full_s,
        output.paper_scaled_leb128_1_stream_s,
        output.paper_scaled_leb128_4_streams_s,
        output.load_after,
    );
    crate::print_stdout(&text)
}
