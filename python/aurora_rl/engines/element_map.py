"""The map from a checkpoint tensor's elements to the parameter memory an engine loaded
them into, taken from the engine's own loading code, and the writes and read-back checks
it gives. Engine-neutral: vLLM (``vllm_worker``) and SGLang (``sglang_worker``) load
Hugging Face checkpoints through the same kind of ``load_weights`` (stacked-parameter
mappings, weight loaders that narrow and copy), so one probe serves both.

The model's ``load_weights`` runs once on shape-only (meta) tensors, with every ``copy_``
recorded instead of done. Each record says which elements of a checkpoint tensor went to
which elements of which parameter (fused q/k/v and gate/up rows, tensor-parallel shards,
padded vocabularies alike). A tensor that reached a parameter through anything but views
(a concatenation, a conversion) has no map and is loaded whole.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("aurora_rl.engines")


@dataclass(frozen=True)
class Piece:
    """One ``copy_`` of the probe: a strided block of a checkpoint tensor's elements to a
    strided block of a parameter's (offsets and strides in elements, the parameter's
    relative to its own start)."""

    parameter: str
    sizes: tuple[int, ...]
    source_offset: int
    source_strides: tuple[int, ...]
    target_offset: int
    target_strides: tuple[int, ...]

    @functools.cached_property
    def runs(self) -> Optional[Runs]:
        """The block as runs of elements at a regular stride on both sides, where it is
        (a whole tensor, a fused part, a shard's rows: one run; a shard of a row-parallel
        layer: the same columns of every row); None otherwise."""
        contiguous = _contiguous_strides(self.sizes)
        if _strides_agree(self.sizes, self.source_strides, contiguous) and _strides_agree(
            self.sizes, self.target_strides, contiguous
        ):
            start = self.source_offset
            return Runs((start, start + math.prod(self.sizes)), self.target_offset - start, 1, 0, 0)
        dims = [(size, s, t) for size, s, t in zip(self.sizes, self.source_strides, self.target_strides) if size != 1]
        if len(dims) != 2 or dims[1][1:] != (1, 1):
            return None
        (count, source_stride, target_stride), (run, _, _) = dims
        if source_stride < run or target_stride < run:
            return None
        start = self.source_offset
        return Runs((start, start + run), self.target_offset - start, count, source_stride, target_stride)

    def place(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For a block that is not ``runs`` and ascending flat indices of its checkpoint
        tensor: which lie in the block (a mask of them), and their indices in the
        parameter."""
        import torch

        rest = indices - self.source_offset
        inside = rest >= 0
        target = torch.full_like(indices, self.target_offset)
        # Views of a contiguous tensor: decompose by the largest stride first.
        for size, stride, target_stride in sorted(
            zip(self.sizes, self.source_strides, self.target_strides), key=lambda d: -d[1]
        ):
            if size == 1:
                continue
            coordinate = torch.div(rest, stride, rounding_mode="floor")
            rest = rest - coordinate * stride
            inside &= coordinate < size
            target += coordinate * target_stride
        inside &= rest == 0
        return inside, target[inside]


@dataclass(frozen=True)
class Runs:
    """A block of a tensor as ``count`` runs of elements: the first ``within`` (source
    elements), each written at its index plus ``shift``; each later run
    ``source_stride`` further in the tensor and ``target_stride`` further in the
    parameter (``aurora_delta::Runs``)."""

    within: tuple[int, int]
    shift: int
    count: int
    source_stride: int
    target_stride: int


def _contiguous_strides(sizes: tuple[int, ...]) -> tuple[int, ...]:
    strides, stride = [], 1
    for size in reversed(sizes):
        strides.append(stride)
        stride *= size
    return tuple(reversed(strides))


def _strides_agree(sizes: tuple[int, ...], strides: tuple[int, ...], expected: tuple[int, ...]) -> bool:
    """Whether ``strides`` lay out ``sizes`` as ``expected`` does (a dimension of one
    element may have any stride)."""
    return all(size == 1 or a == b for size, a, b in zip(sizes, strides, expected))


#: Per checkpoint tensor: its pieces, or None where it has no map (loaded whole).
ElementMap = dict[str, Optional[list[Piece]]]


def probe_element_map(
    model: Any,
    specs: Mapping[str, tuple[list[int], torch.dtype]],
    world_size: int,
    writable: Callable[[Any], bool] = lambda module: True,
    destinations: Optional[dict[str, set[str]]] = None,
) -> ElementMap:
    """Runs the model's own ``load_weights`` on meta tensors of ``specs`` (name: shape,
    dtype) and records where each element would go; nothing is written. A tensor loaded
    into a module ``writable`` refuses (a layer that computes from another copy of its
    weight) has no map. ``destinations``, where given, gets the names of the parameters
    each tensor is copied into, mapped or not."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    owners: dict[int, tuple[str, torch.Tensor, bool]] = {}
    for module_name, module in model.named_modules():
        for name, parameter in module.named_parameters(prefix=module_name, recurse=False):
            if parameter.numel() and parameter.device.type != "meta":
                owners.setdefault(parameter.untyped_storage().data_ptr(), (name, parameter, writable(module)))
    roots: dict[int, str] = {}
    found: ElementMap = {name: [] for name in specs}
    current: list[str] = []

    def unmapped(name: str, why: str) -> None:
        if found.get(name) is not None:
            logger.warning("%s: no element map (%s): each version loads it whole", name, why)
        found[name] = None

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is not torch.ops.aten.copy_.default:
                return func(*args, **(kwargs or {}))
            target, source = args[0], args[1]
            root = source._base if source._base is not None else source
            name = roots.get(id(root))
            owner = owners.get(target.untyped_storage().data_ptr()) if target.device.type != "meta" else None
            loading = name if name is not None else (current[-1] if current else None)
            if owner is not None and loading is not None and destinations is not None:
                destinations.setdefault(loading, set()).add(owner[0])
            if name is None:
                # A copy from a tensor made of the checkpoint's (a concatenation, a
                # conversion): the tensor being loaded cannot be written element-wise.
                if current:
                    unmapped(current[-1], "its loader transforms it")
                return target
            if owner is None:
                unmapped(name, "it is not copied into a parameter")
                return target
            if tuple(source.shape) != tuple(target.shape) or 0 in source.stride():
                unmapped(name, "it is broadcast")
                return target
            parameter_name, parameter, can_write = owner
            if not can_write:
                unmapped(name, f"{parameter_name} is not what its layer computes from")
                return target
            if not parameter.is_contiguous():
                unmapped(name, f"{parameter_name} is not contiguous")
                return target
            pieces = found.get(name)
            if pieces is not None:
                pieces.append(
                    Piece(
                        parameter_name,
                        tuple(source.shape),
                        source.storage_offset(),
                        tuple(source.stride()),
                        target.storage_offset() - parameter.storage_offset(),
                        tuple(target.stride()),
                    )
                )
            return target

    # The meta tensors stay alive, so no id is reused during the probe.
    alive: list[torch.Tensor] = []

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, (shape, dtype) in specs.items():
            tensor = torch.empty(shape, dtype=dtype, device="meta")
            alive.append(tensor)
            roots[id(tensor)] = name
            current.append(name)
            yield name, tensor

    with Recorder(), torch.no_grad():
        model.load_weights(tensors())
    for name, pieces in found.items():
        if pieces is None:
            continue
        covered = sum(math.prod(piece.sizes) for piece in pieces)
        elements = math.prod(specs[name][0])
        # One rank must place every element once; under tensor parallelism each places
        # its share (and replicated tensors whole).
        if not pieces or (world_size == 1 and covered != elements) or covered > elements:
            unmapped(name, f"its copies cover {covered} of {elements} elements")
    return found


def check_changes(name: str, indices: torch.Tensor, values: Optional[torch.Tensor], elements: int) -> None:
    """Refuses a tensor's changed elements before anything is written: as many as
    ``values`` where given, strictly ascending (a fused parameter's pieces are cut from
    them by position), within the tensor's ``elements``. A pass over the indices: the
    writes check what they take themselves, so only a tensor cut into pieces here, in
    torch, needs it (``element_writes``)."""
    if values is not None and indices.shape != values.shape:
        raise ValueError(f"{name}: {indices.numel()} indices for {values.numel()} values")
    if indices.numel() > 1 and not bool((indices[1:] > indices[:-1]).all()):
        raise ValueError(f"{name}: element indices not strictly ascending")
    if indices.numel() and (int(indices[0]) < 0 or int(indices[-1]) >= elements):
        raise IndexError(f"{name}: an element index beyond its {elements} elements")


def element_writes(
    model: Any,
    element_map: ElementMap,
    changes: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    specs: Mapping[str, tuple[list[int], torch.dtype]],
    packed: Optional[Mapping[str, tuple[int, int, int, int]]] = None,
) -> list[Any]:
    """The ``ElementWrite``s of ``changes`` (name: ascending flat indices and their new
    values) under ``element_map``; elements other ranks hold are left to them. A
    parameter in ``packed`` is held packed for a CPU's kernels (``ElementWrite.packed``),
    its elements written where the packing put them. A tensor held whole as one block
    (unfused, or one part of a fused parameter) is written from its own indices, which
    the write checks. One of several blocks (a shard, a strided block) is handed whole
    to the write of each block that is runs of elements (``ElementWrite.runs``), which
    cuts and checks it; for any other block it is checked here, once, and cut in
    torch."""
    from aurora_rl.engines import ElementWrite

    parameters = dict(model.named_parameters())
    writes = []
    for name, (indices, values) in changes.items():
        pieces = element_map[name]
        assert pieces is not None, f"{name} has no element map"
        elements = math.prod(specs[name][0])
        if indices.shape != values.shape:
            raise ValueError(f"{name}: {indices.numel()} indices for {values.numel()} values")
        checked = False
        for piece in pieces:
            parameter = parameters.get(piece.parameter)
            if parameter is None or not parameter.is_contiguous():
                raise RuntimeError(f"{name}: the engine no longer holds {piece.parameter} as it was mapped")
            target = parameter.data.view(-1)
            layout = (packed or {}).get(piece.parameter)
            runs = piece.runs
            if runs is not None:
                # A block of the whole tensor is written from its indices, every one
                # checked to lie in it; one of several is cut by the write.
                whole = runs.count == 1 and runs.within == (0, elements)
                cut = None if whole else (runs.count, runs.source_stride, runs.target_stride, elements)
                writes.append(
                    ElementWrite(target, indices, values, layout, runs.shift, runs.within, name, piece.parameter, cut)
                )
                continue
            if not checked:
                check_changes(name, indices, values, elements)
                checked = True
            inside, piece_indices = piece.place(indices)
            writes.append(
                ElementWrite(target, piece_indices, values[inside], layout, tensor=name, parameter=piece.parameter)
            )
    return writes


def mismatched_pieces(
    element_map: ElementMap, expected: Mapping[str, torch.Tensor], read: Callable[[str], torch.Tensor]
) -> tuple[list[str], list[str]]:
    """Compares each tensor of ``expected`` (Hugging Face names), piece by piece of
    ``element_map``, with what ``read`` gives for the parameter (flat, in the layout the
    loader writes). Returns the names that differ, and those without a map (unchecked)."""
    from aurora_rl.engines import same_bits

    held: dict[str, torch.Tensor] = {}
    differ, unmapped = [], []
    for name, tensor in expected.items():
        pieces = element_map[name]
        if pieces is None:
            unmapped.append(name)
            continue
        source = tensor.reshape(-1)
        for piece in pieces:
            if piece.parameter not in held:
                held[piece.parameter] = read(piece.parameter)
            flat = held[piece.parameter]
            if not same_bits(
                flat.as_strided(piece.sizes, piece.target_strides, flat.storage_offset() + piece.target_offset),
                source.as_strided(piece.sizes, piece.source_strides, source.storage_offset() + piece.source_offset),
            ):
                differ.append(name)
                break
    return differ, unmapped


@dataclass(frozen=True)
class Packing:
    """A CPU kernel's packing of a [rows, columns] weight: rows in blocks of ``block``
    (the last may be shorter), each block stored ``group`` columns at a time ([columns /
    group, block rows, group]). Group 2 is the VNNI-2 layout AMX multiplies from
    (SGLang's linear layers, vLLM's experts with AMX); group 1, column by column (vLLM's
    experts on CPUs without AMX). aurora's element writes take it as
    ``ElementWrite.packed`` (``aurora_delta::ElementLayout::RowBlocks``)."""

    rows: int
    columns: int
    block: int
    group: int

    @property
    def layout(self) -> tuple[int, int, int, int]:
        return (self.rows, self.columns, self.block, self.group)

    def unpacked(self, packed: torch.Tensor) -> torch.Tensor:
        """The weight in the loader's layout (flat), from the packed one (flat)."""
        import torch

        full = self.rows // self.block * self.block
        parts = []
        for start, rows in ((0, full), (full, self.rows - full)):
            if rows == 0:
                continue
            block = self.block if start == 0 else rows
            chunk = packed[start * self.columns : (start + rows) * self.columns]
            parts.append(
                chunk.view(rows // block, self.columns // self.group, block, self.group).permute(0, 2, 1, 3).reshape(-1)
            )
        return torch.cat(parts)

    @classmethod
    @functools.cache
    def of_kernel(
        cls, rows: int, columns: int, dtype: torch.dtype, pack: Callable[[torch.Tensor], torch.Tensor]
    ) -> Optional[Packing]:
        """The packing ``pack`` (a kernel's, of one [rows, columns] weight) applies to a
        weight of this shape and dtype, found by packing a random one with it: every
        element aurora's writes put where the kernel did, and read back to where it was;
        None if no block size does. Once per shape and kernel: a model's layers share a
        few."""
        import torch

        from aurora_rl import _core
        from aurora_rl.engines import same_bits

        size = torch.empty(0, dtype=dtype).element_size()
        if size not in (1, 2):
            return None
        # The pattern repeats per block: a few blocks and the shorter last one suffice.
        largest = 64
        sample_rows = rows if rows <= 3 * largest else 2 * largest + rows % largest
        generator = torch.Generator().manual_seed(rows * 1_000_003 + columns)
        # Random bit patterns: a packing moves elements, it computes nothing.
        weight = torch.randint(0, 2**8, (sample_rows, columns * size), dtype=torch.uint8, generator=generator).view(dtype)
        packed = pack(weight)
        if packed.dtype != dtype or packed.numel() != weight.numel():
            return None
        everything = torch.arange(weight.numel())
        for group in (2, 1):
            if columns % group:
                continue
            for block in (32, 16, 64):
                candidate = cls(sample_rows, columns, block, group)
                written = torch.zeros_like(weight).view(-1)
                values = weight.reshape(-1).clone()
                _core.swap_elements([(
                    "a packing's sample", written.view(torch.uint8), size, candidate.layout,
                    [("every element", everything.view(torch.uint8), 0, everything.numel(), 0, None, values.view(torch.uint8), None)],
                )])
                if same_bits(written, packed.reshape(-1)) and same_bits(
                    candidate.unpacked(packed.reshape(-1)), weight.reshape(-1)
                ):
                    return cls(rows, columns, block, group)
        return None
