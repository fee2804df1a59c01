"""SGLang behind the ``Engine`` boundary, on its real CPU build: an aurora actor feeding an
``sglang.Engine`` takes RL-sized versions (1% of the elements each) from a trainer node,
and what SGLang then generates is bit-identical (tokens and log-probabilities) to a fresh
SGLang started from the trainer's export of that version, and differs from the version
before (a tolerance against another engine could not tell versions this close apart)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import aurora_rl
from aurora_rl.engines import Sampling
from aurora_rl.engines.sglang import SglangEngine
from test_engines import next_work, small_qwen3, sparse_step

PROMPTS = [[5, 17, 300, 42], [1000, 2, 3], [7] * 9, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
GREEDY = Sampling(max_tokens=6, temperature=0.0)
#: SGLang's CPU defaults, sized for this test's small model; its attention kernel for AMX
#: does not match the kernel library's build here, so the portable one (docs: README).
OPTIONS = dict(device="cpu", attention_backend="torch_native", max_total_tokens=4096, max_running_requests=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_qwen3(tmp_path_factory.mktemp("qwen3"))


def serve_versions(engine, model_dir: Path, tmp_path: Path, seeds: list[int]) -> list:
    """An actor feeding ``engine`` takes one RL-sized version per seed from a trainer node;
    returns what ``engine`` generates on each, and exports each as ``version-N``."""
    weights = load_file(str(model_dir / "model.safetensors"))
    served = []
    with aurora_rl.Trainer(tmp_path / "trainer", insecure_plaintext=True) as trainer:
        trainer.publish(weights)
        with aurora_rl.Actor(engine, id=1, region="here", weights=weights, version=0,
                             control=trainer.control_address, upstreams=[trainer.transport_address],
                             token=trainer.token, insecure_plaintext=True) as actor:
            for version, seed in enumerate(seeds, start=1):
                weights = sparse_step(weights, 0.01, seed)
                published = trainer.publish(weights)
                trainer.open_step([version])
                trainer.commit()
                work = next_work(actor)
                assert (work.version, work.weights_hash) == (version, published.weights_hash)
                served.append(engine.generate(PROMPTS, GREEDY))
                actor.submit(work, [(lease, None, 1) for lease in work.leases])
                trainer.wait_step(timeout=60)
                export = tmp_path / f"version-{version}"
                export.mkdir()
                for name in ("config.json", "generation_config.json"):
                    shutil.copy(model_dir / name, export / name)
                save_file(weights, str(export / "model.safetensors"))
    return served


def assert_each_is_a_fresh_engines(served: list, tmp_path: Path) -> None:
    """Each version's outputs equal a fresh SGLang's on its export, bit for bit, and
    differ from the version before."""
    previous = None
    for version, outputs in enumerate(served, start=1):
        reference = fresh(tmp_path / f"version-{version}")
        assert [(c.token_ids, c.logprobs) for c in outputs] == [(c.token_ids, c.logprobs) for c in reference], version
        if previous is not None:
            assert [c.logprobs for c in reference] != [c.logprobs for c in previous], "the versions are told apart"
        previous = reference


def fresh(export: Path) -> list:
    engine = SglangEngine.start(str(export), **OPTIONS)
    try:
        return engine.generate(PROMPTS, GREEDY)
    finally:
        engine.shutdown()


def test_an_sglang_actor_serves_each_version_bit_for_bit(model_dir, tmp_path):
    engine = SglangEngine.start(str(model_dir), **OPTIONS)
    try:
        served = serve_versions(engine, model_dir, tmp_path, [1, 2, 3])
    finally:
        engine.shutdown()
    assert_each_is_a_fresh_engines(served, tmp_path)


def test_an_sglang_server_takes_each_version_bit_for_bit(model_dir, tmp_path):
    """The same through SGLang's HTTP server (``SglangServerEngine``), on loopback."""
    import os
    import queue
    import subprocess
    import sys
    import threading

    from aurora_rl.engines.sglang import SglangServerEngine
    from test_engines import free_port

    with pytest.raises(ValueError, match="loopback only"):
        SglangServerEngine("http://10.1.2.3:30000")
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--host", "127.0.0.1",
         "--port", str(port), "--skip-tokenizer-init", "--dtype", "bfloat16", "--random-seed", "0",
         "--device", OPTIONS["device"], "--attention-backend", OPTIONS["attention_backend"],
         "--max-total-tokens", str(OPTIONS["max_total_tokens"]),
         "--max-running-requests", str(OPTIONS["max_running_requests"]), "--disable-overlap-schedule"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ.copy(),
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in server.stdout], daemon=True).start()
    try:
        seen: list[str] = []
        while not any("fired up and ready" in line for line in seen[-1:]):
            try:
                seen.append(lines.get(timeout=600))
            except queue.Empty:
                raise AssertionError("the server did not start:\n" + "".join(seen[-40:])) from None
        served = serve_versions(SglangServerEngine(f"http://127.0.0.1:{port}"), model_dir, tmp_path, [11, 12])
    finally:
        server.terminate()
        server.wait(timeout=60)
    assert_each_is_a_fresh_engines(served, tmp_path)
