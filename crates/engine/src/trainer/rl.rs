//! One RL step (GRPO or RLOO) on actors' rollouts: the groups' advantages, the
//! micro-batches that stay fixed across epochs, and the clipped surrogate with its
//! optional KL penalty.

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

use super::{Algorithm, MICRO_BATCH_ROWS, RlConfig, TokenBatch, Trainer, add_all};
use crate::error::{ComputeContext, EngineError, Result};
use crate::model;
use crate::policy::Policy;
use crate::rollout::RolloutGroup;
use crate::task::Task;
use crate::tokenizer::Tokenizer;

/// Most prompt groups one step trains on.
pub const MAX_GROUPS_PER_STEP: usize = 4096;

/// What one RL step saw and did.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct TrainStats {
    /// The step's objective: minus the clipped surrogate per token, plus the KL penalty.
    pub loss: f32,
    pub mean_reward: f32,
    /// Share of samples that were correct (reward 1), whatever the reward kind.
    pub solved: f32,
    /// Groups whose rewards were all equal: no learning signal.
    pub groups_without_signal: usize,
    /// Mean k3 estimate of KL(behaviour || new) per completion token, before the update
    /// (the loss, the reference KL and the gradient norm are also those of the first
    /// epoch).
    pub kl_behaviour: f32,
    /// Mean k3 estimate of KL(new || reference) per token; None without a reference.
    pub kl_reference: Option<f32>,
    /// Share of completion tokens whose ratio was clipped, over all epochs.
    pub clip_fraction: f32,
    /// Global gradient norm before clipping.
    pub grad_norm: f32,
    pub groups: usize,
    pub samples: usize,
    /// Completion tokens trained on.
    pub tokens: usize,
}

impl Trainer {
    /// One RL step on `groups` (any order: they are sorted by prompt id first). Rewards
    /// come from `task`; the ratio's denominator from `behaviour`, the version that
    /// generated the rollouts; the KL penalty from `reference` (required when
    /// `rl.kl_coef` is positive).
    pub fn train_step(
        &mut self,
        task: &Task,
        groups: &[RolloutGroup],
        behaviour: &Policy,
        reference: Option<&Policy>,
        rl: &RlConfig,
    ) -> Result<TrainStats> {
        rl.validate()?;
        if *behaviour.config() != self.config {
            return Err(EngineError::Training(
                "behaviour policy has another model configuration".into(),
            ));
        }
        let reference = match (reference, rl.kl_coef > 0.0) {
            (Some(reference), true) if *reference.config() != self.config => {
                return Err(EngineError::Training(
                    "reference policy has another model configuration".into(),
                ));
            }
            (None, true) => {
                return Err(EngineError::Training(format!(
                    "kl_coef {} needs a reference policy",
                    rl.kl_coef
                )));
            }
            (reference, true) => reference,
            (_, false) => None,
        };
        if groups.is_empty() || groups.len() > MAX_GROUPS_PER_STEP {
            return Err(EngineError::Training(format!(
                "{} groups, expected 1..={MAX_GROUPS_PER_STEP}",
                groups.len()
            )));
        }
        let mut sorted: Vec<&RolloutGroup> = groups.iter().collect();
        sorted.sort_by_key(|g| g.prompt_id);
        if let Some(pair) = sorted
            .windows(2)
            .find(|pair| pair[0].prompt_id == pair[1].prompt_id)
        {
            return Err(EngineError::Rollout {
                prompt_id: pair[0].prompt_id,
                reason: "appears twice in one step".into(),
            });
        }

        let mut samples = Vec::new();
        let mut rewards_all = Vec::new();
        let mut groups_without_signal = 0;
        let mut solved = 0;
        for group in &sorted {
            group.validate(&self.config, task, rl.samples_per_prompt)?;
            let problem = task.problem(group.prompt_id)?;
            let prompt = Tokenizer.encode_prompt(&problem.prompt)?;
            let rewards: Vec<f32> = group
                .texts()
                .iter()
                .map(|text| problem.reward(text))
                .collect();
            solved += rewards.iter().filter(|&&r| r == 1.0).count();
            if rewards.iter().all(|&r| r == rewards[0]) {
                groups_without_signal += 1;
            }
            for (completion, advantage) in group
                .completions
                .iter()
                .zip(advantages(rl.algorithm, &rewards))
            {
                samples.push((prompt.clone(), completion.clone(), advantage));
            }
            rewards_all.extend(rewards);
        }
        let tokens: usize = samples.iter().map(|(_, c, _)| c.len()).sum();

        let micro_batches = samples
            .chunks(MICRO_BATCH_ROWS)
            .map(|chunk| {
                let rows: Vec<(&[u32], &[u32])> = chunk
                    .iter()
                    .map(|(p, c, _)| (p.as_slice(), c.as_slice()))
                    .collect();
                let batch = TokenBatch::new(&rows)?;
                Ok(MicroBatch {
                    old: behaviour.log_probs(&batch.inputs, &batch.targets)?,
                    reference: reference
                        .map(|r| r.log_probs(&batch.inputs, &batch.targets))
                        .transpose()?,
                    advantages: chunk.iter().map(|(_, _, a)| *a).collect(),
                    batch,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let mut first_epoch = None;
        let mut clipped = 0;
        for _ in 0..rl.epochs {
            let mut totals = RlTotals::default();
            let mut grads: Option<Vec<Tensor>> = None;
            for micro in &micro_batches {
                let micro_grads = self.rl_gradients(micro, rl, tokens, &mut totals)?;
                grads = Some(match grads {
                    None => micro_grads,
                    Some(sum) => add_all(&sum, &micro_grads)?,
                });
            }
            let grads = grads.ok_or_else(|| EngineError::Training("no samples".into()))?;
            let grad_norm = self.apply_gradients(grads, rl.learning_rate)?;
            clipped += totals.clipped;
            first_epoch.get_or_insert((totals, grad_norm));
        }
        self.rl_steps += 1;
        let (totals, grad_norm) =
            first_epoch.ok_or_else(|| EngineError::Training("no epochs".into()))?;

        let per_token = |sum: f64| (sum / tokens as f64) as f32;
        let kl_reference = reference.map(|_| per_token(totals.kl_reference));
        let stats = TrainStats {
            loss: per_token(-totals.surrogate)
                + kl_reference.map_or(0.0, |kl| (rl.kl_coef as f32) * kl),
            mean_reward: rewards_all.iter().sum::<f32>() / rewards_all.len() as f32,
            solved: solved as f32 / rewards_all.len() as f32,
            groups_without_signal,
            kl_behaviour: per_token(totals.kl_behaviour),
            kl_reference,
            clip_fraction: (clipped as f64 / (tokens * rl.epochs) as f64) as f32,
            grad_norm,
            groups: sorted.len(),
            samples: samples.len(),
            tokens,
        };
        tracing::debug!(step = self.rl_steps, ?stats, "RL step");
        Ok(stats)
    }

    /// Gradients of one micro-batch's share of the RL objective. The clipped surrogate
    /// min(r A, clip(r) A) has the gradient of r A where the ratio is not clipped and
    /// none where it is, so the clipping is decided on the values and the loss is
    /// written with fixed per-token weights.
    fn rl_gradients(
        &self,
        micro: &MicroBatch,
        rl: &RlConfig,
        tokens_total: usize,
        totals: &mut RlTotals,
    ) -> Result<Vec<Tensor>> {
        let batch = &micro.batch;
        let (old, reference) = (micro.old.as_slice(), micro.reference.as_deref());
        let model = self.model()?;
        let logits = model.forward(&batch.inputs, None)?;
        let new = model::token_log_probs(&logits, &batch.targets).context("policy log-probs")?;
        let new_values = model::f32_values(&new).context("policy log-probs")?;
        let normaliser = 1.0 / tokens_total as f64;
        let mut ratio_weights = vec![0f32; batch.mask.len()];
        let mut kl_weights = vec![0f32; batch.mask.len()];
        for (index, &mask) in batch.mask.iter().enumerate() {
            if mask == 0.0 {
                continue;
            }
            let advantage = micro.advantages[index / batch.columns] as f64;
            let log_ratio = new_values[index] as f64 - old[index] as f64;
            let ratio = log_ratio.exp();
            let clipped_ratio = ratio.clamp(1.0 - rl.clip_epsilon, 1.0 + rl.clip_epsilon);
            let clipped = (advantage > 0.0 && ratio > 1.0 + rl.clip_epsilon)
                || (advantage < 0.0 && ratio < 1.0 - rl.clip_epsilon);
            totals.surrogate += (ratio * advantage).min(clipped_ratio * advantage);
            totals.kl_behaviour += ratio - 1.0 - log_ratio;
            totals.clipped += u64::from(clipped);
            if !clipped {
                ratio_weights[index] = (advantage * normaliser) as f32;
            }
            if let Some(reference) = reference {
                let log_ratio = reference[index] as f64 - new_values[index] as f64;
                totals.kl_reference += log_ratio.exp() - log_ratio - 1.0;
                kl_weights[index] = (rl.kl_coef * normaliser) as f32;
            }
        }
        let shape = new.shape().clone();
        let constant = |values: &[f32]| Tensor::from_vec(values.to_vec(), &shape, &Device::Cpu);
        let loss = (|| -> candle_core::Result<Tensor> {
            let mask = constant(&batch.mask)?;
            let old = constant(old)?;
            // Padding positions are multiplied out before exp so they cannot overflow.
            let ratio = ((&new - &old)? * &mask)?.exp()?;
            let mut loss = (ratio * constant(&ratio_weights)?)?.sum_all()?.neg()?;
            if let Some(reference) = reference {
                let log_ratio = ((constant(reference)? - &new)? * &mask)?;
                let k3 = ((log_ratio.exp()? - &log_ratio)? - 1.0)?;
                loss = (loss + (k3 * constant(&kl_weights)?)?.sum_all()?)?;
            }
            Ok(loss)
        })()
        .context("RL loss")?;
        self.gradients(&loss)
    }
}

/// A slice of a step's samples with what stays fixed across epochs.
struct MicroBatch {
    batch: TokenBatch,
    advantages: Vec<f32>,
    old: Vec<f32>,
    reference: Option<Vec<f32>>,
}

#[derive(Default)]
struct RlTotals {
    surrogate: f64,
    kl_behaviour: f64,
    kl_reference: f64,
    clipped: u64,
}

/// Per-sample advantages of one group's rewards.
pub(super) fn advantages(algorithm: Algorithm, rewards: &[f32]) -> Vec<f32> {
    let n = rewards.len() as f64;
    let sum: f64 = rewards.iter().map(|&r| r as f64).sum();
    let mean = sum / n;
    match algorithm {
        Algorithm::Grpo => {
            let std = (rewards
                .iter()
                .map(|&r| (r as f64 - mean).powi(2))
                .sum::<f64>()
                / n)
                .sqrt();
            rewards
                .iter()
                .map(|&r| ((r as f64 - mean) / (std + 1e-6)) as f32)
                .collect()
        }
        Algorithm::Rloo => rewards
            .iter()
            .map(|&r| (r as f64 - (sum - r as f64) / (n - 1.0)) as f32)
            .collect(),
    }
}
