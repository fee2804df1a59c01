"""The aurora weight-transfer backend driven the way a framework drives vLLM's weight sync:
a trainer engine from ``WeightTransferTrainerFactory.trainer_init`` pushes RL-sized steps
with ``send_weights()`` through a ``VLLMWeightSyncClient``, into vLLM started with
``weight_transfer_config={"backend": "aurora"}`` (load format ``aurora``). Run by
test_vllm_backend.py as a script (vLLM's engine process is spawned).

    vllm_backend_run.py offline MODEL_DIR OUT TP   # LLM in this process, its engine process spawned
    vllm_backend_run.py server MODEL_DIR OUT URL   # a running OpenAI server (VLLM_SERVER_DEV_MODE=1)
    vllm_backend_run.py fresh EXPORT_DIR OUT TP    # a fresh LLM on an export: the reference

TP is the tensor-parallel size (the engine is one actor: rank 0's worker runs its node,
the other ranks follow it).

Each mode writes OUT as JSON: per version, the weight version vLLM reports, the weight
versions its outputs carry, and the greedy tokens and log-probabilities (prompt and
generated, top 5) of PROMPTS; the first two modes also export each version as a model
directory beside OUT, for ``fresh``. ``offline`` also writes OUT with the suffix
``.read_back.json``: each rank's read-back check of the last version, clean and with an
element of its shard changed; with TP above 1, then one more version, which rank 1 fails
to write, and writes vLLM's error and what it serves after it to OUT with the suffix
``.refused.json``.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any

PROMPTS = [[5, 17, 300, 42], [1000, 2, 3], [7] * 9, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
VERSIONS = 3
ENGINE = dict(dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=True, load_format="aurora",
              max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256, seed=0)


def logprobs_of(outputs: Any) -> list[dict]:
    """Every number vLLM computed for each prompt, as exact floats (repr round-trips)."""
    def table(steps: Any) -> list:
        return [None if step is None else sorted((t, repr(l.logprob)) for t, l in step.items()) for step in steps or []]

    return [
        {
            "tokens": list(o.outputs[0].token_ids),
            "logprobs": table(o.outputs[0].logprobs),
            "prompt_logprobs": table(o.prompt_logprobs),
            "weight_versions": [[s.version, s.start, s.end] for s in o.outputs[0].weight_versions or []],
        }
        for o in outputs
    ]


def sampling() -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=6, temperature=0.0, logprobs=5, prompt_logprobs=5)


class Source:
    """A ``WeightSource`` over the trainer's current state (Hugging Face names)."""

    def __init__(self, state: dict) -> None:
        self.state = state

    def metadata(self) -> list:
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.state.items()]

    def __iter__(self):
        return iter(list(self.state.items()))


class OfflineClient:
    """``VLLMWeightSyncClient`` over an offline ``LLM``: its own weight-sync methods."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()


def train(model_dir: Path, out: Path, client: Any, generate: Any, weight_version: Any, after: Any = None) -> None:
    """Publishes VERSIONS steps, each served and reported, then has the workers leave;
    ``after(engine, source)``, if given, runs after the last step instead of the leave,
    while the trainer node still answers."""
    import torch
    from safetensors.torch import load_file, save_file
    from test_engines import sparse_step
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    import aurora_rl
    from aurora_rl.vllm_backend import AuroraTrainerInitInfo

    source = Source(load_file(str(model_dir / "model.safetensors")))
    report = []
    with aurora_rl.Trainer(out.parent / "trainer", insecure_plaintext=True) as trainer:
        engine = WeightTransferTrainerFactory.trainer_init(
            AuroraTrainerInitInfo(rank=0, trainer=trainer, dtype=torch.bfloat16,
                                  inference={"region": "here", "id": 1, "insecure_plaintext": True,
                                             "verify": "full"}),
            client=client,
            source=source,
        )
        for version in range(1, VERSIONS + 1):
            source.state = sparse_step(source.state, 0.01, version)
            engine.send_weights()
            assert engine.published.version == version
            assert engine.published.weights_hash == aurora_rl.weights_hash(source.state)
            export = out.parent / f"version-{version}"
            export.mkdir()
            shutil.copy(model_dir / "config.json", export / "config.json")
            save_file(source.state, str(export / "model.safetensors"))
            actors = [actor.actor for actor in trainer.status().actors]
            report.append({"version": version, "weight_version": weight_version(), "outputs": generate(), "actors": actors})
        if after is not None:
            after(engine, source)
        else:
            # The workers leave the fleet while its control plane still answers.
            client.shutdown_weight_transfer_engine()
    out.write_text(json.dumps(report))


#: A parameter every rank holds a shard of, whose first elements are q's.
CORRUPTED = "model.layers.0.self_attn.qkv_proj.weight"


def read_back(worker: Any, export: str) -> dict:
    """In each rank's worker: what the read-back finds against ``export``, the version
    the engine holds, then with one element of this rank's shard of ``CORRUPTED`` changed
    (put back after)."""
    from safetensors.torch import load_file

    from aurora_rl.engines.vllm_worker import worker_writer

    expected = load_file(export)
    writer = worker_writer(worker)
    clean = writer.mismatched(expected)
    weight = dict(writer.model.named_parameters())[CORRUPTED].data.view(-1)
    kept = weight[5].clone()
    weight[5] = kept + 1
    try:
        corrupted = writer.mismatched(expected)
    finally:
        weight[5] = kept
    return {"clean": clean, "corrupted": corrupted}


def fail_next_write_on_rank_one(worker: Any) -> None:
    """In each rank's worker: rank 1's next element write fails before writing."""
    from vllm.distributed import get_tensor_model_parallel_rank

    from aurora_rl.engines.vllm_worker import ModelWriter

    if get_tensor_model_parallel_rank() != 1:
        return
    write_changes = ModelWriter.write_changes

    def fails_once(self: Any, changes: Any) -> Any:
        ModelWriter.write_changes = write_changes
        raise RuntimeError("rank 1's write, failed on purpose")

    ModelWriter.write_changes = fails_once


def offline(model_dir: Path, out: Path, tensor_parallel: int) -> None:
    import os

    # ``read_back`` goes to the workers as a function, which vLLM's own messages refuse
    # unless told: this script trusts itself.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    from vllm import LLM

    llm = LLM(model=str(model_dir), weight_transfer_config={"backend": "aurora"},
              tensor_parallel_size=tensor_parallel, **ENGINE)

    def generate() -> list[dict]:
        # The caller resets cached prefixes after an update, as with any backend.
        llm.reset_prefix_cache()
        return logprobs_of(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sampling(), use_tqdm=False))

    def after(engine: Any, source: Source) -> None:
        from test_engines import sparse_step

        export = out.parent / f"version-{VERSIONS}" / "model.safetensors"
        out.with_suffix(".read_back.json").write_text(json.dumps(llm.collective_rpc(read_back, args=(str(export),))))
        if tensor_parallel == 1:
            llm.shutdown_weight_transfer_engine()
            return
        # One more version, which rank 1 fails to write: refused, and what vLLM serves
        # after it, for the test to compare with the last version's.
        llm.collective_rpc(fail_next_write_on_rank_one)
        source.state = sparse_step(source.state, 0.01, VERSIONS + 1)
        try:
            engine.send_weights()
            refused = None
        except Exception as error:  # vLLM's wrapping of the workers' errors
            refused = str(error)
        out.with_suffix(".refused.json").write_text(json.dumps({"error": refused, "outputs": generate()}))
        # vLLM 0.32's multiprocess executor stops reading the ranks' answers to a
        # collective call at the first that failed, so the next call (this one, which
        # every rank does) is answered with rank 1's answer to the failed update.
        with contextlib.suppress(Exception):
            llm.shutdown_weight_transfer_engine()

    train(model_dir, out, OfflineClient(llm), generate, llm.get_weight_version, after)


def server(model_dir: Path, out: Path, url: str) -> None:
    import requests
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    def generate() -> list[dict]:
        requests.post(f"{url}/reset_prefix_cache", timeout=60).raise_for_status()
        answer = requests.post(
            f"{url}/v1/completions",
            json={"model": "small", "prompt": PROMPTS, "max_tokens": 6, "temperature": 0.0, "logprobs": 5,
                  "return_token_ids": True, "return_tokens_as_token_ids": True},
            timeout=300,
        )
        answer.raise_for_status()
        choices = sorted(answer.json()["choices"], key=lambda c: c["index"])
        return [{"tokens": c["token_ids"], "logprobs": [repr(x) for x in c["logprobs"]["token_logprobs"]]} for c in choices]

    def weight_version() -> str:
        return requests.get(f"{url}/weight_info", timeout=60).json()["weight_version"]

    train(model_dir, out, HTTPVLLMWeightSyncClient(url), generate, weight_version)


def fresh(export: Path, out: Path, tensor_parallel: int) -> None:
    from vllm import LLM

    llm = LLM(model=str(export), tensor_parallel_size=tensor_parallel, **ENGINE)
    out.write_text(json.dumps(logprobs_of(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sampling(), use_tqdm=False))))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    mode, directory, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    if mode == "offline":
        offline(directory, out, int(sys.argv[4]))
    elif mode == "server":
        server(directory, out, sys.argv[4])
    else:
        fresh(directory, out, int(sys.argv[4]))
    print("done", mode)
