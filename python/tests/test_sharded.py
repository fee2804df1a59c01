"""Publishing from FSDP2 shards without a gather: ranks of a gloo group on the CPU train a
small Qwen3 (dense, and mixture-of-experts) GRPO-style, each publishing its own shards;
the trainer node assembles each version, which must be the gathered export bit for bit
(the same weights hash), and an actor verifies every version in full before serving it
(``sharded_training.py``)."""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.multiprocessing as mp
from sharded_training import mistaken, run
from test_engines import free_port, small_qwen3
from test_moe import small_qwen3_moe

import aurora_rl
from aurora_rl import _core

STEPS = 3


@pytest.mark.parametrize(
    ("family", "ranks"), [("dense", 2), ("dense", 4), ("mixture-of-experts", 2)]
)
def test_ranks_publish_their_shards_as_the_gathered_version(tmp_path, family, ranks):
    model_dir = (small_qwen3 if family == "dense" else small_qwen3_moe)(tmp_path / "model")
    out = tmp_path / "report.json"
    mp.spawn(run, args=(ranks, free_port(), str(model_dir), str(tmp_path / "trainer"), STEPS, str(out)), nprocs=ranks)
    versions = json.loads(out.read_text())["versions"]
    assert [v["version"] for v in versions] == list(range(1, STEPS + 1))
    for version in versions:
        # The same changes, cut into chunks at the shards' edges as well.
        assert version["sharded_bytes"] <= 1.2 * version["gathered_bytes"] + 4096, version


def specs(state: dict[str, torch.Tensor]) -> list[tuple[str, str, list[int]]]:
    return [(name, "BF16", list(t.shape)) for name, t in state.items()]


def halves(base: dict[str, torch.Tensor], target: dict[str, torch.Tensor], which: int) -> list:
    """Rank ``which`` of two's pieces: each tensor's half of the rows."""
    pieces = []
    for name, t in target.items():
        rows = (t.shape[0] + 1) // 2
        first, end = which * rows, min((which + 1) * rows, t.shape[0])
        row = t[0].numel()
        pieces.append((name, first * row, base[name][first:end].reshape(-1).view(torch.uint8),
                       t[first:end].reshape(-1).view(torch.uint8)))
    return pieces


def test_a_missing_or_doubled_shard_and_a_wrong_base_are_refused(tmp_path):
    generator = torch.Generator().manual_seed(3)
    base = {f"w{i}": torch.randn(64, 40, generator=generator).to(torch.bfloat16) for i in range(3)}
    target = {name: (t.float() * 1.01).to(torch.bfloat16) for name, t in base.items()}
    with aurora_rl.Trainer(tmp_path / "trainer", insecure_plaintext=True) as trainer:
        trainer.publish(base)
        parts = [_core.extract_shard(specs(target), halves(base, target, i), "aurora") for i in range(2)]
        with pytest.raises(aurora_rl.CheckpointError, match="no shard holds the data at byte 2560 of tensor 'w0'"):
            trainer.publish_shards(specs(target), parts[:1])
        with pytest.raises(aurora_rl.CheckpointError, match="overlap|two shards hold"):
            trainer.publish_shards(specs(target), [parts[0], parts[0], parts[1]])
        with pytest.raises(aurora_rl.DeltaError, match="shard part 1 is invalid"):
            trainer.publish_shards(specs(target), [parts[0], parts[1][:-3]])
        stale = [_core.extract_shard(specs(target), halves(target, target, i), "aurora") for i in range(2)]
        with pytest.raises(aurora_rl.UsageError, match="the base is not version 0 as published"):
            trainer.publish_shards(specs(target), stale)
        published = trainer.publish_shards(specs(target), parts)
        assert (published.version, published.weights_hash) == (1, aurora_rl.weights_hash(target))


def test_a_mistake_on_one_rank_is_raised_on_every_rank(tmp_path):
    ranks = 3
    context = mp.spawn(mistaken, args=(ranks, free_port(), str(tmp_path)), nprocs=ranks, join=False)
    # A rank waiting in a collective for ever would hold this join.
    deadline = time.monotonic() + 300
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("a rank still waits in a collective")
    for rank in range(ranks):
        assert "rank 1 was given one" in (tmp_path / f"rank-{rank}").read_text(), rank
