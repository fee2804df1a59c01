"""A fleet with both engines: a vLLM actor (a process in vLLM's environment) and an SGLang
actor (this process) take the same versions from one trainer node, every version read
back from each engine element by element (``verify="full"``) against the version the
trainer published, and both generate the rollouts of the steps."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

import aurora_rl
from aurora_rl.engines.sglang import SglangEngine
from fleet_actor import join, serve
from test_engines import small_qwen3, sparse_step
from test_sglang import OPTIONS

REPO = Path(__file__).resolve().parents[2]
VERSIONS = 3
PROMPTS_PER_STEP = 8
#: The activation of a version in both engines, and a step's rollouts (seconds).
WAIT_S = 300


def vllm_python() -> str:
    """vLLM's environment (README's set-up; tools/test names it)."""
    python = os.environ.get("AURORA_VLLM_PYTHON", str(REPO / ".venv" / "bin" / "python"))
    if not os.access(python, os.X_OK):
        pytest.fail(f"{python}: no vLLM environment (run README's set-up, or set AURORA_VLLM_PYTHON)")
    return python


def await_staged(trainer: aurora_rl.Trainer, version: int, actors: int, failures: list[BaseException]) -> None:
    """Returns once ``actors`` actors have reported ``version`` staged (or active) to the
    control plane: a step opened then reserves a share of its prompts for each of them,
    in proportion to their estimates (Algorithm 1), where a step opened before they
    staged would go whole to whichever claims first. The control plane has no call that
    blocks on an actor's report, so this asks it again until the deadline."""
    deadline = time.monotonic() + WAIT_S
    while True:
        members = trainer.status().actors
        holding = [m for m in members if version in (m.active, m.staged)]
        if len(holding) >= actors:
            return
        if failures or time.monotonic() > deadline:
            raise AssertionError(f"{len(holding)} of {actors} actors staged version {version}: {members} {failures}")
        time.sleep(0.05)


def test_vllm_and_sglang_actors_serve_every_version_of_one_run(tmp_path):
    model_dir = small_qwen3(tmp_path / "qwen3")
    weights = load_file(str(model_dir / "model.safetensors"))
    with aurora_rl.Trainer(tmp_path / "trainer", insecure_plaintext=True) as trainer:
        trainer.publish(weights)
        vllm_actor = subprocess.Popen(
            [vllm_python(), str(Path(__file__).with_name("fleet_actor.py")), str(model_dir), trainer.control_address,
             trainer.transport_address, trainer.token, str(VERSIONS), "1"],
            stdout=subprocess.PIPE, text=True,
        )
        vllm_reports: queue.Queue = queue.Queue()

        def read_vllm_reports() -> None:
            for line in vllm_actor.stdout:
                if line.startswith("activated "):
                    vllm_reports.put(line.split()[1:])

        threading.Thread(target=read_vllm_reports, daemon=True).start()
        engine = SglangEngine.start(str(model_dir), **OPTIONS)
        sglang_reports: queue.Queue = queue.Queue()
        failures: list[BaseException] = []
        stopping = threading.Event()

        def sglang_actor() -> None:
            try:
                with join(engine, str(model_dir), trainer.control_address, trainer.transport_address,
                          trainer.token, 2) as actor:
                    serve(actor, engine, "sglang", VERSIONS, lambda v, h: sglang_reports.put([str(v), h]),
                          stop=stopping.is_set)
            except BaseException as error:  # reported by the test thread
                failures.append(error)

        thread = threading.Thread(target=sglang_actor)
        thread.start()
        engines = set()
        try:
            for version in range(1, VERSIONS + 1):
                weights = sparse_step(weights, 0.01, version)
                published = trainer.publish(weights)
                await_staged(trainer, version, 2, failures)
                trainer.open_step(list(range(version * PROMPTS_PER_STEP, (version + 1) * PROMPTS_PER_STEP)))
                trainer.commit()
                expected = [str(version), published.weights_hash]
                for name, reports in (("SGLang", sglang_reports), ("vLLM", vllm_reports)):
                    try:
                        report = reports.get(timeout=WAIT_S)
                    except queue.Empty:
                        raise AssertionError(f"the {name} actor did not activate version {version}: {failures}") from None
                    assert report == expected, name
                results = trainer.wait_step(timeout=WAIT_S)
                assert (results.version, results.unfinished) == (version, [])
                engines |= {rollout.payload["engine"] for rollout in results.rollouts}
            thread.join(timeout=WAIT_S)
            assert vllm_actor.wait(timeout=WAIT_S) == 0, "the vLLM actor failed"
        finally:
            stopping.set()
            vllm_actor.kill()
            thread.join(timeout=WAIT_S)
            engine.shutdown()
    assert not failures, failures
    assert engines == {"vllm", "sglang"}, "both engines generated rollouts"
