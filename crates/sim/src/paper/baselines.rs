//! The systems the paper compares, each reduced to how it moves a version: what it
//! sends, over how many streams, through relays or not, how stale a generation may be,
//! and what activation costs.

use std::ops::Range;

use super::calibration::{AURORA_ACTIVATION_SHARE_OF_RELOAD, Encoding};
use super::tcp::{CongestionControl, Flow, Link, TcpModel};
use super::testbed::{
    ModelShape, Network, PAPER_EXTRACTION_S_PER_PARAMETER, RELOAD_BYTES_PER_S, Trainer, Workload,
    actor_decode_s,
};
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
    /// The paper's construction: AuroraRL's trace with each step's sync replaced by a
    /// full broadcast over the single datacenter's RDMA fabric: the ceiling.
    IdealSingleDc,
    /// The paper's own system as its sections 4 and 5 describe it: LEB128 deltas,
    /// extraction of about 5 s for Qwen3-8B pipelined with four streams of the
    /// kernel's congestion control (CUBIC), one relay per region, activation by an
    /// in-place scatter-add, one step of lag. What section 7 measured.
    AuroraRl,
    /// AuroraRL with every actor fetching from the trainer (no relays).
    AuroraRlWithoutRelays,
    /// aurora, this project: its own delta encoding extracted on the trainer's cores,
    /// four BBR streams per flow, one relay per region, the changed elements written
    /// into the engine at activation, one step of lag.
    Aurora,
}

impl System {
    /// The baselines the paper defines, the paper's system, then aurora.
    pub const COMPARED: [System; 7] = [
        System::PrimeRlFull,
        System::Async2,
        System::Async4,
        System::MultiStream,
        System::IdealSingleDc,
        System::AuroraRl,
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
            System::AuroraRl => "AuroraRL",
            System::AuroraRlWithoutRelays => "AuroraRL, no relays",
            System::Aurora => "aurora",
        }
    }
}

/// Streams per flow of the multi-stream systems (the paper's four).
pub const MULTI_STREAMS: u32 = 4;
/// A segment of the segment transport: what a relay or an actor handles at once, so
/// what is left to do after the sender's last byte (`docs/wire-protocol.md`).
const SEGMENT_BYTES: f64 = 8.0 * 1024.0 * 1024.0;

/// A region away from the trainer's.
#[derive(Clone, Debug, PartialEq)]
pub struct RemoteRegion {
    /// The path from the trainer to each of its actors' VMs, at its nominal rate.
    pub path: Link,
    /// Its actors.
    pub actors: u32,
    /// The share of the nominal rate the path runs at, shipment by shipment (cycled):
    /// a commodity link fluctuates, each region's on its own.
    pub rate_shares: Vec<f64>,
    /// Shipments (a shipment made as step n runs is the n-th) during which the region
    /// has no actors, its pool reclaimed and not yet replaced: nothing is sent to it.
    pub absent: Vec<Range<usize>>,
}

impl RemoteRegion {
    /// The path during shipment `shipment`.
    fn path_during(&self, shipment: usize) -> Link {
        let share = match self.rate_shares.len() {
            0 => 1.0,
            shipments => self.rate_shares[shipment % shipments],
        };
        Link {
            rate_bps: self.path.rate_bps * share,
            ..self.path
        }
    }
}

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
    /// Every other region with actors.
    pub remote: Vec<RemoteRegion>,
    /// The transfer-time model.
    pub tcp: TcpModel,
    /// Streams per flow of the delta systems ([`MULTI_STREAMS`] but in what-if rows).
    pub delta_streams: u32,
    /// The encoding aurora's deltas travel in (its own; LEB128 to ask what the paper's
    /// encoding would cost on the same path).
    pub delta_encoding: Encoding,
}

impl Deployment {
    /// How `system` moves one version to every actor of this deployment.
    pub fn sync_plan(&self, system: System) -> SyncPlan {
        let model = &self.model;
        let reload_s = model.checkpoint_bytes() / RELOAD_BYTES_PER_S;
        let each_shipment =
            |ship: &dyn Fn(usize) -> f64| -> Vec<f64> { (0..self.shipments()).map(ship).collect() };
        let full = |lag, streams| SyncPlan {
            lag,
            ship_s: each_shipment(&|shipment| {
                self.fan_out_s(
                    model.checkpoint_bytes(),
                    streams,
                    false,
                    CongestionControl::Cubic,
                    shipment,
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
                ..self.sync_plan(System::AuroraRl)
            },
            // The paper's actors scatter-add the changed elements in place: at about 1%
            // that is milliseconds.
            System::AuroraRl | System::AuroraRlWithoutRelays => SyncPlan {
                activation_s: 0.0,
                ..self.delta_plan(
                    Encoding::Leb128,
                    model.parameters * PAPER_EXTRACTION_S_PER_PARAMETER,
                    system == System::AuroraRl,
                    CongestionControl::Cubic,
                )
            },
            System::Aurora => self.delta_plan(
                self.delta_encoding,
                self.trainer.extraction_s(model, self.delta_encoding),
                true,
                CongestionControl::Bbr,
            ),
        }
    }

    /// A delta system's plan: each version extracted in `extraction_s`, pipelined with
    /// its transfer on [`Deployment::delta_streams`] streams of `cc`, through relays or
    /// not; activation as aurora's.
    fn delta_plan(
        &self,
        encoding: Encoding,
        extraction_s: f64,
        relays: bool,
        cc: CongestionControl,
    ) -> SyncPlan {
        let model = &self.model;
        let delta_bytes = model.delta_bytes(encoding, self.workload.density);
        // Cut-through: a relay forwards and an actor decodes each segment as it lands,
        // so only the last segment's hop and decode follow the last byte.
        let segments = (delta_bytes / SEGMENT_BYTES).ceil().max(1.0);
        let relay_hop_s = if relays {
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
            ship_s: (0..self.shipments())
                .map(|shipment| {
                    self.fan_out_s(delta_bytes, self.delta_streams, relays, cc, shipment)
                        .max(extraction_s)
                })
                .collect(),
            tail_s: actor_decode_s(model) / segments + relay_hop_s,
            // aurora writes the changed elements into the engine's parameters, at the
            // share of a whole reload it measured; the paper's system overrides this.
            activation_s: AURORA_ACTIVATION_SHARE_OF_RELOAD * model.checkpoint_bytes()
                / RELOAD_BYTES_PER_S,
            skips_versions: false,
        }
    }

    /// This deployment with every path between regions at `loss`.
    pub fn with_wan_loss(&self, loss: f64) -> Deployment {
        let mut changed = self.clone();
        for region in &mut changed.remote {
            region.path.loss = loss;
        }
        changed
    }

    /// Shipments after which the paths' fluctuation repeats.
    pub fn shipments(&self) -> usize {
        self.remote
            .iter()
            .map(|region| region.rate_shares.len())
            .max()
            .unwrap_or(0)
            .max(1)
    }

    /// Seconds until every actor has `bytes` from the trainer during shipment
    /// `shipment` (the paths at that shipment's rates): local actors over the datacenter network,
    /// each other region's actors over their own paths and the trainer's shared uplink,
    /// through the region's relay (one receiver) or each from the trainer.
    pub fn fan_out_s(
        &self,
        bytes: f64,
        streams: u32,
        relays: bool,
        cc: CongestionControl,
        shipment: usize,
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
            .filter(|region| {
                region.actors > 0 && !region.absent.iter().any(|steps| steps.contains(&shipment))
            })
            .map(|region| Flow {
                link: region.path_during(shipment),
                streams,
                receivers: receivers(region.actors),
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
