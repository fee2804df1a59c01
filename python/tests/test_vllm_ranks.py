"""One engine's tensor-parallel ranks as one actor (``aurora_rl.engines.vllm_ranks``), over
a real gloo group of two processes: rank 0 drives every step, rank 1 follows, each on its
own half of every tensor's rows. Messages are cut into chunks far smaller than the model
here, so a snapshot, a version and a read-back each cross in several. vLLM's own ranks are
in test_vllm_backend.py; this is the protocol, its failures included, without vLLM."""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from aurora_rl.engines import EngineError, TensorChange, fused_group_names

SHAPES = {
    "model.embed_tokens.weight": (64, 80),  # 10 KiB: larger than a chunk, so it goes alone
    "model.layers.0.mlp.gate_proj.weight": (16, 8),
    "model.layers.0.mlp.up_proj.weight": (16, 8),
    "model.layers.0.mlp.down_proj.weight": (8, 16),
    "model.norm.weight": (2, 8),
}


class ShardWriter:
    """``ModelWriter``'s part in the protocol, on half of each tensor's rows (the test
    double of a rank's model). ``unmapped`` tensors have no element map here."""

    def __init__(self, rank: int, unmapped: tuple[str, ...] = ()) -> None:
        self.rank = rank
        self.unmapped = set(unmapped)
        self.shards: dict[str, torch.Tensor] = {}
        self.mapped: set[str] = set()
        #: Writes until one fails (None: none fails).
        self.writes_until_failure: int | None = None
        self.failure: type[BaseException] = RuntimeError
        #: Changed elements handed to this rank that lie in another rank's rows.
        self.sent_elsewhere = 0

    def _rows(self, shape: Any) -> slice:
        half = shape[0] // 2
        return slice(self.rank * half, (self.rank + 1) * half)

    def map_elements(self, specs: dict) -> None:
        self.mapped.update(specs)

    def source_extents(self, names: Any) -> dict[str, tuple[int, int]]:
        extents = {}
        for name in set(names) - self.unmapped:
            rows, columns = SHAPES[name]
            rows = self._rows((rows,))
            extents[name] = (rows.start * columns, rows.stop * columns)
        return extents

    def load_weights(self, tensors: dict) -> None:
        for name, tensor in tensors.items():
            self.shards[name] = tensor[self._rows(tensor.shape)].clone()

    def whole_loads(self, changes: dict) -> set[str]:
        return {n for n, c in changes.items() if c.indices is None or (c.indices.numel() and n in self.unmapped)}

    def write_changes(self, changes: dict) -> tuple[set[str], Any]:
        whole = self.whole_loads(changes)
        if self.writes_until_failure is not None:
            self.writes_until_failure -= 1
            if self.writes_until_failure == 0:
                self.writes_until_failure = None
                raise self.failure("a short write")
        replaced = []
        for name, change in changes.items():
            # A fused group with a part loaded whole is loaded whole.
            if change.indices is None or name in fused_group_names(whole):
                continue
            flat = self.shards[name].view(-1)
            start = self._rows(change.shape).start * change.shape[1]
            mine = (change.indices >= start) & (change.indices < start + flat.numel())
            self.sent_elsewhere += int((~mine).sum())
            indices = change.indices[mine] - start
            # As aurora's kernel does, the undo keeps the indices it was handed, not a copy.
            replaced.append((flat, change.indices, start, flat[indices].clone()))
            flat[indices] = change.values()[mine]
        reloaded = {name: self.shards[name].clone() for name in fused_group_names(whole)}
        self.load_weights({name: changes[name].tensor for name in fused_group_names(whole)})

        def undo() -> None:
            for flat, handed, start, values in reversed(replaced):
                flat[handed[(handed >= start) & (handed < start + flat.numel())] - start] = values
            self.shards.update(reloaded)

        return whole, undo

    def mismatched(self, expected: dict) -> list[str]:
        return [n for n, t in expected.items() if not torch.equal(self.shards[n], t[self._rows(t.shape)])]

    def held_weights(self) -> dict:
        return dict(self.shards)


def version(number: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(number)
    return {name: torch.randn(shape, generator=generator).bfloat16() for name, shape in SHAPES.items()}


def changes_to(before: dict, after: dict, whole: tuple[str, ...] = ()) -> dict[str, TensorChange]:
    """What an actor hands its engine between two versions: changed elements (each fused
    group whole), laid over the version before as when the engine takes them first."""
    changes = {}
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    for name in fused_group_names(changed):
        if name in whole:
            changes[name] = TensorChange(after[name], None)
            continue
        indices = torch.nonzero(before[name].view(-1) != after[name].view(-1)).view(-1)
        changes[name] = TensorChange(before[name], indices, after[name].view(-1)[indices], laid_over=True)
    return changes


def step(before: dict, fraction: float, seed: int) -> dict:
    """``before`` with ``fraction`` of each tensor's elements (at least one) moved."""
    generator = torch.Generator().manual_seed(seed)
    after = {}
    for name, tensor in before.items():
        flat = tensor.clone().view(-1)
        count = max(1, int(flat.numel() * fraction))
        picked = torch.randperm(flat.numel(), generator=generator)[:count]
        flat[picked] = (flat[picked].float() + 1).bfloat16()
        after[name] = flat.view(tensor.shape)
    return after


def ranks_run(rank: int, port: int) -> None:
    from aurora_rl.engines import vllm_ranks
    from aurora_rl.engines.vllm_ranks import RankedModel, RankGroup, follow

    vllm_ranks.CHUNK_BYTES = 8192
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    ranks = RankGroup(dist.group.WORLD, [0, 1], rank)
    writer = ShardWriter(rank)
    model = RankedModel(writer, ranks)
    v0, v1 = version(0), version(1)
    v2 = step(v1, 0.05, 2)
    # A quarter of the elements: the embedding's changes go in a chunk of their own
    # (rank 0 reckons 10 bytes each), and rank 1's part of them fills most of its buffer.
    v3 = step(v2, 0.25, 3)

    def leads(call: Any) -> Any:
        with model.leading():
            return call()

    def follows(expect: str | None = None) -> None:
        if expect is None:
            follow(ranks, writer)
            return
        with pytest.raises(EngineError, match=expect):
            follow(ranks, writer)

    if rank == 0:
        # The snapshot crosses in chunks; every rank loads its rows.
        leads(lambda: (model.map_elements({n: (list(s), torch.bfloat16) for n, s in SHAPES.items()}), model.load_weights(v1)))
        assert leads(lambda: model.mismatched(v1)) == []
        assert sorted(leads(lambda: model.mismatched(v0))) == sorted(SHAPES), "the read-back tells versions apart"
        # A version as changed elements, and one tensor of a fused group changed whole.
        leads(lambda: model.load_changes(changes_to(v1, v2, whole=("model.layers.0.mlp.up_proj.weight",))))
        assert leads(lambda: model.mismatched(v2)) == []
        assert writer.sent_elsewhere == 0, "rank 0 writes the changes of its own rows only"
        # Rank 1 fails its write: no rank keeps any of the version.
        with pytest.raises(EngineError, match="rank 1: RuntimeError: a short write"):
            leads(lambda: model.load_changes(changes_to(v2, v3)))
        assert leads(lambda: model.mismatched(v2)) == []
        # Rank 0 fails its write: the same.
        writer.writes_until_failure = 1
        with pytest.raises(RuntimeError, match="a short write"):
            leads(lambda: model.load_changes(changes_to(v2, v3)))
        assert leads(lambda: model.mismatched(v2)) == []
        # Rank 0 fails its second chunk: rank 1 undoes both, the first from the buffer it
        # held while the second arrived.
        writer.writes_until_failure = 2
        with pytest.raises(RuntimeError, match="a short write"):
            leads(lambda: model.load_changes(changes_to(v2, v3)))
        assert leads(lambda: model.mismatched(v2)) == []
        # Rank 0 is interrupted in its second chunk: it undoes its first, rank 1 both.
        writer.writes_until_failure, writer.failure = 2, KeyboardInterrupt
        with pytest.raises(KeyboardInterrupt):
            leads(lambda: model.load_changes(changes_to(v2, v3)))
        assert leads(lambda: model.mismatched(v2)) == []
        # An element of rank 1's rows changed behind the engine's back is named.
        assert leads(lambda: model.mismatched(v2)) == ["model.norm.weight"]
        # Rank 0 stops midway through a version: rank 1 undoes what it wrote of it.
        with pytest.raises(KeyboardInterrupt):
            with model.leading():
                ranks.send("write", [("model.norm.weight", "elements", (2, 8), torch.bfloat16)],
                           [torch.tensor([8, 9]), torch.zeros(2, dtype=torch.bfloat16)])
                raise KeyboardInterrupt
        assert leads(lambda: model.mismatched(v2)) == ["model.norm.weight"]
        # A tensor rank 1 lost its element map for since the map (rank 0 has one):
        # refused, not guessed at.
        with pytest.raises(EngineError, match="rank 1: EngineError: no element map here for model.layers.0.mlp.down_proj"):
            leads(lambda: model.load_changes(changes_to(v2, v3)))
        assert leads(lambda: model.mismatched(v2)) == ["model.norm.weight"]
        # Mapped again, rank 1 has none for it (as a rank holding none of an expert):
        # it travels whole, rank 1 loads it whole, rank 0 writes its elements.
        leads(lambda: model.map_elements({"model.layers.0.mlp.down_proj.weight": ([8, 16], torch.bfloat16)}))
        leads(lambda: model.load_changes(changes_to(v2, v3)))
        assert leads(lambda: model.mismatched(v3)) == []
    else:
        for _ in range(4):
            follows()
        assert writer.mapped == set(SHAPES)
        follows()
        assert writer.sent_elsewhere == 0, "rank 0 sends rank 1 the changes of its rows only"
        writer.writes_until_failure = 1
        follows(expect="rank 0: EngineError: the version was not written")
        follows()
        follows(expect="rank 0: RuntimeError: a short write")
        follows()
        follows(expect="rank 0: RuntimeError: a short write")
        follows()
        follows(expect="rank 0: KeyboardInterrupt")
        follows()
        kept = writer.shards["model.norm.weight"][0, 3].clone()
        writer.shards["model.norm.weight"][0, 3] += 1
        follows()
        follows(expect="rank 0: KeyboardInterrupt")
        assert torch.equal(writer.shards["model.norm.weight"][0, :2], v2["model.norm.weight"][1, :2])
        follows()
        writer.unmapped.add("model.layers.0.mlp.down_proj.weight")
        follows(expect="rank 0: EngineError: the version was not written")
        follows()
        writer.shards["model.norm.weight"][0, 3] = kept
        for _ in range(3):
            follows()
    # Both ranks leave the group together: gloo aborts a process whose peer went first.
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_every_rank_does_rank_zeros_steps_on_its_shards_and_none_keeps_a_version_another_failed():
    mp.spawn(ranks_run, args=(free_port(),), nprocs=2)


def test_a_reload_never_gets_part_of_a_layer():
    """vLLM's layerwise reload rebuilds a layer that received part of its weights and
    leaves the rest uninitialised: messages keep every tensor of a numbered block (its
    experts, and a bias beside its weight) together, whatever their size."""
    from aurora_rl.engines import vllm_ranks

    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.bias",
             "model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.experts.3.gate_proj.weight",
             "model.layers.1.mlp.experts.4.up_proj.weight", "model.embed_tokens.weight", "lm_head.weight",
             "model.norm.weight"]
    groups = vllm_ranks._layer_groups(names)
    assert sorted(map(sorted, groups)) == sorted(map(sorted, [
        names[:3], names[3:5], ["model.embed_tokens.weight"], ["lm_head.weight"], ["model.norm.weight"]]))
    chunks = list(vllm_ranks._chunks(groups, lambda name: vllm_ranks.CHUNK_BYTES // 2))
    assert sorted(sum(chunks, [])) == sorted(names)
    for group in groups:
        assert any(set(group) <= set(chunk) for chunk in chunks), f"{group} was split"

