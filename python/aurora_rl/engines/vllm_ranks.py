"""One vLLM engine's tensor-parallel ranks as one aurora actor (docs/vllm-backend.md §4).

Rank 0's worker runs the actor node: it joins, stages each version against the node's
host copy and checks its weights hash, as the worker of a single-rank engine does. The
other ranks run no node and hold no copy, so a machine of N ranks keeps one copy of the
model in host memory, not N, and the fleet counts the engine once. Whenever rank 0's node
hands its engine something (the snapshot it joined from, a version's changed elements,
tensors to read back), rank 0 sends it to the other ranks over vLLM's tensor-parallel
group (its gloo CPU group), and every rank does the same step on its own shards
(``ModelWriter``: each rank's element map holds its shards only).

A message carries at most ``CHUNK_BYTES`` of tensors (more only for one layer larger than
that: a reload must not split a layer), packed into a buffer each rank keeps, so what a
rank holds beyond its shards is a chunk or a layer: a snapshot or a full read-back
crosses in pieces, not as a model.

A step ends with every rank's outcome gathered to all of them. A version's element writes
stay only where every rank wrote its shards, and are undone on every rank otherwise (also
when rank 0's call ends midway), so no rank serves a version the others do not. A tensor
loaded whole is not undone (vLLM's reload keeps no undo); the actor then leaves the fleet,
as after any failed load.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from aurora_rl.engines import EngineError, TensorChange, fused_group_names

if TYPE_CHECKING:
    import torch

    from aurora_rl.engines.vllm_worker import ModelWriter

#: The most tensor bytes one message carries (unless one tensor is larger).
CHUNK_BYTES = 64 << 20

#: Where each tensor of a message lies in its buffer: offset, dtype, shape.
_Layout = list[tuple[int, "torch.dtype", tuple[int, ...]]]


class RankGroup:
    """The ranks of one engine: rank 0 sends (``send``), the others ``receive``, and all
    of them ``gather`` each step's outcomes."""

    def __init__(self, group: Any, ranks: list[int], rank: int) -> None:
        #: A gloo process group of the engine's ranks (their global ranks in ``ranks``,
        #: rank 0 first); this process is ``rank`` in it.
        self._group = group
        self._root = ranks[0]
        self.rank = rank
        self.size = len(ranks)
        #: The buffer every message but the held ones lands in, kept for the next.
        self._kept: Optional[torch.Tensor] = None
        #: Whether a received message's tensors are still in use (``hold``).
        self._kept_held = False

    @classmethod
    def of_worker(cls) -> Optional[RankGroup]:
        """The worker's tensor-parallel group, or None without tensor parallelism."""
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        if group.world_size == 1:
            return None
        return cls(group.cpu_group, list(group.ranks), group.rank_in_group)

    def _buffer(self, size: int) -> torch.Tensor:
        """Where a message of ``size`` bytes goes: the kept buffer, unless it is too
        small or held (a buffer of its own then, dropped with the message)."""
        import torch

        if size > CHUNK_BYTES or self._kept_held:
            return torch.empty(size, dtype=torch.uint8)
        if self._kept is None:
            self._kept = torch.empty(CHUNK_BYTES, dtype=torch.uint8)
        return self._kept[:size]

    def hold(self, tensors: list[torch.Tensor]) -> None:
        """Keeps a received message's ``tensors`` valid past the next message (an undo
        that keeps its indices, until ``release``)."""
        if self._kept is not None and any(t.untyped_storage().data_ptr() == self._kept.untyped_storage().data_ptr() for t in tensors):
            self._kept_held = True

    def release(self) -> None:
        """The held messages' tensors are no longer in use."""
        self._kept_held = False

    def send(self, kind: str, meta: Any = None, tensors: Iterable[torch.Tensor] = ()) -> None:
        """Rank 0: one message, ``meta`` (picklable) and ``tensors``, to every other rank."""
        import torch

        tensors = list(tensors)
        layout: _Layout = []
        size = 0
        for tensor in tensors:
            layout.append((size, tensor.dtype, tuple(tensor.shape)))
            # Every tensor starts 8-aligned, so each can be viewed as its dtype.
            size += -(-tensor.numel() * tensor.element_size() // 8) * 8
        buffer = self._buffer(size)
        for (offset, _, _), tensor in zip(layout, tensors):
            flat = tensor.detach().reshape(-1).view(torch.uint8)
            buffer[offset : offset + flat.numel()].copy_(flat)
        torch.distributed.broadcast_object_list([(kind, meta, layout, size)], src=self._root, group=self._group)
        if size:
            torch.distributed.broadcast(buffer, src=self._root, group=self._group)

    def receive(self) -> tuple[str, Any, list[torch.Tensor]]:
        """Another rank: rank 0's next message. Its tensors are views of a buffer,
        valid until the next message unless held (``hold``)."""
        import torch

        box: list[Any] = [None]
        torch.distributed.broadcast_object_list(box, src=self._root, group=self._group)
        kind, meta, layout, size = box[0]
        buffer = self._buffer(size)
        if size:
            torch.distributed.broadcast(buffer, src=self._root, group=self._group)
        tensors = [
            buffer[offset : offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            for offset, dtype, shape in layout
        ]
        return kind, meta, tensors

    def gather(self, outcome: tuple[Optional[str], Any]) -> list[tuple[Optional[str], Any]]:
        """Every rank's outcome of a step (an error, or None, and what it found), in rank
        order, on every rank."""
        import torch

        outcomes: list[Any] = [None] * self.size
        torch.distributed.all_gather_object(outcomes, outcome, group=self._group)
        return outcomes


def _named(rank: int, error: BaseException) -> str:
    return f"rank {rank}: {type(error).__name__}: {error}"


def _chunks(groups: Iterable[list[str]], nbytes: Callable[[str], int]) -> Iterator[list[str]]:
    """``groups`` of names (kept together) in runs of at most ``CHUNK_BYTES`` (a group
    larger than that goes alone)."""
    chunk: list[str] = []
    size = 0
    for group in groups:
        group_size = sum(nbytes(name) for name in group)
        if chunk and size + group_size > CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
        chunk += group
        size += group_size
    if chunk:
        yield chunk


def _layer_groups(names: Iterable[str]) -> list[list[str]]:
    """``names`` grouped by the layer they load into: everything under a numbered block
    (``model.layers.3.``, experts and fused q/k/v, gate/up included), else everything of
    one module. vLLM's layerwise reload rebuilds a layer that received part of its
    weights and leaves the rest of it uninitialised, so one reload never splits a layer."""
    groups: dict[str, list[str]] = {}
    for name in sorted(names):
        parts = name.split(".")
        numbered = next((i for i, part in enumerate(parts[:-1]) if part.isdigit()), None)
        layer = ".".join(parts[: numbered + 1] if numbered is not None else parts[:-1])
        groups.setdefault(layer, []).append(name)
    return list(groups.values())


def _shape_only(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` that holds one element: what a change written
    element by element needs of its tensor."""
    import torch

    return torch.empty((), dtype=dtype).expand(shape)


def _within(change: TensorChange, extent: Optional[tuple[int, int]]) -> list[torch.Tensor]:
    """The indices and values of ``change`` in ``[first, end)`` (all without an extent):
    views, the indices being ascending."""
    import torch

    indices, values = change.indices, change.values()
    if extent is None:
        return [indices, values]
    first, end = torch.searchsorted(indices, torch.tensor(extent)).tolist()
    return [indices[first:end], values[first:end]]


class RankedModel:
    """The ``aurora_rl.engines.MappedEngine`` and ``CheckedEngine`` an actor node drives in
    rank 0's worker: each step done on rank 0's shards by ``writer`` and, with ``ranks``,
    on every other rank's (``follow``). Without ``ranks`` (one rank), only the first."""

    def __init__(self, writer: ModelWriter, ranks: Optional[RankGroup] = None) -> None:
        self.writer = writer
        self.ranks = ranks
        #: Per mapped tensor, the flat indices ``[first, end)`` the other ranks' shards
        #: span, and rank 0's: a rank is handed only the changes in its span (a
        #: column-parallel layer's shard spans its rows).
        self._extents: dict[str, tuple[int, int]] = {}
        self._own_extents: dict[str, tuple[int, int]] = {}
        #: Tensors some other rank has no element map for (it holds none of an expert
        #: under expert parallelism, or its loader transforms it): they travel whole.
        self._whole_elsewhere: set[str] = set()

    @contextlib.contextmanager
    def leading(self) -> Iterator[None]:
        """Rank 0's part of a call every rank is in (vLLM's ``init_transfer_engine``,
        ``receive_weights``): the other ranks follow until it ends, and fail with it."""
        if self.ranks is None:
            yield
            return
        try:
            yield
        except BaseException as error:
            self.ranks.send("end", _named(0, error))
            raise
        self.ranks.send("end")

    def keep_following(self) -> None:
        """Tells the other ranks rank 0 is still waiting: their receive has the group's
        timeout (gloo's, 30 minutes unless vLLM sets another)."""
        if self.ranks is not None:
            self.ranks.send("wait")

    def _step(
        self,
        kind: str,
        parts: Iterable[tuple[Any, list[torch.Tensor], Callable[[], Any]]],
        undo: Callable[[Any], None] = lambda _: None,
        refused: str = "",
    ) -> tuple[list[Any], list[Any]]:
        """For each part: sends its message to the other ranks, then does its own work
        here (so every rank works on a chunk at once); then gathers every rank's outcome.
        Returns what each part's work here returned and what each other rank found. If
        any rank failed (rank 0 stops at its first failure, in its work or in making the
        next part), ``undo`` takes back each part's work here, last first, and rank 0's
        error is raised, else an ``EngineError`` of ``refused`` and the other ranks'
        errors. An interrupt here is raised after the undo, ungathered (the other ranks
        undo at the end of rank 0's call)."""
        assert self.ranks is not None
        done: list[Any] = []

        def undo_done() -> None:
            for result in reversed(done):
                undo(result)

        failure: Optional[Exception] = None
        try:
            for meta, tensors, local in parts:
                self.ranks.send(kind, meta, tensors)
                done.append(local())
        except Exception as error:
            failure = error
        except BaseException:
            undo_done()
            raise
        self.ranks.send("gather")
        outcomes = self.ranks.gather((None if failure is None else _named(0, failure), None))
        errors = [error for error, _ in outcomes[1:] if error]
        if failure is not None or errors:
            undo_done()
            if failure is not None:
                raise failure
            raise EngineError(refused + "; ".join(errors))
        return done, [found for _, found in outcomes[1:]]

    def map_elements(self, specs: Mapping[str, tuple[list[int], torch.dtype]]) -> None:
        if self.ranks is None:
            self.writer.map_elements(specs)
            return
        _, found = self._step("map", [(dict(specs), [], lambda: self.writer.map_elements(specs))])
        self._own_extents.update(self.writer.source_extents(specs))
        for name in specs:
            spans = [extents.get(name) for extents in found]
            if all(spans):
                self._extents[name] = (min(first for first, _ in spans), max(end for _, end in spans))
            else:
                self._whole_elsewhere.add(name)

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        if self.ranks is None:
            self.writer.load_weights(tensors)
            return

        def part(chunk: list[str]) -> tuple[Any, list[torch.Tensor], Callable[[], None]]:
            loaded = {name: tensors[name] for name in chunk}
            return chunk, list(loaded.values()), lambda: self.writer.load_weights(loaded)

        chunks = _chunks(_layer_groups(tensors), lambda name: tensors[name].nbytes)
        self._step("load", map(part, chunks))

    def load_changes(self, changes: Mapping[str, TensorChange]) -> None:
        if self.ranks is None:
            self.writer.load_changes(changes)
            return
        # What rank 0 loads whole, or another rank cannot write element by element,
        # travels whole; the rest as changed elements. Rank 0 writes the elements of
        # what it can.
        unmapped_elsewhere = {n for n, c in changes.items() if n in self._whole_elsewhere and c.indices is not None and c.indices.numel()}
        whole = fused_group_names(self.writer.whole_loads(changes) | unmapped_elsewhere) & changes.keys()

        def nbytes(name: str) -> int:
            # From the shape, not ``tensor``: that lays the changes over a copy.
            change = changes[name]
            if name in whole:
                return math.prod(change.shape) * change.dtype.itemsize
            return change.indices.numel() * (8 + change.dtype.itemsize)

        def part(chunk: list[str]) -> tuple[Any, list[torch.Tensor], Callable[[], Any]]:
            meta, tensors, written = [], [], {}
            for name in chunk:
                change = changes[name]
                if name in whole:
                    meta.append((name, "whole", tuple(change.shape), change.dtype))
                    tensors.append(change.tensor)
                    written[name] = change
                else:
                    meta.append((name, "elements", tuple(change.shape), change.dtype))
                    tensors += _within(change, self._extents.get(name))
                    indices, values = _within(change, self._own_extents.get(name))
                    written[name] = TensorChange(_shape_only(change.shape, change.dtype), indices, values)
            return meta, tensors, lambda: self.writer.write_changes(written)[1]

        chunks = _chunks(_layer_groups(changes), nbytes)
        self._step("write", map(part, chunks), undo=lambda undo: undo(),
                   refused="the version was not written, and rank 0 undid its writes: ")

    def mismatched(self, expected: Mapping[str, torch.Tensor]) -> list[str]:
        if self.ranks is None:
            return self.writer.mismatched(expected)

        def part(chunk: list[str]) -> tuple[Any, list[torch.Tensor], Callable[[], list[str]]]:
            checked = {name: expected[name] for name in chunk}
            return chunk, list(checked.values()), lambda: self.writer.mismatched(checked)

        chunks = _chunks(([name] for name in sorted(expected)), lambda name: expected[name].nbytes)
        done, found = self._step("check", map(part, chunks))
        return sorted(set().union(*done, *(names or [] for names in found)))

    def held_weights(self) -> Mapping[str, torch.Tensor]:
        """Rank 0's (shards are not gathered)."""
        return self.writer.held_weights()

    def generate(self, prompts: Any, sampling: Any) -> Any:
        raise NotImplementedError("vLLM generates: this engine only loads versions into its model")


@dataclass
class _Following:
    """What a following rank did in the step under way."""

    error: Optional[str] = None
    #: What the step found here: the tensors a check found different, or the extents of
    #: the tensors a map mapped (``ModelWriter.source_extents``).
    found: Any = None
    undos: list[Callable[[], None]] = field(default_factory=list)

    def undo(self) -> None:
        for undo in reversed(self.undos):
            undo()
        self.undos.clear()


def follow(ranks: RankGroup, writer: ModelWriter) -> None:
    """Another rank's part of a call every rank is in: does rank 0's steps on this rank's
    shards until rank 0's call ends; raises if it ended in failure."""
    step = _Following()
    while True:
        kind, meta, tensors = ranks.receive()
        if kind == "wait":
            continue
        if kind == "end":
            # Writes whose step never ended: rank 0 stopped midway.
            step.undo()
            ranks.release()
            if meta is not None:
                raise EngineError(f"rank {ranks.rank} followed rank 0, which failed: {meta}")
            return
        if kind == "gather":
            outcomes = ranks.gather((step.error, step.found))
            if any(error for error, _ in outcomes):
                step.undo()
            ranks.release()
            step = _Following()
            continue
        if step.error is not None:
            continue
        try:
            _do(kind, meta, tensors, writer, step)
        except Exception as error:
            step.error = _named(ranks.rank, error)
        if step.undos:
            # The undo keeps the indices it was handed: views of this message.
            ranks.hold(tensors)


def _do(kind: str, meta: Any, tensors: list[torch.Tensor], writer: ModelWriter, step: _Following) -> None:
    """One of rank 0's messages, on this rank's shards."""
    if kind == "map":
        writer.map_elements(meta)
        # The extents of what this rank holds (None where it has no element map).
        extents = writer.source_extents(meta)
        step.found = {name: extents.get(name) for name in meta}
    elif kind == "load":
        writer.load_weights(dict(zip(meta, tensors)))
    elif kind == "check":
        step.found = (step.found or []) + writer.mismatched(dict(zip(meta, tensors)))
    elif kind == "write":
        changes: dict[str, TensorChange] = {}
        sent = iter(tensors)
        for name, form, shape, dtype in meta:
            if form == "whole":
                changes[name] = TensorChange(next(sent), None)
            else:
                indices, values = next(sent), next(sent)
                changes[name] = TensorChange(_shape_only(shape, dtype), indices, values)
        sent_whole = {name for name, form, _, _ in meta if form == "whole"}
        unsent = fused_group_names(writer.whole_loads(changes)) - sent_whole
        if unsent:
            raise EngineError(
                f"no element map here for {', '.join(sorted(unsent))}, which rank 0 writes element by element"
            )
        _, undo = writer.write_changes(changes)
        step.undos.append(undo)
    else:
        raise EngineError(f"rank 0 sent a step this rank does not know: {kind!r}")
