"""The boundary between an aurora actor and an inference engine.

An actor keeps a host copy of its weights (what its weights hash is computed from),
applies each committed delta to it, and at the engine's safe point (between batches)
hands the engine the tensors that changed. An ``ElementEngine`` gets the changed elements
first, and the host copy takes them once the engine is serving the version. An engine
adapter is one class with the methods of ``Engine``; adding an engine is one module
against it.

- ``aurora_rl.engines.vllm.VllmEngine``: vLLM, offline ``LLM`` (in this process or in
  vLLM's engine process) or the OpenAI-compatible server.
- ``aurora_rl.engines.sglang.SglangEngine``: SGLang's Python ``Engine``.
- ``aurora_rl.engines.hf.TransformersEngine``: Hugging Face transformers, the reference
  engine and the CPU fallback.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Protocol

from aurora_rl import _core

if TYPE_CHECKING:
    import torch


class EngineError(_core.AuroraError, RuntimeError):
    """An engine refused or failed a weight update, a read-back or a request; the message
    is the engine's own."""


@dataclass(frozen=True)
class Sampling:
    """How to continue each prompt. ``temperature`` 0 is greedy."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: Optional[int] = None


@dataclass
class Completion:
    """The tokens generated for one prompt, each with its log-probability under the
    weights it was generated on."""

    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)


class TensorChange:
    """How one tensor changed at an activation, for an engine that writes changed elements
    in place (``ElementEngine``).

    ``tensor`` is the whole new tensor. An actor whose engine takes changes before the
    node's copy has them (the default for an ``ElementEngine``, see ``needs_new_tensors``)
    hands over the tensor before the change with ``laid_over=True``: ``tensor`` is then
    made from it and the new values on first use, a copy of the tensor, so an engine that
    writes only the changed elements never pays for it."""

    __slots__ = ("_tensor", "_laid_over", "indices", "new_values")

    def __init__(
        self,
        tensor: torch.Tensor,
        indices: Optional[torch.Tensor],
        new_values: Optional[torch.Tensor] = None,
        *,
        laid_over: bool = False,
    ) -> None:
        if laid_over and (indices is None or new_values is None):
            raise ValueError("changes laid over a tensor come with their indices and values")
        self._tensor = tensor
        self._laid_over = laid_over
        #: Flat int64 indices of the changed elements, ascending (empty for a fused group's
        #: unchanged part); None when the tensor changed whole (a snapshot, a new layout).
        self.indices = indices
        #: Their new values, in order, when the transport handed them over (read from the
        #: delta it staged, so writing them reads nothing else); None: taken from ``tensor``.
        self.new_values = new_values

    @property
    def shape(self) -> torch.Size:
        return self._tensor.shape

    @property
    def dtype(self) -> torch.dtype:
        return self._tensor.dtype

    @property
    def tensor(self) -> torch.Tensor:
        """The whole new tensor: a read-only view of the actor's host copy, valid during
        the call only, or one made for this call where the changes are laid over."""
        if self._laid_over:
            import torch

            with torch.no_grad():
                laid = self._tensor.clone()
                laid.view(-1)[self.indices] = self.new_values
            self._tensor, self._laid_over = laid, False
        return self._tensor

    def values(self) -> torch.Tensor:
        """The changed elements' new values, in the order of ``indices``."""
        assert self.indices is not None, "a tensor changed whole has no element values"
        if self.new_values is not None:
            return self.new_values
        return self.tensor.reshape(-1)[self.indices]


class Engine(Protocol):
    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Make ``tensors`` (Hugging Face names; the ones that changed, each fused group
        whole, see ``with_fused_groups``) part of the weights every request that starts
        after this returns runs on. Called only at the engine's safe point, between
        batches, so no request runs on a mix of two versions."""
        ...

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[Completion]:
        """One batch: a completion per prompt, in order."""
        ...

    def held_weights(self) -> Optional[Mapping[str, torch.Tensor]]:
        """The weights the engine computes with, under Hugging Face names, read back
        from the engine itself where its layout allows it, else None."""
        ...


class ElementEngine(Engine, Protocol):
    """An engine that writes changed elements into its parameters in place, so that
    activating a version costs what the delta costs. Its actor hands it a verified
    version's changes before the node's own copy takes them, so that the engine serves
    the version one pass over memory sooner; an engine whose ``load_changes`` reads
    every changed tensor whole says ``needs_new_tensors = True`` and gets them after."""

    def load_changes(self, changes: Mapping[str, TensorChange]) -> None:
        """Like ``load_weights``, for ``changes`` (Hugging Face names; every part of a
        fused group one of them belongs to): changed elements are written where the
        engine holds them; tensors it cannot write element-wise (repacked, quantized, or
        changed whole) it loads whole. Transactional: on an error no written element
        stays written."""
        ...


class MappedEngine(ElementEngine, Protocol):
    """An ``ElementEngine`` that finds where each tensor's elements lie in its parameters
    once, ahead of the versions that write them."""

    def map_elements(self, specs: Mapping[str, tuple[list[int], torch.dtype]]) -> None:
        """Finds where the elements of every tensor of ``specs`` (Hugging Face name: shape,
        dtype) lie in the engine. The actor calls it once, with every tensor of the
        weights, before its first activation: a tensor a version is the first to change
        (one of a few hundred elements may go unchanged for several steps) or a read-back
        samples is then not mapped while the engine waits for the version."""
        ...


class CheckedEngine(Engine, Protocol):
    """An engine that checks, element by element, that it computes with a version."""

    def mismatched(self, expected: Mapping[str, torch.Tensor]) -> Optional[list[str]]:
        """The names of ``expected`` (Hugging Face names: the version's tensors) whose
        values the engine does not compute with bit for bit, each read back from the
        engine itself (an engine split over ranks checks the elements each holds); None
        where this engine cannot read its weights back (an engine in another process)."""
        ...


class LabelledEngine(Engine, Protocol):
    """An engine that reports which version its outputs come from, in its own terms."""

    def set_weight_version(self, weight_version: str) -> None:
        """Label what the engine serves from now on (``weight_version``)."""
        ...


def weight_version(version: int, weights_hash: str) -> str:
    """How aurora names a version to an engine, as its weight version: the version number
    and the weights hash it was checked against."""
    return f"{version}:{weights_hash}"


def labels_versions(engine: Engine) -> bool:
    """Whether ``engine`` takes a weight version (``LabelledEngine``)."""
    return callable(getattr(engine, "set_weight_version", None))


def maps_elements(engine: Engine) -> bool:
    """Whether ``engine`` maps tensors' elements ahead of versions (``MappedEngine``)."""
    return callable(getattr(engine, "map_elements", None))


def checks_weights(engine: Engine) -> bool:
    """Whether ``engine`` checks what it computes with (``CheckedEngine``)."""
    return callable(getattr(engine, "mismatched", None))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one dtype and shape hold the same bits (NaNs and signed
    zeros told apart, as the weights hash tells them apart)."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    as_bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(as_bits), b.view(as_bits))


@dataclass(frozen=True)
class ElementWrite:
    """Values to write at flat indices (int64, strictly ascending) of a 1-D view of an
    engine's parameter memory: index ``i`` lands on element ``i + shift``, and every
    index lies in ``within`` (default: the target's elements), the block of a checkpoint
    tensor this memory holds; or, with ``runs``, in one of the runs of that block."""

    target: torch.Tensor
    indices: torch.Tensor
    values: torch.Tensor
    #: ``(rows, columns, block, group)`` where the memory holds a matrix packed for a CPU's
    #: kernels (``Packing``) and the shifted indices are its row-major ones; None where
    #: element ``i`` is at ``i``.
    packed: Optional[tuple[int, int, int, int]] = None
    shift: int = 0
    within: Optional[tuple[int, int]] = None
    #: The checkpoint tensor and the parameter, named in a refusal.
    tensor: str = "a tensor"
    parameter: str = "parameter memory"
    #: ``(count, source_stride, target_stride, elements)`` where the block is ``count``
    #: runs like ``within``, each ``source_stride`` further in the tensor and
    #: ``target_stride`` further in the memory (``element_map.Runs``): the indices and
    #: values are then those of the whole tensor of ``elements``, and the ones outside
    #: the runs are left to the memory that holds them (another rank, another part).
    runs: Optional[tuple[int, int, int, int]] = None


def write_elements(writes: Sequence[ElementWrite]) -> Callable[[], None]:
    """Writes every ``ElementWrite``. In host memory, aurora's kernel swaps the values in:
    one pass over the changed elements of every target together, shared over the cores,
    keeping what they replaced for the undo; on a GPU, indices and values are moved to
    the device first (only the changes travel), checked there with one wait for all,
    and scattered. Everything is checked before the first element lands, and a failure
    undoes what was written. Returns the undo: it writes the replaced values back."""
    import torch

    for write in writes:
        target = write.target
        if target.dim() != 1:
            raise ValueError(f"element writes go to a 1-D view, not {tuple(target.shape)}")
        if write.values.dtype != target.dtype:
            raise ValueError(f"{write.tensor}: values of {write.values.dtype} for parameter memory of {target.dtype}")
        if write.indices.shape != write.values.shape:
            raise ValueError(f"{write.tensor}: {write.indices.numel()} indices for {write.values.numel()} values")
    on_host = [write for write in writes if write.target.device.type == "cpu"]
    on_device = [write for write in writes if write.target.device.type != "cpu"]
    undos: list[Callable[[], None]] = []

    def undo() -> None:
        with torch.no_grad():
            for undo_write in reversed(undos):
                undo_write()

    with torch.no_grad():
        placed = _upload_checked(on_device) if on_device else []
        if on_host:
            undos.append(_swap_on_host(on_host))
        try:
            if placed:
                undos.append(_scatter(placed))
        except BaseException:
            undo()
            raise
    return undo


def _swap_on_host(writes: Sequence[ElementWrite]) -> Callable[[], None]:
    """Swaps the writes into host memory in one call, grouped by the memory they land
    in; returns the undo (what each write replaced, swapped back in)."""
    import torch

    targets: dict[tuple[int, int], tuple] = {}
    for write in writes:
        target = write.target
        key = (target.data_ptr(), target.numel())
        if key not in targets:
            targets[key] = (write.parameter, target.view(torch.uint8), target.element_size(), write.packed, [])
        elif targets[key][3] != write.packed:
            raise ValueError(f"{write.tensor}: {write.parameter} written under two layouts in one version")
        start, end = write.within if write.within is not None else (0, target.numel())
        targets[key][4].append((
            write.tensor,
            write.indices.to(torch.int64).contiguous().view(torch.uint8),
            start,
            end,
            write.shift,
            write.runs,
            write.values.contiguous().view(torch.uint8),
            # Takes the new values, copied by the core (not by torch, whose OpenMP threads
            # would then spin on the cores the swap needs), and swapped with the target's
            # elements: afterwards it holds what they replaced, and swapping again
            # restores them.
            torch.empty(write.values.numel() * write.values.element_size(), dtype=torch.uint8),
        ))
    batch = list(targets.values())
    _core.swap_elements(batch)
    # The kept values swapped back in, each keep buffer now the values.
    undo_batch = [
        (label, memory, size, packed, [(*write, kept, None) for *write, _, kept in writes])
        for label, memory, size, packed, writes in batch
    ]
    return lambda: _core.swap_elements(undo_batch)


def _scatter_on_device(writes: Sequence[ElementWrite]) -> Callable[[], None]:
    """Writes ``writes`` on their devices, all checked first; returns the undo."""
    return _scatter(_upload_checked(writes))


def _upload_checked(writes: Sequence[ElementWrite]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Moves each write's indices and values to its device and checks them as aurora's
    host kernel does, before anything lands: the bounds on the host, where the caller's
    indices are (ascending, their first and last are their least and greatest), the
    order on the device, waited on once for every write (a write of runs waits for its
    own selection). Returns each target with its indices there and their values."""
    import torch

    placed, orders = [], []
    for write in writes:
        target = write.target
        if write.packed is not None:
            raise ValueError(f"packed parameter memory is written on the CPU, not on {target.device}")
        start, end = write.within if write.within is not None else (0, target.numel())
        count, source_stride, target_stride, elements = write.runs or (1, 0, 0, end)
        if write.indices.numel():
            least, greatest = int(write.indices[0]), int(write.indices[-1])
            if write.runs is None and (least < start or greatest >= end):
                raise IndexError(f"{write.tensor}: an element index outside the elements {start}..{end} it holds")
            if least < 0 or greatest >= elements:
                raise IndexError(f"{write.tensor}: an element index beyond its {elements} elements")
        run, last = end - start, max(count - 1, 0)
        # As the host kernel refuses them (aurora_delta::ElementWrite::cut).
        disjoint = count <= 1 or (run > 0 and source_stride >= run and target_stride >= run)
        if count < 0 or not disjoint or start + last * source_stride + run > elements:
            raise ValueError(
                f"{write.tensor}: {count} runs of elements {start}..{end}, {source_stride} apart in the tensor "
                f"and {target_stride} in the target, are not disjoint blocks of its {elements} elements"
            )
        if start + write.shift < 0 or end + write.shift + last * target_stride > target.numel():
            raise IndexError(f"{write.tensor}: its block falls outside the {target.numel()} elements of {write.parameter}")
        indices = write.indices.to(target.device, torch.int64, non_blocking=True)
        values = write.values.to(target.device, non_blocking=True)
        # A repeated index would land one of its values.
        if indices.numel() > 1:
            orders.append((write, (indices[1:] > indices[:-1]).all()))
        if write.runs is None:
            indices = indices + write.shift
        else:
            # The tensor's indices in the runs, each moved by its run's shift.
            offset = indices - start
            of_run = torch.div(offset, source_stride, rounding_mode="floor") if count > 1 else torch.zeros_like(offset)
            inside = (offset >= 0) & (of_run < count) & (offset - of_run * source_stride < run)
            indices = indices[inside] + write.shift + of_run[inside] * (target_stride - source_stride)
            values = values[inside]
        placed.append((target, indices, values))
    if orders and not bool(torch.stack([ordered for _, ordered in orders]).all()):
        unordered = next(write for write, ordered in orders if not bool(ordered))
        raise ValueError(f"{unordered.tensor}: element indices not strictly ascending")
    return placed


def _scatter(placed: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> Callable[[], None]:
    """Scatters checked writes (``_upload_checked``); returns the undo. One that fails
    midway puts back what it wrote."""
    written: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def undo() -> None:
        for target, indices, replaced in reversed(written):
            target.index_copy_(0, indices, replaced)

    try:
        for target, indices, values in placed:
            replaced = target.index_select(0, indices)
            target.index_copy_(0, indices, values)
            written.append((target, indices, replaced))
    except BaseException:
        undo()
        raise
    return undo


#: Where tensors are written for an engine in another process: memory, not disk, when the
#: machine has it.
SHARED_MEMORY = "/dev/shm"


@contextlib.contextmanager
def tensors_file(tensors: Mapping[str, torch.Tensor]) -> Iterator[str]:
    """A directory holding ``tensors`` as ``model.safetensors``, in shared memory where the
    machine has it, for an engine in another process to load; removed afterwards."""
    from safetensors.torch import save_file

    where = SHARED_MEMORY if os.path.isdir(SHARED_MEMORY) else None
    with tempfile.TemporaryDirectory(prefix="aurora-weights-", dir=where) as directory:
        save_file({name: t.contiguous() for name, t in tensors.items()}, os.path.join(directory, "model.safetensors"))
        yield directory


def post_json(url: str, body: Optional[dict], timeout: float) -> Any:
    """POSTs ``body`` as JSON to an engine's server and returns its JSON answer (None when
    empty); an HTTP error raises with the server's own message."""
    import json
    import urllib.request

    request = urllib.request.Request(
        url, data=json.dumps(body or {}).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    return _json_answer(request, timeout)


def get_json(url: str, timeout: float) -> Any:
    """GETs an engine server's JSON document (``post_json``'s errors)."""
    import urllib.request

    return _json_answer(urllib.request.Request(url, method="GET"), timeout)


def _json_answer(request: Any, timeout: float) -> Any:
    import json
    import urllib.error
    import urllib.request

    url = request.full_url
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read()
    except urllib.error.HTTPError as error:
        raise EngineError(f"{request.get_method()} {url}: {error.code}: {error.read().decode(errors='replace')}") from None
    return json.loads(text) if text else None


def takes_changes_first(engine: Engine) -> bool:
    """Whether ``engine`` takes a version's changes before the actor's copy does
    (``ElementEngine``)."""
    return writes_elements(engine) and not getattr(engine, "needs_new_tensors", False)


def writes_elements(engine: Engine) -> bool:
    """Whether ``engine`` takes changed elements (``ElementEngine``)."""
    return callable(getattr(engine, "load_changes", None))


def fused_group_names(changed: Collection[str]) -> set[str]:
    """The names an engine must receive for ``changed``: each changed tensor, and the
    other parts of every fused group one of them belongs to (an engine that fuses q, k and
    v, or gate and up, rebuilds the fused parameter from all its parts; a part left out
    would be left uninitialised)."""
    names: set[str] = set()
    for name in changed:
        parts = _core.fused_parts(name)
        names.update(parts if parts is not None else [name])
    return names


def with_fused_groups(changed: Collection[str], state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of ``state`` an engine must receive for ``changed``
    (``fused_group_names``)."""
    names = fused_group_names(changed)
    missing = sorted(names - state.keys())
    if missing:
        raise KeyError(f"the weights hold no {', '.join(missing)}")
    return {name: state[name] for name in sorted(names)}
