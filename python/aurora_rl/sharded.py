"""Publishing from a model sharded with FSDP2, without gathering it.

Each rank holds a dim-0 shard of every parameter (``fully_shard``'s DTensors). Gathering
them to one rank for every version costs the whole model's bytes through one process; a
``ShardedPublisher`` instead has every rank export its own shards (BF16, under the
checkpoint's names), encode their changes since the last version and hash them, all in
parallel, and hands the ranks' parts (the encoded changes: about the delta's size) to the
``Trainer`` on the publishing rank, which assembles one version: the same weights, and the
same weights hash, as publishing the gathered export (docs/delta-format.md §11).

Every call is a collective: every rank of the group calls it, in the same order. The
first version is published from the gathered export, once: it is a snapshot, which the
store holds whole anyway.
"""

from __future__ import annotations

import builtins
import logging
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from aurora_rl import _core
from aurora_rl._tensors import dtype_name, host_tensor
from aurora_rl.export import Place, checkpoint_places, export_bf16, hugging_face_name
from aurora_rl.trainer import Published, Trainer

logger = logging.getLogger("aurora_rl.sharded")


@dataclass(frozen=True)
class _Piece:
    """The elements ``[first, first + len(data))`` of checkpoint tensor ``name``, as this
    rank exported them."""

    name: str
    first: int
    data: torch.Tensor


class ShardedPublisher:
    """Publishes versions of ``model`` (sharded with FSDP2, or replicated) from every
    rank of ``group`` (the default group when None), through ``trainer``, which the
    publishing rank holds (every other rank passes None).

    Floating-point tensors are published in ``dtype``, under the names the model's
    checkpoints use (``aurora_rl.export``). Parameters must be sharded along dimension 0
    (FSDP2's ``Shard(0)``) or replicated; replicated tensors and buffers are split by rows
    among the ranks, so every rank encodes its share of them too.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        trainer: Optional[Trainer],
        *,
        publishing_rank: int = 0,
        group: Any = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise _core.UsageError("a ShardedPublisher needs torch.distributed initialised: use Trainer.publish")
        self._model = model
        self._group = group
        self._dtype = dtype
        self._rank = dist.get_rank(group)
        self._ranks = dist.get_world_size(group)
        self._publishing = publishing_rank
        self._trainer = trainer
        # Every rank learns of any rank's mistake, rather than waiting in a collective the
        # mistaken one never joins.
        mistake = None
        if (trainer is not None) != (self._rank == publishing_rank):
            mistake = (
                f"the publishing rank ({publishing_rank}) holds the Trainer and no other rank does "
                f"(rank {self._rank} was given {'one' if trainer is not None else 'none'})"
            )
        mistakes: list[Any] = [None] * self._ranks
        dist.all_gather_object(mistakes, mistake, group=group)
        if any(mistakes):
            raise _core.UsageError("; ".join(m for m in mistakes if m))
        self._places: dict[str, Place] = checkpoint_places(model)
        self._encoding = self._broadcast(trainer.encoding if trainer is not None else None)
        self._table: Optional[list[tuple[str, str, list[int]]]] = None
        # This rank's pieces of the latest version: the base of the next.
        self._previous: Optional[list[_Piece]] = None

    def publish(self) -> Published:
        """Publishes the model's current weights as the next version (the first from the
        gathered export) and returns it, on every rank."""
        trainer = self._trainer
        first = self._on_publishing_rank(lambda: trainer._node.latest() is None and trainer._base is None)
        if first:
            state = export_bf16(self._model, publishing_rank=self._global(self._publishing), dtype=self._dtype)
            published = self._on_publishing_rank(lambda: trainer.publish(state))
            self._previous = self._pieces()
            return published
        pieces: list[_Piece] = []

        def part() -> bytes:
            if self._previous is None:
                raise _core.UsageError(
                    "the trainer's store already holds published versions: call resume() with the latest "
                    "version's weights in the model first"
                )
            pieces.extend(self._pieces())
            return self._part(self._previous, pieces)

        parts = self._gather(_outcome(part))
        published = self._on_publishing_rank(lambda: trainer.publish_shards(self._table, _values(parts)))
        self._previous = pieces
        return published

    def resume(self) -> int:
        """Carries on from a reopened trainer directory: the model must hold the latest
        published version's weights (checked by the hash the ranks' shards compose), the
        base of the next publish. Returns that version, on every rank."""
        pieces: list[_Piece] = []

        def part() -> bytes:
            pieces.extend(self._pieces())
            return self._part(pieces, pieces)

        parts = self._gather(_outcome(part))
        version = self._on_publishing_rank(lambda: self._trainer.check_shards(self._table, _values(parts)))
        self._previous = pieces
        return version

    def _pieces(self) -> list[_Piece]:
        """This rank's share of every checkpoint tensor, exported (a new tensor each)."""
        state = self._model.state_dict()
        pieces: list[_Piece] = []
        table = []
        for place, (name, first, shape) in sorted(self._places.items()):
            # As the gathered export names it (without what wrappers add).
            stored = hugging_face_name(place)
            tensor = state[name].detach()
            local, start = self._held(name, tensor)
            count = math.prod(shape)
            exported_dtype = self._dtype if tensor.is_floating_point() else tensor.dtype
            table.append((stored, dtype_name(exported_dtype), list(shape)))
            lo, hi = max(first, start), min(first + count, start + local.numel())
            if lo >= hi:
                continue
            data = local.reshape(-1)[lo - start : hi - start]
            data = data.to(exported_dtype) if data.is_floating_point() else data
            pieces.append(_Piece(stored, lo - first, data.to("cpu", copy=True).contiguous()))
        self._table = table
        return pieces

    def _held(self, name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The elements of state tensor ``name`` this rank exports, flat, and the first's
        number: its dim-0 shard, or its share of the rows of a replicated tensor."""
        placements = getattr(tensor, "placements", None)
        if placements is not None and not all(p.is_replicate() or p.is_shard() for p in placements):
            raise _core.UsageError(f"{name}: placements {placements} hold partial values: publish the gathered export")
        if placements is not None and not all(p.is_replicate() for p in placements):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            local = tensor.to_local()
            shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, placements)
            if list(shape[1:]) != list(tensor.shape[1:]) or any(offset[1:]) or len(tensor.device_mesh.shape) != 1:
                raise _core.UsageError(
                    f"{name}: placements {placements} on a mesh of shape {tuple(tensor.device_mesh.shape)} do not "
                    "shard it along dimension 0 alone (FSDP2's Shard(0)): publish the gathered export instead"
                )
            return local.reshape(-1), offset[0] * math.prod(tensor.shape[1:])
        if placements is not None:
            tensor = tensor.to_local()
        rows = tensor.shape[0] if tensor.dim() else 1
        per_rank = -(-rows // self._ranks)
        first, end = min(self._rank * per_rank, rows), min((self._rank + 1) * per_rank, rows)
        row = tensor.numel() // max(rows, 1)
        return tensor.reshape(-1)[first * row : end * row], first * row

    def _part(self, base: list[_Piece], target: list[_Piece]) -> bytes:
        if [(p.name, p.first, p.data.numel()) for p in base] != [(p.name, p.first, p.data.numel()) for p in target]:
            raise _core.UsageError("this rank's shards moved since the last version: the model was resharded")
        return _core.extract_shard(
            self._table,
            [
                (b.name, b.first, host_tensor(b.name, b.data)[3], host_tensor(t.name, t.data)[3])
                for b, t in zip(base, target)
            ],
            self._encoding,
        )

    def _gather(self, outcome: tuple) -> Optional[list[tuple]]:
        """Every rank's ``outcome`` on the publishing rank (None on the others)."""
        import torch.distributed as dist

        outcomes: Optional[list[Any]] = [None] * self._ranks if self._rank == self._publishing else None
        dist.gather_object(outcome, outcomes, dst=self._global(self._publishing), group=self._group)
        return outcomes

    def _on_publishing_rank(self, call: Any) -> Any:
        """``call()``'s result on the publishing rank, given to every rank; its error
        raised on every rank (so no rank waits for a collective the others left)."""
        outcome = _outcome(call) if self._rank == self._publishing else None
        return _value(self._broadcast(outcome))

    def _broadcast(self, value: Any) -> Any:
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=self._global(self._publishing), group=self._group)
        return box[0]

    def _global(self, rank: int) -> int:
        import torch.distributed as dist

        return rank if self._group is None else dist.get_global_rank(self._group, rank)


def _outcome(call: Any) -> tuple:
    """``("ok", call())``, or what it raised as ``("error", type name, message)``: what a
    rank hands the others, which must all leave a collective the same way."""
    try:
        return ("ok", call())
    except Exception as error:
        return ("error", type(error).__name__, str(error))


def _value(outcome: tuple) -> Any:
    """An outcome's value, or its error raised: as the extension's exception type where
    it is one, as the builtin type where that is one, else as an ``AuroraError``."""
    if outcome[0] == "ok":
        return outcome[1]
    _, name, message = outcome
    kind = getattr(_core, name, None) or getattr(builtins, name, None)
    if not (isinstance(kind, type) and issubclass(kind, Exception)):
        kind, message = _core.AuroraError, f"{name}: {message}"
    raise kind(message)


def _values(outcomes: list[tuple]) -> list[Any]:
    """Every rank's value; the first rank's error raised, naming the rank."""
    for rank, outcome in enumerate(outcomes):
        if outcome[0] == "error":
            _, name, message = outcome
            _value(("error", name, f"rank {rank}: {message}"))
    return [outcome[1] for outcome in outcomes]
