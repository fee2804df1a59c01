"""What runs inside vLLM's worker for element writes: a model loader that keeps every
weight where the model computes from it, the map from a checkpoint tensor's elements to
the parameter memory vLLM loaded them into, and the transactional writes.

**The loader** (load format ``aurora``, registered by ``aurora_rl.vllm_plugin``) loads as
vLLM's default loader does (its dummy loader for a directory without weights, which an
actor fills from aurora), and marks each unquantized linear layer with vLLM's own
``_cpu_skip_gemm_dispatch``: on the CPU, vLLM otherwise packs a copy of each linear
weight for oneDNN and empties the parameter, where no element write could land. After
vLLM processed the weights it points every layer that still holds a packed copy (the
embedding doubling as the head) at its parameter. On a GPU the marks change nothing.

**The map** comes from vLLM's own loading code, not from re-derived row ranges: the
model's ``load_weights`` runs once on shape-only (meta) tensors, with every ``copy_``
recorded instead of done. Each record says which elements of a checkpoint tensor went
to which elements of which parameter (fused q/k/v and gate/up rows, tensor-parallel
shards, padded vocabularies alike). A tensor that reached a parameter through anything
but views (a concatenation, a conversion) has no map and is loaded whole.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("aurora_rl.vllm")

#: vLLM's quantize methods whose layers compute from the checkpoint's tensors as loaded.
_UNQUANTIZED = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")


def aurora_model_loader() -> type:
    """The loader class of load format ``aurora`` (imports vLLM, so built on demand)."""
    from pathlib import Path

    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    class AuroraModelLoader(BaseModelLoader):
        """vLLM's default loader (its dummy loader for a directory without weights),
        keeping every weight where the model computes from it."""

        def _inner(self, model_config: Any) -> Any:
            directory = Path(model_config.model)
            dummy = directory.is_dir() and not any(directory.glob("*.safetensors"))
            load_config = copy.copy(self.load_config)
            load_config.load_format = "dummy" if dummy else "auto"
            return (DummyModelLoader if dummy else DefaultModelLoader)(load_config)

        def download_model(self, model_config: Any) -> None:
            self._inner(model_config).download_model(model_config)

        def load_weights(self, model: Any, model_config: Any) -> None:
            keep_checkpoint_layout(model)
            self._inner(model_config).load_weights(model, model_config)

        def get_all_weights(self, model_config: Any, model: Any) -> Any:
            """The checkpoint's tensors, for vLLM's reload from a directory."""
            return self._inner(model_config).get_all_weights(model_config, model)

        def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
            model = super().load_model(vllm_config, model_config, prefix)
            compute_from_parameters(model)
            return model

    return AuroraModelLoader


def keep_checkpoint_layout(model: Any) -> None:
    """Marks every unquantized layer so that vLLM's processing keeps its weight."""
    for module in model.modules():
        if type(getattr(module, "quant_method", None)).__name__ in _UNQUANTIZED:
            module._cpu_skip_gemm_dispatch = True


def compute_from_parameters(model: Any) -> None:
    """Points each unquantized layer vLLM's CPU build packed a copy for, and kept its
    parameter (an embedding that is also the head), at the parameter. Run after every
    processing of the weights (a load, a whole-tensor reload)."""
    import torch

    for module in model.modules():
        if type(getattr(module, "quant_method", None)).__name__ not in _UNQUANTIZED:
            continue
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and weight is not None and weight.numel():
            module.cpu_linear = torch.nn.functional.linear


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

    def place(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For flat indices of the checkpoint tensor: which lie in this block, and the
        flat indices in the parameter they go to."""
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


#: Per checkpoint tensor: its pieces, or None where it has no map (loaded whole).
ElementMap = dict[str, Optional[list[Piece]]]


def probe_element_map(model: Any, specs: Mapping[str, tuple[list[int], torch.dtype]], world_size: int) -> ElementMap:
    """Runs the model's own ``load_weights`` on meta tensors of ``specs`` (name: shape,
    dtype) and records where each element would go; nothing is written."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    owners: dict[int, tuple[str, torch.Tensor]] = {}
    for name, parameter in model.named_parameters():
        if parameter.numel() and parameter.device.type != "meta":
            owners.setdefault(parameter.untyped_storage().data_ptr(), (name, parameter))
    roots: dict[int, str] = {}
    found: ElementMap = {name: [] for name in specs}
    current: list[str] = []

    def unmapped(name: str, why: str) -> None:
        if found.get(name) is not None:
            logger.info("%s: no element map (%s): it is loaded whole", name, why)
        found[name] = None

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is not torch.ops.aten.copy_.default:
                return func(*args, **(kwargs or {}))
            target, source = args[0], args[1]
            root = source._base if source._base is not None else source
            name = roots.get(id(root))
            owner = owners.get(target.untyped_storage().data_ptr()) if target.device.type != "meta" else None
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
            parameter_name, parameter = owner
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


def element_writes(model: Any, element_map: ElementMap, changes: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> list[Any]:
    """The ``ElementWrite``s of ``changes`` (name: flat indices and their new values)
    under ``element_map``; elements other ranks hold are left to them."""
    from aurora_rl.engines import ElementWrite

    parameters = dict(model.named_parameters())
    writes = []
    for name, (indices, values) in changes.items():
        pieces = element_map[name]
        assert pieces is not None, f"{name} has no element map"
        for piece in pieces:
            parameter = parameters.get(piece.parameter)
            if parameter is None or not parameter.is_contiguous():
                raise RuntimeError(f"{name}: vLLM no longer holds {piece.parameter} as it was mapped")
            inside, target = piece.place(indices)
            writes.append(ElementWrite(parameter.data.view(-1), target, values[inside]))
    return writes


def write_changes(worker: Any, changes: Mapping[str, tuple[torch.Tensor, torch.Tensor]], specs: Mapping[str, tuple[list[int], torch.dtype]]) -> list[str]:
    """In the worker (``collective_rpc``): writes the changed elements of every tensor
    ``changes`` names that has an element map (probed on first sight from ``specs``),
    keeping the undo for ``undo_changes``. Returns the names it left for a whole load."""
    from vllm.distributed import get_tensor_model_parallel_world_size

    from aurora_rl.engines import write_elements

    for name, (indices, values) in changes.items():
        elements = math.prod(specs[name][0])
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= elements):
            raise IndexError(f"{name}: an element index beyond its {elements} elements")
        if indices.shape != values.shape:
            raise ValueError(f"{name}: {indices.numel()} indices for {values.numel()} values")
    model = worker.model_runner.get_model()
    element_map: ElementMap = worker.__dict__.setdefault("_aurora_element_map", {})
    unseen = {name: spec for name, spec in specs.items() if name not in element_map}
    if unseen:
        element_map.update(probe_element_map(model, unseen, get_tensor_model_parallel_world_size()))
    mapped = {name: change for name, change in changes.items() if element_map.get(name) is not None}
    worker._aurora_undo = write_elements(element_writes(model, element_map, mapped))
    return sorted(set(changes) - set(mapped))


def undo_changes(worker: Any) -> None:
    """In the worker: writes back what the last ``write_changes`` replaced."""
    undo = worker.__dict__.pop("_aurora_undo", None)
    if undo is not None:
        undo()


def after_reload(worker: Any) -> None:
    """In the worker, after a whole-tensor reload processed layers again."""
    worker.__dict__.pop("_aurora_undo", None)
    compute_from_parameters(worker.model_runner.get_model())
