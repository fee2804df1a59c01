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

**The map** comes from vLLM's own loading code, not from re-derived row ranges
(``aurora_rl.engines.element_map``).

**Experts.** A mixture-of-experts layer holds each projection of all its experts in one
3-D parameter ([experts, rows, columns]), which vLLM's CPU build packs in place for its
AMX kernel after loading (row blocks stored column pair by column pair). Each checkpoint
expert tensor's map still says where the loader put its elements; the writes place them
through the packing (``Packing``, checked against vLLM's own packing op once per shape),
so an activation writes the changed rows of the changed experts only.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Optional

from aurora_rl.engines.element_map import (
    ElementMap,
    Packing,
    element_writes,
    mismatched_pieces,
    probe_element_map,
)

if TYPE_CHECKING:
    import torch

    from aurora_rl.engines import TensorChange

logger = logging.getLogger("aurora_rl.vllm")

#: vLLM's quantize methods whose layers compute from the checkpoint's tensors as loaded
#: (FP8 block-quantized layers: their FP8 weight and scales) when marked to keep them.
_UNQUANTIZED = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")
_AS_LOADED = (*_UNQUANTIZED, "Fp8LinearMethod")


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
    """Marks every unquantized or FP8 layer so that vLLM's processing keeps its weight (and
    an FP8 layer its scales) as loaded: its CPU kernels then pack per call."""
    for module in model.modules():
        if type(getattr(module, "quant_method", None)).__name__ in _AS_LOADED:
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


def _computes_from_own_weight(module: Any) -> bool:
    """Whether vLLM computes with ``module``'s parameters as stored: not a layer its CPU
    build computes from a packed copy of (``cpu_linear`` other than plain ``linear``)."""
    import torch

    return getattr(module, "cpu_linear", torch.nn.functional.linear) is torch.nn.functional.linear


def _probe(model: Any, specs: Mapping[str, tuple[list[int], torch.dtype]]) -> ElementMap:
    from vllm.distributed import get_tensor_model_parallel_world_size

    return probe_element_map(model, specs, get_tensor_model_parallel_world_size(), _computes_from_own_weight)


def _experts_packed_for(module: Any) -> Optional[str]:
    """The instruction set vLLM's CPU build packed this mixture-of-experts layer's weights
    for (``cpu_prepack_moe_weight``), or None where its experts compute from the weights
    as loaded."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return None
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(getattr(kernel, "impl", kernel), "fused_experts", None)
    if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
        return None
    return experts.isa


@functools.cache
def _expert_packer(isa: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """vLLM's packing of one expert's [rows, columns] weight for ``isa``."""
    from vllm import _custom_ops

    return lambda weight: _custom_ops.cpu_prepack_moe_weight(weight.unsqueeze(0), isa)[0]


def expert_packings(model: Any) -> dict[str, Packing]:
    """Per packed expert parameter of ``model``: its packing, as one matrix of every
    expert's rows (each expert's rows start a row block). A parameter whose packing is
    not one aurora places elements through is left out, and its tensors are written as
    loaded, which the read-back check then refuses."""
    packings: dict[str, Packing] = {}
    for module_name, module in model.named_modules():
        isa = _experts_packed_for(module)
        if isa is None:
            continue
        for name, parameter in module.named_parameters(prefix=module_name, recurse=False):
            if parameter.dim() != 3:
                continue
            experts, rows, columns = parameter.shape
            packing = Packing.of_kernel(rows, columns, parameter.dtype, _expert_packer(isa))
            if packing is None or rows % packing.block:
                logger.warning("%s: packed in a layout aurora does not place elements in", name)
                continue
            packings[name] = Packing(experts * rows, columns, packing.block, packing.group)
    return packings


class ModelWriter:
    """Writes versions into one vLLM model, in the process that holds it: changed
    elements in place where the model has an element map, everything else through
    ``reload`` (vLLM's layerwise reload of checkpoint-format tensors). Transactional:
    elements written are undone if the whole-tensor reload that follows fails."""

    def __init__(self, model: Any, reload: Callable[[dict[str, torch.Tensor]], None]) -> None:
        self.model = model
        self._reload = reload
        self.element_map: ElementMap = {}
        #: Shape and dtype of each tensor in the map.
        self.specs: dict[str, tuple[list[int], torch.dtype]] = {}
        self.packings = expert_packings(model)

    def map_elements(self, specs: Mapping[str, tuple[list[int], torch.dtype]]) -> None:
        """Probes those of ``specs`` not mapped yet (``aurora_rl.engines.MappedEngine``)."""
        unseen = {name: spec for name, spec in specs.items() if name not in self.element_map}
        if unseen:
            self.element_map.update(_probe(self.model, unseen))
            self.specs.update(unseen)

    def source_extents(self, names: Iterable[str]) -> dict[str, tuple[int, int]]:
        """For each of ``names`` with an element map: the flat indices ``[first, end)``
        its pieces span in the checkpoint tensor. A tensor-parallel rank's shard of a
        column-parallel layer spans its rows only, so the rank needs no changes outside."""
        extents = {}
        for name in names:
            pieces = self.element_map.get(name)
            if not pieces:
                continue
            first = min(p.source_offset + sum(min(0, (n - 1) * s) for n, s in zip(p.sizes, p.source_strides)) for p in pieces)
            end = max(p.source_offset + sum(max(0, (n - 1) * s) for n, s in zip(p.sizes, p.source_strides)) + 1 for p in pieces)
            extents[name] = (first, end)
        return extents

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Loads ``tensors`` whole (fused groups complete), then points the layers the
        reload processed again at their parameters. A tensor held in a packed expert
        parameter is written, every element, through its map instead: vLLM's reload
        leaves a CPU build's expert weights unpacked where its kernel reads them packed
        (vLLM 0.32), and it would rebuild every expert of the layer for one of them."""
        import torch

        from aurora_rl.engines import write_elements

        specs = {name: (list(t.shape), t.dtype) for name, t in tensors.items()}
        packed = self._in_packed_parameters(specs)
        for name in packed:
            # One tensor at a time: the element numbers of the whole model would not fit.
            everything = torch.arange(tensors[name].numel())
            write_elements(
                element_writes(
                    self.model, self.element_map, {name: (everything, tensors[name].reshape(-1))}, specs, self._layouts()
                )
            )
        rest = {name: tensor for name, tensor in tensors.items() if name not in packed}
        if rest:
            with _untouched_layers_quiet():
                self._reload(rest)
            compute_from_parameters(self.model)

    def _in_packed_parameters(self, specs: Mapping[str, tuple[list[int], torch.dtype]]) -> set[str]:
        """Those of ``specs`` whose elements all lie in packed expert parameters."""
        if not self.packings:
            return set()
        self.map_elements(specs)
        return {
            name
            for name in specs
            if self.element_map.get(name) and all(piece.parameter in self.packings for piece in self.element_map[name])
        }

    def _layouts(self) -> dict[str, tuple[int, int, int, int]]:
        return {name: packing.layout for name, packing in self.packings.items()}

    def load_changes(self, changes: Mapping[str, TensorChange]) -> set[str]:
        """See ``aurora_rl.engines.ElementEngine``. Returns the tensors loaded whole
        (``whole_loads``)."""
        whole, _ = self.write_changes(changes)
        return whole

    def whole_loads(self, changes: Mapping[str, TensorChange]) -> set[str]:
        """Those of ``changes`` a write loads whole, before their fused groups: changed
        whole, or changed and without an element map."""
        self.map_elements({name: (list(c.shape), c.dtype) for name, c in changes.items() if c.indices is not None})
        return {
            name
            for name, c in changes.items()
            if c.indices is None or (c.indices.numel() and self.element_map.get(name) is None)
        }

    def write_changes(self, changes: Mapping[str, TensorChange]) -> tuple[set[str], Callable[[], None]]:
        """``load_changes``, keeping the undo of the element writes: a caller that learns
        after the write that the version must not stay (another tensor-parallel rank
        failed its own) writes the replaced values back with it."""
        from aurora_rl.engines import fused_group_names, write_elements

        whole = self.whole_loads(changes)
        mapped = {
            name: (c.indices, c.values())
            for name, c in changes.items()
            if c.indices is not None and self.element_map.get(name) is not None
        }
        specs = {name: (list(changes[name].shape), changes[name].dtype) for name in mapped}
        undo = write_elements(element_writes(self.model, self.element_map, mapped, specs, self._layouts()))
        try:
            if whole:
                # A tensor reloaded whole takes its fused group with it.
                self.load_weights({name: changes[name].tensor for name in fused_group_names(whole)})
        except BaseException:
            undo()
            raise
        return whole, undo

    def mismatched(self, expected: Mapping[str, torch.Tensor]) -> list[str]:
        """See ``aurora_rl.engines.CheckedEngine``. Each parameter is read back as the
        model computes with it (``read_back``) and compared, piece by piece of the
        element map, with the elements of ``expected`` it holds: under tensor
        parallelism each rank checks its own shards, against the version's tensors rank
        0 sent it (``aurora_rl.engines.vllm_ranks``). A tensor without an element map (loaded whole)
        is compared with ``held_weights``'s (one rank only; under tensor parallelism it
        is named in a warning as not checked)."""
        import torch
        from vllm.distributed import get_tensor_model_parallel_world_size

        from aurora_rl.engines import same_bits

        world_size = get_tensor_model_parallel_world_size()
        self.map_elements({name: (list(t.shape), t.dtype) for name, t in expected.items()})
        with torch.no_grad():
            differ, unmapped = mismatched_pieces(self.element_map, expected, self._read_back)
        if unmapped and world_size > 1:
            logger.warning(
                "not checked: %s (loaded whole; under tensor parallelism a rank cannot read them back)",
                ", ".join(unmapped),
            )
        elif unmapped:
            held = self.held_weights()
            differ += [name for name in unmapped if not same_bits(held[name], expected[name])]
        return differ

    def _read_back(self, name: str) -> torch.Tensor:
        """What the model computes with for its parameter ``name``, flat, in the layout
        the loader writes (``read_back``; a packed expert parameter unpacked)."""
        parameter = self.model.get_parameter(name)
        packing = self.packings.get(name)
        if packing is not None:
            return packing.unpacked(parameter.detach().reshape(-1))
        return read_back(self.model, name, parameter)

    def held_weights(self) -> dict[str, torch.Tensor]:
        """The weights the model computes with, under Hugging Face names, read back
        through each layer's own forward (``read_back``), whatever layout it holds them
        in (one rank: shards are not gathered)."""
        import torch

        model = self.model
        # A tied head is the embedding, which checkpoints store once.
        tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
        held: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, module in model.named_modules():
                method = getattr(module, "quant_method", None)
                if method is None or not hasattr(module, "weight") or name.endswith("embed_tokens"):
                    continue
                if tied and name == "lm_head":
                    continue
                weight = _through_forward(module)
                parts = _fused_parts(name, module, "weight")
                if not parts:
                    held[f"{name}.weight"] = _unpadded(module, weight)
                for part, rows in parts:
                    held[part] = weight[rows].contiguous()
            for name, module in model.named_modules():
                # Embeddings and norms are used as stored.
                if name.endswith("embed_tokens") or name.endswith("norm"):
                    held[f"{name}.weight"] = _unpadded(module, module.weight.detach())
            held.update(self._assembled(set(held)))
        return held

    def _assembled(self, known: set[str]) -> dict[str, torch.Tensor]:
        """The mapped tensors no layer's own weight is (experts, which share one
        parameter per projection), each put together from its pieces of the map: those
        the writer has seen (a load, a change, a check), on one rank only."""
        import torch
        from vllm.distributed import get_tensor_model_parallel_world_size

        if get_tensor_model_parallel_world_size() > 1:
            return {}
        read: dict[str, torch.Tensor] = {}
        assembled = {}
        for name, pieces in self.element_map.items():
            if name in known or not pieces:
                continue
            shape, dtype = self.specs[name]
            tensor = torch.empty(math.prod(shape), dtype=dtype)
            for piece in pieces:
                if piece.parameter not in read:
                    read[piece.parameter] = self._read_back(piece.parameter)
                flat = read[piece.parameter]
                tensor.as_strided(piece.sizes, piece.source_strides, piece.source_offset).copy_(
                    flat.as_strided(piece.sizes, piece.target_strides, flat.storage_offset() + piece.target_offset)
                )
            assembled[name] = tensor.view(shape)
        return assembled


def read_back(model: Any, name: str, parameter: torch.Tensor) -> torch.Tensor:
    """What the model computes with for its parameter ``name``, laid out as the
    parameter, flat. A layer that computes from another copy of its weight (vLLM's CPU
    build packs unquantized linear weights for oneDNN unless load format ``aurora`` kept
    them) is read back through its own forward: applied to an identity matrix it gives its
    weight exactly (one product per output, accumulated with zeros), at O(outputs x
    inputs^2). Anything that computes from the parameter itself (such a layer under load
    format ``aurora``, where ``compute_from_parameters`` pointed it back; an embedding,
    which is looked up; a norm; a bias) is read as stored, at O(elements)."""
    module_name, _, attribute = name.rpartition(".")
    module = model.get_submodule(module_name)
    if attribute == "weight" and not _computes_from_parameter(module):
        weight = _through_forward(module)
        if weight.shape == parameter.shape:
            return weight.contiguous().view(-1)
    return parameter.detach().reshape(-1)


def _computes_from_parameter(module: Any) -> bool:
    """Whether ``module`` computes from its ``weight`` parameter: every module but a linear
    layer whose quantize method computes from another copy (a packed one on the CPU, a
    quantized one)."""
    import torch

    method = getattr(module, "quant_method", None)
    if method is None or not hasattr(module, "weight"):
        return True
    if type(method).__name__ == "Fp8LinearMethod":
        return getattr(module, "_cpu_skip_gemm_dispatch", False)
    if type(method).__name__ not in _UNQUANTIZED:
        return False
    return getattr(module, "cpu_linear", torch.nn.functional.linear) is torch.nn.functional.linear


def _through_forward(module: Any) -> torch.Tensor:
    """A linear layer's weight, [outputs, inputs], through its quantize method's apply."""
    import torch

    identity = torch.eye(_input_size(module), dtype=getattr(module, "params_dtype", torch.bfloat16))
    return module.quant_method.apply(module, identity).t()


def _fused_parts(name: str, module: Any, parameter: str) -> list[tuple[str, slice]]:
    """For a fused module's parameter (q/k/v, gate/up): each Hugging Face part's name and
    its rows, in the order of `unfused_names`; empty for any other."""
    from aurora_rl import _core

    parts = _core.unfused_names(f"{name}.{parameter}") if hasattr(module, "output_sizes") else None
    if parts is None:
        return []
    starts = [sum(module.output_sizes[:index]) for index in range(len(parts))]
    return [(part, slice(start, start + size)) for part, start, size in zip(parts, starts, module.output_sizes)]


def _unpadded(module: Any, weight: torch.Tensor) -> torch.Tensor:
    """Vocabulary rows beyond the checkpoint's: vLLM pads an embedding or head to a
    multiple of 64 rows."""
    rows = getattr(module, "org_vocab_size", None)
    return (weight if rows is None else weight[:rows]).contiguous()


def _input_size(module: Any) -> int:
    for attribute in ("input_size_per_partition", "embedding_dim"):
        value = getattr(module, attribute, None)
        if value:
            return int(value)
    return int(module.weight.shape[1])


class _UntouchedLayers(logging.Filter):
    """vLLM's layerwise reload warns "Failed to load weights" for every layer a reload
    left alone: a partial reload leaves most of them alone on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to load weights" not in record.getMessage()


@contextlib.contextmanager
def _untouched_layers_quiet() -> Iterator[None]:
    reload_logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    quiet = _UntouchedLayers()
    reload_logger.addFilter(quiet)
    try:
        yield
    finally:
        reload_logger.removeFilter(quiet)


def worker_writer(worker: Any) -> ModelWriter:
    """The ``ModelWriter`` of a vLLM worker's model, kept on the worker (its element map
    is probed once); whole tensors go through the worker's own ``reload_weights``."""
    writer = worker.__dict__.get("_aurora_writer")
    if writer is None:

        def reload(tensors: dict[str, torch.Tensor]) -> None:
            worker.reload_weights(weights_iterator=list(tensors.items()), is_checkpoint_format=True)

        writer = worker._aurora_writer = ModelWriter(worker.model_runner.get_model(), reload)
    return writer


def map_elements(worker: Any, specs: Mapping[str, tuple[list[int], torch.dtype]]) -> None:
    """``collective_rpc`` entry: ``ModelWriter.map_elements`` in the worker."""
    worker_writer(worker).map_elements(specs)


def load_changes(worker: Any, changes: Mapping[str, TensorChange]) -> set[str]:
    """``collective_rpc`` entry: ``ModelWriter.load_changes`` in the worker."""
    return worker_writer(worker).load_changes(changes)


def load_weights(worker: Any, tensors: Mapping[str, torch.Tensor]) -> None:
    """``collective_rpc`` entry: ``ModelWriter.load_weights`` in the worker."""
    worker_writer(worker).load_weights(tensors)


def mismatched(worker: Any, expected: Mapping[str, torch.Tensor]) -> list[str]:
    """``collective_rpc`` entry: ``ModelWriter.mismatched`` in the worker."""
    return worker_writer(worker).mismatched(expected)


def held_weights(worker: Any) -> dict[str, torch.Tensor]:
    """``collective_rpc`` entry: ``ModelWriter.held_weights`` in the worker."""
    return worker_writer(worker).held_weights()
