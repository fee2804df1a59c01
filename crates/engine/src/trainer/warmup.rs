//! The supervised warm-up: cross-entropy steps on the task's reference solutions that
//! produce the base policy RL starts from.

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

use super::{MICRO_BATCH_ROWS, TokenBatch, Trainer, WarmupConfig, add_all};
use crate::error::{ComputeContext, EngineError, Result};
use crate::model;
use crate::task::Task;
use crate::tokenizer::Tokenizer;

/// Warm-up problems take their prompt ids from this range, apart from the run's.
const WARMUP_ID_BIT: u64 = 1 << 62;

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct WarmupProgress {
    /// Warm-up steps done so far, this one included (over all calls).
    pub step: u64,
    /// Mean cross-entropy per completion token of this step's batch.
    pub loss: f32,
}

impl Trainer {
    /// Supervised fine-tuning on the task's reference solutions, `config.steps` steps
    /// of `config.batch_size` training problems; reports each step's loss. Successive
    /// calls continue the same problem stream and optimizer state, so warming up in
    /// pieces equals warming up at once (with the same batch size).
    pub fn warmup(
        &mut self,
        task: &Task,
        config: &WarmupConfig,
        mut progress: impl FnMut(WarmupProgress),
    ) -> Result<()> {
        config.validate()?;
        task.validate()?;
        for _ in 0..config.steps {
            let first_id = self.warmup_steps * config.batch_size as u64;
            let sequences = (0..config.batch_size as u64)
                .map(|i| {
                    let problem = task.problem(WARMUP_ID_BIT | (first_id + i))?;
                    Ok((
                        Tokenizer.encode_prompt(&problem.prompt)?,
                        Tokenizer.encode_completion(&problem.solution)?,
                    ))
                })
                .collect::<Result<Vec<_>>>()?;
            let (grads, loss) = self.supervised_gradients(&sequences)?;
            self.apply_gradients(grads, config.learning_rate)?;
            self.warmup_steps += 1;
            tracing::trace!(step = self.warmup_steps, loss, "warm-up step");
            progress(WarmupProgress {
                step: self.warmup_steps,
                loss,
            });
        }
        Ok(())
    }

    /// Gradients of the mean cross-entropy of the completions, and that mean.
    pub(super) fn supervised_gradients(
        &self,
        sequences: &[(Vec<u32>, Vec<u32>)],
    ) -> Result<(Vec<Tensor>, f32)> {
        let tokens: usize = sequences.iter().map(|(_, c)| c.len()).sum();
        let mut grads: Option<Vec<Tensor>> = None;
        let mut loss_sum = 0f64;
        for chunk in sequences.chunks(MICRO_BATCH_ROWS) {
            let rows: Vec<(&[u32], &[u32])> = chunk
                .iter()
                .map(|(p, c)| (p.as_slice(), c.as_slice()))
                .collect();
            let batch = TokenBatch::new(&rows)?;
            let model = self.model()?;
            let logits = model.forward(&batch.inputs, None)?;
            let loss = (|| -> candle_core::Result<Tensor> {
                let log_probs = model::token_log_probs(&logits, &batch.targets)?;
                let mask = Tensor::from_vec(batch.mask.clone(), log_probs.shape(), &Device::Cpu)?;
                (log_probs * mask)?
                    .sum_all()?
                    .affine(-1.0 / tokens as f64, 0.0)
            })()
            .context("supervised loss")?;
            loss_sum += loss.to_scalar::<f32>().context("supervised loss")? as f64;
            let chunk_grads = self.gradients(&loss)?;
            grads = Some(match grads {
                None => chunk_grads,
                Some(sum) => add_all(&sum, &chunk_grads)?,
            });
        }
        let grads = grads.ok_or_else(|| EngineError::Training("empty warm-up batch".into()))?;
        Ok((grads, loss_sum as f32))
    }
}
