//! Realistic synthetic checkpoint sequences for tests and benchmarks.
//!
//! A [`Synth`] holds FP32 master weights of a Qwen3-architecture model (Hugging Face
//! tensor names) and advances them with Adam-style updates, exporting BF16 after every
//! step, the way an RL trainer does. What matters for delta coding is reproduced:
//! - weight magnitudes follow a real model's spread (Qwen3-8B per the AuroraRL paper:
//!   |W| in (1e-3,1e-2] 28%, (1e-2,1e-1] 67%, (1e-4,1e-3] 4%, (0,1e-4] 0.7%), from a
//!   Gaussian of standard deviation 0.025 (scaled per tensor) plus a 1% near-zero
//!   component;
//! - one-step updates are Adam-normalised: each element has a persistent gradient bias
//!   (so its master weight drifts like under momentum) plus per-step noise, giving
//!   |dW| mostly between 0.1 and 1 times the learning rate; some elements get no
//!   gradient at all (half of the embedding rows, as for tokens absent from a batch, and
//!   a few percent elsewhere), so about 15% of one-step updates are exactly zero;
//! - the BF16 export rounds to nearest even, so at lr 1e-6 about 1% of elements change.
//!
//! Random numbers come from a counter-based hash (splitmix64) keyed by seed, tensor,
//! element and step, not from a seeded stream: the output is identical for any thread
//! count and stays bit-stable across dependency upgrades, which the tests rely on.

mod files;

use rayon::prelude::*;

pub use files::write_checkpoints;

use aurora_checkpoint::safetensors_bytes;
use aurora_delta::{
    Dtype, Encoding, ExtractOptions, Extraction, Hash, OwnedTensor, owned_checkpoint,
};

/// Architecture sizes of a Qwen3-style decoder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelShape {
    pub hidden: u64,
    pub layers: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub intermediate: u64,
    pub vocab: u64,
    pub tied_embeddings: bool,
}

/// Named shapes: two small ones for tests and the Qwen3 release sizes.
pub const PRESETS: [(&str, ModelShape); 7] = [
    ("tiny", shape(64, 2, 4, 2, 16, 192, 512, true)),
    ("small", shape(256, 4, 4, 2, 64, 768, 4096, true)),
    ("medium", shape(512, 8, 8, 4, 64, 1536, 16384, true)),
    ("0.6b", shape(1024, 28, 16, 8, 128, 3072, 151_936, true)),
    ("1.7b", shape(2048, 28, 16, 8, 128, 6144, 151_936, true)),
    ("4b", shape(2560, 36, 32, 8, 128, 9728, 151_936, true)),
    ("8b", shape(4096, 36, 32, 8, 128, 12_288, 151_936, false)),
];

#[allow(clippy::too_many_arguments)]
const fn shape(
    hidden: u64,
    layers: u64,
    heads: u64,
    kv_heads: u64,
    head_dim: u64,
    intermediate: u64,
    vocab: u64,
    tied_embeddings: bool,
) -> ModelShape {
    ModelShape {
        hidden,
        layers,
        heads,
        kv_heads,
        head_dim,
        intermediate,
        vocab,
        tied_embeddings,
    }
}

pub fn preset(name: &str) -> Option<ModelShape> {
    PRESETS
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, s)| *s)
}

/// A tensor of the model: name, shape, and whether it is a norm gain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<u64>,
    pub is_norm: bool,
}

impl ModelShape {
    /// Every tensor with its Hugging Face name, in name order.
    pub fn tensors(&self) -> Vec<TensorSpec> {
        let h = self.hidden;
        let q = self.heads * self.head_dim;
        let kv = self.kv_heads * self.head_dim;
        let mut out = Vec::new();
        let mut push = |name: String, shape: Vec<u64>, is_norm: bool| {
            out.push(TensorSpec {
                name,
                shape,
                is_norm,
            })
        };
        push(
            "model.embed_tokens.weight".into(),
            vec![self.vocab, h],
            false,
        );
        push("model.norm.weight".into(), vec![h], true);
        if !self.tied_embeddings {
            push("lm_head.weight".into(), vec![self.vocab, h], false);
        }
        for layer in 0..self.layers {
            let p = format!("model.layers.{layer}");
            push(format!("{p}.input_layernorm.weight"), vec![h], true);
            push(
                format!("{p}.post_attention_layernorm.weight"),
                vec![h],
                true,
            );
            push(format!("{p}.self_attn.q_proj.weight"), vec![q, h], false);
            push(format!("{p}.self_attn.k_proj.weight"), vec![kv, h], false);
            push(format!("{p}.self_attn.v_proj.weight"), vec![kv, h], false);
            push(format!("{p}.self_attn.o_proj.weight"), vec![h, q], false);
            push(
                format!("{p}.self_attn.q_norm.weight"),
                vec![self.head_dim],
                true,
            );
            push(
                format!("{p}.self_attn.k_norm.weight"),
                vec![self.head_dim],
                true,
            );
            push(
                format!("{p}.mlp.gate_proj.weight"),
                vec![self.intermediate, h],
                false,
            );
            push(
                format!("{p}.mlp.up_proj.weight"),
                vec![self.intermediate, h],
                false,
            );
            push(
                format!("{p}.mlp.down_proj.weight"),
                vec![h, self.intermediate],
                false,
            );
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    pub fn parameters(&self) -> u64 {
        self.tensors()
            .iter()
            .map(|t| t.shape.iter().product::<u64>())
            .sum()
    }
}

#[derive(Debug, Clone)]
pub struct SynthConfig {
    pub shape: ModelShape,
    pub seed: u64,
    pub learning_rate: f32,
    /// Export norm gains as F32 instead of BF16.
    pub f32_norms: bool,
}

impl SynthConfig {
    pub fn new(shape: ModelShape, seed: u64) -> Self {
        SynthConfig {
            shape,
            seed,
            learning_rate: 1e-6,
            f32_norms: false,
        }
    }
}

struct TensorState {
    spec: TensorSpec,
    key: u64,
    /// Gradient-free rows (embeddings) have this many columns; zero elsewhere.
    row_len: u64,
    master: Vec<f32>,
    momentum: Vec<f32>,
}

/// A model under training; see the crate documentation for the update model.
pub struct Synth {
    config: SynthConfig,
    tensors: Vec<TensorState>,
    step: u64,
}

const BETA1: f32 = 0.9;
/// Standard deviation of the persistent per-element gradient bias, in units of the
/// gradient noise: sets how far Adam's normalised update sits from zero on average.
const DRIFT: f32 = 0.2;
/// Standard deviation of momentum's noise part at steady state: sqrt((1-b1)/(1+b1)).
const MOMENTUM_NOISE: f32 = 0.229;
const EMBEDDING_ROWS_WITHOUT_GRADIENT: f64 = 0.5;
const ELEMENTS_WITHOUT_GRADIENT: f64 = 0.06;
/// Work is split into blocks this large so both cores share every large tensor.
const BLOCK: usize = 1 << 16;

impl TensorState {
    /// Tensor `index` of `config`'s model at `version`: version 0 stepped `version`
    /// times.
    fn at(config: &SynthConfig, index: usize, spec: &TensorSpec, version: u64) -> TensorState {
        let mut state = TensorState::new(config.seed, index, spec.clone());
        for step in 1..=version {
            state.step(step, config.learning_rate);
        }
        state
    }

    /// Tensor `index` of the model at version 0: its master weights, and momentum at
    /// its steady state.
    fn new(seed: u64, index: usize, spec: TensorSpec) -> TensorState {
        let key = mix(seed ^ mix(index as u64 + 1));
        let len = spec.shape.iter().product::<u64>() as usize;
        let row_len = if spec.name.contains("embed_tokens") || spec.name.contains("lm_head") {
            spec.shape[1]
        } else {
            0
        };
        // Layers differ in scale; output projections are smaller, as in trained models.
        let scale: f32 = 0.025
            * (0.7 + 0.7 * unit(mix(key ^ 0x5CA1E)) as f32)
            * if spec.name.contains("o_proj") || spec.name.contains("down_proj") {
                0.6
            } else {
                1.0
            };
        let mut master = vec![0f32; len];
        master
            .par_chunks_mut(BLOCK)
            .enumerate()
            .for_each(|(block, values)| {
                for (i, value) in values.iter_mut().enumerate() {
                    let h = mix(key ^ mix((block * BLOCK + i) as u64));
                    *value = if spec.is_norm {
                        1.0 + 0.05 * gaussian(h)
                    } else if h.is_multiple_of(100) {
                        3e-4 * gaussian(mix(h))
                    } else {
                        scale * gaussian(mix(h))
                    };
                }
            });
        // The optimizer starts warm, as in the middle of a run: momentum at its
        // steady state, so every step has the same statistics.
        let mut momentum = vec![0f32; len];
        momentum
            .par_chunks_mut(BLOCK)
            .enumerate()
            .for_each(|(block, values)| {
                for (i, value) in values.iter_mut().enumerate() {
                    let element = mix(key ^ mix((block * BLOCK + i) as u64));
                    *value =
                        DRIFT * gaussian(element) + MOMENTUM_NOISE * gaussian(mix(element ^ 0x3A4));
                }
            });
        TensorState {
            momentum,
            spec,
            key,
            row_len,
            master,
        }
    }

    /// Optimizer step number `step` at learning rate `lr`.
    fn step(&mut self, step: u64, lr: f32) {
        let key = self.key;
        let row_len = self.row_len;
        self.master
            .par_chunks_mut(BLOCK)
            .zip(self.momentum.par_chunks_mut(BLOCK))
            .enumerate()
            .for_each(|(block, (master, momentum))| {
                for i in 0..master.len() {
                    let index = (block * BLOCK + i) as u64;
                    let element = mix(key ^ mix(index));
                    if !has_gradient(key, index, row_len, element) {
                        continue;
                    }
                    let drift = DRIFT * gaussian(element);
                    let noise = gaussian(mix(element ^ mix(step)));
                    momentum[i] = BETA1 * momentum[i] + (1.0 - BETA1) * (drift + noise);
                    // Adam's second moment of this gradient is 1 + drift^2.
                    let update = momentum[i] / (1.0 + drift * drift).sqrt();
                    master[i] -= lr * update;
                }
            });
    }

    /// The dtype the trainer exports this tensor in.
    fn export_dtype(spec: &TensorSpec, f32_norms: bool) -> Dtype {
        if spec.is_norm && f32_norms {
            Dtype::F32
        } else {
            Dtype::Bf16
        }
    }

    /// The current weights as the trainer exports them, written into `out` (of the
    /// export's size).
    fn export_into(&self, f32_norms: bool, out: &mut [u8]) {
        if Self::export_dtype(&self.spec, f32_norms) == Dtype::F32 {
            for (out, value) in out.chunks_exact_mut(4).zip(&self.master) {
                out.copy_from_slice(&value.to_le_bytes());
            }
        } else {
            out.par_chunks_mut(2 * BLOCK)
                .zip(self.master.par_chunks(BLOCK))
                .for_each(|(out, values)| {
                    for (o, v) in out.chunks_exact_mut(2).zip(values) {
                        o.copy_from_slice(&half::bf16::from_f32(*v).to_le_bytes());
                    }
                });
        }
    }

    fn export(&self, f32_norms: bool) -> OwnedTensor {
        let dtype = Self::export_dtype(&self.spec, f32_norms);
        let mut data = vec![0u8; self.master.len() * dtype.size_bytes()];
        self.export_into(f32_norms, &mut data);
        OwnedTensor {
            name: self.spec.name.clone(),
            dtype,
            shape: self.spec.shape.clone(),
            data,
        }
    }
}

impl Synth {
    /// Initial weights (version 0).
    pub fn new(config: SynthConfig) -> Synth {
        let tensors = config
            .shape
            .tensors()
            .into_iter()
            .enumerate()
            .map(|(index, spec)| TensorState::new(config.seed, index, spec))
            .collect();
        Synth {
            config,
            tensors,
            step: 0,
        }
    }

    pub fn version(&self) -> u64 {
        self.step
    }

    /// One optimizer step.
    pub fn step(&mut self) {
        self.step += 1;
        for tensor in &mut self.tensors {
            tensor.step(self.step, self.config.learning_rate);
        }
    }

    /// The current weights as exported by the trainer: BF16, norms optionally F32.
    pub fn export(&self) -> Vec<OwnedTensor> {
        self.tensors
            .iter()
            .map(|tensor| tensor.export(self.config.f32_norms))
            .collect()
    }
}

fn has_gradient(key: u64, index: u64, row_len: u64, element: u64) -> bool {
    // Rows of an embedding (row_len > 0) share their fate; other tensors go by element.
    match index.checked_div(row_len) {
        Some(row) => unit(mix(key ^ 0xE0B ^ mix(row))) >= EMBEDDING_ROWS_WITHOUT_GRADIENT,
        None => unit(mix(element ^ 0x6AD)) >= ELEMENTS_WITHOUT_GRADIENT,
    }
}

/// splitmix64's finaliser: a strong 64-bit mix, used as a counter-based generator.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn unit(h: u64) -> f64 {
    (h >> 11) as f64 / (1u64 << 53) as f64
}

/// A standard normal sample from one hash (Box-Muller on its two halves).
fn gaussian(h: u64) -> f32 {
    let u1 = ((h >> 32) as f32 + 1.0) / 4_294_967_296.0;
    let u2 = (h & 0xFFFF_FFFF) as f32 / 4_294_967_296.0;
    (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
}

/// Checkpoints 0..=n of a synthetic model, as safetensors images with their weights
/// hashes, and the `aurora` deltas between consecutive ones: the published history the
/// protocol's and the transport's tests replay.
pub struct DeltaChain {
    pub images: Vec<Vec<u8>>,
    pub hashes: Vec<Hash>,
    /// `deltas[v - 1]` turns version v-1 into v.
    pub deltas: Vec<Vec<u8>>,
}

impl DeltaChain {
    /// `versions` steps of `config`, each delta cut into segments of about
    /// `segment_target_bytes`.
    pub fn new(config: SynthConfig, versions: u64, segment_target_bytes: usize) -> DeltaChain {
        let mut synth = Synth::new(config);
        let mut exports = vec![synth.export()];
        for _ in 0..versions {
            synth.step();
            exports.push(synth.export());
        }
        let checkpoint = |tensors| owned_checkpoint(tensors).expect("a synthetic checkpoint");
        let deltas = exports
            .windows(2)
            .zip(1u64..)
            .map(|(pair, version)| {
                let options = ExtractOptions {
                    encoding: Encoding::Aurora,
                    base_version: version - 1,
                    target_version: version,
                    segment_target_bytes,
                    ..ExtractOptions::default()
                };
                let (_, bytes) =
                    Extraction::new(&checkpoint(&pair[0]), &checkpoint(&pair[1]), options)
                        .and_then(|extraction| extraction.to_bytes())
                        .expect("extracting a synthetic delta");
                bytes
            })
            .collect();
        DeltaChain {
            images: exports
                .iter()
                .map(|tensors| safetensors_bytes(tensors).expect("a synthetic checkpoint"))
                .collect(),
            hashes: exports
                .iter()
                .map(|tensors| checkpoint(tensors).weights_hash())
                .collect(),
            deltas,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aurora_delta::{count_changed, owned_checkpoint};

    #[test]
    fn qwen3_shapes_have_the_published_parameter_counts() {
        let billions = |name: &str| preset(name).unwrap().parameters() as f64 / 1e9;
        assert!(
            (billions("0.6b") - 0.596).abs() < 0.01,
            "{}",
            billions("0.6b")
        );
        assert!(
            (billions("1.7b") - 1.72).abs() < 0.03,
            "{}",
            billions("1.7b")
        );
        assert!((billions("4b") - 4.02).abs() < 0.05, "{}", billions("4b"));
        assert!((billions("8b") - 8.19).abs() < 0.05, "{}", billions("8b"));
    }

    #[test]
    fn deterministic_by_seed() {
        let run = |seed| {
            let mut synth = Synth::new(SynthConfig::new(preset("tiny").unwrap(), seed));
            synth.step();
            synth.export()
        };
        assert_eq!(run(1), run(1));
        assert_ne!(run(1), run(2));
    }

    #[test]
    fn one_step_updates_look_like_adam_at_the_learning_rate() {
        let mut config = SynthConfig::new(preset("small").unwrap(), 4);
        config.learning_rate = 1e-6;
        let mut synth = Synth::new(config);
        // Past the momentum's warm-up.
        for _ in 0..4 {
            synth.step();
        }
        let masters = |synth: &Synth| -> Vec<f32> {
            synth
                .tensors
                .iter()
                .flat_map(|t| t.master.clone())
                .collect()
        };
        let before = masters(&synth);
        synth.step();
        let updates: Vec<f64> = before
            .iter()
            .zip(masters(&synth))
            .map(|(b, a)| f64::from((a - b).abs()))
            .collect();
        let share = |keep: &dyn Fn(f64) -> bool| {
            updates.iter().filter(|u| keep(**u)).count() as f64 / updates.len() as f64
        };
        let zero = share(&|u| u == 0.0);
        assert!((0.10..0.20).contains(&zero), "exactly zero: {zero}");
        let in_band = share(&|u| (1e-7..=1e-6).contains(&u)) / (1.0 - zero);
        assert!(in_band > 0.6, "of the nonzero, in 1e-7..1e-6: {in_band}");
        let above = share(&|u| u > 4e-6);
        assert!(above < 0.01, "above 4e-6: {above}");
    }

    #[test]
    fn magnitudes_and_density_look_like_rl_training() {
        let mut synth = Synth::new(SynthConfig::new(preset("small").unwrap(), 3));
        let before = synth.export();
        synth.step();
        synth.step();
        let base = synth.export();
        synth.step();
        let after = synth.export();
        let weights: Vec<f32> = base
            .iter()
            .filter(|t| !t.name.contains("norm"))
            .flat_map(|t| {
                t.data
                    .chunks_exact(2)
                    .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32().abs())
            })
            .collect();
        let share = |lo: f32, hi: f32| {
            weights.iter().filter(|w| **w > lo && **w <= hi).count() as f64 / weights.len() as f64
        };
        assert!(
            (0.60..0.75).contains(&share(1e-2, 1e-1)),
            "{}",
            share(1e-2, 1e-1)
        );
        assert!(
            (0.22..0.34).contains(&share(1e-3, 1e-2)),
            "{}",
            share(1e-3, 1e-2)
        );
        assert!(
            (0.02..0.06).contains(&share(1e-4, 1e-3)),
            "{}",
            share(1e-4, 1e-3)
        );
        assert!(
            (0.002..0.012).contains(&share(0.0, 1e-4)),
            "{}",
            share(0.0, 1e-4)
        );

        let changed: u64 = base
            .iter()
            .zip(&after)
            .map(|(a, b)| count_changed(&a.data, &b.data, 2))
            .sum();
        let elements: u64 = base.iter().map(|t| t.data.len() as u64 / 2).sum();
        let density = changed as f64 / elements as f64;
        assert!((0.008..0.015).contains(&density), "density {density}");
        assert_ne!(
            owned_checkpoint(&before).unwrap().weights_hash(),
            owned_checkpoint(&base).unwrap().weights_hash()
        );
    }
}
