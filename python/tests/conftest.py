"""Shared fixtures: the `aurora` binary the Rust tests built, and synthetic checkpoints
it writes (realistic magnitudes and one-step Adam updates, `aurora synth`)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def aurora_bin() -> Path:
    """The CLI whose bytes the bindings must reproduce. tools/test builds it before
    pytest runs; AURORA_BIN points elsewhere. Missing, the suite fails: it never skips."""
    path = Path(os.environ.get("AURORA_BIN", REPO / "target" / "debug" / "aurora"))
    assert path.is_file(), f"{path} is missing: build it with `cargo build -p aurora-cli`"
    return path


def run(aurora_bin: Path, *args: object) -> str:
    result = subprocess.run(
        [str(aurora_bin), *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, "NO_COLOR": "1", "AURORA_LOG": "warn"},
    )
    assert result.returncode == 0, f"aurora {args} failed:\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="session")
def synth_steps(aurora_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three consecutive BF16 exports of the `small` preset (with F32 norms), as
    safetensors files."""
    out = tmp_path_factory.mktemp("synth")
    run(aurora_bin, "synth", "--preset", "small", "--steps", "2", "--f32-norms", "--out", out)
    steps = sorted(out.glob("*.safetensors"))
    assert len(steps) == 3, steps
    return steps
