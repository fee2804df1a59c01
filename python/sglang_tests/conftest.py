"""The SGLang tests run in SGLang's own environment (README, "SGLang"), which tools/test
makes them use; they share the model helpers of the main suite."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
# SGLang's CPU build, on every core of this machine.
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
os.environ.setdefault("SGLANG_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")


@pytest.fixture(scope="session", autouse=True)
def _sglang_shared_memory_removed() -> Iterator[None]:
    """SGLang's CPU kernel library leaves a 270 MB all-reduce buffer in /dev/shm for every
    engine started (``deepspeed_allreduce_buffer_*``, never unlinked; README, "SGLang"):
    those the suite's engines left are removed at its end."""
    shm = Path("/dev/shm")
    before = set(shm.glob("deepspeed_allreduce_buffer_*"))
    yield
    for leftover in set(shm.glob("deepspeed_allreduce_buffer_*")) - before:
        leftover.unlink(missing_ok=True)
