"""One rank of a GRPO-style run whose trainer shards its model with FSDP2 over a gloo
group on the CPU (``test_sharded.py`` spawns the ranks).

Rank 0 holds the trainer node and an actor on the transformers engine, which verifies
every version in full before it serves it. Every rank trains on its share of each
step's rollouts and publishes through ``ShardedPublisher`` (no gather); the gathered
export is then taken too, and rank 0 checks that both are the same weights. At the end
the trainer node is reopened and the ranks resume from their shards.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

import aurora_rl
from aurora_rl.engines.hf import TransformersEngine
from aurora_rl.export import export_bf16
from aurora_rl.sharded import ShardedPublisher


def run(rank: int, ranks: int, port: int, model_dir: str, directory: str, steps: int, out: str) -> None:
    from grpo_steps import grpo_loss, last_version_served, rollout_step, verifying_actor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    torch.set_num_threads(1)
    # FP32 masters, from the BF16 checkpoint the actor serves as version 0.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (ranks,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    trainer = aurora_rl.Trainer(directory, insecure_plaintext=True, snapshot_every=2) if rank == 0 else None
    publisher = ShardedPublisher(model, trainer)
    first = export_bf16(model)
    assert publisher.publish().version == 0
    actor = verifying_actor(trainer, TransformersEngine.start(model_dir), first) if rank == 0 else None

    report = {"versions": []}
    previous = first
    for step in range(steps):
        rollouts = [rollout_step(trainer, actor, step).rollouts if rank == 0 else None]
        dist.broadcast_object_list(rollouts, src=0)
        optimizer.zero_grad(set_to_none=True)
        grpo_loss(model, rollouts[0][rank::ranks]).backward()
        optimizer.step()
        published = publisher.publish()
        assert published.version == step + 1
        gathered = export_bf16(model)
        if rank == 0:
            assert published.weights_hash == aurora_rl.weights_hash(gathered), f"version {published.version}"
            report["versions"].append({
                "version": published.version,
                "sharded_bytes": published.artifact_bytes,
                "gathered_bytes": len(aurora_rl.diff(previous, gathered)),
            })
            previous = gathered
    if rank == 0:
        last_version_served(trainer, actor, published)
        actor.close()
        trainer.close()

    # A restarted trainer node carries on from the ranks' shards.
    trainer = aurora_rl.Trainer(directory, insecure_plaintext=True, snapshot_every=2) if rank == 0 else None
    publisher = ShardedPublisher(model, trainer)
    assert publisher.resume() == steps
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1.001)
    resumed = publisher.publish()
    gathered = export_bf16(model)
    if rank == 0:
        assert (resumed.version, resumed.weights_hash) == (steps + 1, aurora_rl.weights_hash(gathered))
        trainer.close()
        Path(out).write_text(json.dumps(report))
    # Rank 0 serves the group's store: no rank may leave while another still uses it.
    dist.barrier()
    dist.destroy_process_group()


def mistaken(rank: int, ranks: int, port: int, directory: str) -> None:
    """Every rank builds a ``ShardedPublisher``, rank 1 wrongly with a trainer of its own:
    each rank writes what it raised, instead of waiting in a collective for ever."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    trainer = aurora_rl.Trainer(Path(directory) / "trainer", insecure_plaintext=True) if rank == 0 else None
    try:
        ShardedPublisher(torch.nn.Linear(4, 4), trainer if rank != 1 else object())
        raised = "nothing"
    except aurora_rl.UsageError as error:
        raised = str(error)
    Path(directory, f"rank-{rank}").write_text(raised)
    if trainer is not None:
        trainer.close()
    dist.barrier()
    dist.destroy_process_group()
