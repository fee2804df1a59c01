"""The GRPO example (examples/python/grpo) in its short form, as CI runs it: a trainer,
two regions with an `aurora relay` each, two vLLM actors as separate processes; one actor
is killed at step 2 and a new one joins by snapshot; every step completes with rollouts
accepted for its version, and at the end every live actor, the newcomer included, runs
the last version (each actor checks after every activation that the weights vLLM computes
with hash to the version's, and exits if not). Once with the dense model, once with the
mixture-of-experts one (``--moe``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "python" / "grpo" / "run.py"
STEPS = 5


@pytest.mark.parametrize(
    "model",
    [
        ["--warmup-max-steps", "50"],
        # A warm-up long enough that some groups carry a signal, so versions move experts.
        ["--moe", "--warmup-max-steps", "600"],
    ],
    ids=["dense", "mixture-of-experts"],
)
def test_the_short_grpo_run_survives_a_killed_actor(aurora_bin, tmp_path, model):
    out = tmp_path / "grpo"
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", str(STEPS), "--prompts-per-step", "8", "--kill-at", "2",
         *model, "--eval-every", "5", "--held-out", "50", "--out", str(out), "--aurora-bin", str(aurora_bin)],
        capture_output=True,
        text=True,
        cwd=EXAMPLE.parent,
        env={**os.environ, "PYTHONPATH": str(EXAMPLE.parent)},
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-6000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(STEPS))
    assert [s["version"] for s in steps] == list(range(STEPS))
    assert [s["published"] for s in steps] == list(range(1, STEPS + 1))
    assert "killed actor 1" in steps[2]["events"][0]
    assert all(1 not in s["actors"] for s in steps[3:]), "the killed actor generated nothing after"
    summary = json.loads((out / "summary.json").read_text())
    # The newcomer (actor 3) joined by snapshot and followed the deltas to the end.
    assert sorted(a["actor"] for a in summary["actors"]) == [2, 3]
    assert all(a["active"] == STEPS for a in summary["actors"])
