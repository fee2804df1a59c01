//! Inference on one version of the weights: sampling rollouts (what actors do), greedy
//! evaluation, and the log-probabilities the trainer needs from a past version.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

use crate::config::ModelConfig;
use crate::error::{ComputeContext, EngineError, Result};
use crate::model::{self, KvCache, Model};
use crate::rng;
use crate::rollout::{RolloutGroup, SamplingConfig};
use crate::task::{Problem, Task};
use crate::tokenizer::{BOS, EOS, PAD, Tokenizer};
use crate::weights;

/// Most prompts evaluated together in one greedy batch.
pub const MAX_EVAL_BATCH: usize = 64;

/// A policy computing in F32 from the BF16 values of one exported version.
pub struct Policy {
    config: ModelConfig,
    model: Model,
}

/// Rollouts of a set of prompts and what generating them took, the scheduler's
/// throughput signal.
#[derive(Debug, Clone)]
pub struct Generation {
    pub groups: Vec<RolloutGroup>,
    pub tokens_generated: u64,
    pub elapsed: Duration,
}

/// Greedy accuracy on a problem set.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Accuracy {
    pub correct: usize,
    pub total: usize,
}

impl Accuracy {
    pub fn fraction(&self) -> f64 {
        if self.total == 0 {
            0.0
        } else {
            self.correct as f64 / self.total as f64
        }
    }
}

impl Policy {
    /// Loads BF16 safetensors bytes (a version's export), checking every tensor's name,
    /// dtype and shape against `config`.
    pub fn from_safetensors(config: &ModelConfig, bytes: &[u8]) -> Result<Self> {
        config.validate()?;
        let values = weights::import_bf16(config, bytes)?;
        Self::from_values(config, values)
    }

    pub(crate) fn from_values(config: &ModelConfig, values: Vec<Vec<f32>>) -> Result<Self> {
        let tensors = model::tensors_from_values(config, values)?;
        Ok(Policy {
            config: *config,
            model: Model::new(config, &tensors)?,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// `sampling.samples_per_prompt` completions of each problem. Sample `j` of prompt
    /// `p` draws its token at position `t` from a hash of (seed, p, j, t), and each
    /// prompt's samples are computed as one batch on their own, so a completion depends
    /// only on the weights, the prompt, the seed and `sampling`: never on which other
    /// prompts were generated with it, by which process, or on how many threads.
    pub fn generate(
        &self,
        problems: &[Problem],
        sampling: &SamplingConfig,
        seed: u64,
    ) -> Result<Generation> {
        sampling.validate()?;
        let started = Instant::now();
        let mut groups = Vec::with_capacity(problems.len());
        let mut tokens_generated = 0u64;
        for problem in problems {
            let prompt = Tokenizer.encode_prompt(&problem.prompt)?;
            let completions = self.complete(
                &[prompt],
                sampling.samples_per_prompt,
                sampling.max_new_tokens,
                |sample, position, logits| {
                    let u = rng::unit(&[seed, problem.prompt_id, sample as u64, position as u64]);
                    sample_token(logits, sampling.temperature, u)
                },
            )?;
            tokens_generated += completions.iter().map(|c| c.len() as u64).sum::<u64>();
            groups.push(RolloutGroup {
                prompt_id: problem.prompt_id,
                completions,
            });
        }
        Ok(Generation {
            groups,
            tokens_generated,
            elapsed: started.elapsed(),
        })
    }

    /// Greedy completions of each problem, in the order given; prompts of the same
    /// length are batched.
    pub fn greedy(&self, problems: &[Problem], max_new_tokens: usize) -> Result<Vec<String>> {
        let mut by_length: BTreeMap<usize, Vec<(usize, Vec<u32>)>> = BTreeMap::new();
        for (index, problem) in problems.iter().enumerate() {
            let prompt = Tokenizer.encode_prompt(&problem.prompt)?;
            by_length
                .entry(prompt.len())
                .or_default()
                .push((index, prompt));
        }
        let mut texts = vec![String::new(); problems.len()];
        for batch in by_length
            .values()
            .flat_map(|same| same.chunks(MAX_EVAL_BATCH))
        {
            let prompts: Vec<Vec<u32>> = batch.iter().map(|(_, p)| p.clone()).collect();
            let completions = self.complete(&prompts, 1, max_new_tokens, |_, _, logits| {
                sample_token(logits, 0.0, 0.0)
            })?;
            for ((index, _), completion) in batch.iter().zip(completions) {
                texts[*index] = Tokenizer.decode(&completion);
            }
        }
        Ok(texts)
    }

    /// Fraction of `problems` solved by the greedy completion.
    pub fn accuracy(&self, task: &Task, problems: &[Problem]) -> Result<Accuracy> {
        let texts = self.greedy(problems, task.max_completion_tokens())?;
        let correct = problems
            .iter()
            .zip(&texts)
            .filter(|(problem, text)| problem.reward(text) == 1.0)
            .count();
        Ok(Accuracy {
            correct,
            total: problems.len(),
        })
    }

    /// Completes prompts of equal length, each `copies` times (row `r` continues prompt
    /// `r % prompts.len()`), choosing each token with `choose(row, position, logits)`.
    /// Stops at EOS per row, or at `max_new_tokens`.
    fn complete(
        &self,
        prompts: &[Vec<u32>],
        copies: usize,
        max_new_tokens: usize,
        mut choose: impl FnMut(usize, usize, &[f32]) -> u32,
    ) -> Result<Vec<Vec<u32>>> {
        let prompt_len = prompts.first().map_or(0, Vec::len);
        if prompt_len + max_new_tokens > self.config.max_seq_len {
            return Err(EngineError::Generation(format!(
                "prompt of {prompt_len} tokens plus {max_new_tokens} new tokens exceeds max_seq_len {}",
                self.config.max_seq_len
            )));
        }
        let vocab = self.config.vocab_size;
        let flat: Vec<u32> = prompts.concat();
        let input = Tensor::from_vec(flat, (prompts.len(), prompt_len), &Device::Cpu)
            .context("prompt batch")?;
        let mut cache = KvCache::new(&self.config);
        let logits = self.model.forward(&input, Some(&mut cache))?;
        let last = logits
            .narrow(1, prompt_len - 1, 1)
            .context("last prompt logits")?;
        let mut logits = model::f32_values(&last).context("last prompt logits")?;
        if copies > 1 {
            cache = cache.repeat(copies).context("kv cache copies")?;
            logits = logits.repeat(copies);
        }
        let rows = prompts.len() * copies;
        let mut completions = vec![Vec::new(); rows];
        let mut finished = vec![false; rows];
        for position in 0..max_new_tokens {
            let mut next = Vec::with_capacity(rows);
            for row in 0..rows {
                if !finished[row] {
                    let token = choose(row, position, &logits[row * vocab..(row + 1) * vocab]);
                    completions[row].push(token);
                    finished[row] = token == EOS;
                }
                // A finished row keeps feeding its last token; its logits are ignored.
                next.push(*completions[row].last().unwrap_or(&EOS));
            }
            if position + 1 == max_new_tokens || finished.iter().all(|&f| f) {
                break;
            }
            let input = Tensor::from_vec(next, (rows, 1), &Device::Cpu).context("decode batch")?;
            let step = self.model.forward(&input, Some(&mut cache))?;
            logits = model::f32_values(&step).context("decode logits")?;
        }
        Ok(completions)
    }

    /// Log-probabilities `(batch, seq)` of `targets` after `inputs`, whole sequences at
    /// once (no cache), as the trainer computes them.
    pub(crate) fn log_probs(&self, inputs: &Tensor, targets: &Tensor) -> Result<Vec<f32>> {
        let logits = self.model.forward(inputs, None)?;
        let log_probs = model::token_log_probs(&logits, targets).context("behaviour log-probs")?;
        model::f32_values(&log_probs).context("behaviour log-probs")
    }

    /// Logits of every position of one sequence, from the whole-sequence path; with
    /// `cached`, from the KV-cache path one token at a time.
    #[cfg(test)]
    pub(crate) fn sequence_logits(&self, tokens: &[u32], cached: bool) -> Result<Vec<f32>> {
        let as_tensor =
            |t: &[u32]| Tensor::from_vec(t.to_vec(), (1, t.len()), &Device::Cpu).context("tokens");
        if !cached {
            return model::f32_values(&self.model.forward(&as_tensor(tokens)?, None)?)
                .context("logits");
        }
        let mut cache = KvCache::new(&self.config);
        let mut all = Vec::new();
        for &token in tokens {
            let logits = self
                .model
                .forward(&as_tensor(&[token])?, Some(&mut cache))?;
            all.extend(model::f32_values(&logits).context("logits")?);
        }
        Ok(all)
    }
}

/// Samples from softmax(logits / temperature) by inverting the CDF at `u`, in f64 and a
/// fixed order; greedy (first maximum) at temperature 0. PAD and BOS are never chosen.
fn sample_token(logits: &[f32], temperature: f32, u: f64) -> u32 {
    let candidates: Vec<(u32, f64)> = (0..logits.len() as u32)
        .zip(logits)
        .filter(|&(token, logit)| token != PAD && token != BOS && !logit.is_nan())
        .map(|(token, &logit)| (token, logit as f64))
        .collect();
    let best = candidates.iter().fold(
        None,
        |best: Option<(u32, f64)>, &(token, logit)| match best {
            Some((_, max)) if max >= logit => best,
            _ => Some((token, logit)),
        },
    );
    let Some((argmax, max)) = best else {
        return EOS;
    };
    if temperature == 0.0 || !max.is_finite() {
        return argmax;
    }
    let weights: Vec<(u32, f64)> = candidates
        .iter()
        .map(|&(token, logit)| (token, ((logit - max) / temperature as f64).exp()))
        .collect();
    let total: f64 = weights.iter().map(|(_, w)| w).sum();
    let mut threshold = u * total;
    for &(token, weight) in &weights {
        if threshold < weight {
            return token;
        }
        threshold -= weight;
    }
    argmax
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trainer::Trainer;

    fn tiny_policy(tie_embeddings: bool) -> Policy {
        let config = ModelConfig {
            tie_embeddings,
            ..ModelConfig::tiny()
        };
        Trainer::new(&config, 5).unwrap().policy().unwrap()
    }

    #[test]
    fn kv_cached_logits_match_the_training_module() {
        for tied in [true, false] {
            let policy = tiny_policy(tied);
            let tokens = Tokenizer.encode_prompt("12,34:56=(7*8)-9").unwrap();
            let whole = policy.sequence_logits(&tokens, false).unwrap();
            let cached = policy.sequence_logits(&tokens, true).unwrap();
            assert_eq!(whole.len(), tokens.len() * policy.config().vocab_size);
            let scale = whole.iter().fold(0f32, |m, v| m.max(v.abs()));
            let worst = whole
                .iter()
                .zip(&cached)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(scale > 0.01, "degenerate logits {scale}");
            assert!(
                worst <= 1e-5 * scale.max(1.0),
                "largest difference {worst} at scale {scale}"
            );
        }
    }

    #[test]
    fn generation_is_reproducible_and_independent_of_the_other_prompts() {
        let policy = tiny_policy(true);
        let task = Task::addition(2, 3);
        let problems: Vec<Problem> = (0..4).map(|id| task.problem(id).unwrap()).collect();
        let sampling = SamplingConfig {
            samples_per_prompt: 6,
            temperature: 1.0,
            max_new_tokens: task.max_completion_tokens(),
        };
        let all = policy.generate(&problems, &sampling, 11).unwrap();
        assert_eq!(all.groups.len(), 4);
        let alone = policy.generate(&problems[2..3], &sampling, 11).unwrap();
        assert_eq!(alone.groups[0], all.groups[2]);
        let reordered = policy
            .generate(&[problems[3].clone(), problems[2].clone()], &sampling, 11)
            .unwrap();
        assert_eq!(reordered.groups[1], all.groups[2]);
        let again = Trainer::new(&ModelConfig::tiny(), 5)
            .unwrap()
            .policy()
            .unwrap();
        assert_eq!(
            again.generate(&problems, &sampling, 11).unwrap().groups,
            all.groups
        );
        let reseeded = policy.generate(&problems, &sampling, 12).unwrap();
        assert_ne!(reseeded.groups, all.groups);

        let counted: usize = all.groups.iter().map(RolloutGroup::tokens).sum();
        assert_eq!(all.tokens_generated, counted as u64);
        for group in &all.groups {
            group.validate(policy.config(), &task, 6).unwrap();
            for completion in &group.completions {
                assert!(
                    completion.last() == Some(&EOS) || completion.len() == sampling.max_new_tokens
                );
            }
        }
        // A random policy spreads its samples: the six samples of a prompt differ.
        assert!(
            all.groups
                .iter()
                .all(|g| g.completions.iter().any(|c| *c != g.completions[0]))
        );
    }

    #[test]
    fn greedy_evaluation_matches_greedy_sampling() {
        let policy = tiny_policy(false);
        let task = Task::countdown(3, 20, 1);
        let problems = task.held_out(40).unwrap();
        let lengths: std::collections::HashSet<usize> =
            problems.iter().map(|p| p.prompt.len()).collect();
        assert!(lengths.len() > 1, "the batches should mix prompt lengths");
        let batched = policy
            .greedy(&problems, task.max_completion_tokens())
            .unwrap();
        let sampling = SamplingConfig {
            samples_per_prompt: 2,
            temperature: 0.0,
            max_new_tokens: task.max_completion_tokens(),
        };
        let one_by_one = policy.generate(&problems, &sampling, 0).unwrap();
        for (text, group) in batched.iter().zip(&one_by_one.groups) {
            assert_eq!(group.texts(), vec![text.clone(), text.clone()]);
        }
        let accuracy = policy.accuracy(&task, &problems).unwrap();
        assert_eq!(accuracy.total, 40);
        let correct = problems
            .iter()
            .zip(&batched)
            .filter(|(p, t)| p.reward(t) == 1.0)
            .count();
        assert_eq!(accuracy.correct, correct);
    }

    #[test]
    fn generation_refuses_sequences_beyond_the_model() {
        let config = ModelConfig {
            max_seq_len: 10,
            ..ModelConfig::tiny()
        };
        let policy = Trainer::new(&config, 1).unwrap().policy().unwrap();
        let problem = Task::addition(3, 0).problem(0).unwrap();
        let sampling = SamplingConfig {
            samples_per_prompt: 1,
            temperature: 1.0,
            max_new_tokens: 5,
        };
        let message = policy
            .generate(std::slice::from_ref(&problem), &sampling, 0)
            .unwrap_err()
            .to_string();
        assert!(
            message.contains("prompt of 9 tokens plus 5 new tokens exceeds max_seq_len 10"),
            "{message}"
        );
        let fits = SamplingConfig {
            max_new_tokens: 1,
            ..sampling
        };
        assert_eq!(
            policy.generate(&[problem], &fits, 0).unwrap().groups[0].completions[0].len(),
            1
        );
        let message = policy
            .generate(
                &[],
                &SamplingConfig {
                    samples_per_prompt: 0,
                    ..fits
                },
                0,
            )
            .unwrap_err()
            .to_string();
        assert!(message.contains("samples_per_prompt 0"), "{message}");
    }

    #[test]
    fn sampling_follows_the_distribution_and_skips_special_tokens() {
        let mut logits = vec![f32::NEG_INFINITY; 6];
        logits[PAD as usize] = 10.0;
        logits[BOS as usize] = 10.0;
        logits[3] = 0.0;
        logits[4] = 2f32.ln();
        assert_eq!(sample_token(&logits, 0.0, 0.5), 4);
        let draws = 30_000;
        let fours = (0..draws)
            .filter(|&i| sample_token(&logits, 1.0, rng::unit(&[1, i])) == 4)
            .count();
        let share = fours as f64 / draws as f64;
        assert!((share - 2.0 / 3.0).abs() < 0.01, "{share}");
        // Temperature 2 flattens 2:1 into sqrt(2):1.
        let fours = (0..draws)
            .filter(|&i| sample_token(&logits, 2.0, rng::unit(&[2, i])) == 4)
            .count();
        let expected = 2f64.sqrt() / (1.0 + 2f64.sqrt());
        assert!((fours as f64 / draws as f64 - expected).abs() < 0.01);
        assert!((0..1000).all(|i| sample_token(&logits, 5.0, rng::unit(&[3, i])) > BOS));
    }

    #[test]
    fn sampling_survives_degenerate_logits() {
        assert_eq!(sample_token(&[f32::NAN; 5], 1.0, 0.3), EOS);
        assert_eq!(sample_token(&[0.0, 0.0, f32::NAN, f32::NAN], 1.0, 0.3), EOS);
        assert_eq!(sample_token(&[0.0, 0.0, 1.0, 1.0], 1.0, 0.999_999), 3);
    }
}
