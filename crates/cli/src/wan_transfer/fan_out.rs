//! `fan-out`: one delta from the hub to every other region's actors, direct, through
//! relays and cut-through, with each link's bytes and each actor's times.

use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::fleet::{Fleet, FleetRegion, FleetSpec, StagedReport};
use anyhow::{Context, Result, bail, ensure};
use aurora_delta::{
    Checkpoint, Encoding, ExtractOptions, Extraction, TargetHash, owned_checkpoint,
    safetensors_layout,
};
use aurora_proto::{Role, Weights};
use aurora_transport::{SocketOptions, TransportError};
use aurora_wan::Network;
use bytes::Bytes;
use serde::Serialize;

use super::setup::{TIMEOUT, runtime_in};
use super::{CommonArgs, TransportSecurity, checkpoint_pair, load_average, write_json};
use crate::wan_cmd::{growth, load_scaled};

/// The version every benchmark publishes: the step from the synthetic base (version 0).
const VERSION: u64 = 1;

#[derive(Serialize)]
struct LinkBytes {
    region: String,
    /// IP bytes the emulator passed from the hub to the region (TCP/IP headers and
    /// retransmissions included; a super-packet's header counted once).
    bytes: u64,
    copies: f64,
}

#[derive(Serialize)]
struct MemberTimes {
    region: String,
    name: String,
    role: String,
    received_s: f64,
    staged_s: f64,
}

#[derive(Serialize)]
struct FanOutRow {
    mode: &'static str,
    security: TransportSecurity,
    links: Vec<LinkBytes>,
    /// Of the actors (relays are in `members`), from publication (cut-through: from the
    /// first segment leaving the encoder).
    first_received_s: f64,
    last_received_s: f64,
    first_staged_s: f64,
    last_staged_s: f64,
    /// Cut-through only: from the extraction's start to its first segment and to its
    /// end, during the run.
    first_segment_s: Option<f64>,
    extraction_s: Option<f64>,
    members: Vec<MemberTimes>,
    load: String,
}

#[derive(Serialize)]
struct FanOutOutput {
    scenario: String,
    preset: String,
    density_percent: f64,
    artifact_bytes: u64,
    actors_per_region: usize,
    streams: u8,
    /// Extraction of the same delta with nothing else running, before the network.
    extraction_alone_s: f64,
    rows: Vec<FanOutRow>,
}

#[derive(Clone, Copy, PartialEq)]
enum Publication {
    /// The complete artifact, published at once.
    Stored,
    /// A live extraction, each segment published as it leaves the encoder.
    Live,
}

pub(super) fn fan_out(
    common: &CommonArgs,
    actors: usize,
    streams: u8,
    securities: &[TransportSecurity],
) -> Result<()> {
    ensure!(actors >= 1, "--actors must be at least 1");
    let scenario = load_scaled(&common.scenario, common.rate_scale)?;
    if scenario.regions.len() < 2 {
        bail!(
            "scenario {} needs a hub region and at least one other",
            scenario.name
        );
    }
    let hub = scenario.regions[0].name.clone();
    let remotes: Vec<String> = scenario.regions[1..]
        .iter()
        .map(|r| r.name.clone())
        .collect();
    let (base, target) = checkpoint_pair(common)?;
    let image = aurora_checkpoint::safetensors_bytes(&base).map_err(anyhow::Error::msg)?;
    drop(base);
    let weights = Weights::new(image, VERSION - 1).context("the synthetic base")?;
    let layout = safetensors_layout(weights.image())?;
    let base_view = Checkpoint::from_layout(weights.image(), &layout)?;
    let target_view = owned_checkpoint(&target)?;
    let options = ExtractOptions {
        encoding: Encoding::Aurora,
        base_version: VERSION - 1,
        target_version: VERSION,
        base_hash: Some(weights.active().hash),
        target_hash: TargetHash::Known(target_view.weights_hash()),
        ..ExtractOptions::default()
    };
    let alone = Extraction::new(&base_view, &target_view, options.clone())?;
    let started = Instant::now();
    let (_, artifact) = alone.to_bytes()?;
    let extraction_alone = started.elapsed();
    let artifact = Bytes::from(artifact);
    crate::print_stdout(&format!(
        "{}: {} at {}% density, aurora delta of {} bytes, {actors} actors in each of {}, {} \
         streams; extraction alone {:.3} s\n",
        scenario.name,
        common.preset,
        common.density,
        artifact.len(),
        remotes.join(", "),
        streams,
        extraction_alone.as_secs_f64(),
    ))?;

    let network = Network::up(&scenario)?;
    let mut runtimes = Vec::new();
    for region in std::iter::once(&hub).chain(&remotes) {
        runtimes.push(runtime_in(&network, region)?);
    }
    let regions = remotes
        .iter()
        .zip(&runtimes[1..])
        .map(|(name, runtime)| {
            Ok(FleetRegion {
                name: name.clone(),
                actors,
                address: network.address(name)?.into(),
                runtime: Some(runtime.handle().clone()),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let main = crate::runtime(Some(1))?;
    let mut rows = Vec::new();
    let modes = [
        ("direct", false, Publication::Stored),
        ("relays", true, Publication::Stored),
        ("cut-through", true, Publication::Live),
    ];
    for ((mode, relays, publication), &security) in modes
        .into_iter()
        .flat_map(|mode| securities.iter().map(move |security| (mode, security)))
    {
        let spec = FleetSpec {
            regions: regions.clone(),
            relays,
            hub_listen: SocketAddr::new(network.address(&hub)?.into(), 0),
            hub_runtime: Some(runtimes[0].handle().clone()),
            streams,
            socket: SocketOptions::default(),
            tune_interval: None,
            timeout: TIMEOUT,
            security: security.bench()?,
        };
        tracing::info!(mode, "starting the fleet");
        let fleet = main
            .block_on(Fleet::start(&spec, &weights))
            .with_context(|| format!("starting the {mode} fleet"))?;
        let before = network.counters();
        tracing::info!(mode, "publishing");
        let (reports, cut_through) = match publication {
            Publication::Stored => {
                let start = Instant::now();
                let reports = main.block_on(async {
                    fleet.hub.publish(artifact.clone()).await?;
                    fleet.staged(VERSION, start).await
                });
                (reports, None)
            }
            Publication::Live => {
                let live = Extraction::new(&base_view, &target_view, options.clone())?;
                let first = OnceLock::new();
                let start = Instant::now();
                std::thread::scope(|scope| {
                    let publisher = scope.spawn(|| {
                        let hash = live.header().target_hash;
                        let published = fleet.hub.publish_delta_observed(
                            &live,
                            || Ok::<_, TransportError>(hash),
                            |_| {
                                first.get_or_init(Instant::now);
                            },
                        );
                        (published, start.elapsed())
                    });
                    let reports = main.block_on(fleet.staged(VERSION, start));
                    let (published, extraction) = publisher
                        .join()
                        .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
                    published.context("the live extraction")?;
                    let first = first
                        .get()
                        .context("the extraction produced no segment")?
                        .duration_since(start);
                    Ok::<_, anyhow::Error>((reports, Some((first, extraction))))
                })?
            }
        };
        let reports = reports.with_context(|| format!("the {mode} fan-out"))?;
        let after = network.counters();
        main.block_on(fleet.stop());
        let links = remotes
            .iter()
            .map(|region| {
                let bytes = growth(&before, &after, |d| {
                    if d.from == hub && &d.to == region {
                        d.counters.bytes_out
                    } else {
                        0
                    }
                });
                LinkBytes {
                    region: region.clone(),
                    bytes,
                    copies: bytes as f64 / artifact.len() as f64,
                }
            })
            .collect();
        let row = fan_out_row((mode, security), links, &reports, cut_through);
        print_fan_out_row(&row)?;
        rows.push(row);
    }
    drop(runtimes);
    network.down()?;
    let output = FanOutOutput {
        scenario: scenario.name.clone(),
        preset: common.preset.clone(),
        density_percent: common.density,
        artifact_bytes: artifact.len() as u64,
        actors_per_region: actors,
        streams,
        extraction_alone_s: extraction_alone.as_secs_f64(),
        rows,
    };
    print_fan_out_verdict(&output)?;
    write_json(common.json.as_deref(), &output)
}

/// Times of a fan-out; for a cut-through one they count from the first segment leaving
/// the encoder (`cut_through`: first segment and extraction end, from its start).
fn fan_out_row(
    (mode, security): (&'static str, TransportSecurity),
    links: Vec<LinkBytes>,
    reports: &[StagedReport],
    cut_through: Option<(Duration, Duration)>,
) -> FanOutRow {
    let origin = cut_through.map_or(Duration::ZERO, |(first, _)| first);
    let since = |at: Duration| at.saturating_sub(origin).as_secs_f64();
    let members: Vec<MemberTimes> = reports
        .iter()
        .map(|report| MemberTimes {
            region: report.region.clone(),
            name: report.name.clone(),
            role: report.role.to_string(),
            received_s: since(report.received),
            staged_s: since(report.staged),
        })
        .collect();
    // Actors only: a relay decodes nothing, so it counts as staged once it holds the
    // version, ahead of every actor behind it.
    let actors: Vec<&MemberTimes> = members
        .iter()
        .zip(reports)
        .filter(|(_, report)| report.role == Role::Actor)
        .map(|(member, _)| member)
        .collect();
    let extreme = |field: fn(&MemberTimes) -> f64, pick: fn(f64, f64) -> f64, start: f64| {
        actors.iter().map(|member| field(member)).fold(start, pick)
    };
    FanOutRow {
        mode,
        security,
        links,
        first_received_s: extreme(|m| m.received_s, f64::min, f64::INFINITY),
        last_received_s: extreme(|m| m.received_s, f64::max, 0.0),
        first_staged_s: extreme(|m| m.staged_s, f64::min, f64::INFINITY),
        last_staged_s: extreme(|m| m.staged_s, f64::max, 0.0),
        first_segment_s: cut_through.map(|(first, _)| first.as_secs_f64()),
        extraction_s: cut_through.map(|(_, extraction)| extraction.as_secs_f64()),
        members,
        load: load_average(),
    }
}

fn print_fan_out_row(row: &FanOutRow) -> Result<()> {
    let links: Vec<String> = row
        .links
        .iter()
        .map(|link| {
            format!(
                "hub->{} {} B ({:.2} copies)",
                link.region, link.bytes, link.copies
            )
        })
        .collect();
    let mut text = format!(
        "{:<12} {:<9} {}; received first {:.3} s, last {:.3} s; staged first {:.3} s, last \
         {:.3} s (last/first {:.2}); load {}\n",
        row.mode,
        row.security.name(),
        links.join(", "),
        row.first_received_s,
        row.last_received_s,
        row.first_staged_s,
        row.last_staged_s,
        row.last_staged_s / row.first_staged_s,
        row.load,
    );
    if let (Some(first), Some(extraction)) = (row.first_segment_s, row.extraction_s) {
        text += &format!(
            "{:<12} times from the first segment leaving the encoder, {first:.3} s after the \
             extraction started; the extraction ended at {extraction:.3} s\n",
            ""
        );
    }
    crate::print_stdout(&text)
}

/// The targets: one copy per region on each cross-region link with relays, and the last
/// actor staged within 10% of the first; then cut-through against store-and-forward.
fn print_fan_out_verdict(output: &FanOutOutput) -> Result<()> {
    /// More than this many copies on a link is no longer "one copy" (headers and
    /// retransmissions add a few percent).
    const ONE_COPY: f64 = 1.5;
    const SPREAD: f64 = 1.1;
    let mut text = String::new();
    let met = |ok: bool| if ok { "met" } else { "NOT met" };
    for row in &output.rows {
        let most = row.links.iter().map(|l| l.copies).fold(0.0, f64::max);
        let spread = row.last_staged_s / row.first_staged_s;
        text += &format!(
            "{} {}: at most {most:.2} copies per cross-region link{}; last staged {:.2}x the \
             first: target <= {SPREAD} {} (last received {:.2}x the first)\n",
            row.mode,
            row.security.name(),
            if row.mode == "direct" {
                String::new()
            } else {
                format!(": target one copy {}", met(most < ONE_COPY))
            },
            spread,
            met(spread <= SPREAD),
            row.last_received_s / row.first_received_s,
        );
    }
    let relays = output.rows.iter().find(|row| row.mode == "relays");
    let cut = output.rows.iter().find(|row| row.mode == "cut-through");
    if let (Some(relays), Some(cut)) = (relays, cut) {
        let alone = output.extraction_alone_s;
        text += &format!(
            "cut-through, from the first segment leaving the encoder: last actor received \
             {:.3} s, staged {:.3} s; store-and-forward, extraction alone ({alone:.3} s) then \
             publication to the last actor: received {:.3} s, staged {:.3} s\n",
            cut.last_received_s,
            cut.last_staged_s,
            alone + relays.last_received_s,
            alone + relays.last_staged_s,
        );
    }
    crate::print_stdout(&text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(name: &str, role: Role, received_ms: u64, staged_ms: u64) -> StagedReport {
        StagedReport {
            region: "east".into(),
            name: name.into(),
            role,
            received: Duration::from_millis(received_ms),
            staged: Duration::from_millis(staged_ms),
        }
    }

    /// A relay decodes nothing: it counts as staged once it holds the version, ahead of
    /// every actor behind it, so the spread is the actors' alone. It stays a member.
    #[test]
    fn the_spread_of_a_fan_out_is_its_actors_alone() {
        let reports = [
            report("relay-east", Role::Relay, 300, 300),
            report("east-1", Role::Actor, 320, 1_000),
            report("east-2", Role::Actor, 330, 1_050),
        ];
        let row = fan_out_row(
            ("relays", TransportSecurity::Plaintext),
            Vec::new(),
            &reports,
            None,
        );
        assert_eq!(row.members.len(), 3);
        assert_eq!(row.first_received_s, 0.32);
        assert_eq!(row.last_received_s, 0.33);
        assert_eq!(row.first_staged_s, 1.0);
        assert_eq!(row.last_staged_s, 1.05);
    }
}
