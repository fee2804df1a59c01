//! Python exception classes for the Rust errors, each carrying the Rust error's message.
//!
//! The hierarchy lets callers branch on what they can act on: a damaged or cut-short
//! artifact (fetch it again), the wrong base (catch up first), invalid tensors (their own
//! bug). All derive from `AuroraError`.

use aurora_delta::DeltaError as Rust;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

create_exception!(
    aurora_rl,
    AuroraError,
    PyException,
    "Base class of every error aurora_rl raises."
);
create_exception!(
    aurora_rl,
    DeltaError,
    AuroraError,
    "The delta artifact is not valid: malformed, of an unknown version, or over a limit."
);
create_exception!(
    aurora_rl,
    TruncatedDeltaError,
    DeltaError,
    "The delta artifact is cut short."
);
create_exception!(
    aurora_rl,
    CorruptedDeltaError,
    DeltaError,
    "The delta artifact's bytes do not match their hashes."
);
create_exception!(
    aurora_rl,
    WrongBaseError,
    AuroraError,
    "The weights given are not the delta's base."
);
create_exception!(
    aurora_rl,
    TargetMismatchError,
    AuroraError,
    "Applying the delta did not reproduce its target weights hash."
);
create_exception!(
    aurora_rl,
    CheckpointError,
    AuroraError,
    "The tensors given do not form a valid checkpoint, or cannot be expressed as a delta."
);

create_exception!(
    aurora_rl,
    NodeError,
    AuroraError,
    "A node failed: its transport, control plane, store or files."
);
create_exception!(
    aurora_rl,
    NodeClosedError,
    NodeError,
    "The node was closed (`close()`, `leave()` or the end of its `with` block)."
);

/// `UsageError(AuroraError, ValueError)`: a call the node's contract does not allow (an
/// argument out of range, publishing out of order, an activation still held).
static USAGE_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
/// `NodeTimeoutError(NodeError, TimeoutError)`: what a node waited for did not happen.
static NODE_TIMEOUT_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// A class deriving from aurora's `base` and the builtin `builtin`, so that code catching
/// either catches it: pyo3's exception macro takes one base.
fn two_based(
    py: Python<'_>,
    cell: &'static PyOnceLock<Py<PyType>>,
    name: &str,
    doc: &str,
    bases: (Bound<'_, PyType>, Bound<'_, PyType>),
) -> PyResult<Py<PyType>> {
    cell.get_or_try_init(py, || {
        let namespace = PyDict::new(py);
        namespace.set_item("__doc__", doc)?;
        namespace.set_item("__module__", "aurora_rl")?;
        let bases = PyTuple::new(py, [bases.0, bases.1])?;
        let class = py.get_type::<PyType>().call1((name, bases, namespace))?;
        Ok(class.cast_into::<PyType>()?.unbind())
    })
    .map(|class| class.clone_ref(py))
}

fn usage_error_type(py: Python<'_>) -> PyResult<Py<PyType>> {
    two_based(
        py,
        &USAGE_ERROR,
        "UsageError",
        "A call the node's contract does not allow: an argument out of range, publishing \
         out of order, an activation still held.",
        (py.get_type::<AuroraError>(), py.get_type::<PyValueError>()),
    )
}

fn node_timeout_error_type(py: Python<'_>) -> PyResult<Py<PyType>> {
    two_based(
        py,
        &NODE_TIMEOUT_ERROR,
        "NodeTimeoutError",
        "What a node waited for (a join, a step's results, an activation) did not happen in time.",
        (py.get_type::<NodeError>(), py.get_type::<PyTimeoutError>()),
    )
}

/// An error of one of the two-based classes, with `message`.
fn two_based_error(class: fn(Python<'_>) -> PyResult<Py<PyType>>, message: String) -> PyErr {
    Python::attach(|py| match class(py) {
        Ok(class) => PyErr::from_type(class.into_bound(py), message),
        Err(error) => error,
    })
}

/// A `UsageError` with `message`.
pub fn usage_error(message: impl Into<String>) -> PyErr {
    two_based_error(usage_error_type, message.into())
}

/// A `NodeTimeoutError` with `message`.
pub fn node_timeout_error(message: impl Into<String>) -> PyErr {
    two_based_error(node_timeout_error_type, message.into())
}

/// The Python exception for a Rust error, with its message.
pub fn delta_error(error: Rust) -> PyErr {
    let message = error.to_string();
    match error {
        Rust::Truncated { .. } => TruncatedDeltaError::new_err(message),
        Rust::ManifestCorrupted | Rust::SegmentCorrupted { .. } => {
            CorruptedDeltaError::new_err(message)
        }
        Rust::WrongBase { .. } | Rust::BaseMismatch(_) => WrongBaseError::new_err(message),
        Rust::TargetMismatch { .. } => TargetMismatchError::new_err(message),
        Rust::Checkpoint(_) | Rust::Unsupported { .. } | Rust::ShardCoverage(_) => {
            CheckpointError::new_err(message)
        }
        Rust::BadMagic
        | Rust::UnsupportedVersion { .. }
        | Rust::Malformed(_)
        | Rust::LimitExceeded { .. }
        | Rust::SegmentMalformed { .. }
        | Rust::ChunkMalformed { .. }
        | Rust::ShardPart { .. }
        | Rust::BrokenChain(_)
        | Rust::Journal(_)
        | Rust::Spill { .. }
        | Rust::Image { .. }
        | Rust::RestoreFailed { .. }
        | Rust::Cancelled => DeltaError::new_err(message),
        Rust::ElementWrites(_) => usage_error(message),
    }
}

pub fn register(module: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = module.py();
    module.add("AuroraError", py.get_type::<AuroraError>())?;
    module.add("DeltaError", py.get_type::<DeltaError>())?;
    module.add("TruncatedDeltaError", py.get_type::<TruncatedDeltaError>())?;
    module.add("CorruptedDeltaError", py.get_type::<CorruptedDeltaError>())?;
    module.add("WrongBaseError", py.get_type::<WrongBaseError>())?;
    module.add("TargetMismatchError", py.get_type::<TargetMismatchError>())?;
    module.add("CheckpointError", py.get_type::<CheckpointError>())?;
    module.add("NodeError", py.get_type::<NodeError>())?;
    module.add("NodeClosedError", py.get_type::<NodeClosedError>())?;
    module.add("UsageError", usage_error_type(py)?)?;
    module.add("NodeTimeoutError", node_timeout_error_type(py)?)?;
    Ok(())
}
