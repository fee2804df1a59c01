//! Python exception classes for the Rust errors, each carrying the Rust error's message.
//!
//! The hierarchy lets callers branch on what they can act on: a damaged or cut-short
//! artifact (fetch it again), the wrong base (catch up first), invalid tensors (their own
//! bug). All derive from `AuroraError`.

use aurora_delta::DeltaError as Rust;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

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
        Rust::Checkpoint(_) | Rust::Unsupported { .. } => CheckpointError::new_err(message),
        Rust::BadMagic
        | Rust::UnsupportedVersion { .. }
        | Rust::Malformed(_)
        | Rust::LimitExceeded { .. }
        | Rust::SegmentMalformed { .. }
        | Rust::ChunkMalformed { .. }
        | Rust::BrokenChain(_)
        | Rust::Journal(_)
        | Rust::Spill(_)
        | Rust::Cancelled => DeltaError::new_err(message),
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
    Ok(())
}
