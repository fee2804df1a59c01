//! The built-in CPU RL engine: a small Qwen3-architecture policy (Hugging Face tensor
//! names) trained with GRPO or RLOO on tasks with verifiable rewards.
//!
//! - [`Trainer`]: FP32 master weights under AdamW, supervised warm-up
//!   ([`Trainer::warmup`]), RL steps ([`Trainer::train_step`]), the BF16 export every
//!   version is made of ([`Trainer::export_bf16`]), and its state as bytes.
//! - [`Policy`]: what an actor runs, loaded from a version's BF16 safetensors bytes and
//!   computing in F32; samples rollouts with a KV cache and evaluates greedily.
//! - [`Task`]: addition and countdown problems drawn from (seed, prompt id), checked by
//!   [`Problem::reward`], with a held-out part never drawn for training.
//!
//! # Reproducibility
//! A completion is a function of (weights bytes, prompt, seed, [`SamplingConfig`]); a
//! trainer's exports are a function of its seed, the warm-up settings and the sequence
//! of steps with their rollouts. Neither depends on the number of threads (candle's
//! matrix products split output tiles across threads but always sum the inner
//! dimension in the same order; `tests/threads.rs` runs the same work under 1, 2 and
//! 3 threads and compares hashes), nor on which process computes it. Bits are only
//! guaranteed to match between machines with the same CPU features, since the matrix
//! kernels are chosen at run time (AVX-512, AVX2 with FMA, ...).
//!
//! The engine does no I/O: weights and trainer state are bytes in and bytes out.

mod config;
mod error;
mod model;
mod policy;
mod rng;
mod rollout;
mod task;
mod tokenizer;
mod trainer;
mod weights;

pub use config::{MAX_LAYERS, MAX_PARAMETERS, MAX_SEQ_LEN, ModelConfig, PRESET_NAMES, TensorSpec};
pub use error::{EngineError, Result};
pub use policy::{Accuracy, Generation, MAX_EVAL_BATCH, Policy};
pub use rollout::{
    MAX_COMPLETION_TOKENS, MAX_SAMPLES_PER_PROMPT, MAX_TEMPERATURE, RolloutGroup, SamplingConfig,
};
pub use task::{
    HELD_OUT_ID_BIT, MAX_ADDITION_DIGITS, MAX_COUNTDOWN_NUMBER, MAX_COUNTDOWN_NUMBERS,
    MAX_COUNTDOWN_TARGET, MAX_EXPRESSION_CHARS, MAX_EXPRESSION_DEPTH, MAX_HELD_OUT, Problem, Task,
    TaskKind,
};
pub use tokenizer::{BOS, EOS, PAD, Tokenizer};
pub use trainer::{
    Algorithm, MAX_EPOCHS, MAX_GROUPS_PER_STEP, MAX_STATE_BYTES, MAX_WARMUP_BATCH, OptimizerConfig,
    RlConfig, TrainStats, Trainer, WarmupConfig, WarmupProgress,
};
