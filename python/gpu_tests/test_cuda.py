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


def test_the_gpu_takes_each_ranks_runs_of_a_row_parallel_layer_as_the_host_kernel_does() -> None:
    """A tensor-parallel rank's shard of a matrix split by columns, on the GPU, written
    from every changed element of the matrix (``ElementWrite.runs``): the same bits as
    aurora's host kernel writes into the same shard on the CPU, and the undo restores
    it."""
    from aurora_rl.engines import ElementWrite, _swap_on_host, write_elements

    assert torch.cuda.is_available(), "this suite needs a CUDA GPU"
    generator = torch.Generator().manual_seed(11)
    rows, columns, ranks = 512, 768, 2
    matrix = torch.randn(rows, columns, generator=generator).to(torch.bfloat16)
    indices = (torch.rand(rows * columns, generator=generator) < 0.01).nonzero().flatten()
    values = torch.randn(indices.numel(), generator=generator).to(torch.bfloat16)
    width = columns // ranks
    for rank in range(ranks):
        shard = matrix[:, rank * width : (rank + 1) * width].contiguous().view(-1)
        on_host, on_gpu = shard.clone(), shard.to("cuda")
        write = dict(shift=-rank * width, within=(rank * width, (rank + 1) * width), runs=(rows, columns, width, rows * columns))
        _swap_on_host([ElementWrite(on_host, indices, values, **write)])
        undo = write_elements([ElementWrite(on_gpu, indices, values, **write)])
        assert torch.equal(on_gpu.cpu().view(torch.int16), on_host.view(torch.int16))
        assert not torch.equal(on_host.view(torch.int16), shard.view(torch.int16))
        undo()
        assert torch.equal(on_gpu.cpu().view(torch.int16), shard.view(torch.int16))
