//! Weights as safetensors bytes: the BF16 export that versions (and deltas) are made of,
//! and its strict reader.

use half::bf16;
use safetensors::tensor::{Dtype as StDtype, SafeTensors, TensorView};

use crate::config::ModelConfig;
use crate::error::{EngineError, Result};

/// BF16 safetensors bytes of `values` (in the order of `config.tensors()`), each value
/// rounded to nearest even. No metadata: the bytes depend on the weights alone.
pub(crate) fn export_bf16(config: &ModelConfig, values: &[Vec<f32>]) -> Result<Vec<u8>> {
    let specs = config.tensors();
    let encoded: Vec<Vec<u8>> = values
        .iter()
        .map(|tensor| {
            tensor
                .iter()
                .flat_map(|&v| bf16::from_f32(v).to_bits().to_le_bytes())
                .collect()
        })
        .collect();
    let views = specs
        .iter()
        .zip(&encoded)
        .map(|(spec, bytes)| {
            TensorView::new(StDtype::BF16, spec.shape.clone(), bytes)
                .map(|view| (spec.name.as_str(), view))
                .map_err(|e| EngineError::Tensor {
                    name: spec.name.clone(),
                    reason: e.to_string(),
                })
        })
        .collect::<Result<Vec<_>>>()?;
    safetensors::serialize(views, None).map_err(|e| EngineError::Weights(e.to_string()))
}

/// The F32 values of BF16 safetensors `bytes` in the order of `config.tensors()`;
/// refuses a missing, unexpected, mistyped or misshapen tensor by name.
pub(crate) fn import_bf16(config: &ModelConfig, bytes: &[u8]) -> Result<Vec<Vec<f32>>> {
    let file = read(bytes)?;
    check_names(config, &file.names(), "")?;
    config
        .tensors()
        .iter()
        .map(|spec| {
            let view = tensor(&file, &spec.name, "")?;
            check_view(&spec.name, &view, StDtype::BF16, &spec.shape)?;
            Ok(view
                .data()
                .chunks_exact(2)
                .map(|b| bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
                .collect())
        })
        .collect()
}

pub(crate) fn read(bytes: &[u8]) -> Result<SafeTensors<'_>> {
    SafeTensors::deserialize(bytes)
        .map_err(|e| EngineError::Weights(format!("not a valid safetensors file: {e}")))
}

/// Checks that the file holds exactly the model's tensors under `prefix`.
pub(crate) fn check_names(config: &ModelConfig, names: &[&str], prefix: &str) -> Result<()> {
    let expected: Vec<String> = config
        .tensors()
        .into_iter()
        .map(|spec| format!("{prefix}{}", spec.name))
        .collect();
    if let Some(unexpected) = names
        .iter()
        .filter(|name| name.starts_with(prefix))
        .find(|name| !expected.iter().any(|e| e == *name))
    {
        return Err(EngineError::Weights(format!(
            "unexpected tensor '{unexpected}' for this model configuration"
        )));
    }
    match expected.iter().find(|e| !names.contains(&e.as_str())) {
        Some(missing) => Err(EngineError::Weights(format!("missing tensor '{missing}'"))),
        None => Ok(()),
    }
}

pub(crate) fn tensor<'a>(
    file: &SafeTensors<'a>,
    name: &str,
    prefix: &str,
) -> Result<TensorView<'a>> {
    let full = format!("{prefix}{name}");
    file.tensor(&full).map_err(|e| EngineError::Tensor {
        name: full,
        reason: e.to_string(),
    })
}

pub(crate) fn check_view(
    name: &str,
    view: &TensorView<'_>,
    dtype: StDtype,
    shape: &[usize],
) -> Result<()> {
    if view.dtype() != dtype {
        return Err(EngineError::Tensor {
            name: name.to_string(),
            reason: format!("dtype {:?}, expected {dtype:?}", view.dtype()),
        });
    }
    if view.shape() != shape {
        return Err(EngineError::Tensor {
            name: name.to_string(),
            reason: format!("shape {:?}, expected {shape:?}", view.shape()),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::initial_weights;

    #[test]
    fn export_rounds_to_nearest_even() {
        let config = ModelConfig::tiny();
        let mut values = initial_weights(&config, 1).unwrap();
        let step = 2f32.powi(-8);
        // halfway cases go to the even mantissa, others to the nearest.
        values[0][..4].copy_from_slice(&[
            1.0 + step,
            1.0 + 3.0 * step,
            1.0 + 1.5 * step,
            -(1.0 + step),
        ]);
        let bytes = export_bf16(&config, &values).unwrap();
        let back = import_bf16(&config, &bytes).unwrap();
        assert_eq!(
            &back[0][..4],
            &[1.0, 1.0 + 4.0 * step, 1.0 + 2.0 * step, -1.0]
        );
    }

    #[test]
    fn export_reloads_exactly_and_is_a_pure_function_of_the_values() {
        let config = ModelConfig::tiny();
        let values = initial_weights(&config, 2).unwrap();
        let bytes = export_bf16(&config, &values).unwrap();
        assert_eq!(bytes, export_bf16(&config, &values).unwrap());
        let back = import_bf16(&config, &bytes).unwrap();
        assert_eq!(export_bf16(&config, &back).unwrap(), bytes);
        let file = read(&bytes).unwrap();
        for spec in config.tensors() {
            let view = file.tensor(&spec.name).unwrap();
            assert_eq!(view.dtype(), StDtype::BF16);
            assert_eq!(view.shape(), spec.shape.as_slice());
        }
        assert_eq!(file.names().len(), config.tensors().len());
    }

    #[test]
    fn import_refuses_files_that_do_not_match_the_model() {
        let config = ModelConfig::tiny();
        let values = initial_weights(&config, 3).unwrap();
        let bytes = export_bf16(&config, &values).unwrap();
        let check = |bytes: &[u8], config: &ModelConfig, expected: &str| {
            let message = import_bf16(config, bytes).unwrap_err().to_string();
            assert!(message.contains(expected), "{message}");
        };
        check(
            &bytes[..bytes.len() - 1],
            &config,
            "not a valid safetensors",
        );
        check(b"", &config, "not a valid safetensors");
        let untied = ModelConfig {
            tie_embeddings: false,
            ..config
        };
        check(&bytes, &untied, "missing tensor 'lm_head.weight'");
        let shallower = ModelConfig {
            num_layers: 1,
            ..config
        };
        check(&bytes, &shallower, "unexpected tensor 'model.layers.1.");
        let wider = ModelConfig {
            intermediate_size: 65,
            ..config
        };
        check(&bytes, &wider, "shape [32, 64], expected [32, 65]");

        let specs = config.tensors();
        let f32_bytes: Vec<Vec<u8>> = values
            .iter()
            .map(|t| t.iter().flat_map(|v| v.to_le_bytes()).collect())
            .collect();
        let views: Vec<_> = specs
            .iter()
            .zip(&f32_bytes)
            .map(|(s, b)| {
                (
                    s.name.as_str(),
                    TensorView::new(StDtype::F32, s.shape.clone(), b).unwrap(),
                )
            })
            .collect();
        let as_f32 = safetensors::serialize(views, None).unwrap();
        check(&as_f32, &config, "dtype F32, expected BF16");
    }
}
