"""The delta codec on tensors: ``diff``, ``apply`` and ``weights_hash``.

Each is one call into the Rust crate that ``aurora delta`` runs, so an artifact made here
is byte for byte the one the CLI makes from the same tensors (docs/delta-format.md).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Optional

from aurora_rl import _core
from aurora_rl._tensors import OutputBuffer, Tensor, host_tensors

logger = logging.getLogger("aurora_rl")


def weights_hash(state: Mapping[str, Tensor]) -> str:
    """The weights hash of ``state`` (docs/delta-format.md §2) in hex: BLAKE3 over every
    tensor's name, dtype, shape and bytes, in name order."""
    return _core.weights_hash(host_tensors(state))


def diff(
    base: Mapping[str, Tensor],
    target: Mapping[str, Tensor],
    *,
    encoding: str = "aurora",
    base_version: int = 0,
    target_version: Optional[int] = None,
) -> bytes:
    """The delta artifact that turns ``base`` into ``target`` bit for bit.

    ``encoding`` is ``"aurora"`` (the default), ``"leb128"`` (the AuroraRL paper's) or
    ``"dense"``; ``target_version`` defaults to ``base_version + 1``. Tensors present on
    one side only are added or removed, and a changed dtype or shape replaces a tensor.
    """
    artifact = _core.diff(
        host_tensors(base), host_tensors(target), encoding, base_version, target_version
    )
    logger.debug(
        "diff: %d tensors, version %d to %s, %d bytes (%s)",
        len(target),
        base_version,
        target_version if target_version is not None else base_version + 1,
        len(artifact),
        encoding,
    )
    return artifact


def apply(base: Mapping[str, Tensor], delta: bytes) -> dict[str, Tensor]:
    """The delta's target, built from ``base``: new tensors of the kind ``base`` holds
    (torch or numpy, on its device), bit for bit the target the delta was made from.

    Raises ``WrongBaseError`` when ``base`` is not the delta's base,
    ``TruncatedDeltaError`` or ``CorruptedDeltaError`` for damaged bytes and
    ``DeltaError`` for any other invalid artifact; ``base`` is never modified.
    """
    if not isinstance(delta, bytes):
        delta = bytes(delta)
    length, layout = _core.target_layout(delta)
    out = OutputBuffer(base, length)
    target_hash = _core.apply_into(host_tensors(base), delta, out.flat)
    logger.debug("apply: %d target tensors, weights hash %s", len(layout), target_hash)
    return {name: out.view(name, dtype, shape, start, end) for name, dtype, shape, start, end in layout}
