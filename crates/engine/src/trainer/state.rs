//! The whole trainer as safetensors bytes (master weights, AdamW moments, counters and
//! settings in a JSON header), to cache a base policy or resume a run.

use safetensors::tensor::{Dtype as StDtype, TensorView};
use serde::{Deserialize, Serialize};

use super::{OptimizerConfig, Trainer};
use crate::config::ModelConfig;
use crate::error::{ComputeContext, EngineError, Result};
use crate::model;
use crate::weights;

/// Largest trainer state accepted by [`Trainer::load_state`]: three F32 copies of the
/// largest model allowed, plus room for the header.
pub const MAX_STATE_BYTES: u64 = 3 * 4 * crate::config::MAX_PARAMETERS + (1 << 20);
const STATE_FORMAT: &str = "aurora-engine-trainer";
const STATE_VERSION: u32 = 1;

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct StateHeader {
    format: String,
    version: u32,
    model: ModelConfig,
    optimizer: OptimizerConfig,
    adam_steps: u64,
    warmup_steps: u64,
    rl_steps: u64,
}

impl Trainer {
    /// The whole trainer (master weights, AdamW moments, counters and settings) as
    /// safetensors bytes, to cache a base policy or resume a run.
    pub fn save_state(&self) -> Result<Vec<u8>> {
        let header = StateHeader {
            format: STATE_FORMAT.into(),
            version: STATE_VERSION,
            model: self.config,
            optimizer: self.optimizer,
            adam_steps: self.adam_steps,
            warmup_steps: self.warmup_steps,
            rl_steps: self.rl_steps,
        };
        let header =
            serde_json::to_string(&header).map_err(|e| EngineError::State(e.to_string()))?;
        let specs = self.config.tensors();
        let mut named = Vec::with_capacity(3 * specs.len());
        for (spec, param) in specs.iter().zip(&self.params) {
            for (prefix, tensor) in [
                ("master.", param.var.as_tensor()),
                ("adam_m.", &param.first_moment),
                ("adam_v.", &param.second_moment),
            ] {
                let bytes: Vec<u8> = model::f32_values(tensor)
                    .context("trainer state")?
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect();
                named.push((format!("{prefix}{}", spec.name), spec.shape.clone(), bytes));
            }
        }
        let views = named
            .iter()
            .map(|(name, shape, bytes)| {
                TensorView::new(StDtype::F32, shape.clone(), bytes)
                    .map(|view| (name.as_str(), view))
                    .map_err(|e| EngineError::State(format!("tensor '{name}': {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        let metadata = [(STATE_FORMAT.to_string(), header)].into_iter().collect();
        safetensors::serialize(views, Some(metadata)).map_err(|e| EngineError::State(e.to_string()))
    }

    /// A trainer from [`Trainer::save_state`] bytes; every tensor, the format version
    /// and the configuration are checked.
    pub fn load_state(bytes: &[u8]) -> Result<Self> {
        check_state_len(bytes.len() as u64)?;
        let file = weights::read(bytes).map_err(|e| EngineError::State(e.to_string()))?;
        let (_, metadata) = safetensors::SafeTensors::read_metadata(bytes)
            .map_err(|e| EngineError::State(format!("unreadable header: {e}")))?;
        let header = metadata
            .metadata()
            .as_ref()
            .and_then(|m| m.get(STATE_FORMAT))
            .ok_or_else(|| {
                EngineError::State(format!("no '{STATE_FORMAT}' metadata: not a trainer state"))
            })?;
        let header: StateHeader = serde_json::from_str(header)
            .map_err(|e| EngineError::State(format!("bad header: {e}")))?;
        if header.format != STATE_FORMAT || header.version != STATE_VERSION {
            return Err(EngineError::State(format!(
                "format '{}' version {}, expected '{STATE_FORMAT}' version {STATE_VERSION}",
                header.format, header.version
            )));
        }
        header.model.validate()?;
        header.optimizer.validate()?;
        let config = header.model;
        let names = file.names();
        let mut sections = Vec::with_capacity(3);
        for prefix in ["master.", "adam_m.", "adam_v."] {
            weights::check_names(&config, &names, prefix)
                .map_err(|e| EngineError::State(e.to_string()))?;
            let values = config
                .tensors()
                .iter()
                .map(|spec| {
                    let view = weights::tensor(&file, &spec.name, prefix)?;
                    weights::check_view(
                        &format!("{prefix}{}", spec.name),
                        &view,
                        StDtype::F32,
                        &spec.shape,
                    )?;
                    Ok(view
                        .data()
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .collect())
                })
                .collect::<Result<Vec<Vec<f32>>>>()?;
            sections.push(values);
        }
        if names.len() != 3 * config.tensors().len() {
            return Err(EngineError::State(format!(
                "{} tensors, expected {}",
                names.len(),
                3 * config.tensors().len()
            )));
        }
        let second = sections.pop().unwrap_or_default();
        let first = sections.pop().unwrap_or_default();
        let master = sections.pop().unwrap_or_default();
        let mut trainer =
            Self::from_parts(&config, header.optimizer, master, Some((first, second)))?;
        trainer.adam_steps = header.adam_steps;
        trainer.warmup_steps = header.warmup_steps;
        trainer.rl_steps = header.rl_steps;
        Ok(trainer)
    }
}

pub(super) fn check_state_len(len: u64) -> Result<()> {
    if len > MAX_STATE_BYTES {
        return Err(EngineError::State(format!(
            "{len} bytes exceed the {MAX_STATE_BYTES}-byte limit"
        )));
    }
    Ok(())
}
