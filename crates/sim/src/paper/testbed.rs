//! The hardware, models, workload and links the paper's evaluation runs on, and the
//! first-principles costs derived from them: how fast an actor decodes, how long the
//! trainer takes per step, how big each kind of update is.
//!
//! Model shapes are the published Hugging Face configurations; GPU figures are the
//! vendors' data sheets. What the paper's Table 2 fixes and this file could not read
//! (engine efficiency, batch, trainer size) is an assumption, named as one, and listed
//! in docs/paper-eval.md.

use super::calibration::{
    AURORA_DECODE_GBPS_PER_CORE, AURORA_EXTRACT_GBPS_PER_CORE, CODEC_PARALLEL_EFFICIENCY, Encoding,
    LEB128_EXTRACT_GBPS_PER_CORE,
};
use super::tcp::{CongestionControl, Link, TcpModel};

/// A decoder-only transformer, as far as sizes and decode costs go.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ModelShape {
    /// Its name in the report.
    pub name: &'static str,
    /// Parameters (elements of the checkpoint).
    pub parameters: f64,
    /// Transformer layers.
    pub layers: f64,
    /// Key-value heads (grouped-query attention).
    pub kv_heads: f64,
    /// Dimension of a head.
    pub head_dim: f64,
}

/// Qwen3-4B (Hugging Face config; 4.02 B parameters, as `aurora synth --preset 4b`).
pub const QWEN3_4B: ModelShape = ModelShape {
    name: "Qwen3-4B",
    parameters: 4.02e9,
    layers: 36.0,
    kv_heads: 8.0,
    head_dim: 128.0,
};
/// Qwen3-8B (8.19 B, as `aurora synth --preset 8b`).
pub const QWEN3_8B: ModelShape = ModelShape {
    name: "Qwen3-8B",
    parameters: 8.19e9,
    layers: 36.0,
    kv_heads: 8.0,
    head_dim: 128.0,
};
/// Qwen3-14B (14.77 B; 40 layers, 8 KV heads of 128).
pub const QWEN3_14B: ModelShape = ModelShape {
    name: "Qwen3-14B",
    parameters: 14.77e9,
    layers: 40.0,
    kv_heads: 8.0,
    head_dim: 128.0,
};
/// A 70B-class dense model beyond the paper (Llama-3-70B's shape: 70.6 B, 80 layers).
pub const DENSE_70B: ModelShape = ModelShape {
    name: "70B",
    parameters: 70.6e9,
    layers: 80.0,
    kv_heads: 8.0,
    head_dim: 128.0,
};

impl ModelShape {
    /// The BF16 checkpoint, bytes: what a full broadcast sends.
    pub fn checkpoint_bytes(&self) -> f64 {
        2.0 * self.parameters
    }

    /// One step's update in `encoding` when `density` of the elements change.
    pub fn delta_bytes(&self, encoding: Encoding, density: f64) -> f64 {
        self.parameters * density * encoding.bytes_per_change(density)
    }

    /// Key and value cache per token of context, BF16.
    fn kv_bytes_per_token(&self) -> f64 {
        2.0 * self.layers * self.kv_heads * self.head_dim * 2.0
    }
}

/// A GPU, from its data sheet.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gpu {
    /// Its name.
    pub name: &'static str,
    /// Memory, bytes.
    pub memory_bytes: f64,
    /// Memory bandwidth, bytes per second.
    pub bandwidth_bytes_per_s: f64,
    /// Dense BF16 tensor throughput, FLOP/s.
    pub bf16_flops: f64,
}

/// NVIDIA H100 SXM: 80 GB, 3.35 TB/s, 989 TFLOPS.
pub const H100: Gpu = Gpu {
    name: "H100",
    memory_bytes: 80e9,
    bandwidth_bytes_per_s: 3.35e12,
    bf16_flops: 989e12,
};
/// NVIDIA A100 80 GB SXM: 2.04 TB/s, 312 TFLOPS.
pub const A100: Gpu = Gpu {
    name: "A100",
    memory_bytes: 80e9,
    bandwidth_bytes_per_s: 2.039e12,
    bf16_flops: 312e12,
};
/// NVIDIA L40: 48 GB, 864 GB/s, 181 TFLOPS.
pub const L40: Gpu = Gpu {
    name: "L40",
    memory_bytes: 48e9,
    bandwidth_bytes_per_s: 0.864e12,
    bf16_flops: 181e12,
};

/// Assumption: the share of the memory roofline a serving engine reaches in decode
/// (paged attention, sampling and scheduling overheads).
const DECODE_ROOFLINE_SHARE: f64 = 0.5;
/// Assumption: the share of peak FLOP/s the trainer reaches (model FLOPs utilisation).
const TRAINER_MFU: f64 = 0.4;
/// Assumption: most sequences an engine decodes at once.
const MAX_CONCURRENT_SEQUENCES: f64 = 256.0;
/// Share of GPU memory the engine may use (vLLM's default `gpu_memory_utilization`).
const ENGINE_MEMORY_SHARE: f64 = 0.9;

/// One rollout actor: `gpus` GPUs of one kind serving one model replica (tensor
/// parallel when more than one).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ActorKind {
    /// The GPU.
    pub gpu: Gpu,
    /// GPUs per replica.
    pub gpus: u32,
}

/// What a step asks of the actors and the trainer. The paper trains GRPO groups; a
/// group is one prompt of the control plane (one lease).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Workload {
    /// Prompt groups per step.
    pub prompts_per_step: u32,
    /// Samples per group.
    pub samples_per_prompt: u32,
    /// Prompt tokens per sample.
    pub prompt_tokens: f64,
    /// Shortest and longest completion, tokens.
    pub completion_tokens: (u64, u64),
    /// Share of elements that change per step.
    pub density: f64,
}

/// Assumption: the paper's workload as far as the text says: GRPO groups of 8, a
/// batch whose generation takes tens of seconds, about 1% of elements changing per
/// step (the abstract's ρ ≈ 1%).
pub const PAPER_WORKLOAD: Workload = Workload {
    prompts_per_step: 128,
    samples_per_prompt: 8,
    prompt_tokens: 256.0,
    completion_tokens: (256, 768),
    density: 0.01,
};

impl Workload {
    /// Tokens of one group, shortest and longest (the range the control core's
    /// simulated prompts draw from).
    pub fn group_tokens(&self) -> (u64, u64) {
        let samples = u64::from(self.samples_per_prompt);
        (
            samples * self.completion_tokens.0,
            samples * self.completion_tokens.1,
        )
    }

    /// Mean context a sequence holds while it decodes: its prompt and half its answer.
    fn mean_context_tokens(&self) -> f64 {
        let (shortest, longest) = self.completion_tokens;
        self.prompt_tokens + (shortest + longest) as f64 / 4.0
    }

    /// Generated tokens per step, on average.
    pub fn tokens_per_step(&self) -> f64 {
        let (shortest, longest) = self.group_tokens();
        f64::from(self.prompts_per_step) * (shortest + longest) as f64 / 2.0
    }
}

impl ActorKind {
    /// Decode throughput, tokens per second: each decode iteration reads the weights
    /// and every running sequence's KV cache once (memory-bound at these batch sizes,
    /// unless the FLOPs say otherwise); the batch is as large as memory allows.
    pub fn tokens_per_s(&self, model: &ModelShape, workload: &Workload) -> f64 {
        let gpus = f64::from(self.gpus);
        let memory = self.gpu.memory_bytes * gpus * ENGINE_MEMORY_SHARE;
        let kv_per_sequence = model.kv_bytes_per_token() * workload.mean_context_tokens();
        let room = (memory - model.checkpoint_bytes()).max(0.0);
        let batch = (room / kv_per_sequence)
            .floor()
            .min(MAX_CONCURRENT_SEQUENCES);
        if batch < 1.0 {
            return 0.0;
        }
        let bytes_per_iteration = model.checkpoint_bytes() + batch * kv_per_sequence;
        let memory_s = bytes_per_iteration / (self.gpu.bandwidth_bytes_per_s * gpus);
        let compute_s = 2.0 * model.parameters * batch / (self.gpu.bf16_flops * gpus);
        batch * DECODE_ROOFLINE_SHARE / memory_s.max(compute_s)
    }
}

/// The trainer: `gpus` GPUs and the host cores that extract each version's delta.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Trainer {
    /// The GPU.
    pub gpu: Gpu,
    /// How many.
    pub gpus: u32,
    /// Host cores given to extraction.
    pub extraction_cores: u32,
}

/// Assumption: the paper's trainer is one node of eight H100s; extraction gets 16 of
/// its host cores.
pub const PAPER_TRAINER: Trainer = Trainer {
    gpu: H100,
    gpus: 8,
    extraction_cores: 16,
};

impl Trainer {
    /// One GRPO step: forward and backward over every generated and prompt token
    /// (6 FLOPs per parameter and token) plus the old-policy forward (2 more).
    pub fn step_s(&self, model: &ModelShape, workload: &Workload) -> f64 {
        let sequences = f64::from(workload.prompts_per_step * workload.samples_per_prompt);
        let tokens = workload.tokens_per_step() + sequences * workload.prompt_tokens;
        8.0 * model.parameters * tokens / (self.gpu.bf16_flops * f64::from(self.gpus) * TRAINER_MFU)
    }

    /// Seconds to extract one version's delta in `encoding` from the BF16 export.
    pub fn extraction_s(&self, model: &ModelShape, encoding: Encoding) -> f64 {
        let per_core = match encoding {
            Encoding::Aurora => AURORA_EXTRACT_GBPS_PER_CORE,
            Encoding::Leb128 | Encoding::Int32 => LEB128_EXTRACT_GBPS_PER_CORE,
        };
        model.checkpoint_bytes() / (parallel_rate(per_core, self.extraction_cores) * 1e9)
    }
}

/// Assumption: host cores an actor gives to decoding staged segments.
pub const ACTOR_DECODE_CORES: u32 = 8;
/// Assumption: the rate at which an engine reloads changed tensors from host memory
/// into the GPU at activation (PCIe 4.0 x16 at about three quarters of its 32 GB/s).
pub const RELOAD_BYTES_PER_S: f64 = 24e9;

/// Seconds an actor's host takes to decode a whole version's delta against its
/// weights (staged behind generation; only its last segment shows).
pub fn actor_decode_s(model: &ModelShape) -> f64 {
    model.checkpoint_bytes()
        / (parallel_rate(AURORA_DECODE_GBPS_PER_CORE, ACTOR_DECODE_CORES) * 1e9)
}

fn parallel_rate(per_core_gbps: f64, cores: u32) -> f64 {
    per_core_gbps * (1.0 + f64::from(cores.saturating_sub(1)) * CODEC_PARALLEL_EFFICIENCY)
}

/// Where machines sit and how they are joined.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Network {
    /// The trainer's uplink, bits per second: shared by every flow leaving its region.
    pub uplink_bps: f64,
    /// The path from the trainer's region to any other.
    pub wan: Link,
    /// A datacenter's network between machines of one region (no RDMA).
    pub lan: Link,
    /// The ideal single datacenter's RDMA fabric.
    pub rdma: Link,
}

/// Assumption: the paper's links as far as its text says: commodity 1 Gbps paths
/// between regions, here all of 50 ms; a trainer in a cloud region with a 10 Gbps
/// uplink (so the paths, not the trainer, are what is commodity); 25 GbE inside a
/// region; 400 Gb/s InfiniBand for the ideal datacenter. The WAN's loss rate is not in
/// what this simulation could read of the paper: [`super::calibrate_wan_loss`] infers
/// it from one of the paper's own transfers.
pub const PAPER_NETWORK: Network = Network {
    uplink_bps: 10e9,
    wan: Link {
        rate_bps: 1e9,
        rtt_s: 0.05,
        loss: 0.0,
    },
    lan: Link {
        rate_bps: 25e9,
        rtt_s: 0.000_5,
        loss: 0.0,
    },
    rdma: Link {
        rate_bps: 400e9,
        rtt_s: 0.000_01,
        loss: 0.0,
    },
};

/// [`aurora_proto::KEPT_TAIL_SNAPSHOTS`], as the model counts.
pub const KEPT_TAIL_SNAPSHOTS: f64 = aurora_proto::KEPT_TAIL_SNAPSHOTS as f64;

/// Where a joiner takes its snapshot from ([`Network::snapshot_join_s`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum JoinFrom {
    /// The hub, across the WAN: its region's relay keeps no snapshot it can serve.
    Hub,
    /// Its region's relay, which keeps a snapshot and `tail_bytes` of deltas after it.
    Relay { tail_bytes: f64 },
}

impl JoinFrom {
    /// Where a joiner takes its snapshot from in aurora `steps` versions after its
    /// region's relay took one: the relay while the deltas it keeps after it add up to
    /// no more than [`aurora_proto::KEPT_TAIL_SNAPSHOTS`] snapshots, the hub after that.
    pub fn aurora(model: &ModelShape, density: f64, steps: u64) -> JoinFrom {
        let tail_bytes = steps as f64 * model.delta_bytes(Encoding::Aurora, density);
        if tail_bytes <= KEPT_TAIL_SNAPSHOTS * model.checkpoint_bytes() {
            JoinFrom::Relay { tail_bytes }
        } else {
            JoinFrom::Hub
        }
    }
}

impl Network {
    /// Seconds a newcomer (or a preempted actor's replacement) in another region takes
    /// to fetch a snapshot before it can work, on aurora's four BBR streams: the whole
    /// checkpoint from the hub over its region's path, or from its region's relay over
    /// the datacenter's network with the deltas the relay keeps after it
    /// (wire-protocol §8).
    pub fn snapshot_join_s(&self, tcp: &TcpModel, model: &ModelShape, from: JoinFrom) -> f64 {
        let (bytes, path) = match from {
            JoinFrom::Hub => (model.checkpoint_bytes(), self.wan),
            JoinFrom::Relay { tail_bytes } => (model.checkpoint_bytes() + tail_bytes, self.lan),
        };
        tcp.transfer_s(bytes, path, CongestionControl::Bbr, 4)
    }

    /// The path to a region: the datacenter's own network for the trainer's region,
    /// the WAN for any other.
    pub fn path(&self, region: usize) -> Link {
        if region == 0 { self.lan } else { self.wan }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_joiner_takes_its_relay_s_snapshot_while_the_deltas_after_it_fit() {
        let density = PAPER_WORKLOAD.density;
        let delta = QWEN3_8B.delta_bytes(Encoding::Aurora, density);
        let fits = (KEPT_TAIL_SNAPSHOTS * QWEN3_8B.checkpoint_bytes() / delta).floor() as u64;
        assert_eq!(
            JoinFrom::aurora(&QWEN3_8B, density, fits),
            JoinFrom::Relay {
                tail_bytes: fits as f64 * delta
            }
        );
        assert_eq!(
            JoinFrom::aurora(&QWEN3_8B, density, fits + 1),
            JoinFrom::Hub
        );
        let tcp = TcpModel::calibrated();
        let join_s = |from| PAPER_NETWORK.snapshot_join_s(&tcp, &QWEN3_8B, from);
        let from_relay = join_s(JoinFrom::aurora(&QWEN3_8B, density, 14));
        assert!(from_relay < join_s(JoinFrom::Hub) / 10.0, "{from_relay}");
    }

    #[test]
    fn decode_slows_less_than_the_weights_grow_and_needs_the_memory() {
        let a100 = ActorKind { gpu: A100, gpus: 1 };
        let rate = |kind: ActorKind, model| kind.tokens_per_s(&model, &PAPER_WORKLOAD);
        let slowdown = rate(a100, QWEN3_4B) / rate(a100, QWEN3_14B);
        // The KV cache every iteration reads does not grow with the parameters.
        assert!(slowdown > 1.0 && slowdown < QWEN3_14B.parameters / QWEN3_4B.parameters);
        let l40 = ActorKind { gpu: L40, gpus: 1 };
        assert!(rate(l40, QWEN3_8B) < rate(a100, QWEN3_8B));
        assert_eq!(
            rate(a100, DENSE_70B),
            0.0,
            "141 GB of weights do not fit 80 GB"
        );
        let four_h100 = ActorKind { gpu: H100, gpus: 4 };
        assert!(rate(four_h100, DENSE_70B) > 0.0);
    }

    #[test]
    fn a_step_trains_in_proportion_to_parameters() {
        let ratio = PAPER_TRAINER.step_s(&QWEN3_14B, &PAPER_WORKLOAD)
            / PAPER_TRAINER.step_s(&QWEN3_4B, &PAPER_WORKLOAD);
        assert!((ratio - QWEN3_14B.parameters / QWEN3_4B.parameters).abs() < 1e-9);
    }
}
