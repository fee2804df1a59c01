//! `aurora_rl._core`: the extension module under the `aurora_rl` Python package.
//!
//! It converts and calls; every rule lives in the Rust crates (ARCHITECTURE.md). Tensors
//! arrive as `(name, dtype, shape, bytes)` tuples whose bytes are a flat `uint8` host
//! tensor, borrowed through DLPack (`dlpack.rs`); the framework-specific conversions are
//! in Python (`aurora_rl/_tensors.py`). Every heavy call releases the GIL.

mod dlpack;
mod errors;
mod node;
mod trust;

use aurora_delta::{
    Checkpoint, DeltaFile, Dtype, Encoding, ExtractOptions, Extraction, Hash, ShardPiece,
    ShardTable, TensorSpec, TensorView, check_base, decode,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes};

use dlpack::HostBytes;
use errors::{delta_error, usage_error};

/// Offsets of the tensors `apply` builds are multiples of this, so each can be viewed as
/// its dtype in any framework (and lands on its own cache line).
const TARGET_ALIGN: usize = 64;

/// A tensor as the Python side passes it: name, safetensors dtype name, shape, and its
/// bytes as a flat `uint8` host tensor.
type TensorArg<'py> = (String, String, Vec<u64>, Bound<'py, PyAny>);

/// The borrowed bytes of a mapping's tensors, with their metadata.
struct Tensors<'py> {
    specs: Vec<(String, Dtype, Vec<u64>)>,
    bytes: Vec<HostBytes<'py>>,
}

impl<'py> Tensors<'py> {
    fn borrow(tensors: Vec<TensorArg<'py>>) -> PyResult<Tensors<'py>> {
        let mut specs = Vec::with_capacity(tensors.len());
        let mut bytes = Vec::with_capacity(tensors.len());
        for (name, dtype, shape, data) in tensors {
            let dtype = Dtype::from_name(&dtype).ok_or_else(|| {
                PyValueError::new_err(format!(
                    "tensor '{name}': dtype {dtype} is not one the delta format knows"
                ))
            })?;
            bytes.push(HostBytes::borrow(&data, &format!("tensor '{name}'"))?);
            specs.push((name, dtype, shape));
        }
        Ok(Tensors { specs, bytes })
    }

    /// The checkpoint these tensors make; checks names and sizes.
    fn checkpoint(&self) -> PyResult<Checkpoint<'_>> {
        let views = self
            .specs
            .iter()
            .zip(&self.bytes)
            .map(|((name, dtype, shape), bytes)| TensorView {
                name: name.clone(),
                dtype: *dtype,
                shape: shape.clone(),
                data: bytes.as_slice(),
            })
            .collect();
        Checkpoint::new(views).map_err(delta_error)
    }
}

fn encoding_named(name: &str) -> PyResult<Encoding> {
    match name {
        "aurora" => Ok(Encoding::Aurora),
        "leb128" => Ok(Encoding::Leb128),
        "dense" => Ok(Encoding::Dense),
        other => Err(PyValueError::new_err(format!(
            "unknown encoding {other:?}: aurora, leb128 or dense"
        ))),
    }
}

/// A tensor of a sharded checkpoint's table: name, safetensors dtype name, whole shape.
type SpecArg = (String, String, Vec<u64>);

fn tensor_specs(tensors: Vec<SpecArg>) -> PyResult<Vec<(String, TensorSpec)>> {
    tensors
        .into_iter()
        .map(|(name, dtype, shape)| {
            let dtype = Dtype::from_name(&dtype).ok_or_else(|| {
                PyValueError::new_err(format!(
                    "tensor '{name}': dtype {dtype} is not one the delta format knows"
                ))
            })?;
            Ok((name, TensorSpec { dtype, shape }))
        })
        .collect()
}

/// A rank's part of a delta extracted where the model is sharded (docs/delta-format.md
/// §11): `tensors` is the whole table (every rank gives the same), `pieces` the element
/// ranges this rank holds, each `(name, first element, base bytes, target bytes)` with
/// the bytes as flat `uint8` host tensors.
#[pyfunction]
fn extract_shard<'py>(
    py: Python<'py>,
    tensors: Vec<SpecArg>,
    pieces: Vec<(String, u64, Bound<'py, PyAny>, Bound<'py, PyAny>)>,
    encoding: &str,
) -> PyResult<Bound<'py, PyBytes>> {
    let table =
        ShardTable::new(tensor_specs(tensors)?, encoding_named(encoding)?).map_err(delta_error)?;
    let mut borrowed = Vec::with_capacity(pieces.len());
    for (name, first, base, target) in &pieces {
        let what = format!("the shard of tensor '{name}' from element {first}");
        borrowed.push((
            name,
            *first,
            HostBytes::borrow(base, &what)?,
            HostBytes::borrow(target, &what)?,
        ));
    }
    let shard_pieces: Vec<ShardPiece<'_>> = borrowed
        .iter()
        .map(|(name, first, base, target)| ShardPiece {
            name,
            first: *first,
            base: base.as_slice(),
            target: target.as_slice(),
        })
        .collect();
    let part = py
        .detach(|| table.extract(&shard_pieces))
        .map_err(delta_error)?;
    Ok(PyBytes::new(py, &part))
}

/// The weights hash (§2, in hex) of the target the ranks' parts of a sharded delta
/// compose, checked to cover every tensor of `tensors` once.
#[pyfunction]
fn shards_weights_hash(
    py: Python<'_>,
    tensors: Vec<SpecArg>,
    parts: Vec<Bound<'_, PyBytes>>,
    encoding: &str,
) -> PyResult<String> {
    let table =
        ShardTable::new(tensor_specs(tensors)?, encoding_named(encoding)?).map_err(delta_error)?;
    let parts: Vec<&[u8]> = parts.iter().map(|part| part.as_bytes()).collect();
    py.detach(|| table.assemble(0, Hash::ZERO, &parts))
        .map(|assembly| assembly.target_hash().to_hex())
        .map_err(delta_error)
}

/// The weights hash of docs/delta-format.md §2, in hex.
#[pyfunction]
fn weights_hash(py: Python<'_>, state: Vec<TensorArg<'_>>) -> PyResult<String> {
    let tensors = Tensors::borrow(state)?;
    let checkpoint = tensors.checkpoint()?;
    Ok(py.detach(|| checkpoint.weights_hash()).to_hex())
}

/// The artifact (docs/delta-format.md) that turns `base` into `target`: the bytes
/// `aurora delta diff` writes for the same tensors and options.
#[pyfunction]
#[pyo3(signature = (base, target, encoding, base_version, target_version))]
fn diff<'py>(
    py: Python<'py>,
    base: Vec<TensorArg<'py>>,
    target: Vec<TensorArg<'py>>,
    encoding: &str,
    base_version: u64,
    target_version: Option<u64>,
) -> PyResult<Bound<'py, PyBytes>> {
    let encoding = encoding_named(encoding)?;
    let target_version = match target_version {
        Some(version) => version,
        None => base_version.checked_add(1).ok_or_else(|| {
            PyValueError::new_err("base_version is the last version there is: give target_version")
        })?,
    };
    let (base, target) = (Tensors::borrow(base)?, Tensors::borrow(target)?);
    let (base, target) = (base.checkpoint()?, target.checkpoint()?);
    let options = ExtractOptions {
        encoding,
        base_version,
        target_version,
        ..ExtractOptions::default()
    };
    let bytes = py.detach(|| {
        Extraction::new(&base, &target, options)
            .and_then(|extraction| extraction.to_bytes())
            .map(|(_, bytes)| bytes)
    });
    Ok(PyBytes::new(py, &bytes.map_err(delta_error)?))
}

/// Where `apply_into` will put each target tensor of `delta` in one buffer: the buffer's
/// length and, per tensor, `(name, dtype, shape, start, end)`. Parses and verifies the
/// artifact's manifest, so a damaged delta is refused before anything is allocated.
#[pyfunction]
#[allow(clippy::type_complexity)]
fn target_layout(
    py: Python<'_>,
    delta: &[u8],
) -> PyResult<(usize, Vec<(String, String, Vec<u64>, usize, usize)>)> {
    let (layout, len) = py
        .detach(|| {
            DeltaFile::parse(delta).and_then(|delta| delta.header().target_layout(TARGET_ALIGN))
        })
        .map_err(delta_error)?;
    let tensors = layout
        .into_iter()
        .map(|t| {
            let (start, end) = (t.bytes.start, t.bytes.end);
            (t.name, t.dtype.name().to_string(), t.shape, start, end)
        })
        .collect();
    Ok((len, tensors))
}

/// Checks that `base` is the delta's base, decodes the delta and writes its target into
/// `out`, a buffer of the length `target_layout` gave, at its places. `base` is only read:
/// on any error it is as it was. Returns the target's weights hash.
#[pyfunction]
fn apply_into(
    py: Python<'_>,
    base: Vec<TensorArg<'_>>,
    delta: &[u8],
    out: Bound<'_, PyAny>,
) -> PyResult<String> {
    let base = Tensors::borrow(base)?;
    let base = base.checkpoint()?;
    let mut out = HostBytes::borrow(&out, "the output buffer")?;
    let out = out.as_mut_slice();
    let hash = py
        .detach(|| {
            let delta = DeltaFile::parse(delta)?;
            let (layout, len) = delta.header().target_layout(TARGET_ALIGN)?;
            if out.len() != len {
                return Err(aurora_delta::DeltaError::Checkpoint(format!(
                    "the output buffer has {} bytes, the target needs {len}",
                    out.len()
                )));
            }
            check_base(delta.header(), &base, None)?;
            decode(&delta, &base)?.materialize_into(&base, out, &layout)
        })
        .map_err(delta_error)?;
    Ok(hash.to_hex())
}

/// One write of `swap_elements`: its label, the int64 indices' bytes, the block of the
/// tensor they lie in (`start`, `end`), the shift to the target's elements, the runs the
/// block repeats in (or None), the values' bytes, and a buffer to keep what they replace
/// (or None).
type WriteArg<'py> = (
    String,
    Bound<'py, PyAny>,
    u64,
    u64,
    i64,
    Option<(u64, u64, u64, u64)>,
    Bound<'py, PyAny>,
    Option<Bound<'py, PyAny>>,
);

/// One target of `swap_elements`: its label, memory, element width, packing and writes.
type TargetArg<'py> = (
    String,
    Bound<'py, PyAny>,
    usize,
    Option<(u64, u64, u64, u64)>,
    Vec<WriteArg<'py>>,
);

/// Swaps each write's values with its target's elements (see
/// `aurora_delta::swap_elements`), in one pass shared over the thread pool. `targets`:
/// `(label, memory, element_bytes, packed, writes)`, `memory` an engine's parameter memory as a
/// flat `uint8` view of a host tensor; `packed`, where given, `(rows, columns, block,
/// group)`: the memory holds a matrix in row blocks, `group` columns at a time
/// (`ElementLayout::RowBlocks`), and the shifted indices are row-major; `writes`:
/// `(label, indices, start, end, shift, runs, values, keep)`, the ascending int64 indices
/// of a tensor's elements within `start..end`, each written at its index plus `shift`,
/// or, where `runs` is `(count, source_stride, target_stride, elements)`, the indices of
/// all `elements` of the tensor, of which those in `count` runs like `start..end`, each
/// `source_stride` further in the tensor and `target_stride` further in the target, are
/// written (`aurora_delta::ElementWrite::cut`: a tensor-parallel shard, cut here rather
/// than by the caller); their new values, and where to keep what they replace: `keep`, a buffer as large as `values`
/// (the values are then only read, copied into it here rather than by the caller: a
/// torch copy leaves torch's OpenMP threads spinning on the cores this pass needs), or,
/// if None, `values` themselves. Afterwards that buffer holds what was replaced: the same
/// call again, with it as the values and no `keep`, undoes it. Nothing is written unless
/// every write fits; no two buffers written may share memory.
#[pyfunction]
fn swap_elements(py: Python<'_>, targets: Vec<TargetArg<'_>>) -> PyResult<()> {
    struct Borrowed<'py> {
        label: String,
        memory: HostBytes<'py>,
        element_bytes: usize,
        layout: aurora_delta::ElementLayout,
        writes: Vec<BorrowedWrite<'py>>,
    }
    struct BorrowedWrite<'py> {
        label: String,
        indices: HostBytes<'py>,
        within: std::ops::Range<u64>,
        shift: i64,
        runs: Option<(aurora_delta::Runs, u64)>,
        values: HostBytes<'py>,
        keep: Option<HostBytes<'py>>,
    }
    let mut borrowed = Vec::with_capacity(targets.len());
    for (label, memory, element_bytes, packed, writes) in targets {
        let layout = match packed {
            None => aurora_delta::ElementLayout::RowMajor,
            Some((rows, columns, block, group)) => aurora_delta::ElementLayout::RowBlocks {
                rows,
                columns,
                block,
                group,
            },
        };
        let writes = writes
            .into_iter()
            .map(|(write, indices, start, end, shift, runs, values, keep)| {
                let indices = HostBytes::borrow(&indices, &format!("{write}'s indices"))?;
                let bytes = indices.as_slice();
                if !bytes.is_empty()
                    && (bytes.len() % 8 != 0 || bytes.as_ptr().align_offset(8) != 0)
                {
                    return Err(usage_error(format!(
                        "{write}: the indices must be the bytes of an int64 tensor"
                    )));
                }
                let values = HostBytes::borrow(&values, &format!("{write}'s values"))?;
                let keep = keep
                    .map(|keep| HostBytes::borrow(&keep, &format!("{write}'s keep")))
                    .transpose()?;
                if let Some(keep) = &keep
                    && keep.as_slice().len() != values.as_slice().len()
                {
                    return Err(usage_error(format!(
                        "{write}: {} bytes to keep what {} bytes of values replace",
                        keep.as_slice().len(),
                        values.as_slice().len()
                    )));
                }
                Ok(BorrowedWrite {
                    label: write,
                    indices,
                    within: start..end,
                    shift,
                    runs: runs.map(|(count, source_stride, target_stride, elements)| {
                        let runs = aurora_delta::Runs {
                            count,
                            source_stride,
                            target_stride,
                        };
                        (runs, elements)
                    }),
                    values,
                    keep,
                })
            })
            .collect::<PyResult<_>>()?;
        borrowed.push(Borrowed {
            memory: HostBytes::borrow(&memory, &label)?,
            label,
            element_bytes,
            layout,
            writes,
        });
    }
    // What is written (memories, values) shares no byte with anything else handed in;
    // what is only read (indices) may share with other indices.
    let mut ranges: Vec<(std::ops::Range<*const u8>, bool)> = Vec::new();
    for target in &borrowed {
        ranges.push((target.memory.as_slice().as_ptr_range(), true));
        for BorrowedWrite {
            indices,
            values,
            keep,
            ..
        } in &target.writes
        {
            ranges.push((indices.as_slice().as_ptr_range(), false));
            ranges.push((values.as_slice().as_ptr_range(), keep.is_none()));
            if let Some(keep) = keep {
                ranges.push((keep.as_slice().as_ptr_range(), true));
            }
        }
    }
    ranges.retain(|(range, _)| range.start != range.end);
    ranges.sort_by_key(|(range, _)| range.start);
    let (mut reach, mut written_reach) = (std::ptr::null(), std::ptr::null());
    for (range, written) in ranges {
        if range.start < written_reach || (written && range.start < reach) {
            return Err(usage_error(
                "the memory written (targets, values or their keep buffers) must not share bytes with any other buffer handed in",
            ));
        }
        reach = reach.max(range.end);
        if written {
            written_reach = written_reach.max(range.end);
        }
    }
    // Checked above: a keep buffer shares no byte with its values.
    let copies: Vec<(&[u8], &mut [u8])> = borrowed
        .iter_mut()
        .flat_map(|target| target.writes.iter_mut())
        .filter_map(|write| {
            let keep = write.keep.as_mut()?.as_mut_slice();
            Some((write.values.as_slice(), keep))
        })
        .collect();
    py.detach(|| {
        use rayon::prelude::*;
        copies
            .into_par_iter()
            .for_each(|(values, keep)| keep.copy_from_slice(values));
    });
    // The writes as the core takes them, each with the runs it is to be cut into.
    type Cut<'a> = (
        aurora_delta::ElementWrite<'a>,
        Option<(aurora_delta::Runs, u64)>,
    );
    let targets: Vec<(aurora_delta::ElementTarget<'_>, Vec<Cut<'_>>)> = borrowed
        .iter_mut()
        .map(|target| {
            let writes = target
                .writes
                .iter_mut()
                .map(
                    |BorrowedWrite {
                         label,
                         indices,
                         within,
                         shift,
                         runs,
                         values,
                         keep,
                     }| {
                        let write = aurora_delta::ElementWrite {
                            label,
                            indices: match indices.as_slice() {
                                [] => &[],
                                // SAFETY: checked above: 8-aligned and a whole number of
                                // 8-byte words, which any bit pattern makes a valid u64;
                                // int64 tensors hold native-endian words, and a negative
                                // index reads as one beyond any block, which is refused.
                                bytes => unsafe {
                                    std::slice::from_raw_parts(
                                        bytes.as_ptr().cast::<u64>(),
                                        bytes.len() / 8,
                                    )
                                },
                            },
                            within: within.clone(),
                            shift: *shift,
                            values: match keep {
                                Some(keep) => keep.as_mut_slice(),
                                None => values.as_mut_slice(),
                            },
                        };
                        (write, *runs)
                    },
                )
                .collect();
            let target = aurora_delta::ElementTarget {
                label: &target.label,
                memory: target.memory.as_mut_slice(),
                element_bytes: target.element_bytes,
                layout: target.layout,
                writes: Vec::new(),
            };
            (target, writes)
        })
        .collect();
    py.detach(|| {
        let mut cut_targets = Vec::with_capacity(targets.len());
        for (mut target, writes) in targets {
            for (write, runs) in writes {
                match runs {
                    None => target.writes.push(write),
                    Some((runs, elements)) => {
                        target
                            .writes
                            .extend(write.cut(runs, elements, target.element_bytes)?)
                    }
                }
            }
            cut_targets.push(target);
        }
        aurora_delta::swap_elements(cut_targets)
    })
    .map_err(delta_error)
}

/// Takes a version's changes to a BF16 matrix into its FP8 image
/// (`aurora_delta::fp8::requantize`): `grid` is `(rows, columns, block rows, block
/// columns)`, `matrix` the new matrix whole, `indices` and `values` the changes, `stats`
/// the blocks' scales, largest magnitudes and their places (updated in place), and
/// `quantized` receives the changes' FP8 values. Returns the rescaled blocks, their new
/// scales and, where a scale moved, every element to write as writable bytes (int64
/// indices, FP8 values).
#[pyfunction]
#[allow(clippy::type_complexity)]
fn fp8_requantize<'py>(
    py: Python<'py>,
    grid: (u64, u64, u64, u64),
    matrix: Bound<'py, PyAny>,
    indices: Bound<'py, PyAny>,
    values: Bound<'py, PyAny>,
    stats: (Bound<'py, PyAny>, Bound<'py, PyAny>, Bound<'py, PyAny>),
    quantized: Bound<'py, PyAny>,
) -> PyResult<(
    Vec<u64>,
    Vec<f32>,
    Option<(Bound<'py, PyByteArray>, Bound<'py, PyByteArray>)>,
)> {
    let (rows, columns, block_rows, block_columns) = grid;
    let grid = aurora_delta::fp8::BlockGrid {
        rows,
        columns,
        block_rows,
        block_columns,
    };
    let matrix = HostBytes::borrow(&matrix, "the matrix")?;
    let indices = HostBytes::borrow(&indices, "the indices")?;
    let values = HostBytes::borrow(&values, "the values")?;
    let mut scales = HostBytes::borrow(&stats.0, "the scales")?;
    let mut largest = HostBytes::borrow(&stats.1, "the largest magnitudes")?;
    let mut largest_at = HostBytes::borrow(&stats.2, "the places of the largest magnitudes")?;
    let mut quantized = HostBytes::borrow(&quantized, "the quantized values")?;
    let bf16 = "must be the bytes of a bfloat16 tensor";
    let matrix: &[u16] = words(matrix.as_slice(), &format!("the matrix {bf16}"))?;
    let indices: &[u64] = words(
        indices.as_slice(),
        "the indices must be the bytes of an int64 tensor",
    )?;
    let values: &[u16] = words(values.as_slice(), &format!("the values {bf16}"))?;
    let stats = aurora_delta::fp8::BlockStats {
        scales: words_mut(
            scales.as_mut_slice(),
            "the scales must be the bytes of a float32 tensor",
        )?,
        largest: words_mut(
            largest.as_mut_slice(),
            "the largest magnitudes must be the bytes of a float32 tensor",
        )?,
        largest_at: words_mut(
            largest_at.as_mut_slice(),
            "their places must be the bytes of an int64 tensor",
        )?,
    };
    let quantized = quantized.as_mut_slice();
    let out = py
        .detach(|| aurora_delta::fp8::requantize(grid, matrix, indices, values, stats, quantized))
        .map_err(delta_error)?;
    let merged = (!out.rescaled.is_empty()).then(|| {
        (
            PyByteArray::new(py, bytemuck::cast_slice(&out.indices)),
            PyByteArray::new(py, &out.values),
        )
    });
    Ok((out.rescaled, out.scales, merged))
}

/// `bytes` as a slice of `T` words, refused with `refusal` unless aligned and whole.
fn words<'a, T: bytemuck::Pod>(bytes: &'a [u8], refusal: &str) -> PyResult<&'a [T]> {
    if bytes.is_empty() {
        return Ok(&[]);
    }
    bytemuck::try_cast_slice(bytes).map_err(|_| usage_error(refusal))
}

/// [`words`] of writable bytes.
fn words_mut<'a, T: bytemuck::Pod>(bytes: &'a mut [u8], refusal: &str) -> PyResult<&'a mut [T]> {
    if bytes.is_empty() {
        return Ok(&mut []);
    }
    bytemuck::try_cast_slice_mut(bytes).map_err(|_| usage_error(refusal))
}

/// The Hugging Face names an inference engine stores as one fused parameter with `name`
/// (q, k and v projections; gate and up), in concatenation order, or None for a name it
/// keeps whole (docs/delta-format.md §9). An engine must receive such a group whole.
#[pyfunction]
fn fused_parts(name: &str) -> Option<Vec<String>> {
    aurora_delta::fused::fused_name(name).map(|(_, _, parts)| parts)
}

/// For the name of an engine's fused parameter (`...qkv_proj.weight`): the Hugging Face
/// names of its parts, in concatenation order; None for any other name.
#[pyfunction]
fn unfused_names(name: &str) -> Option<Vec<String>> {
    aurora_delta::fused::unfused_names(name)
}

#[pymodule]
fn _core(module: &Bound<'_, PyModule>) -> PyResult<()> {
    pyo3_log::init();
    module.add("FORMAT_VERSION", aurora_delta::FORMAT_VERSION)?;
    module.add("RETURN_AFTER_S", aurora_node::RETURN_AFTER.as_secs_f64())?;
    module.add(
        "BEHIND_TIMEOUT_S",
        aurora_node::BEHIND_TIMEOUT.as_secs_f64(),
    )?;
    module.add_function(wrap_pyfunction!(weights_hash, module)?)?;
    module.add_function(wrap_pyfunction!(diff, module)?)?;
    module.add_function(wrap_pyfunction!(extract_shard, module)?)?;
    module.add_function(wrap_pyfunction!(shards_weights_hash, module)?)?;
    module.add_function(wrap_pyfunction!(target_layout, module)?)?;
    module.add_function(wrap_pyfunction!(apply_into, module)?)?;
    module.add_function(wrap_pyfunction!(swap_elements, module)?)?;
    module.add_function(wrap_pyfunction!(fp8_requantize, module)?)?;
    module.add_function(wrap_pyfunction!(fused_parts, module)?)?;
    module.add_function(wrap_pyfunction!(unfused_names, module)?)?;
    module.add_class::<node::TrainerNodeCore>()?;
    module.add_class::<node::ActorNodeCore>()?;
    module.add_class::<node::ActivationCore>()?;
    errors::register(module)
}
