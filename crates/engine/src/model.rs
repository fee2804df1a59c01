//! The Qwen3-architecture decoder, written from candle operations that all have a
//! backward pass (candle's fused CPU kernels for RMSNorm, RoPE, softmax and attention
//! have none, and would leave every weight but the embedding without gradient).
//!
//! One forward function serves training (whole sequences, causal mask) and generation
//! (a KV cache that grows one token at a time), so the two cannot drift apart.

use std::collections::HashMap;

use candle_core::{D, DType, Device, Tensor};

use crate::config::ModelConfig;
use crate::error::{ComputeContext, EngineError, Result};
use crate::rng;

/// Initial standard deviation of projection and embedding weights (GPT-2 and Qwen use
/// 0.02); residual output projections are further scaled by 1/sqrt(2 * layers).
const INIT_STD: f64 = 0.02;

struct Layer {
    input_norm: Tensor,
    q_proj: Tensor,
    k_proj: Tensor,
    v_proj: Tensor,
    o_proj: Tensor,
    q_norm: Tensor,
    k_norm: Tensor,
    post_norm: Tensor,
    gate_proj: Tensor,
    up_proj: Tensor,
    down_proj: Tensor,
}

/// The decoder over a set of weight tensors (plain tensors for inference, the tensors
/// of candle `Var`s for training).
pub(crate) struct Model {
    config: ModelConfig,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Option<Tensor>,
    cos: Tensor,
    sin: Tensor,
}

/// Keys and values of every layer for the tokens seen so far.
pub(crate) struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    length: usize,
}

impl KvCache {
    pub(crate) fn new(config: &ModelConfig) -> Self {
        KvCache {
            layers: vec![None; config.num_layers],
            length: 0,
        }
    }

    /// The same cache for each of `copies` sequences (a prompt shared by a group of
    /// samples is prefilled once).
    pub(crate) fn repeat(&self, copies: usize) -> candle_core::Result<KvCache> {
        let layers = self
            .layers
            .iter()
            .map(|entry| {
                entry
                    .as_ref()
                    .map(|(k, v)| Ok((k.repeat((copies, 1, 1, 1))?, v.repeat((copies, 1, 1, 1))?)))
                    .transpose()
            })
            .collect::<candle_core::Result<_>>()?;
        Ok(KvCache {
            layers,
            length: self.length,
        })
    }
}

impl Model {
    /// `tensors` in the order of `config.tensors()`, shapes already checked.
    pub(crate) fn new(config: &ModelConfig, tensors: &[Tensor]) -> Result<Self> {
        config.validate()?;
        let specs = config.tensors();
        if specs.len() != tensors.len() {
            return Err(EngineError::Weights(format!(
                "{} tensors given, the model has {}",
                tensors.len(),
                specs.len()
            )));
        }
        let mut by_name: HashMap<String, Tensor> = specs
            .into_iter()
            .zip(tensors)
            .map(|(spec, tensor)| (spec.name, tensor.clone()))
            .collect();
        let mut take = |name: String| {
            by_name
                .remove(&name)
                .ok_or(EngineError::Weights(format!("missing tensor '{name}'")))
        };
        let layers = (0..config.num_layers)
            .map(|i| {
                let mut take = |suffix: &str| take(format!("model.layers.{i}.{suffix}"));
                Ok(Layer {
                    input_norm: take("input_layernorm.weight")?,
                    q_proj: take("self_attn.q_proj.weight")?,
                    k_proj: take("self_attn.k_proj.weight")?,
                    v_proj: take("self_attn.v_proj.weight")?,
                    o_proj: take("self_attn.o_proj.weight")?,
                    q_norm: take("self_attn.q_norm.weight")?,
                    k_norm: take("self_attn.k_norm.weight")?,
                    post_norm: take("post_attention_layernorm.weight")?,
                    gate_proj: take("mlp.gate_proj.weight")?,
                    up_proj: take("mlp.up_proj.weight")?,
                    down_proj: take("mlp.down_proj.weight")?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let lm_head = if config.tie_embeddings {
            None
        } else {
            Some(take("lm_head.weight".into())?)
        };
        let (cos, sin) = rope_tables(config).context("rope tables")?;
        Ok(Model {
            config: *config,
            embed: take("model.embed_tokens.weight".into())?,
            norm: take("model.norm.weight".into())?,
            layers,
            lm_head,
            cos,
            sin,
        })
    }

    /// Logits `(batch, seq, vocab)` for `tokens` `(batch, seq)` (u32). With a cache,
    /// the tokens continue the cached ones and the cache grows; without, they start at
    /// position 0 under a causal mask.
    pub(crate) fn forward(&self, tokens: &Tensor, cache: Option<&mut KvCache>) -> Result<Tensor> {
        let (_, seq) = tokens.dims2().context("token batch shape")?;
        let start = cache.as_ref().map_or(0, |c| c.length);
        if start + seq > self.config.max_seq_len {
            return Err(EngineError::Generation(format!(
                "sequence of {} tokens exceeds max_seq_len {}",
                start + seq,
                self.config.max_seq_len
            )));
        }
        self.forward_inner(tokens, cache).context("forward pass")
    }

    fn forward_inner(
        &self,
        tokens: &Tensor,
        mut cache: Option<&mut KvCache>,
    ) -> candle_core::Result<Tensor> {
        let (batch, seq) = tokens.dims2()?;
        let start = cache.as_ref().map_or(0, |c| c.length);
        let mut x = self
            .embed
            .index_select(&tokens.flatten_all()?, 0)?
            .reshape((batch, seq, self.config.hidden_size))?;
        let mask = (seq > 1)
            .then(|| self.causal_mask(start, seq, tokens.device()))
            .transpose()?;
        for (index, layer) in self.layers.iter().enumerate() {
            let entry = cache.as_mut().map(|c| &mut c.layers[index]);
            let normed = rms_norm(&x, &layer.input_norm, self.config.rms_norm_eps)?;
            x = (x + self.attention(layer, &normed, start, mask.as_ref(), entry)?)?;
            let normed = rms_norm(&x, &layer.post_norm, self.config.rms_norm_eps)?;
            let gate = candle_nn::ops::silu(&linear(&normed, &layer.gate_proj)?)?;
            let up = linear(&normed, &layer.up_proj)?;
            x = (x + linear(&(gate * up)?, &layer.down_proj)?)?;
        }
        if let Some(cache) = cache {
            cache.length += seq;
        }
        let x = rms_norm(&x, &self.norm, self.config.rms_norm_eps)?;
        linear(&x, self.lm_head.as_ref().unwrap_or(&self.embed))
    }

    fn attention(
        &self,
        layer: &Layer,
        x: &Tensor,
        start: usize,
        mask: Option<&Tensor>,
        cache: Option<&mut Option<(Tensor, Tensor)>>,
    ) -> candle_core::Result<Tensor> {
        let c = &self.config;
        let (batch, seq, _) = x.dims3()?;
        let group = c.num_heads / c.num_kv_heads;
        let heads = |w: &Tensor, count: usize, norm: Option<&Tensor>| {
            let projected = linear(x, w)?.reshape((batch, seq, count, c.head_dim))?;
            let normed = match norm {
                Some(norm) => rms_norm(&projected, norm, c.rms_norm_eps)?,
                None => projected,
            };
            normed.transpose(1, 2)?.contiguous()
        };
        let q = self.rope(
            &heads(&layer.q_proj, c.num_heads, Some(&layer.q_norm))?,
            start,
        )?;
        let mut k = self.rope(
            &heads(&layer.k_proj, c.num_kv_heads, Some(&layer.k_norm))?,
            start,
        )?;
        let mut v = heads(&layer.v_proj, c.num_kv_heads, None)?;
        if let Some(entry) = cache {
            if let Some((cached_k, cached_v)) = entry.as_ref() {
                k = Tensor::cat(&[cached_k, &k], 2)?;
                v = Tensor::cat(&[cached_v, &v], 2)?;
            }
            *entry = Some((k.clone(), v.clone()));
        }
        // Grouped-query attention without copying keys: the query heads that share a
        // key/value head are stacked along the sequence axis of that head.
        let q = q.reshape((batch, c.num_kv_heads, group * seq, c.head_dim))?;
        let scores = (q.matmul(&k.t()?)? * (1.0 / (c.head_dim as f64).sqrt()))?;
        let scores = match mask {
            Some(mask) => scores.broadcast_add(mask)?,
            None => scores,
        };
        let probabilities = candle_nn::ops::softmax(&scores, D::Minus1)?;
        let out = probabilities
            .matmul(&v)?
            .reshape((batch, c.num_heads, seq, c.head_dim))?
            .transpose(1, 2)?
            .reshape((batch, seq, c.num_heads * c.head_dim))?;
        linear(&out, &layer.o_proj)
    }

    /// Rotary embedding (the "rotate half" convention of Hugging Face Qwen3) for heads
    /// `(batch, heads, seq, head_dim)` at positions `start..start + seq`.
    fn rope(&self, x: &Tensor, start: usize) -> candle_core::Result<Tensor> {
        let seq = x.dim(2)?;
        let half = self.config.head_dim / 2;
        let cos = self.cos.narrow(0, start, seq)?;
        let sin = self.sin.narrow(0, start, seq)?;
        let x1 = x.narrow(D::Minus1, 0, half)?;
        let x2 = x.narrow(D::Minus1, half, half)?;
        let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
        x.broadcast_mul(&cos)?.add(&rotated.broadcast_mul(&sin)?)
    }

    /// Additive mask `(group * seq, start + seq)`: query i of each stacked head sees keys
    /// up to position start + i.
    fn causal_mask(
        &self,
        start: usize,
        seq: usize,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        let group = self.config.num_heads / self.config.num_kv_heads;
        let keys = start + seq;
        let values: Vec<f32> = (0..group * seq)
            .flat_map(|row| {
                let visible = start + row % seq;
                (0..keys).map(move |key| {
                    if key <= visible {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                })
            })
            .collect();
        Tensor::from_vec(values, (group * seq, keys), device)
    }
}

/// `x @ w^T` over the last axis, as one matrix product whatever the leading axes.
fn linear(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    let mut dims = x.dims().to_vec();
    let inner = dims.pop().unwrap_or(1);
    let rows: usize = dims.iter().product();
    let out = x.reshape((rows, inner))?.matmul(&w.t()?)?;
    dims.push(w.dim(0)?);
    out.reshape(dims)
}

fn rms_norm(x: &Tensor, weight: &Tensor, eps: f32) -> candle_core::Result<Tensor> {
    let mean_square = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(mean_square + eps as f64)?.sqrt()?)?
        .broadcast_mul(weight)
}

fn rope_tables(config: &ModelConfig) -> candle_core::Result<(Tensor, Tensor)> {
    let half = config.head_dim / 2;
    let mut cos = Vec::with_capacity(config.max_seq_len * config.head_dim);
    let mut sin = Vec::with_capacity(config.max_seq_len * config.head_dim);
    for position in 0..config.max_seq_len {
        for i in 0..config.head_dim {
            let exponent = (2 * (i % half)) as f64 / config.head_dim as f64;
            let angle = position as f64 / (config.rope_theta as f64).powf(exponent);
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    let shape = (config.max_seq_len, config.head_dim);
    Ok((
        Tensor::from_vec(cos, shape, &Device::Cpu)?,
        Tensor::from_vec(sin, shape, &Device::Cpu)?,
    ))
}

/// Fresh weights in the order of `config.tensors()`: norms at one, matrices normal with
/// standard deviation [`INIT_STD`] (output projections scaled down), drawn from the
/// counter-based generator so every process and thread count gets the same values.
pub(crate) fn initial_weights(config: &ModelConfig, seed: u64) -> Result<Vec<Vec<f32>>> {
    config.validate()?;
    let residual_scale = 1.0 / (2.0 * config.num_layers as f64).sqrt();
    Ok(config
        .tensors()
        .iter()
        .enumerate()
        .map(|(index, spec)| {
            if spec.is_norm() {
                return vec![1.0; spec.elements()];
            }
            let std = if spec.name.ends_with("o_proj.weight")
                || spec.name.ends_with("down_proj.weight")
            {
                INIT_STD * residual_scale
            } else {
                INIT_STD
            };
            (0..spec.elements() as u64)
                .map(|element| (rng::normal(&[seed, index as u64, element]) * std) as f32)
                .collect()
        })
        .collect())
}

/// Tensors for `values` in the order of `config.tensors()`.
pub(crate) fn tensors_from_values(
    config: &ModelConfig,
    values: Vec<Vec<f32>>,
) -> Result<Vec<Tensor>> {
    config
        .tensors()
        .iter()
        .zip(values)
        .map(|(spec, data)| {
            Tensor::from_vec(data, spec.shape.as_slice(), &Device::Cpu).map_err(|e| {
                EngineError::Tensor {
                    name: spec.name.clone(),
                    reason: e.to_string(),
                }
            })
        })
        .collect()
}

/// Log-probabilities `(batch, seq)` of `targets` under `logits` `(batch, seq, vocab)`.
pub(crate) fn token_log_probs(logits: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
    let log_probs = candle_nn::ops::log_softmax(logits, D::Minus1)?;
    log_probs
        .gather(&targets.unsqueeze(D::Minus1)?, D::Minus1)?
        .squeeze(D::Minus1)
}

pub(crate) fn f32_values(tensor: &Tensor) -> candle_core::Result<Vec<f32>> {
    tensor.flatten_all()?.to_dtype(DType::F32)?.to_vec1()
}
