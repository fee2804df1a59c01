//! The fleet file's format (docs/paper-eval.md, "Fleet files", version
//! [`super::FLEET_FORMAT`]): what `aurora sim fleet` deserializes, before
//! [`super::run_fleet`] checks it against its topology.

use serde::Deserialize;

use super::super::baselines::System;
use super::super::testbed::{
    A100, DECODE_ROOFLINE_SHARE, DENSE_70B, Gpu, H100, L40, ModelShape, PAPER_NETWORK, QWEN3_4B,
    QWEN3_8B, QWEN3_14B, QWEN3_30B_A3B, TRAINER_MFU,
};

/// A fleet file (docs/paper-eval.md, "Fleet files").
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetSpec {
    /// [`FLEET_FORMAT`].
    pub format: u32,
    /// Its name in the report.
    pub name: String,
    /// What it is for.
    #[serde(default)]
    pub description: String,
    /// The topology: a `wan/scenarios` file, relative to the fleet file. Read by the
    /// caller, which passes its links as a [`Topology`].
    pub topology: String,
    /// The topology's region the trainer is in.
    pub trainer_region: String,
    /// The model trained.
    pub model: ModelChoice,
    /// The trainer's H100s.
    pub trainer_gpus: u32,
    /// The share of peak FLOP/s the trainer reaches.
    #[serde(default = "default_trainer_mfu")]
    pub trainer_mfu: f64,
    /// What a step generates.
    pub dataset: DatasetChoice,
    /// Steps per run.
    #[serde(default = "default_steps")]
    pub steps: u32,
    /// Steps left out of the throughputs at the start.
    #[serde(default = "default_warm_up")]
    pub warm_up: u32,
    /// One run per seed; the report gives the mean and the spread over them.
    #[serde(default = "default_seeds")]
    pub seeds: Vec<u64>,
    /// The systems compared; every one when empty.
    #[serde(default)]
    pub systems: Vec<SystemChoice>,
    /// The share of its nominal rate a path between regions may fall to between
    /// shipments (each region's path on its own sequence).
    #[serde(default = "default_link_low_share")]
    pub link_low_share: f64,
    /// The trainer's uplink, shared by every flow leaving its region.
    #[serde(default = "default_trainer_uplink_mbps")]
    pub trainer_uplink_mbps: f64,
    /// The share of the memory roofline the actors' engines decode at.
    #[serde(default = "default_decode_share")]
    pub decode_share: f64,
    /// The actors, by region and GPU.
    pub actors: Vec<ActorGroup>,
    /// Whole regions whose actors are reclaimed at once (a spot pool taken back).
    #[serde(default)]
    pub reclaims: Vec<Reclaim>,
    /// One input taken over several values.
    #[serde(default)]
    pub sweep: Option<FleetSweep>,
}

fn default_trainer_mfu() -> f64 {
    TRAINER_MFU
}
fn default_steps() -> u32 {
    30
}
fn default_warm_up() -> u32 {
    4
}
fn default_seeds() -> Vec<u64> {
    vec![1]
}
fn default_link_low_share() -> f64 {
    PAPER_NETWORK.link_low_share
}
fn default_trainer_uplink_mbps() -> f64 {
    PAPER_NETWORK.uplink_bps / 1e6
}
fn default_decode_share() -> f64 {
    DECODE_ROOFLINE_SHARE
}
fn one() -> u32 {
    1
}

/// A model the simulation knows the shape of.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ModelChoice {
    /// Qwen3-4B.
    Qwen3_4b,
    /// Qwen3-8B.
    Qwen3_8b,
    /// Qwen3-14B.
    Qwen3_14b,
    /// Qwen3-30B-A3B, a mixture of experts.
    #[serde(rename = "qwen3-30b-a3b")]
    Qwen3_30bA3b,
    /// A 70B dense model (an actor's replica split over four of its GPUs).
    #[serde(rename = "dense-70b")]
    Dense70b,
}

impl ModelChoice {
    pub(super) fn shape(self) -> ModelShape {
        match self {
            ModelChoice::Qwen3_4b => QWEN3_4B,
            ModelChoice::Qwen3_8b => QWEN3_8B,
            ModelChoice::Qwen3_14b => QWEN3_14B,
            ModelChoice::Qwen3_30bA3b => QWEN3_30B_A3B,
            ModelChoice::Dense70b => DENSE_70B,
        }
    }
}

/// One of section 7.1's datasets (docs/paper-eval.md names their assumed lengths).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DatasetChoice {
    /// GSM8K.
    Gsm8k,
    /// Hendrycks MATH.
    Math,
    /// DeepScaleR.
    Deepscaler,
}

/// A system to compare.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SystemChoice {
    /// [`System::PrimeRlFull`].
    PrimerlFull,
    /// [`System::Async2`].
    Async2,
    /// [`System::Async4`].
    Async4,
    /// [`System::MultiStream`].
    Multistream,
    /// [`System::IdealSingleDc`].
    IdealSingleDc,
    /// [`System::AuroraRl`].
    Aurorarl,
    /// [`System::AuroraRlWithoutRelays`].
    AurorarlWithoutRelays,
    /// [`System::Aurora`].
    Aurora,
}

impl SystemChoice {
    pub(super) fn system(self) -> System {
        match self {
            SystemChoice::PrimerlFull => System::PrimeRlFull,
            SystemChoice::Async2 => System::Async2,
            SystemChoice::Async4 => System::Async4,
            SystemChoice::Multistream => System::MultiStream,
            SystemChoice::IdealSingleDc => System::IdealSingleDc,
            SystemChoice::Aurorarl => System::AuroraRl,
            SystemChoice::AurorarlWithoutRelays => System::AuroraRlWithoutRelays,
            SystemChoice::Aurora => System::Aurora,
        }
    }
}

/// A GPU an actor may run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum GpuChoice {
    /// A100 80 GB PCIe.
    A100,
    /// L40.
    L40,
    /// H100 SXM.
    H100,
}

impl GpuChoice {
    pub(super) fn gpu(self) -> Gpu {
        match self {
            GpuChoice::A100 => A100,
            GpuChoice::L40 => L40,
            GpuChoice::H100 => H100,
        }
    }
}

/// Actors of one GPU in one region.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ActorGroup {
    /// A region of the topology.
    pub region: String,
    /// Their GPU.
    pub gpu: GpuChoice,
    /// How many.
    #[serde(default = "one")]
    pub count: u32,
}

/// Every actor of a region reclaimed at once as a step opens, and, optionally, as many
/// fresh actors joining later: they take the whole checkpoint from the trainer across
/// the region's path, since the region's relay went with the pool.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Reclaim {
    /// The region.
    pub region: String,
    /// The step during which its actors get their preemption notices.
    pub at_step: u32,
    /// The step as which their replacements start to fetch the checkpoint.
    #[serde(default)]
    pub replaced_at_step: Option<u32>,
}

/// One input taken over several values, every other input as the file gives it.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetSweep {
    /// The input.
    pub parameter: SweepParameter,
    /// Its values.
    pub values: Vec<f64>,
}

/// An input a sweep may take over values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SweepParameter {
    /// Every path's nominal rate between regions, Mbps.
    RateMbps,
    /// Every path's round trip, ms.
    RttMs,
    /// Every path's random loss.
    Loss,
    /// [`FleetSpec::link_low_share`].
    LinkLowShare,
    /// [`FleetSpec::trainer_uplink_mbps`].
    TrainerUplinkMbps,
    /// [`FleetSpec::trainer_gpus`].
    TrainerGpus,
    /// [`FleetSpec::trainer_mfu`].
    TrainerMfu,
    /// [`FleetSpec::decode_share`].
    DecodeShare,
    /// Every group's [`ActorGroup::count`].
    ActorsPerGroup,
}

impl SweepParameter {
    pub(super) fn name(self) -> &'static str {
        match self {
            SweepParameter::RateMbps => "rate_mbps",
            SweepParameter::RttMs => "rtt_ms",
            SweepParameter::Loss => "loss",
            SweepParameter::LinkLowShare => "link_low_share",
            SweepParameter::TrainerUplinkMbps => "trainer_uplink_mbps",
            SweepParameter::TrainerGpus => "trainer_gpus",
            SweepParameter::TrainerMfu => "trainer_mfu",
            SweepParameter::DecodeShare => "decode_share",
            SweepParameter::ActorsPerGroup => "actors_per_group",
        }
    }
}
