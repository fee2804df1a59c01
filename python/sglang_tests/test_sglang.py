"""SGLang behind the ``Engine`` boundary, on its real CPU build: an aurora actor feeding an
``sglang.Engine`` takes RL-sized versions (1% of the elements each) from a trainer node,
and what SGLang then generates is bit-identical (tokens and log-probabilities) to a fresh
SGLang started from the trainer's export of that version, and differs from the version
before (a tolerance against another engine could not tell versions this close apart).
Every version is also read back from SGLang's scheduler, element by element, as its
kernels compute from it (``verify="full"``), and labelled as SGLang's weight version."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import aurora_rl
from aurora_rl.engines import EngineError, Sampling, TensorChange, fused_group_names, weight_version
from aurora_rl.engines.sglang import SglangEngine
from test_engines import element_changes, next_work, small_qwen3, sparse_step

PROMPTS = [[5, 17, 300, 42], [1000, 2, 3], [7] * 9, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
GREEDY = Sampling(max_tokens=6, temperature=0.0)
#: SGLang's CPU defaults, sized for this test's small model; its attention kernel for AMX
#: does not match the kernel library's build here, so the portable one (docs: README).
OPTIONS = dict(device="cpu", attention_backend="torch_native", max_total_tokens=4096, max_running_requests=4)
#: A version that changes one tensor only: every other layer must stay as it was (SGLang's
#: own update lifecycle, closed with ``end_weight_update``, packs untouched layers again).
ONE_TENSOR = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_qwen3(tmp_path_factory.mktemp("qwen3"))


def one_tensor_step(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    stepped = dict(state)
    stepped[ONE_TENSOR] = sparse_step({ONE_TENSOR: state[ONE_TENSOR]}, 0.05, seed)[ONE_TENSOR]
    return stepped


def serve_versions(engine, model_dir: Path, tmp_path: Path, steps: list) -> tuple[list, list]:
    """An actor feeding ``engine`` (checking every tensor of every version) takes one
    version per step (a function of the weights) from a trainer node; returns what
    ``engine`` generates on each and the weight version it reports, and exports each
    version as ``version-N``."""
    weights = load_file(str(model_dir / "model.safetensors"))
    served, labels = [], []
    with aurora_rl.Trainer(tmp_path / "trainer", insecure_plaintext=True) as trainer:
        trainer.publish(weights)
        with aurora_rl.Actor(engine, id=1, region="here", weights=weights, version=0,
                             control=trainer.control_address, upstreams=[trainer.transport_address],
                             token=trainer.token, insecure_plaintext=True, verify="full") as actor:
            for version, step in enumerate(steps, start=1):
                weights = step(weights)
                published = trainer.publish(weights)
                trainer.open_step([version])
                trainer.commit()
                work = next_work(actor)
                assert (work.version, work.weights_hash) == (version, published.weights_hash)
                assert engine.loaded_whole == [], "every tensor is written element by element"
                served.append(engine.generate(PROMPTS, GREEDY))
                labels.append((weight_version(version, published.weights_hash), reported_version(engine)))
                actor.submit(work, [(lease, None, 1) for lease in work.leases])
                trainer.wait_step(timeout=60)
                export = tmp_path / f"version-{version}"
                export.mkdir()
                for name in ("config.json", "generation_config.json"):
                    shutil.copy(model_dir / name, export / name)
                save_file(weights, str(export / "model.safetensors"))
    return served, labels


def reported_version(engine) -> str:
    """The weight version SGLang's outputs carry."""
    if isinstance(engine, SglangEngine):
        output = engine.engine.generate(input_ids=[PROMPTS[0]], sampling_params={"max_new_tokens": 1})
    else:
        output = engine._post("/generate", {"input_ids": [PROMPTS[0]], "sampling_params": {"max_new_tokens": 1}})
    return output[0]["meta_info"]["weight_version"]


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
        steps = [lambda w: sparse_step(w, 0.01, 1), lambda w: one_tensor_step(w, 2), lambda w: sparse_step(w, 0.01, 3)]
        served, labels = serve_versions(engine, model_dir, tmp_path, steps)
        assert [reported for _, reported in labels] == [label for label, _ in labels]
        refused_writes_leave_no_trace(engine, load_file(str(tmp_path / "version-3" / "model.safetensors")))
    finally:
        engine.shutdown()
    assert_each_is_a_fresh_engines(served, tmp_path)


def refused_writes_leave_no_trace(engine: SglangEngine, last: dict[str, torch.Tensor]) -> None:
    """A write SGLang's scheduler refuses raises, and the model stays on ``last``; a wrong
    element written is named by the read-back; whole tensors are written whole."""
    assert engine.mismatched(last) == []
    stepped = sparse_step(last, 0.01, 99)
    changes = element_changes(last, stepped)
    beyond = dict(changes)
    beyond[ONE_TENSOR] = TensorChange(last[ONE_TENSOR], torch.tensor([last[ONE_TENSOR].numel()]), last[ONE_TENSOR].reshape(-1)[:1])
    elements = last[ONE_TENSOR].numel()
    with pytest.raises(EngineError, match=f"{ONE_TENSOR} into .*: index {elements} is outside elements 0..{elements}"):
        engine.load_changes(beyond)
    assert engine.mismatched(last) == []
    # Checked whole before the first write, in SGLang's scheduler.
    unordered = dict(changes)
    unordered[ONE_TENSOR] = TensorChange(stepped[ONE_TENSOR], torch.tensor([7, 3]), stepped[ONE_TENSOR].reshape(-1)[[7, 3]])
    with pytest.raises(EngineError, match="ascending"):
        engine.load_changes(unordered)
    assert engine.mismatched(last) == []
    name = "model.layers.0.self_attn.k_proj.weight"
    wrong = (last[name].reshape(-1)[5:6].float() + 1).to(last[name].dtype)
    group = {part: TensorChange(last[part], torch.empty(0, dtype=torch.int64)) for part in fused_group_names([name])}
    group[name] = TensorChange(last[name], torch.tensor([5]), wrong)
    engine.load_changes(group)
    assert engine.mismatched(last) == [name]
    # Whole tensors (an actor joining from a snapshot) land through the same maps.
    engine.load_weights(stepped)
    assert (engine.mismatched(stepped), engine.loaded_whole) == ([], [])


def test_an_sglang_server_takes_each_version_bit_for_bit(model_dir, tmp_path):
    """The same through SGLang's HTTP server (``SglangServerEngine``), on loopback."""
    import os
    import sys

    from aurora_rl.engines.sglang import SglangServerEngine
    from aurora_rl.engines.sglang_worker import LOAD_FORMAT
    from test_engines import free_port, running_server

    with pytest.raises(ValueError, match="loopback only"):
        SglangServerEngine("http://10.1.2.3:30000")
    port = free_port()
    command = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--host", "127.0.0.1",
               "--port", str(port), "--skip-tokenizer-init", "--dtype", "bfloat16", "--random-seed", "0",
               "--device", OPTIONS["device"], "--attention-backend", OPTIONS["attention_backend"],
               "--max-total-tokens", str(OPTIONS["max_total_tokens"]),
               "--max-running-requests", str(OPTIONS["max_running_requests"]), "--disable-overlap-schedule",
               "--custom-weight-loader", LOAD_FORMAT]
    with running_server(command, "fired up and ready", os.environ.copy(), timeout=600):
        steps = [lambda w: sparse_step(w, 0.01, 11), lambda w: one_tensor_step(w, 12)]
        served, labels = serve_versions(SglangServerEngine(f"http://127.0.0.1:{port}"), model_dir, tmp_path, steps)
        assert [reported for _, reported in labels] == [label for label, _ in labels]
    assert_each_is_a_fresh_engines(served, tmp_path)
