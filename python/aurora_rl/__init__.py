"""aurora_rl: lossless sparse delta checkpoints for RL post-training, from Python.

The Rust core that the ``aurora`` binary runs, with torch and numpy faces:

- ``diff``, ``apply`` and ``weights_hash``: the delta codec on mappings of Hugging Face
  tensor names to torch tensors or numpy arrays.

Errors are ``AuroraError`` subclasses carrying the Rust error's message. Log records go
to the ``aurora_rl`` logger.
"""

from aurora_rl._core import (
    FORMAT_VERSION,
    AuroraError,
    CheckpointError,
    CorruptedDeltaError,
    DeltaError,
    TargetMismatchError,
    TruncatedDeltaError,
    WrongBaseError,
)
from aurora_rl.codec import apply, diff, weights_hash

__all__ = [
    "FORMAT_VERSION",
    "AuroraError",
    "CheckpointError",
    "CorruptedDeltaError",
    "DeltaError",
    "TargetMismatchError",
    "TruncatedDeltaError",
    "WrongBaseError",
    "apply",
    "diff",
    "weights_hash",
]
