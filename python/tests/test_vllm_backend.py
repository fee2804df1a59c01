"""aurora as vLLM's weight-transfer backend, proven with the calls a framework makes: a
trainer engine (``WeightTransferTrainerFactory``) pushes RL-sized steps (1% of elements)
with ``send_weights()``; vLLM, started with the backend, joins the fleet, stages each
version, writes its changed elements in place and checks the weights it computes with.

What it serves is checked against a fresh vLLM loaded from the trainer's export of the same
version, in a separate process: every log-probability bit-identical, and different from the
previous version's (at this step size a tolerance against another engine could not tell the
versions apart)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_engines import free_port, running_server, small_qwen3

HERE = Path(__file__).parent
SCRIPT = HERE / "vllm_backend_run.py"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_qwen3(tmp_path_factory.mktemp("qwen3"))


def script(*args: object, env: dict | None = None, timeout: float = 540) -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})},
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]


def parallel(tensor_parallel: int) -> dict:
    """vLLM's CPU build binds each rank's threads to a NUMA node of its own unless told
    which cores: this machine has one node, so each rank gets one core."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    if tensor_parallel > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(rank % os.cpu_count()) for rank in range(tensor_parallel))
    return env


def fresh(export: Path, tensor_parallel: int = 1) -> list[dict]:
    out = export / "fresh.json"
    script("fresh", export, out, tensor_parallel, env=parallel(tensor_parallel))
    return json.loads(out.read_text())


@pytest.mark.parametrize("tensor_parallel", [1, 2], ids=["tp1", "tp2"])
def test_a_vllm_started_with_the_aurora_backend_serves_each_version_bit_for_bit(model_dir, tmp_path, tensor_parallel):
    # vLLM's default: the engine in a process of its own, where the actor node runs too;
    # with tensor parallelism, in rank 0's worker, and every rank writes its own slices.
    out = tmp_path / "offline.json"
    script("offline", model_dir, out, tensor_parallel, env=parallel(tensor_parallel))
    report = json.loads(out.read_text())
    assert [r["version"] for r in report] == [1, 2, 3]
    # One engine, one actor, whatever its tensor-parallel size.
    assert all(r["actors"] == [1] for r in report)
    previous = None
    for served in report:
        version, label = served["version"], served["weight_version"]
        assert label.startswith(f"{version}:") and len(label) == len(f"{version}:") + 64
        # Each output carries the version it was generated on.
        assert all(o["weight_versions"] == [[label, 0, len(o["tokens"])]] for o in served["outputs"])
        reference = fresh(tmp_path / f"version-{version}", tensor_parallel)
        for output, expected in zip(served["outputs"], reference, strict=True):
            assert output["tokens"] == expected["tokens"]
            assert output["logprobs"] == expected["logprobs"]
            assert output["prompt_logprobs"] == expected["prompt_logprobs"]
        if previous is not None:
            assert [o["prompt_logprobs"] for o in reference] != [o["prompt_logprobs"] for o in previous], (
                "the comparison tells one version from the next"
            )
        previous = reference
    if tensor_parallel > 1:
        # A fourth version that rank 1 failed to write: refused, naming the rank, and
        # undone on rank 0, which had written its shards: vLLM serves version 3, bit for bit.
        refused = json.loads(out.with_suffix(".refused.json").read_text())
        assert "rank 1: RuntimeError: rank 1's write, failed on purpose" in refused["error"]
        for output, expected in zip(refused["outputs"], previous, strict=True):
            assert (output["tokens"], output["logprobs"], output["prompt_logprobs"]) == (
                expected["tokens"], expected["logprobs"], expected["prompt_logprobs"])
    # Every update was checked in full, each rank against its own shards: the check finds
    # nothing on the served weights and names the tensor of an element changed behind it.
    checks = json.loads(out.with_suffix(".read_back.json").read_text())
    assert checks == [{"clean": [], "corrupted": ["model.layers.0.self_attn.q_proj.weight"]}] * tensor_parallel


def test_the_openai_server_with_the_aurora_backend_serves_each_version_bit_for_bit(model_dir, tmp_path):
    """The same through the server's weight-transfer routes (``HTTPVLLMWeightSyncClient``)."""
    port = free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", "small", "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "256",
               "--max-num-seqs", "4", "--max-num-batched-tokens", "256", "--seed", "0",
               "--skip-tokenizer-init", "--load-format", "aurora", "--weight-transfer-config", '{"backend": "aurora"}',
               "--host", "127.0.0.1", "--port", str(port)]
    out = tmp_path / "server.json"
    with running_server(command, "Application startup complete", env):
        script("server", model_dir, out, f"http://127.0.0.1:{port}")
    report = json.loads(out.read_text())
    assert [r["version"] for r in report] == [1, 2, 3]
    for served in report:
        version = served["version"]
        assert served["weight_version"].startswith(f"{version}:")
        reference = fresh(tmp_path / f"version-{version}")
        for output, expected in zip(served["outputs"], reference, strict=True):
            assert output["tokens"] == expected["tokens"]
            # The server gives each chosen token's log-probability; the reference, the top 5.
            chosen = [dict(step)[token] for step, token in zip(expected["logprobs"], expected["tokens"], strict=True)]
            assert output["logprobs"] == chosen


def test_update_and_init_info_that_is_not_what_the_backend_takes_is_refused_by_name():
    """They arrive as JSON through the server's routes, from whoever reaches them."""
    from aurora_rl.vllm_backend import AuroraInitInfo, AuroraUpdateInfo

    good = "ab" * 32
    AuroraUpdateInfo(version=3, weights_hash=good)
    for bad, match in [
        (dict(version="3", weights_hash=good), "version"),
        (dict(version=-1, weights_hash=good), "version"),
        (dict(version=3, weights_hash="AB" * 32), "weights_hash"),
        (dict(version=3, weights_hash=good[:-1]), "weights_hash"),
        (dict(version=3, weights_hash=good, timeout=0), "timeout"),
    ]:
        with pytest.raises(ValueError, match=match):
            AuroraUpdateInfo(**bad)
    base = dict(control="127.0.0.1:1", upstreams=["127.0.0.1:2"], region="here", id=1)
    AuroraInitInfo(**base)
    for change, match in [({"upstreams": "127.0.0.1:2"}, "upstreams"), ({"id": -1}, "id"), ({"verify": "some"}, "verify")]:
        with pytest.raises(ValueError, match=match):
            AuroraInitInfo(**{**base, **change})
