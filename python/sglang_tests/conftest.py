"""The SGLang tests run in SGLang's own environment (README, "SGLang"), which tools/test
makes them use; they share the model helpers of the main suite."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
# SGLang's CPU build, on every core of this machine.
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
os.environ.setdefault("SGLANG_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
