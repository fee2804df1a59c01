//! What actors send back: the completion tokens of each prompt's samples. Rewards and
//! log-probabilities are recomputed by the trainer, so nothing here is trusted beyond
//! its shape, which [`RolloutGroup::validate`] checks.

use serde::{Deserialize, Serialize};

use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::task::Task;
use crate::tokenizer::{EOS, Tokenizer};

/// Most samples of one prompt a group may carry.
pub const MAX_SAMPLES_PER_PROMPT: usize = 64;
/// Most tokens one completion may carry (the task usually allows far fewer).
pub const MAX_COMPLETION_TOKENS: usize = 256;
/// Highest sampling temperature accepted.
pub const MAX_TEMPERATURE: f32 = 10.0;

/// How actors sample. Part of what determines a completion, with the weights, the
/// prompt and the seed.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SamplingConfig {
    pub samples_per_prompt: usize,
    /// 0 samples greedily.
    pub temperature: f32,
    pub max_new_tokens: usize,
}

impl SamplingConfig {
    pub fn validate(&self) -> Result<()> {
        let fail = |reason: String| Err(EngineError::Generation(reason));
        if !(1..=MAX_SAMPLES_PER_PROMPT).contains(&self.samples_per_prompt) {
            return fail(format!(
                "samples_per_prompt {} is outside 1..={MAX_SAMPLES_PER_PROMPT}",
                self.samples_per_prompt
            ));
        }
        if !(0.0..=MAX_TEMPERATURE).contains(&self.temperature) {
            return fail(format!(
                "temperature {} is outside 0..={MAX_TEMPERATURE}",
                self.temperature
            ));
        }
        if !(1..=MAX_COMPLETION_TOKENS).contains(&self.max_new_tokens) {
            return fail(format!(
                "max_new_tokens {} is outside 1..={MAX_COMPLETION_TOKENS}",
                self.max_new_tokens
            ));
        }
        Ok(())
    }
}

/// The completions of one prompt: token ids, each ending with EOS unless cut at the
/// token limit. Compact enough for a JSON body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RolloutGroup {
    pub prompt_id: u64,
    pub completions: Vec<Vec<u32>>,
}

impl RolloutGroup {
    /// The completions as text (up to EOS).
    pub fn texts(&self) -> Vec<String> {
        self.completions
            .iter()
            .map(|c| Tokenizer.decode(c))
            .collect()
    }

    pub fn tokens(&self) -> usize {
        self.completions.iter().map(Vec::len).sum()
    }

    /// Checks what a hostile or broken actor could get wrong: the sample count, each
    /// completion's length against the task and the model, and every token id (text
    /// tokens only, EOS only last).
    pub fn validate(
        &self,
        config: &ModelConfig,
        task: &Task,
        samples_per_prompt: usize,
    ) -> Result<()> {
        let fail = |reason: String| {
            Err(EngineError::Rollout {
                prompt_id: self.prompt_id,
                reason,
            })
        };
        if self.completions.len() != samples_per_prompt {
            return fail(format!(
                "{} completions, expected {samples_per_prompt}",
                self.completions.len()
            ));
        }
        let prompt_tokens = task.problem(self.prompt_id)?.prompt.len() + 1;
        let max_tokens = task
            .max_completion_tokens()
            .min(MAX_COMPLETION_TOKENS)
            .min(config.max_seq_len.saturating_sub(prompt_tokens));
        for (index, completion) in self.completions.iter().enumerate() {
            if completion.is_empty() || completion.len() > max_tokens {
                return fail(format!(
                    "completion {index} has {} tokens, allowed 1..={max_tokens}",
                    completion.len()
                ));
            }
            let last = completion.len() - 1;
            for (position, &token) in completion.iter().enumerate() {
                let is_text = token > EOS && (token as usize) < config.vocab_size;
                if !(is_text || token == EOS && position == last) {
                    return fail(format!(
                        "completion {index} has invalid token {token} at position {position}"
                    ));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::{BOS, PAD};

    fn check(group: &RolloutGroup, expected: &str) {
        let message = group
            .validate(&ModelConfig::tiny(), &Task::addition(3, 0), 2)
            .unwrap_err()
            .to_string();
        assert!(message.contains(expected), "{message}");
        assert!(
            message.contains(&format!("prompt {}", group.prompt_id)),
            "{message}"
        );
    }

    fn group(completions: Vec<Vec<u32>>) -> RolloutGroup {
        RolloutGroup {
            prompt_id: 5,
            completions,
        }
    }

    #[test]
    fn accepts_well_formed_groups() {
        let task = Task::addition(3, 0);
        let longest = vec![4; task.max_completion_tokens()];
        let good = group(vec![vec![4, 5, EOS], longest]);
        good.validate(&ModelConfig::tiny(), &task, 2).unwrap();
        assert_eq!(good.texts()[0], "12");
        let json = serde_json::to_string(&good).unwrap();
        assert_eq!(serde_json::from_str::<RolloutGroup>(&json).unwrap(), good);
    }

    #[test]
    fn refuses_hostile_groups_by_reason() {
        let task = Task::addition(3, 0);
        check(&group(vec![vec![4, EOS]]), "1 completions, expected 2");
        check(&group(vec![vec![4, EOS]; 3]), "3 completions");
        check(
            &group(vec![vec![4, EOS], vec![]]),
            "completion 1 has 0 tokens",
        );
        let too_long = vec![4; task.max_completion_tokens() + 1];
        check(&group(vec![vec![4, EOS], too_long]), "allowed 1..=5");
        check(
            &group(vec![vec![4, 21], vec![4]]),
            "invalid token 21 at position 1",
        );
        check(&group(vec![vec![PAD], vec![4]]), "invalid token 0");
        check(&group(vec![vec![BOS], vec![4]]), "invalid token 1");
        check(
            &group(vec![vec![EOS, 4], vec![4]]),
            "invalid token 2 at position 0",
        );
        check(
            &group(vec![vec![u32::MAX], vec![4]]),
            "invalid token 4294967295",
        );
        assert!(
            serde_json::from_str::<RolloutGroup>(r#"{"prompt_id":1,"completions":[[-1]]}"#)
                .is_err()
        );
        assert!(
            serde_json::from_str::<RolloutGroup>(r#"{"prompt_id":1,"completions":[],"reward":1}"#)
                .is_err()
        );
    }

    #[test]
    fn completion_length_is_bounded_by_the_model_too() {
        let task = Task::addition(9, 0);
        let config = ModelConfig {
            max_seq_len: 24,
            ..ModelConfig::tiny()
        };
        let problem = task.problem(5).unwrap();
        let room = 24 - problem.prompt.len() - 1;
        assert!(room < task.max_completion_tokens());
        let fits = group(vec![vec![4; room]; 2]);
        fits.validate(&config, &task, 2).unwrap();
        let message = group(vec![vec![4; room + 1]; 2])
            .validate(&config, &task, 2)
            .unwrap_err()
            .to_string();
        assert!(
            message.contains(&format!("allowed 1..={room}")),
            "{message}"
        );
    }

    #[test]
    fn sampling_limits_are_enforced() {
        let good = SamplingConfig {
            samples_per_prompt: MAX_SAMPLES_PER_PROMPT,
            temperature: MAX_TEMPERATURE,
            max_new_tokens: MAX_COMPLETION_TOKENS,
        };
        good.validate().unwrap();
        for (bad, expected) in [
            (
                SamplingConfig {
                    samples_per_prompt: 0,
                    ..good
                },
                "samples_per_prompt 0",
            ),
            (
                SamplingConfig {
                    samples_per_prompt: MAX_SAMPLES_PER_PROMPT + 1,
                    ..good
                },
                "samples_per_prompt",
            ),
            (
                SamplingConfig {
                    temperature: -0.1,
                    ..good
                },
                "temperature",
            ),
            (
                SamplingConfig {
                    temperature: f32::NAN,
                    ..good
                },
                "temperature NaN",
            ),
            (
                SamplingConfig {
                    temperature: MAX_TEMPERATURE * 2.0,
                    ..good
                },
                "temperature",
            ),
            (
                SamplingConfig {
                    max_new_tokens: 0,
                    ..good
                },
                "max_new_tokens 0",
            ),
            (
                SamplingConfig {
                    max_new_tokens: MAX_COMPLETION_TOKENS + 1,
                    ..good
                },
                "max_new_tokens",
            ),
        ] {
            let message = bad.validate().unwrap_err().to_string();
            assert!(message.contains(expected), "{message}");
        }
    }
}
