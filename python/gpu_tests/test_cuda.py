"""The Python nodes with a CUDA GPU on both sides: a trainer that publishes the tensors
of a model on the GPU, and an actor whose transformers engine computes there.

CI has no GPU: run this suite on a machine with one (`pytest python/gpu_tests`, with the
package importable); without a GPU it fails rather than skips.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_engines import GREEDY, PROMPTS, generation_mismatch, next_version, small_qwen3  # noqa: E402
from test_nodes import ActorLoop  # noqa: E402

import aurora_rl  # noqa: E402
from aurora_rl.engines.hf import TransformersEngine  # noqa: E402

STEPS = 3


def on_gpu(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.to("cuda") for name, tensor in state.items()}


def test_an_engine_on_the_gpu_holds_every_version_a_gpu_trainer_published(tmp_path: Path) -> None:
    assert torch.cuda.is_available(), "this suite needs a CUDA GPU"
    model_dir = small_qwen3(tmp_path / "qwen3")
    versions = [load_file(str(model_dir / "model.safetensors"))]
    trainer = aurora_rl.Trainer(tmp_path / "trainer", insecure_plaintext=True)
    published = [trainer.publish(on_gpu(versions[0]))]
    assert published[0].weights_hash == aurora_rl.weights_hash(versions[0])

    engine = TransformersEngine.start(str(model_dir))
    engine.model.to("cuda")
    actor = aurora_rl.Actor(
        engine,
        id=1,
        region="gpu",
        control=trainer.control_address,
        upstreams=[trainer.transport_address],
        token=trainer.token,
        insecure_plaintext=True,
    )
    loop = ActorLoop(actor)
    loop.start()
    try:
        for step in range(STEPS):
            trainer.open_step(list(range(step * 4, step * 4 + 4)))
            assert trainer.commit() == step
            results = loop.results(trainer)
            assert results.version == step and results.unfinished == []
            versions.append(next_version(versions[-1], step))
            published.append(trainer.publish(on_gpu(versions[-1])))
    finally:
        loop.stop.set()
        loop.join(timeout=60)
        actor.leave()
    assert loop.error is None, loop.error
    # Each step was generated on exactly the weights the trainer published, read back
    # from the GPU.
    assert loop.served == {p.version: p.weights_hash for p in published[:STEPS]}
    held = engine.held_weights()
    assert all(t.device.type == "cuda" for t in held.values())
    assert aurora_rl.weights_hash(held) == published[STEPS - 1].weights_hash
    # And the GPU computes with them: its greedy tokens are those of the CPU reference on
    # the same weights, up to rounding.
    reference = TransformersEngine.start(str(model_dir))
    reference.load_weights(versions[STEPS - 1])
    assert generation_mismatch(engine.generate(PROMPTS, GREEDY), reference) is None
