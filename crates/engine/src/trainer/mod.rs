//! The trainer: FP32 master weights under AdamW, a supervised warm-up that produces the
//! base policy, GRPO or RLOO steps on actors' rollouts, BF16 export of every version,
//! and its own state as bytes.
//!
//! Everything a step computes is a function of the state and the inputs in a canonical
//! order (groups sorted by prompt id, gradients summed in parameter order, the same
//! micro-batches), so the same steps on the same rollouts export the same bytes.
//!
//! Submodules: `settings` (the configuration types and their checks), `warmup` and `rl`
//! (the two kinds of step), `optimizer` (the AdamW update), `state` (the trainer as
//! bytes); here the weights, their export and what both kinds of step share.

mod optimizer;
mod rl;
mod settings;
mod state;
#[cfg(test)]
mod tests;
mod warmup;

use candle_core::{Device, Tensor, Var};

use crate::config::ModelConfig;
use crate::error::{ComputeContext, Result};
use crate::model::{self, Model};
use crate::policy::Policy;
use crate::tokenizer::PAD;
use crate::weights;

pub use rl::{MAX_GROUPS_PER_STEP, TrainStats};
pub use settings::{
    Algorithm, MAX_EPOCHS, MAX_WARMUP_BATCH, OptimizerConfig, RlConfig, WarmupConfig,
};
pub use state::MAX_STATE_BYTES;
pub use warmup::WarmupProgress;

/// Sequences per forward and backward pass; larger batches accumulate gradients, which
/// bounds memory whatever the batch.
const MICRO_BATCH_ROWS: usize = 256;

struct Param {
    var: Var,
    first_moment: Tensor,
    second_moment: Tensor,
    decays: bool,
}

/// AdamW's first and second moments, per tensor.
type Moments = (Vec<Vec<f32>>, Vec<Vec<f32>>);

/// FP32 master weights and AdamW moments of one model.
pub struct Trainer {
    config: ModelConfig,
    optimizer: OptimizerConfig,
    params: Vec<Param>,
    adam_steps: u64,
    warmup_steps: u64,
    rl_steps: u64,
}

/// Token sequences (prompt then completion) right-padded into one batch; `mask` marks
/// the target positions that are completion tokens.
struct TokenBatch {
    inputs: Tensor,
    targets: Tensor,
    mask: Vec<f32>,
    columns: usize,
}

impl TokenBatch {
    fn new(rows: &[(&[u32], &[u32])]) -> Result<Self> {
        let columns = rows
            .iter()
            .map(|(prompt, completion)| prompt.len() + completion.len() - 1)
            .max()
            .unwrap_or(0);
        let mut inputs = vec![PAD; rows.len() * columns];
        let mut targets = vec![PAD; rows.len() * columns];
        let mut mask = vec![0f32; rows.len() * columns];
        for (row, (prompt, completion)) in rows.iter().enumerate() {
            let sequence: Vec<u32> = prompt.iter().chain(completion.iter()).copied().collect();
            let offset = row * columns;
            for position in 0..sequence.len() - 1 {
                inputs[offset + position] = sequence[position];
                targets[offset + position] = sequence[position + 1];
                if position + 1 >= prompt.len() {
                    mask[offset + position] = 1.0;
                }
            }
        }
        let shape = (rows.len(), columns);
        Ok(TokenBatch {
            inputs: Tensor::from_vec(inputs, shape, &Device::Cpu).context("input batch")?,
            targets: Tensor::from_vec(targets, shape, &Device::Cpu).context("target batch")?,
            mask,
            columns,
        })
    }
}

impl Trainer {
    /// Fresh weights drawn from `seed` (the same in every process) and default AdamW.
    pub fn new(config: &ModelConfig, seed: u64) -> Result<Self> {
        Self::with_optimizer(config, OptimizerConfig::default(), seed)
    }

    pub fn with_optimizer(
        config: &ModelConfig,
        optimizer: OptimizerConfig,
        seed: u64,
    ) -> Result<Self> {
        optimizer.validate()?;
        let values = model::initial_weights(config, seed)?;
        Self::from_parts(config, optimizer, values, None)
    }

    fn from_parts(
        config: &ModelConfig,
        optimizer: OptimizerConfig,
        values: Vec<Vec<f32>>,
        moments: Option<Moments>,
    ) -> Result<Self> {
        config.validate()?;
        let tensors = model::tensors_from_values(config, values)?;
        let (first, second) = match moments {
            Some((first, second)) => (
                model::tensors_from_values(config, first)?,
                model::tensors_from_values(config, second)?,
            ),
            None => {
                let zeros = tensors
                    .iter()
                    .map(|t| t.zeros_like())
                    .collect::<candle_core::Result<Vec<_>>>();
                let zeros = zeros.context("optimizer moments")?;
                (zeros.clone(), zeros)
            }
        };
        let params = config
            .tensors()
            .iter()
            .zip(tensors)
            .zip(first.into_iter().zip(second))
            .map(|((spec, tensor), (first_moment, second_moment))| {
                Ok(Param {
                    var: Var::from_tensor(&tensor).context("parameter")?,
                    first_moment,
                    second_moment,
                    decays: !spec.is_norm(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Trainer {
            config: *config,
            optimizer,
            params,
            adam_steps: 0,
            warmup_steps: 0,
            rl_steps: 0,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// RL steps trained so far.
    pub fn rl_steps(&self) -> u64 {
        self.rl_steps
    }

    pub fn warmup_steps(&self) -> u64 {
        self.warmup_steps
    }

    /// The current weights as BF16 safetensors bytes (round to nearest even): the
    /// version actors load and deltas are taken from.
    pub fn export_bf16(&self) -> Result<Vec<u8>> {
        weights::export_bf16(&self.config, &self.master_values()?)
    }

    /// The policy of the current BF16 export, exactly as an actor would load it.
    pub fn policy(&self) -> Result<Policy> {
        Policy::from_safetensors(&self.config, &self.export_bf16()?)
    }

    fn master_values(&self) -> Result<Vec<Vec<f32>>> {
        self.params
            .iter()
            .map(|p| model::f32_values(p.var.as_tensor()).context("master weights"))
            .collect()
    }

    fn model(&self) -> Result<Model> {
        let tensors: Vec<Tensor> = self
            .params
            .iter()
            .map(|p| p.var.as_tensor().clone())
            .collect();
        Model::new(&self.config, &tensors)
    }

    /// The gradient of `loss` for every parameter, in parameter order; zeros for one
    /// the loss does not reach.
    fn gradients(&self, loss: &Tensor) -> Result<Vec<Tensor>> {
        let store = loss.backward().context("backward pass")?;
        self.params
            .iter()
            .map(|p| match store.get(p.var.as_tensor()) {
                Some(grad) => Ok(grad.clone()),
                None => p.var.as_tensor().zeros_like().context("zero gradient"),
            })
            .collect()
    }
}

fn add_all(a: &[Tensor], b: &[Tensor]) -> Result<Vec<Tensor>> {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x + y).context("gradient accumulation"))
        .collect()
}
