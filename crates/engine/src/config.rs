use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};
use crate::tokenizer::Tokenizer;

/// Upper bound on a configuration read from outside (a state file, a run file): larger
/// models are not what a CPU engine is for, and the bound keeps allocation sizes sane.
pub const MAX_PARAMETERS: u64 = 1 << 30;
pub const MAX_LAYERS: usize = 256;
pub const MAX_SEQ_LEN: usize = 4096;

/// Architecture of a Qwen3-style decoder: GQA attention with per-head q/k RMSNorm and
/// RoPE, SwiGLU MLP, pre-norm residual blocks, optionally tied embeddings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    /// Longest prompt plus completion, in tokens (BOS included).
    pub max_seq_len: usize,
    pub rope_theta: f32,
    pub rms_norm_eps: f32,
    pub tie_embeddings: bool,
}

/// Preset names accepted by [`ModelConfig::preset`].
pub const PRESET_NAMES: [&str; 4] = ["tiny", "default", "large", "xlarge"];

impl Default for ModelConfig {
    /// About 1.6 million parameters: sized so that warm-up plus a few dozen GRPO steps
    /// on the built-in tasks fit in minutes on two CPU cores.
    fn default() -> Self {
        ModelConfig {
            hidden_size: 192,
            num_layers: 4,
            num_heads: 6,
            num_kv_heads: 2,
            head_dim: 32,
            intermediate_size: 512,
            ..ModelConfig::tiny()
        }
    }
}

impl ModelConfig {
    /// About 20 thousand parameters, for tests.
    pub fn tiny() -> Self {
        ModelConfig {
            vocab_size: Tokenizer.vocab_size(),
            hidden_size: 32,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 8,
            intermediate_size: 64,
            max_seq_len: 48,
            rope_theta: 10_000.0,
            rms_norm_eps: 1e-6,
            tie_embeddings: true,
        }
    }

    /// About 6.6 million parameters, for longer runs.
    pub fn large() -> Self {
        ModelConfig {
            hidden_size: 320,
            num_layers: 6,
            num_heads: 10,
            num_kv_heads: 2,
            head_dim: 32,
            intermediate_size: 896,
            ..ModelConfig::tiny()
        }
    }

    /// About 50 million parameters (100 MB of BF16): the smallest size at which a
    /// checkpoint crosses a 1 Gbps link in most of a second, so that shipping it whole is
    /// bound by bandwidth rather than by round trips, as for the models the project is
    /// for; a step still takes seconds on two CPU cores with short sequences.
    pub fn xlarge() -> Self {
        ModelConfig {
            hidden_size: 768,
            num_layers: 8,
            num_heads: 12,
            num_kv_heads: 4,
            head_dim: 64,
            intermediate_size: 2048,
            ..ModelConfig::tiny()
        }
    }

    pub fn preset(name: &str) -> Option<Self> {
        match name.to_ascii_lowercase().as_str() {
            "tiny" => Some(Self::tiny()),
            "default" => Some(Self::default()),
            "large" => Some(Self::large()),
            "xlarge" => Some(Self::xlarge()),
            _ => None,
        }
    }

    /// Checks every invariant the model code relies on, with bounds for a configuration
    /// that came from outside.
    pub fn validate(&self) -> Result<()> {
        let fail = |reason: String| Err(EngineError::Config(reason));
        let sizes = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_layers", self.num_layers),
            ("num_heads", self.num_heads),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("intermediate_size", self.intermediate_size),
            ("max_seq_len", self.max_seq_len),
        ];
        if let Some((name, _)) = sizes.iter().find(|(_, size)| *size == 0) {
            return fail(format!("{name} is zero"));
        }
        if self.vocab_size != Tokenizer.vocab_size() {
            return fail(format!(
                "vocab_size {} differs from the tokenizer's {}",
                self.vocab_size,
                Tokenizer.vocab_size()
            ));
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return fail(format!(
                "num_heads {} is not a multiple of num_kv_heads {}",
                self.num_heads, self.num_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return fail(format!(
                "head_dim {} is odd; RoPE needs pairs",
                self.head_dim
            ));
        }
        if self.num_layers > MAX_LAYERS {
            return fail(format!(
                "num_layers {} exceeds {MAX_LAYERS}",
                self.num_layers
            ));
        }
        if self.max_seq_len > MAX_SEQ_LEN {
            return fail(format!(
                "max_seq_len {} exceeds {MAX_SEQ_LEN}",
                self.max_seq_len
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return fail(format!("rope_theta {} must exceed 1", self.rope_theta));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return fail(format!(
                "rms_norm_eps {} must be positive",
                self.rms_norm_eps
            ));
        }
        match self.checked_parameters() {
            Some(count) if count <= MAX_PARAMETERS => Ok(()),
            _ => fail(format!("more than {MAX_PARAMETERS} parameters")),
        }
    }

    /// Every tensor with its Hugging Face name and shape, sorted by name.
    pub fn tensors(&self) -> Vec<TensorSpec> {
        let hidden = self.hidden_size;
        let q = self.num_heads * self.head_dim;
        let kv = self.num_kv_heads * self.head_dim;
        let mut specs = vec![
            TensorSpec::matrix("model.embed_tokens.weight", self.vocab_size, hidden),
            TensorSpec::norm("model.norm.weight", hidden),
        ];
        if !self.tie_embeddings {
            specs.push(TensorSpec::matrix(
                "lm_head.weight",
                self.vocab_size,
                hidden,
            ));
        }
        for layer in 0..self.num_layers {
            let name = |suffix: &str| format!("model.layers.{layer}.{suffix}");
            specs.extend([
                TensorSpec::norm(&name("input_layernorm.weight"), hidden),
                TensorSpec::norm(&name("post_attention_layernorm.weight"), hidden),
                TensorSpec::matrix(&name("self_attn.q_proj.weight"), q, hidden),
                TensorSpec::matrix(&name("self_attn.k_proj.weight"), kv, hidden),
                TensorSpec::matrix(&name("self_attn.v_proj.weight"), kv, hidden),
                TensorSpec::matrix(&name("self_attn.o_proj.weight"), hidden, q),
                TensorSpec::norm(&name("self_attn.q_norm.weight"), self.head_dim),
                TensorSpec::norm(&name("self_attn.k_norm.weight"), self.head_dim),
                TensorSpec::matrix(
                    &name("mlp.gate_proj.weight"),
                    self.intermediate_size,
                    hidden,
                ),
                TensorSpec::matrix(&name("mlp.up_proj.weight"), self.intermediate_size, hidden),
                TensorSpec::matrix(
                    &name("mlp.down_proj.weight"),
                    hidden,
                    self.intermediate_size,
                ),
            ]);
        }
        specs.sort_by(|a, b| a.name.cmp(&b.name));
        specs
    }

    pub fn parameters(&self) -> u64 {
        self.checked_parameters().unwrap_or(u64::MAX)
    }

    fn checked_parameters(&self) -> Option<u64> {
        let hidden = self.hidden_size as u64;
        let q = (self.num_heads as u64).checked_mul(self.head_dim as u64)?;
        let kv = (self.num_kv_heads as u64).checked_mul(self.head_dim as u64)?;
        let per_layer = [
            (2, hidden),
            (2, self.head_dim as u64),
            (2, q.checked_mul(hidden)?),
            (2, kv.checked_mul(hidden)?),
            (3, (self.intermediate_size as u64).checked_mul(hidden)?),
        ]
        .iter()
        .try_fold(0u64, |sum, &(copies, n)| {
            sum.checked_add(n.checked_mul(copies)?)
        })?;
        let embeddings = (self.vocab_size as u64).checked_mul(hidden)?;
        let heads = if self.tie_embeddings { 1 } else { 2 };
        per_layer
            .checked_mul(self.num_layers as u64)?
            .checked_add(embeddings.checked_mul(heads)?)?
            .checked_add(hidden)
    }
}

/// A tensor of the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
}

impl TensorSpec {
    fn matrix(name: &str, rows: usize, columns: usize) -> Self {
        TensorSpec {
            name: name.to_string(),
            shape: vec![rows, columns],
        }
    }

    fn norm(name: &str, size: usize) -> Self {
        TensorSpec {
            name: name.to_string(),
            shape: vec![size],
        }
    }

    pub fn is_norm(&self) -> bool {
        self.shape.len() == 1
    }

    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_valid_and_counted_exactly() {
        for name in PRESET_NAMES {
            let config = ModelConfig::preset(name).unwrap();
            config.validate().unwrap();
            let counted: usize = config.tensors().iter().map(TensorSpec::elements).sum();
            assert_eq!(config.parameters(), counted as u64, "{name}");
        }
        assert!(ModelConfig::preset("huge").is_none());
        let default = ModelConfig::default().parameters();
        assert!((1_000_000..3_000_000).contains(&default), "{default}");
        let xlarge = ModelConfig::xlarge().parameters();
        assert!((45_000_000..55_000_000).contains(&xlarge), "{xlarge}");
    }

    #[test]
    fn tensors_have_the_hugging_face_qwen3_names() {
        let config = ModelConfig {
            num_layers: 1,
            tie_embeddings: false,
            ..ModelConfig::tiny()
        };
        let names: Vec<String> = config.tensors().into_iter().map(|t| t.name).collect();
        assert_eq!(
            names,
            [
                "lm_head.weight",
                "model.embed_tokens.weight",
                "model.layers.0.input_layernorm.weight",
                "model.layers.0.mlp.down_proj.weight",
                "model.layers.0.mlp.gate_proj.weight",
                "model.layers.0.mlp.up_proj.weight",
                "model.layers.0.post_attention_layernorm.weight",
                "model.layers.0.self_attn.k_norm.weight",
                "model.layers.0.self_attn.k_proj.weight",
                "model.layers.0.self_attn.o_proj.weight",
                "model.layers.0.self_attn.q_norm.weight",
                "model.layers.0.self_attn.q_proj.weight",
                "model.layers.0.self_attn.v_proj.weight",
                "model.norm.weight",
            ]
        );
        let q_proj = config
            .tensors()
            .into_iter()
            .find(|t| t.name.ends_with("q_proj.weight"))
            .unwrap();
        assert_eq!(q_proj.shape, vec![32, 32]);
    }

    #[test]
    fn validation_names_the_broken_field() {
        let check = |config: ModelConfig, expected: &str| {
            let message = config.validate().unwrap_err().to_string();
            assert!(message.contains(expected), "{message}");
        };
        let tiny = ModelConfig::tiny();
        check(
            ModelConfig {
                hidden_size: 0,
                ..tiny
            },
            "hidden_size is zero",
        );
        check(
            ModelConfig {
                vocab_size: 99,
                ..tiny
            },
            "vocab_size 99",
        );
        check(
            ModelConfig {
                num_kv_heads: 3,
                ..tiny
            },
            "not a multiple",
        );
        check(
            ModelConfig {
                head_dim: 7,
                ..tiny
            },
            "odd",
        );
        check(
            ModelConfig {
                num_layers: MAX_LAYERS + 1,
                ..tiny
            },
            "num_layers",
        );
        check(
            ModelConfig {
                max_seq_len: MAX_SEQ_LEN + 1,
                ..tiny
            },
            "max_seq_len",
        );
        check(
            ModelConfig {
                rope_theta: f32::NAN,
                ..tiny
            },
            "rope_theta",
        );
        check(
            ModelConfig {
                rms_norm_eps: 0.0,
                ..tiny
            },
            "rms_norm_eps",
        );
        check(
            ModelConfig {
                hidden_size: 1 << 20,
                intermediate_size: 1 << 20,
                ..tiny
            },
            "parameters",
        );
        check(
            ModelConfig {
                hidden_size: usize::MAX,
                ..tiny
            },
            "parameters",
        );
        ModelConfig {
            num_layers: MAX_LAYERS,
            max_seq_len: MAX_SEQ_LEN,
            ..tiny
        }
        .validate()
        .unwrap();
    }
}
