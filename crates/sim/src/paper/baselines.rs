//! The systems the paper compares, each reduced to how it moves a version: what it
//! sends, over how many streams, through relays or not, how stale a generation may be,
//! and what activation costs.

use super::calibration::Encoding;
use super::tcp::{CongestionControl, Flow, Link, TcpModel};
use super::testbed::{ModelShape, Network, RELOAD_BYTES_PER_S, Trainer, Workload, actor_decode_s};
use super::timeline::SyncPlan;

/// A system under comparison. The baselines run Linux's default congestion control,
/// CUBIC; aurora's transport runs BBR, its default.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum System {
    /// PrimeRL's default: the full BF16 checkpoint to every actor on one stream each,
    /// one step of lag.
    PrimeRlFull,
    /// The same with generations up to two versions behind.
    Async2,
    /// The same with generations up to four versions behind.
    Async4,
    /// The full checkpoint on four streams per actor, one step of lag.
    MultiStream,
    /// The paper's construction: aurora's run with its cross-cloud transfer replaced by
    /// a full broadcast over the single datacenter's RDMA fabric: the ceiling.
    IdealSingleDc,
    /// aurora: the `aurora` delta, extraction streamed into four streams per flow, one
    /// relay per region, one step of lag.
    Aurora,
    /// aurora with every actor fetching from the trainer (no relays).
    AuroraWithoutRelays,
}

impl System {
    /// The baselines the paper defines, then aurora.
    pub const COMPARED: [System; 6] = [
        System::PrimeRlFull,
        System::Async2,
        System::Async4,
        System::MultiStream,
        System::IdealSingleDc,
        System::Aurora,
    ];

    /// The name the report prints.
    pub fn name(self) -> &'static str {
        match self {
            System::PrimeRlFull => "PrimeRL-Full",
            System::Async2 => "Async2",
            System::Async4 => "Async4",
            System::MultiStream => "MultiStream",
            System::IdealSingleDc => "Ideal-SingleDC",
            System::Aurora => "aurora",
            System::AuroraWithoutRelays => "aurora, no relays",
        }
    }
}

/// Streams per flow of the multi-stream systems (the paper's four).
pub const MULTI_STREAMS: u32 = 4;
/// A segment of the segment transport: what a relay or an actor handles at once, so
/// what is left to do after the sender's last byte (`docs/wire-protocol.md`).
const SEGMENT_BYTES: f64 = 8.0 * 1024.0 * 1024.0;

/// Everything that fixes a run but the system.
#[derive(Clone, Debug, PartialEq)]
pub struct Deployment {
    /// The model.
    pub model: ModelShape,
    /// What a step asks for.
    pub workload: Workload,
    /// The trainer.
    pub trainer: Trainer,
    /// The links around the trainer.
    pub network: Network,
    /// Actors in the trainer's own datacenter.
    pub local_actors: u32,
    /// Every other region: the path from the trainer to each of its actors' VMs, and
    /// how many actors it has.
    pub remote: Vec<(Link, u32)>,
    /// The share of their nominal rate the remote paths run at, shipment by shipment
    /// (cycled): section 7.1's link fluctuates.
    pub rate_shares: Vec<f64>,
    /// The transfer-time model.
    pub tcp: TcpModel,
    /// The encoding aurora's deltas travel in (its own; LEB128 to ask what the paper's
    /// encoding would cost on the same path).
    pub delta_encoding: Encoding,
}

impl Deployment {
    /// How `system` moves one version to every actor of this deployment.
    pub fn sync_plan(&self, system: System) -> SyncPlan {
        let model = &self.model;
        let reload_s = model.checkpoint_bytes() / RELOAD_BYTES_PER_S;
        let each_shipment = |ship: &dyn Fn(f64) -> f64| -> Vec<f64> {
            self.rate_shares.iter().map(|&share| ship(share)).collect()
        };
        let full = |lag, streams| SyncPlan {
            lag,
            ship_s: each_shipment(&|share| {
                self.fan_out_s(
                    model.checkpoint_bytes(),
                    streams,
                    false,
                    CongestionControl::Cubic,
                    share,
                )
            }),
            tail_s: 0.0,
            activation_s: reload_s,
            skips_versions: true,
        };
        match system {
            System::PrimeRlFull => full(1, 1),
            System::Async2 => full(2, 1),
            System::Async4 => full(4, 1),
            System::MultiStream => full(1, MULTI_STREAMS),
            System::IdealSingleDc => SyncPlan {
                ship_s: vec![self.tcp.transfer_s(
                    model.checkpoint_bytes(),
                    self.network.rdma,
                    CongestionControl::Bbr,
                    1,
                )],
                tail_s: 0.0,
                ..self.sync_plan(System::Aurora)
            },
            System::Aurora | System::AuroraWithoutRelays => {
                let relays = system == System::Aurora;
                let delta_bytes = model.delta_bytes(self.delta_encoding, self.workload.density);
                let extraction_s = self.trainer.extraction_s(model, self.delta_encoding);
                // Cut-through: a relay forwards and an actor decodes each segment as it
                // lands, so only the last segment's hop and decode follow the last byte.
                let segments = (delta_bytes / SEGMENT_BYTES).ceil().max(1.0);
                let last_segment_s = actor_decode_s(model) / segments
                    + if relays {
                        self.tcp.transfer_s(
                            SEGMENT_BYTES.min(delta_bytes),
                            self.network.lan,
                            CongestionControl::Bbr,
                            MULTI_STREAMS,
                        )
                    } else {
                        0.0
                    };
                SyncPlan {
                    lag: 1,
                    ship_s: each_shipment(&|share| {
                        self.fan_out_s(
                            delta_bytes,
                            MULTI_STREAMS,
                            relays,
                            CongestionControl::Bbr,
                            share,
                        )
                        .max(extraction_s)
                    }),
                    tail_s: last_segment_s,
                    // The engine reloads every tensor with a change, which at 1% is
                    // every tensor: writing only the changed elements into a GPU's
                    // parameters is not built (BENCHMARKS.md, "Activation into vLLM").
                    activation_s: reload_s,
                    skips_versions: false,
                }
            }
        }
    }

    /// Seconds until every actor has `bytes` from the trainer, the remote paths at
    /// `rate_share` of their nominal rate: local actors over the datacenter network,
    /// each other region's actors over their own paths and the trainer's shared uplink,
    /// through the region's relay (one receiver) or each from the trainer.
    pub fn fan_out_s(
        &self,
        bytes: f64,
        streams: u32,
        relays: bool,
        cc: CongestionControl,
        rate_share: f64,
    ) -> f64 {
        let receivers = |actors: u32| if relays { 1 } else { actors };
        let local_s = if self.local_actors == 0 {
            0.0
        } else {
            let local = Flow {
                link: self.network.lan,
                streams,
                receivers: receivers(self.local_actors),
            };
            self.tcp.fan_out_s(
                bytes,
                &[local],
                self.network.lan.rate_bps,
                CongestionControl::Bbr,
            )
        };
        let remote: Vec<Flow> = self
            .remote
            .iter()
            .filter(|&&(_, actors)| actors > 0)
            .map(|&(link, actors)| Flow {
                link: Link {
                    rate_bps: link.rate_bps * rate_share,
                    ..link
                },
                streams,
                receivers: receivers(actors),
            })
            .collect();
        let remote_s = if remote.is_empty() {
            0.0
        } else {
            self.tcp
                .fan_out_s(bytes, &remote, self.network.uplink_bps, cc)
        };
        local_s.max(remote_s)
    }
}
