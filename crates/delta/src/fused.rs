//! Fused parameter layouts of inference engines (docs/delta-format.md §9).
//!
//! Engines such as vLLM store `q_proj`, `k_proj` and `v_proj` as one `qkv_proj`, and
//! `gate_proj` and `up_proj` as one `gate_up_proj`, concatenated along the output
//! dimension (dimension 0 of the row-major `[out, in]` weight) in that order. Deltas are
//! extracted from Hugging Face names; this module maps each such name to its byte range
//! inside the fused tensor, so a delta applies directly to fused weights and its weights
//! hashes are checked in Hugging Face terms.

use std::collections::HashMap;

use crate::apply::OwnedTensor;
use crate::checkpoint::{Checkpoint, TensorLayout, checked_byte_len};
use crate::error::{DeltaError, Result};
use crate::format::TensorSpec;

/// Fused groups: (parts in concatenation order, fused projection name).
const GROUPS: [(&[&str], &str); 2] = [
    (&["q_proj", "k_proj", "v_proj"], "qkv_proj"),
    (&["gate_proj", "up_proj"], "gate_up_proj"),
];

/// For a Hugging Face name that an engine fuses: the fused name, the part's index in
/// the concatenation, and the names of all parts in order.
pub fn fused_name(name: &str) -> Option<(String, usize, Vec<String>)> {
    let (head, suffix) = name.rsplit_once('.')?;
    let (prefix, projection) = head.rsplit_once('.')?;
    GROUPS.iter().find_map(|(parts, fused)| {
        let index = parts.iter().position(|p| *p == projection)?;
        let all = parts
            .iter()
            .map(|p| format!("{prefix}.{p}.{suffix}"))
            .collect();
        Some((format!("{prefix}.{fused}.{suffix}"), index, all))
    })
}

/// For the name of an engine's fused parameter (`...qkv_proj.weight`): the Hugging Face
/// names of its parts, in concatenation order.
pub fn unfused_names(name: &str) -> Option<Vec<String>> {
    let (head, suffix) = name.rsplit_once('.')?;
    let (prefix, projection) = head.rsplit_once('.')?;
    let (parts, _) = GROUPS.iter().find(|(_, fused)| *fused == projection)?;
    Some(
        parts
            .iter()
            .map(|p| format!("{prefix}.{p}.{suffix}"))
            .collect(),
    )
}

/// Places the Hugging Face tensors `hf` inside a buffer laid out as `fused` (for example
/// the safetensors image of a fused checkpoint): the returned layouts let
/// [`crate::Patch::apply_in_place`] and [`Checkpoint::from_layout`] work on the fused buffer
/// by Hugging Face names.
pub fn hf_layout_in_fused(
    fused: &[TensorLayout],
    hf: &[(String, TensorSpec)],
) -> Result<Vec<TensorLayout>> {
    let fused_by_name: HashMap<&str, &TensorLayout> =
        fused.iter().map(|l| (l.name.as_str(), l)).collect();
    let hf_by_name: HashMap<&str, &TensorSpec> = hf
        .iter()
        .map(|(name, spec)| (name.as_str(), spec))
        .collect();
    let mismatch = |reason: String| DeltaError::BaseMismatch(format!("fused layout: {reason}"));
    let mut out = Vec::with_capacity(hf.len());
    for (name, spec) in hf {
        let byte_len = checked_byte_len(spec.dtype, &spec.shape)
            .ok_or_else(|| mismatch(format!("'{name}' has an overflowing shape")))?
            as usize;
        let Some((fused_name, index, parts)) = fused_name(name) else {
            let place = fused_by_name
                .get(name.as_str())
                .ok_or_else(|| mismatch(format!("'{name}' is missing")))?;
            if place.dtype != spec.dtype
                || place.shape != spec.shape
                || place.bytes.len() != byte_len
            {
                return Err(mismatch(format!(
                    "'{name}' has a different dtype, shape or size"
                )));
            }
            out.push((*place).clone());
            continue;
        };
        let place = fused_by_name
            .get(fused_name.as_str())
            .ok_or_else(|| mismatch(format!("'{fused_name}' (for '{name}') is missing")))?;
        let mut offset = 0usize;
        let mut total = 0usize;
        let mut rows = 0u64;
        for (i, part) in parts.iter().enumerate() {
            let part_spec = hf_by_name
                .get(part.as_str())
                .ok_or_else(|| mismatch(format!("'{part}', fused with '{name}', is missing")))?;
            if part_spec.dtype != place.dtype || part_spec.shape.get(1..) != place.shape.get(1..) {
                return Err(mismatch(format!(
                    "'{part}' ({} {:?}) does not fit '{fused_name}' ({} {:?})",
                    part_spec.dtype, part_spec.shape, place.dtype, place.shape
                )));
            }
            let part_bytes = part_spec.byte_len() as usize;
            if i < index {
                offset += part_bytes;
            }
            total += part_bytes;
            rows += part_spec.shape.first().copied().unwrap_or(1);
        }
        if total != place.bytes.len() || place.shape.first().copied().unwrap_or(1) != rows {
            return Err(mismatch(format!(
                "'{fused_name}' has {} bytes, its parts {total}",
                place.bytes.len()
            )));
        }
        let start = place.bytes.start + offset;
        out.push(TensorLayout {
            name: name.clone(),
            dtype: spec.dtype,
            shape: spec.shape.clone(),
            bytes: start..start + byte_len,
        });
    }
    Ok(out)
}

/// Fuses a Hugging Face checkpoint the way an inference engine stores it.
pub fn fuse(checkpoint: &Checkpoint<'_>) -> Result<Vec<OwnedTensor>> {
    let mut out: Vec<OwnedTensor> = Vec::new();
    for tensor in checkpoint.tensors() {
        match fused_name(&tensor.name) {
            None => out.push(OwnedTensor {
                name: tensor.name.clone(),
                dtype: tensor.dtype,
                shape: tensor.shape.clone(),
                data: tensor.data.to_vec(),
            }),
            // Each group is built once, when its first part comes by.
            Some((fused, 0, parts)) => {
                let mut data = Vec::new();
                let mut rows = 0;
                for part in &parts {
                    let view = checkpoint.get(part).ok_or_else(|| {
                        DeltaError::Checkpoint(format!(
                            "'{part}' is missing, cannot build '{fused}'"
                        ))
                    })?;
                    if view.dtype != tensor.dtype || view.shape.get(1..) != tensor.shape.get(1..) {
                        return Err(DeltaError::Checkpoint(format!(
                            "'{part}' cannot be concatenated into '{fused}'"
                        )));
                    }
                    data.extend_from_slice(view.data);
                    rows += view.shape.first().copied().unwrap_or(1);
                }
                let mut shape = tensor.shape.clone();
                if let Some(first) = shape.first_mut() {
                    *first = rows;
                }
                out.push(OwnedTensor {
                    name: fused,
                    dtype: tensor.dtype,
                    shape,
                    data,
                });
            }
            Some(_) => {}
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_fused_parameters() {
        let (fused, index, parts) = fused_name("model.layers.3.self_attn.k_proj.weight").unwrap();
        assert_eq!(fused, "model.layers.3.self_attn.qkv_proj.weight");
        assert_eq!(index, 1);
        assert_eq!(parts[2], "model.layers.3.self_attn.v_proj.weight");
        let (fused, index, _) = fused_name("model.layers.0.mlp.up_proj.weight").unwrap();
        assert_eq!(
            (fused.as_str(), index),
            ("model.layers.0.mlp.gate_up_proj.weight", 1)
        );
        assert!(fused_name("model.layers.0.mlp.down_proj.weight").is_none());
        assert!(fused_name("lm_head.weight").is_none());
        assert!(fused_name("q_proj").is_none());
    }

    #[test]
    fn fused_parameters_map_back_to_their_parts() {
        for part in ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"] {
            let name = format!("model.layers.7.x.{part}.bias");
            let (fused, _, parts) = fused_name(&name).unwrap();
            assert_eq!(unfused_names(&fused), Some(parts));
        }
        assert!(unfused_names("model.layers.0.mlp.down_proj.weight").is_none());
        assert!(unfused_names("qkv_proj").is_none());
    }
}
