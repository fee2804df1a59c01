//! The hardware, models, workload and links the paper's evaluation runs on, and the
//! first-principles costs derived from them: how fast an actor decodes, how long the
//! trainer takes per step, how big each kind of update is.
//!
//! Model shapes are the published Hugging Face configurations; GPU figures are the
//! vendors' data sheets; the trainer's speed relative to the actors' is the paper's own
//! measurement (section 2's table of training against generation for Qwen3-8B). What the
//! paper leaves unstated (engine efficiency, answer lengths, the dataset of that
//! measurement) is an assumption, named as one, and listed in docs/paper-eval.md.

use super::calibration::{
    AURORA_DECODE_GBPS_PER_CORE, AURORA_EXTRACT_GBPS_PER_CORE, CODEC_PARALLEL_EFFICIENCY, Encoding,
    LEB128_EXTRACT_GBPS_PER_CORE,
};
use super::tcp::{CongestionControl, Link, TcpModel};
use std::borrow::Cow;

use crate::scenario::BatchedDecode;
use crate::world::SplitMix64;

/// A decoder-only transformer, as far as sizes and decode costs go.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ModelShape {
    /// Its name in the report.
    pub name: &'static str,
    /// Parameters (elements of the checkpoint).
    pub parameters: f64,
    /// Parameters one token passes through: all of them in a dense model, the routed
    /// experts' share in a mixture of experts. Compute follows these; memory and the
    /// checkpoint follow [`ModelShape::parameters`].
    pub active_parameters: f64,
    /// The share of elements one step changes, as the paper measured it in its section 3
    /// (a property of the workload, not a result of section 7): 1.12% for Qwen3-4B, 0.96%
    /// for Qwen3-8B under GRPO, 1.85% for Qwen2.5-72B (taken for the 70B model); where it
    /// measured nothing, 1%, the abstract's figure.
    pub density: f64,
    /// A step's delta over a dense model's of the same size at the same density: 1 for
    /// a dense model; for a mixture of experts the share aurora measured when a quarter
    /// of the experts see tokens (experts no token reached do not change).
    pub delta_share: f64,
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
    active_parameters: 4.02e9,
    density: 0.0112,
    delta_share: 1.0,
    layers: 36.0,
    kv_heads: 8.0,
    head_dim: 128.0,
};
/// Qwen3-8B (8.19 B, as `aurora synth --preset 8b`).
pub const QWEN3_8B: ModelShape = ModelShape {
    name: "Qwen3-8B",
    parameters: 8.19e9,
    active_parameters: 8.19e9,
    density: 0.0096,
    delta_share: 1.0,
    layers: 36.0,
    kv_heads: 8.0,
    head_dim: 128.0,
};
/// Qwen3-14B (14.77 B; 40 layers, 8 KV heads of 128).
pub const QWEN3_14B: ModelShape = ModelShape {
    name: "Qwen3-14B",
    parameters: 14.77e9,
    active_parameters: 14.77e9,
    density: 0.01,
    delta_share: 1.0,
    layers: 40.0,
    kv_heads: 8.0,
    head_dim: 128.0,
};
/// Qwen3-30B-A3B beyond the paper: 30.5 B parameters, 3.3 B active per token (8 of 128
/// experts), 48 layers, 4 KV heads of 128. Its delta is 0.30 of a dense model's of the
/// same size (BENCHMARKS.md, issue 42's MoE row: 0.27 to 0.33 with 128 experts, 8 per
/// token, a quarter reached; `python/benchmarks/moe.py`).
pub const QWEN3_30B_A3B: ModelShape = ModelShape {
    name: "Qwen3-30B-A3B",
    parameters: 30.5e9,
    active_parameters: 3.3e9,
    density: 0.01,
    delta_share: 0.30,
    layers: 48.0,
    kv_heads: 4.0,
    head_dim: 128.0,
};
/// A 70B-class dense model beyond the paper (Llama-3-70B's shape: 70.6 B, 80 layers).
pub const DENSE_70B: ModelShape = ModelShape {
    name: "70B",
    parameters: 70.6e9,
    active_parameters: 70.6e9,
    density: 0.0185,
    delta_share: 1.0,
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
        self.delta_share * self.parameters * density * encoding.bytes_per_change(density)
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
/// NVIDIA A100 80 GB PCIe, the paper's actor GPU (section 7.1): 1.935 TB/s, 312
/// TFLOPS. Which memory size the paper rented is not stated: the 80 GB card is the
/// assumption.
pub const A100: Gpu = Gpu {
    name: "A100",
    memory_bytes: 80e9,
    bandwidth_bytes_per_s: 1.935e12,
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
/// (paged attention, sampling and scheduling overheads; plausible 0.3 to 0.7).
pub const DECODE_ROOFLINE_SHARE: f64 = 0.5;
/// The ends of that range, each a what-if.
pub const DECODE_ROOFLINE_RANGE: [f64; 2] = [0.3, 0.7];
/// Assumption beyond the paper's deployments: the share of peak FLOP/s a trainer
/// reaches (model FLOPs utilisation; plausible 0.2 to 0.45 for FSDP2 with GRPO's extra
/// passes). The paper's own trainer follows from its measurement instead
/// ([`paper_trainer_mfu`]); this is the what-if beside it.
pub const TRAINER_MFU: f64 = 0.4;
/// Section 2's measurement of the paper's own pipeline (tab:sync-cost-example, "Trainer
/// 40 s, Actor 45 s" for Qwen3-8B): a training step takes 40/45 of a step's generation.
pub const PAPER_TRAIN_OVER_GENERATION: f64 = 40.0 / 45.0;
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

/// A dataset the paper trains on, as far as a step's shape goes. The paper states
/// neither prompt nor completion lengths: each is an assumption, named with its
/// plausible range in docs/paper-eval.md, and the sections show what the figures do
/// across it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Dataset {
    /// Its name in the report.
    pub name: &'static str,
    /// Prompt tokens per sample, with the chat template.
    pub prompt_tokens: f64,
    /// Shortest and longest mean completion of a prompt's group, tokens per sample.
    pub completion_tokens: (u64, u64),
}

/// Assumption: grade-school problems; Qwen3's reasoning answers run to about a thousand
/// tokens (plausible mean 300 to 1,500).
pub const GSM8K: Dataset = Dataset {
    name: "GSM8K",
    prompt_tokens: 150.0,
    completion_tokens: (400, 1_600),
};
/// The what-if at the top of GSM8K's plausible range: thinking answers of 1,500 tokens
/// on average.
pub const GSM8K_LONG: Dataset = Dataset {
    name: "GSM8K, 1,500-token answers",
    prompt_tokens: 150.0,
    completion_tokens: (600, 2_400),
};
/// Assumption: competition mathematics; answers about twice GSM8K's (plausible mean
/// 800 to 4,000).
pub const MATH: Dataset = Dataset {
    name: "MATH",
    prompt_tokens: 200.0,
    completion_tokens: (800, 3_200),
};
/// Assumption: olympiad problems, the longest answers, capped by the generation limit
/// (plausible mean 2,000 to 8,000).
pub const DEEPSCALER: Dataset = Dataset {
    name: "DeepScaleR",
    prompt_tokens: 250.0,
    completion_tokens: (1_200, 4_800),
};
/// The what-if at the bottom of MATH's plausible range: answers of 800 tokens on
/// average.
pub const MATH_SHORT: Dataset = Dataset {
    name: "MATH, 800-token answers",
    prompt_tokens: 200.0,
    completion_tokens: (320, 1_280),
};
/// The what-if at the bottom of DeepScaleR's plausible range: answers of 2,000 tokens
/// on average.
pub const DEEPSCALER_SHORT: Dataset = Dataset {
    name: "DeepScaleR, 2,000-token answers",
    prompt_tokens: 250.0,
    completion_tokens: (800, 3_200),
};
/// The three datasets of section 7.1; the paper's ranges are over them.
pub const DATASETS: [Dataset; 3] = [GSM8K, MATH, DEEPSCALER];

/// What a step asks of the actors and the trainer. The paper trains GRPO groups; a
/// group is one prompt of the control plane (one lease).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Workload {
    /// The dataset.
    pub dataset: Dataset,
    /// Prompt groups per step.
    pub prompts_per_step: u32,
    /// Samples per group.
    pub samples_per_prompt: u32,
    /// Share of elements that change per step.
    pub density: f64,
    /// The engine's limit on a sequence, prompt and answer, in tokens: longer answers
    /// are cut there ([`SEQUENCE_LIMIT`]).
    pub sequence_limit: u64,
}

/// Assumption: the limit RL runs set on a sequence, prompt and answer (`max_model_len`,
/// `max_tokens`): 8,192 tokens, the geometric middle of 2,048 to 32,768 (Qwen3's own
/// recommended output length for thinking). No answer section 7.1's datasets are assumed
/// to give reaches it; at the low end of the range MATH's and DeepScaleR's are cut.
pub const SEQUENCE_LIMIT: u64 = 8_192;
/// The ends of [`SEQUENCE_LIMIT`]'s plausible range.
pub const SEQUENCE_LIMIT_RANGE: [u64; 2] = [2_048, 32_768];

impl Workload {
    /// This workload with its sequences cut at `limit` tokens.
    pub fn limited_to(self, limit: u64) -> Workload {
        Workload {
            sequence_limit: limit,
            ..self
        }
    }
}

/// Rollouts per step in all: section 7.1's B = 512. An interpretation: section 7.1 says
/// "each Actor generates a rollout group of size B=512", but Algorithm 1 splits one batch
/// B over the actors and the scalability run keeps "batch 512" from one actor to four,
/// so B is taken as the step's total.
pub const ROLLOUTS_PER_STEP: u32 = 512;
/// Assumption: GRPO samples per prompt (plausible 4 to 16).
pub const SAMPLES_PER_PROMPT: u32 = 8;

impl Workload {
    /// A step of `model` on `dataset`: B = 512 rollouts, and the density the paper
    /// measured for the model's updates ([`ModelShape::density`]).
    pub fn of(model: &ModelShape, dataset: Dataset) -> Workload {
        Workload {
            dataset,
            prompts_per_step: ROLLOUTS_PER_STEP / SAMPLES_PER_PROMPT,
            samples_per_prompt: SAMPLES_PER_PROMPT,
            density: model.density,
            sequence_limit: SEQUENCE_LIMIT,
        }
    }

    /// Tokens of one group, shortest and longest, before the limit cuts them (the range
    /// the control core's simulated prompts draw from).
    pub fn group_tokens(&self) -> (u64, u64) {
        let samples = u64::from(self.samples_per_prompt);
        let (shortest, longest) = self.dataset.completion_tokens;
        (samples * shortest, samples * longest)
    }

    /// The most tokens a group's answers reach: each cut at the sequence limit.
    pub fn group_limit(&self) -> u64 {
        u64::from(self.samples_per_prompt) * self.answer_limit()
    }

    /// The longest answer the engine lets a sequence give after its prompt.
    fn answer_limit(&self) -> u64 {
        self.sequence_limit
            .saturating_sub(self.dataset.prompt_tokens.ceil() as u64)
            .max(1)
    }

    /// The longest answer of the dataset, as the limit leaves it.
    pub fn longest_answer(&self) -> u64 {
        self.dataset.completion_tokens.1.min(self.answer_limit())
    }

    /// The mean answer: drawn evenly over the dataset's range, those past the limit cut
    /// at it.
    pub fn mean_answer(&self) -> f64 {
        let (shortest, longest) = self.dataset.completion_tokens;
        let (shortest, longest) = (shortest as f64, longest as f64);
        let limit = self.answer_limit() as f64;
        if limit >= longest {
            return (shortest + longest) / 2.0;
        }
        if limit <= shortest {
            return limit;
        }
        let below = (limit - shortest) / (longest - shortest);
        below * (shortest + limit) / 2.0 + (1.0 - below) * limit
    }

    /// Mean context a sequence holds while it decodes: its prompt and half its answer.
    fn mean_context_tokens(&self) -> f64 {
        self.dataset.prompt_tokens + self.mean_answer() / 2.0
    }

    /// Generated tokens per step, on average.
    pub fn tokens_per_step(&self) -> f64 {
        f64::from(self.prompts_per_step * self.samples_per_prompt) * self.mean_answer()
    }
}

impl ActorKind {
    /// The most sequences the engine holds at once: as many caches as its memory
    /// leaves room for beside the weights, up to [`MAX_CONCURRENT_SEQUENCES`].
    fn max_sequences(&self, model: &ModelShape, workload: &Workload) -> f64 {
        let memory = self.gpu.memory_bytes * f64::from(self.gpus) * ENGINE_MEMORY_SHARE;
        let room = (memory - model.checkpoint_bytes()).max(0.0);
        (room / (model.kv_bytes_per_token() * workload.mean_context_tokens()))
            .floor()
            .min(MAX_CONCURRENT_SEQUENCES)
    }

    /// The engine's batched decode at `speed` of the decode model: an iteration reads
    /// the weights, and each token its sequence's cache (or costs its FLOPs, where those
    /// take longer), both at [`DECODE_ROOFLINE_SHARE`] of the roofline. With it an
    /// actor decodes only the sequences it was given: under section 7.1's B = 512 over
    /// 4, 8 or 12 actors that is 128, 64 or about 43 each, well under what its memory
    /// holds, so the weights' read is shared by fewer tokens than a full batch's.
    pub fn batched_decode(
        &self,
        model: &ModelShape,
        workload: &Workload,
        speed: f64,
    ) -> BatchedDecode {
        let gpus = f64::from(self.gpus);
        let bandwidth = self.gpu.bandwidth_bytes_per_s * gpus * DECODE_ROOFLINE_SHARE * speed;
        let flops = self.gpu.bf16_flops * gpus * DECODE_ROOFLINE_SHARE * speed;
        let cache_s = model.kv_bytes_per_token() * workload.mean_context_tokens() / bandwidth;
        let compute_s = 2.0 * model.active_parameters / flops;
        BatchedDecode {
            iteration_us: (model.checkpoint_bytes() / bandwidth * 1e6).round() as u64,
            token_ns: (cache_s.max(compute_s) * 1e9).round() as u64,
            max_sequences: self.max_sequences(model, workload).max(1.0) as u64,
            sequences_per_prompt: u64::from(workload.samples_per_prompt),
        }
    }

    /// Decode throughput, tokens per second: each decode iteration reads the weights
    /// and every running sequence's KV cache once (memory-bound at these batch sizes,
    /// unless the FLOPs say otherwise); the batch is as large as memory allows.
    pub fn tokens_per_s(&self, model: &ModelShape, workload: &Workload) -> f64 {
        let gpus = f64::from(self.gpus);
        let kv_per_sequence = model.kv_bytes_per_token() * workload.mean_context_tokens();
        let batch = self.max_sequences(model, workload);
        if batch < 1.0 {
            return 0.0;
        }
        let bytes_per_iteration = model.checkpoint_bytes() + batch * kv_per_sequence;
        let memory_s = bytes_per_iteration / (self.gpu.bandwidth_bytes_per_s * gpus);
        let compute_s = 2.0 * model.active_parameters * batch / (self.gpu.bf16_flops * gpus);
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
    /// The share of peak FLOP/s it reaches.
    pub mfu: f64,
}

/// Section 7.1's deployment of each model it trains.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PaperDeployment {
    /// The model.
    pub model: ModelShape,
    /// The trainer's H100s.
    pub trainer_gpus: u32,
    /// The A100 actors, in Canada.
    pub actors: usize,
}

/// "Qwen3 models at 4B/8B/14B with 2/4/6xH100 (SXM5) for training and 4/8/12 Actors,
/// each on a single A100 (PCIe) GPU."
pub const PAPER_DEPLOYMENTS: [PaperDeployment; 3] = [
    PaperDeployment {
        model: QWEN3_4B,
        trainer_gpus: 2,
        actors: 4,
    },
    PaperDeployment {
        model: QWEN3_8B,
        trainer_gpus: 4,
        actors: 8,
    },
    PaperDeployment {
        model: QWEN3_14B,
        trainer_gpus: 6,
        actors: 12,
    },
];

/// Assumption: host cores given to extraction on the trainer's node.
pub const EXTRACTION_CORES: u32 = 16;

impl Trainer {
    /// `gpus` H100s.
    pub const fn of(gpus: u32) -> Trainer {
        Trainer {
            gpu: H100,
            gpus,
            extraction_cores: EXTRACTION_CORES,
            mfu: TRAINER_MFU,
        }
    }
}

/// The paper's trainer's model FLOPs utilisation, from section 2's measurement: the MFU
/// at which section 7.1's Qwen3-8B trainer (4 H100) trains a step in
/// [`PAPER_TRAIN_OVER_GENERATION`] of the time its 8 A100 actors take to generate it. The
/// step is MATH's (an assumption: section 2 does not name the dataset it measured), each
/// actor decoding an even share whose longest answer is the dataset's longest. A ratio,
/// not the 40 s themselves: the answer lengths, assumed, set both sides alike.
pub fn paper_trainer_mfu() -> f64 {
    const ACTORS: f64 = 8.0;
    let workload = Workload::of(&QWEN3_8B, MATH);
    let decode = ActorKind { gpu: A100, gpus: 1 }.batched_decode(&QWEN3_8B, &workload, 1.0);
    let tokens = workload.tokens_per_step() / ACTORS;
    let iterations = (workload.longest_answer() as f64).max(tokens / decode.max_sequences as f64);
    let generation_s =
        iterations * decode.iteration_us as f64 / 1e6 + tokens * decode.token_ns as f64 / 1e9;
    let at_peak = Trainer {
        mfu: 1.0,
        ..Trainer::of(4)
    };
    at_peak.step_s(&QWEN3_8B, &workload) / (PAPER_TRAIN_OVER_GENERATION * generation_s)
}

impl Trainer {
    /// The paper's trainer: `gpus` H100s at [`paper_trainer_mfu`].
    pub fn paper(gpus: u32) -> Trainer {
        Trainer {
            mfu: paper_trainer_mfu(),
            ..Trainer::of(gpus)
        }
    }

    /// One GRPO step: forward and backward over every generated and prompt token
    /// (6 FLOPs per parameter and token) plus the old-policy forward (2 more).
    pub fn step_s(&self, model: &ModelShape, workload: &Workload) -> f64 {
        let sequences = f64::from(workload.prompts_per_step * workload.samples_per_prompt);
        let tokens = workload.tokens_per_step() + sequences * workload.dataset.prompt_tokens;
        8.0 * model.active_parameters * tokens
            / (self.gpu.bf16_flops * f64::from(self.gpus) * self.mfu)
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

/// The paper's own extraction, seconds per parameter: "extracting a sparse delta takes
/// approximately 5 s" for Qwen3-8B (its section 4, measured in section 7's US-Canada
/// deployment), scaled by size. A measurement of the paper's system, not of one of
/// section 7's results; the one section 7 figure it would restate (7 to 12 s of
/// extraction plus transfer) is therefore not compared.
pub const PAPER_EXTRACTION_S_PER_PARAMETER: f64 = 5.0 / 8.19e9;

/// Assumption: host cores an actor gives to decoding staged segments.
pub const ACTOR_DECODE_CORES: u32 = 8;
/// Assumption: the rate at which an engine reloads its weights from host memory
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
    /// The share of their nominal rate the paths between regions may fall to between
    /// shipments.
    pub link_low_share: f64,
    /// The path from the trainer's region to any other.
    pub wan: Link,
    /// A datacenter's network between machines of one region (no RDMA).
    pub lan: Link,
    /// The ideal single datacenter's RDMA fabric.
    pub rdma: Link,
}

/// Assumption: random loss on a commodity long-haul path, the geometric middle of a
/// plausible 1e-6 to 1e-5 (nothing in the paper gives it). It bounds a CUBIC stream at
/// `C MSS / (RTT sqrt(loss))`, which is why a far region's single stream is slow.
pub const WAN_LOSS: f64 = 3.16e-6;
/// The ends of that range, each a what-if.
pub const WAN_LOSS_RANGE: [f64; 2] = [1e-6, 1e-5];
/// The share of a path's nominal rate it may fall to between steps: section 7.1's link
/// "fluctuates between 500 Mbps and 1 Gbps".
pub const LINK_LOW_SHARE: f64 = 0.5;

/// A path between regions at its nominal (highest) rate.
pub const fn wan_path(rtt_ms: f64) -> Link {
    Link {
        rate_bps: 1e9,
        rtt_s: rtt_ms / 1e3,
        loss: WAN_LOSS,
    }
}

/// A region of a deployment, with its path from the trainer's region.
#[derive(Clone, Debug, PartialEq)]
pub struct Region {
    /// Its name in the report (the paper's regions are constants; a fleet file names
    /// its own).
    pub name: Cow<'static, str>,
    /// The path from the trainer's region: each actor's VM has one of its own, at
    /// this rate (a cross-cloud VM's bandwidth), sharing only the trainer's uplink.
    pub path: Link,
    /// Whether it is the trainer's own region (its actors on the datacenter's network).
    pub local: bool,
}

/// Section 7.1: actors in Canada, the trainer in the US, over a commodity cross-cloud
/// link of 0.5 to 1 Gbps. The round trip is an assumption: this project's
/// `wan/scenarios/us-canada.toml` (30 ms; plausible 10 to 70).
pub const CANADA: Region = Region {
    name: Cow::Borrowed("Canada"),
    path: wan_path(30.0),
    local: false,
};
/// Assumption: US to Japan, 135 ms (plausible 100 to 170); rate as Canada's.
pub const JAPAN: Region = Region {
    name: Cow::Borrowed("Japan"),
    path: wan_path(135.0),
    local: false,
};
/// Assumption: US to the Netherlands, 100 ms (plausible 80 to 120).
pub const NETHERLANDS: Region = Region {
    name: Cow::Borrowed("Netherlands"),
    path: wan_path(100.0),
    local: false,
};
/// Assumption: US to Iceland, 90 ms (plausible 70 to 110).
pub const ICELAND: Region = Region {
    name: Cow::Borrowed("Iceland"),
    path: wan_path(90.0),
    local: false,
};
/// Assumption: Canada to Australia, 205 ms (plausible 180 to 230).
pub const AUSTRALIA: Region = Region {
    name: Cow::Borrowed("Australia"),
    path: wan_path(205.0),
    local: false,
};
/// Section 7.4's heterogeneous pool sits in the US with the trainer in Canada: the
/// same path as [`CANADA`], the other way.
pub const US: Region = Region {
    name: Cow::Borrowed("US"),
    path: wan_path(30.0),
    local: false,
};

/// The links around the trainer: its uplink, and the datacenter networks. The
/// uplink (unstated) is an assumption: a cloud VM's 10 Gbps, so a region's paths, not
/// the trainer, are what is commodity. 25 GbE inside a region; the ideal datacenter's
/// RDMA at section 7.1's 800 Gb/s.
pub const PAPER_NETWORK: Network = Network {
    uplink_bps: 10e9,
    link_low_share: LINK_LOW_SHARE,
    wan: CANADA.path,
    lan: Link {
        rate_bps: 25e9,
        rtt_s: 0.000_5,
        loss: 0.0,
    },
    rdma: Link {
        rate_bps: 800e9,
        rtt_s: 0.000_01,
        loss: 0.0,
    },
};

/// The shares of their nominal rate fluctuating paths run at for `shipments`
/// shipments: uniform in [`low_share`, 1] from `seed`, so every system of a
/// comparison meets the same sequence.
pub fn rate_shares(seed: u64, shipments: usize, low_share: f64) -> Vec<f64> {
    let mut random = SplitMix64(seed);
    (0..shipments)
        .map(|_| {
            let unit = (random.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
            low_share + (1.0 - low_share) * unit
        })
        .collect()
}

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
    /// Seconds until `actors` fresh actors behind `path` all have the whole checkpoint
    /// from the trainer: each VM on its own path, all of them through its uplink (their
    /// region's relay went with the pool they replace).
    pub fn refetch_s(&self, tcp: &TcpModel, model: &ModelShape, path: Link, actors: usize) -> f64 {
        let one_s = tcp.transfer_s(model.checkpoint_bytes(), path, CongestionControl::Bbr, 4);
        let uplink_s = actors as f64 * model.checkpoint_bytes() * 8.0
            / (self.uplink_bps * tcp.goodput_efficiency);
        one_s.max(uplink_s)
    }

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
        let density = QWEN3_8B.density;
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
        let rate = |kind: ActorKind, model| kind.tokens_per_s(&model, &Workload::of(&model, MATH));
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
    fn a_fluctuating_path_stays_within_section_7_1_s_range_and_repeats_per_seed() {
        let shares = rate_shares(7, 1000, LINK_LOW_SHARE);
        assert!(
            shares
                .iter()
                .all(|&share| (LINK_LOW_SHARE..=1.0).contains(&share))
        );
        let mean = shares.iter().sum::<f64>() / shares.len() as f64;
        assert!((mean - 0.75).abs() < 0.02, "{mean}");
        assert_eq!(shares, rate_shares(7, 1000, LINK_LOW_SHARE));
        assert_ne!(shares, rate_shares(8, 1000, LINK_LOW_SHARE));
    }

    #[test]
    fn section_7_1_sizes_the_trainer_to_the_model() {
        let gpus = PAPER_DEPLOYMENTS.map(|deployment| deployment.trainer_gpus);
        assert_eq!(gpus, [2, 4, 6]);
        let workload = Workload::of(&QWEN3_8B, GSM8K);
        assert_eq!(workload.prompts_per_step * workload.samples_per_prompt, 512);
    }

    #[test]
    fn section_2_s_measurement_puts_the_paper_s_trainer_in_the_plausible_range() {
        let mfu = paper_trainer_mfu();
        assert!((0.2..=0.45).contains(&mfu), "{mfu}");
    }

    #[test]
    fn an_actor_given_fewer_sequences_makes_fewer_tokens_per_second() {
        let a100 = ActorKind { gpu: A100, gpus: 1 };
        let workload = Workload::of(&QWEN3_8B, MATH);
        let decode = a100.batched_decode(&QWEN3_8B, &workload, 1.0);
        // Section 7.1's B = 512 over 8 actors, against a full engine.
        let (few, full) = (decode.tokens_per_s(64), decode.tokens_per_s(256));
        assert!(10 * few < 7 * full, "{few} {full}");
        // At a full engine, the same rate as the whole-batch decode model.
        let model = a100.tokens_per_s(&QWEN3_8B, &workload);
        assert!((full as f64 / model - 1.0).abs() < 0.05, "{full} {model}");
    }

    /// The assumed limit cuts no answer of section 7.1's datasets; at the low end of its
    /// range it cuts MATH's and DeepScaleR's, which shortens their means and longest.
    #[test]
    fn a_sequence_limit_cuts_the_answers_past_it() {
        for dataset in DATASETS {
            let workload = Workload::of(&QWEN3_8B, dataset);
            let (shortest, longest) = dataset.completion_tokens;
            assert_eq!(workload.mean_answer(), (shortest + longest) as f64 / 2.0);
            assert_eq!(workload.longest_answer(), longest);
        }
        let whole = Workload::of(&QWEN3_8B, DEEPSCALER);
        let cut = whole.limited_to(4_096);
        assert_eq!(cut.longest_answer(), 4_096 - 250);
        // A quarter of the answers drawn evenly over 1,200 to 4,800 are cut at 3,846.
        assert!(
            (2_870.0..2_880.0).contains(&cut.mean_answer()),
            "{}",
            cut.mean_answer()
        );
        assert_eq!(cut.group_limit(), 8 * (4_096 - 250));
        assert!(cut.tokens_per_step() < whole.tokens_per_step());
        let gsm8k = Workload::of(&QWEN3_8B, GSM8K).limited_to(SEQUENCE_LIMIT_RANGE[0]);
        assert_eq!(
            gsm8k.longest_answer(),
            1_600,
            "GSM8K's answers fit in 2,048"
        );
    }

    #[test]
    fn a_step_trains_in_proportion_to_parameters() {
        let trainer = Trainer::of(4);
        let ratio = trainer.step_s(&QWEN3_14B, &Workload::of(&QWEN3_14B, MATH))
            / trainer.step_s(&QWEN3_4B, &Workload::of(&QWEN3_4B, MATH));
        assert!((ratio - QWEN3_14B.parameters / QWEN3_4B.parameters).abs() < 1e-9);
    }
}
