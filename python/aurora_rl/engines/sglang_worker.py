"""What runs inside SGLang's scheduler for element writes, entered through SGLang's own
extension point: a custom weight loader (server argument ``custom_weight_loader``), which
a weight-update request names as its ``load_format`` (``LOAD_FORMAT``).

**A request** is three named tensors, as ``update_weights_from_tensor`` carries them
(through shared memory): ``REQUEST``, a JSON document (``{"op": "probe" | "write" |
"check", "tensors": {name: [offset, dtype, shape]}, ...}``); ``DATA``, one buffer holding
the op's tensors at those offsets (one shared-memory segment, however many tensors: each
segment costs a file descriptor passed between the processes); and ``ANSWER``, a buffer
the loader writes its answer into (SGLang drops a loader's return value, and an exception
raised in a loader would end its scheduler: every error is caught and answered).

**The map** is ``aurora_rl.engines.element_map``'s, from SGLang's own ``load_weights``.

**Packed layers.** On a CPU with AMX, SGLang computes each unquantized linear layer from
its weight packed in place by its kernel library (``convert_weight_packed``: rows in
blocks, each block's columns in pairs). A parameter's elements are a permutation of the
loader's, so a changed element is still one element write, which aurora's swap places
through the packing (``aurora_delta::ElementLayout::RowBlocks``; ``Packing`` here).
The packing is not assumed: for each shape it is checked against the kernel's own function
before any write, and a layer whose packing does not match is loaded whole and packed by
SGLang's own processing.

**No closing of the session.** SGLang takes tensors only between ``begin_weight_update``
and ``end_weight_update``, and ``end_weight_update`` processes every layer again: on an
AMX CPU it packs every weight anew, including those already packed and not loaded (they
come out scrambled). Element writes land in the layout the model computes from, so the
adapter opens one session for the engine's life and never closes it.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping
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

logger = logging.getLogger("aurora_rl.sglang")

#: The load format that runs ``serve`` (a custom weight loader is named by its import path).
LOAD_FORMAT = "aurora_rl.engines.sglang_worker.serve"
#: The request's JSON document, as uint8.
REQUEST = "aurora:request"
#: Where the loader writes its answer: 8 bytes of length (little-endian), then JSON.
ANSWER = "aurora:answer"
ANSWER_BYTES = 1 << 20
#: The op's tensors, at the offsets the request gives (each aligned for any dtype).
DATA = "aurora:data"
ALIGNMENT = 64
#: The suffixes of a changed tensor's indices and values in a write request.
INDICES, VALUES = "#indices", "#values"


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as a request names it (``bfloat16``), which ``getattr(torch, name)`` reads."""
    return str(dtype).removeprefix("torch.")


def data_layout(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, list], int]:
    """Where each of ``tensors`` lies in a request's ``DATA`` (name: [offset, dtype name,
    shape]), and the buffer's size in bytes."""
    layout, size = {}, 0
    for name, tensor in tensors.items():
        layout[name] = [size, dtype_name(tensor.dtype), list(tensor.shape)]
        size += -(-tensor.numel() * tensor.element_size() // ALIGNMENT) * ALIGNMENT
    return layout, size


def pack_data(tensors: Mapping[str, torch.Tensor], layout: Mapping[str, list], data: torch.Tensor) -> None:
    """Copies ``tensors`` into ``data`` where ``layout`` places them."""
    for name, tensor in tensors.items():
        _placed(data, layout[name]).copy_(tensor)


def unpack_data(data: torch.Tensor, layout: Mapping[str, list]) -> dict[str, torch.Tensor]:
    """Views of the tensors ``layout`` places in ``data``."""
    return {name: _placed(data, place) for name, place in layout.items()}


def _placed(data: torch.Tensor, place: list) -> torch.Tensor:
    import torch

    offset, named_dtype, shape = place
    dtype = getattr(torch, named_dtype)
    size = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if offset % ALIGNMENT or offset + size > data.numel():
        raise ValueError(f"a tensor of {size} bytes at {offset} is not within the request's {data.numel()}")
    return data[offset : offset + size].view(dtype).view(shape)


def serve(model: Any, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """SGLang's custom weight loader: answers one request (module docstring)."""
    named = dict(named_tensors)
    answer = named.get(ANSWER)
    try:
        request = json.loads(bytes(named[REQUEST].numpy()))
        tensors = unpack_data(named[DATA], request.get("tensors", {}))
        writer = _writer(model)
        op = request.get("op")
        if op == "probe":
            reply: dict[str, Any] = {"unmapped": writer.probe(request["specs"])}
        elif op == "write":
            reply = {"whole": writer.write(request["specs"], set(request["whole"]), tensors)}
        elif op == "check":
            reply = {"mismatched": writer.mismatched(tensors)}
        else:
            raise ValueError(f"unknown op {op!r}")
        reply["ok"] = True
    except Exception as error:
        logger.exception("aurora's weight loader failed")
        reply = {"ok": False, "error": f"{type(error).__name__}: {error}"}
    if answer is not None:
        write_answer(answer, reply)


def write_answer(buffer: torch.Tensor, reply: dict[str, Any]) -> None:
    import torch

    body = json.dumps(reply).encode()
    if 8 + len(body) > buffer.numel():
        body = json.dumps({"ok": False, "error": f"an answer of {len(body)} bytes does not fit"}).encode()
    framed = len(body).to_bytes(8, "little") + body
    buffer[: len(framed)] = torch.frombuffer(bytearray(framed), dtype=torch.uint8)


def read_answer(buffer: torch.Tensor) -> dict[str, Any]:
    """The loader's answer in ``buffer``; an unanswered buffer (all zeros) says the
    loader never ran."""
    from aurora_rl.engines import EngineError

    length = int.from_bytes(bytes(buffer[:8].numpy()), "little")
    if not 0 < length <= buffer.numel() - 8:
        raise EngineError("SGLang did not run aurora's weight loader (no answer)")
    return json.loads(bytes(buffer[8 : 8 + length].numpy()))


def _writer(model: Any) -> ModelWriter:
    """The ``ModelWriter`` of ``model``, kept on it (its map is probed once)."""
    writer = model.__dict__.get("_aurora_writer")
    if writer is None:
        writer = model._aurora_writer = ModelWriter(model)
    return writer


def _sgl_pack(weight: torch.Tensor) -> torch.Tensor:
    """SGLang's kernel library's packing of one [rows, columns] weight."""
    import torch

    return torch.ops.sgl_kernel.convert_weight_packed(weight)


def _packed(module: Any) -> bool:
    """Whether SGLang computes ``module`` from its weight packed by the kernel library."""
    return bool(getattr(module, "use_intel_amx_backend", False))


class ModelWriter:
    """Writes versions into one SGLang model, in the scheduler that holds it: changed
    elements in place (through the packing of a packed layer), tensors without a map
    whole through the model's ``load_weights``. Transactional: elements written are undone
    if a whole load that follows fails."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.element_map: ElementMap = {}
        #: Per tensor: the parameters its loader copies it into.
        self.destinations: dict[str, set[str]] = {}
        #: Per packed parameter: its packing (None: no known one; its layer loads whole).
        self.packings: dict[str, Optional[Packing]] = {}
        self._module_names = {id(module): name for name, module in model.named_modules()}

    def _packing(self, parameter_name: str) -> Optional[Packing]:
        if parameter_name not in self.packings:
            parameter = self.model.get_parameter(parameter_name)
            rows, columns = parameter.shape if parameter.dim() == 2 else (0, 0)
            packing = Packing.of_kernel(rows, columns, parameter.dtype, _sgl_pack) if rows else None
            if packing is None:
                logger.warning("%s: packed in a layout aurora does not know: it is loaded whole", parameter_name)
            self.packings[parameter_name] = packing
        return self.packings[parameter_name]

    def _writable(self, module: Any) -> bool:
        """Whether element writes can land in ``module``: a packed layer's packing must be
        known."""
        if not _packed(module):
            return True
        name = self._module_names.get(id(module))
        return name is not None and self._packing(f"{name}.weight") is not None

    def probe(self, specs: Mapping[str, tuple[list[int], str]]) -> list[str]:
        """Maps the tensors of ``specs`` (name: shape, dtype name) not mapped yet; returns
        every one of them without a map (loaded whole)."""
        from sglang.srt.runtime_context import get_parallel

        unseen = {name: spec for name, spec in specs_typed(specs).items() if name not in self.element_map}
        if unseen:
            world_size = get_parallel().tp_size
            self.element_map.update(
                probe_element_map(self.model, unseen, world_size, self._writable, destinations=self.destinations)
            )
        return sorted(name for name in specs if self.element_map[name] is None)

    def _packed_layouts(self) -> dict[str, tuple[int, int, int]]:
        """The packing of each parameter held packed (``ElementWrite.packed``)."""
        modules = dict(self.model.named_modules())
        return {
            name: packing.layout
            for name, packing in self.packings.items()
            if packing is not None and _packed(modules[name.rpartition(".")[0]])
        }

    def write(self, specs: Mapping[str, tuple[list[int], str]], whole: set[str], tensors: Mapping[str, torch.Tensor]) -> list[str]:
        """Writes a version: for each tensor of ``specs``, its changed elements
        (``name#indices``, ``name#values``), or, for one in ``whole``, the tensor itself.
        Returns the tensors loaded whole through the model's loader."""
        import torch

        from aurora_rl.engines import write_elements

        self.probe(specs)
        changes: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        mapped_whole: dict[str, torch.Tensor] = {}
        loaded: dict[str, torch.Tensor] = {}
        for name in specs:
            if name in whole:
                (loaded if self.element_map[name] is None else mapped_whole)[name] = tensors[name]
                continue
            if self.element_map[name] is None:
                raise ValueError(f"{name} has no element map: it must come whole")
            indices, values = tensors[name + INDICES], tensors[name + VALUES]
            changes[name] = (indices, values)
        undos: list[Callable[[], None]] = []
        with torch.no_grad():
            try:
                undos.append(self._write_whole(mapped_whole))
                writes = element_writes(self.model, self.element_map, changes, specs_typed(specs), self._packed_layouts())
                undos.append(write_elements(writes))
                if loaded:
                    self._load_whole(loaded)
            except BaseException:
                for undo in reversed(undos):
                    undo()
                raise
        return sorted(loaded)

    def _write_whole(self, tensors: Mapping[str, torch.Tensor]) -> Callable[[], None]:
        """Copies whole tensors into the parameters their maps name, piece by piece (a
        packed parameter unpacked, written, and packed again by the kernel library's own
        function); returns the undo. Without index arrays: a vocabulary-sized tensor
        would need eight bytes of index per element."""
        import torch

        by_parameter: dict[str, list[tuple[Any, torch.Tensor]]] = {}
        for name, tensor in tensors.items():
            for piece in self.element_map[name] or ():
                by_parameter.setdefault(piece.parameter, []).append((piece, tensor.reshape(-1)))
        packed = self._packed_layouts()
        restores: list[tuple[torch.Tensor, torch.Tensor]] = []

        def undo() -> None:
            for flat, before in reversed(restores):
                flat.copy_(before)

        try:
            for parameter_name, pieces in by_parameter.items():
                flat = self.model.get_parameter(parameter_name).data.view(-1)
                packing = self.packings[parameter_name] if parameter_name in packed else None
                before = flat.clone()
                logical = packing.unpacked(flat) if packing is not None else flat
                for piece, source in pieces:
                    logical.as_strided(piece.sizes, piece.target_strides, logical.storage_offset() + piece.target_offset).copy_(
                        source.as_strided(piece.sizes, piece.source_strides, source.storage_offset() + piece.source_offset)
                    )
                restores.append((flat, before))
                if packing is not None:
                    flat.copy_(torch.ops.sgl_kernel.convert_weight_packed(logical.view(packing.rows, packing.columns)).reshape(-1))
        except BaseException:
            undo()
            raise
        return undo

    def _load_whole(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Loads ``tensors`` (fused groups complete) through the model's loader, then has
        SGLang process again each packed layer they went into (its loader writes the
        checkpoint's layout)."""
        self.model.load_weights(list(tensors.items()))
        modules = dict(self.model.named_modules())
        reprocessed = set()
        for name in tensors:
            for parameter in self.destinations.get(name, ()):
                module_name = parameter.rpartition(".")[0]
                module = modules[module_name]
                if _packed(module) and module_name not in reprocessed:
                    module.quant_method.process_weights_after_loading(module)
                    reprocessed.add(module_name)

    def mismatched(self, expected: Mapping[str, torch.Tensor]) -> list[str]:
        """The tensors of ``expected`` SGLang does not compute with, bit for bit: each
        parameter is read as the model holds it (a packed one unpacked through its checked
        packing) and compared piece by piece of the map. A tensor without a map is named
        in a warning as not checked."""
        import torch

        self.probe({name: (list(t.shape), dtype_name(t.dtype)) for name, t in expected.items()})

        def read(name: str) -> torch.Tensor:
            flat = self.model.get_parameter(name).detach().reshape(-1)
            packing = self.packings.get(name)
            module = self.model.get_submodule(name.rpartition(".")[0])
            if packing is not None and _packed(module):
                return packing.unpacked(flat)
            return flat

        with torch.no_grad():
            differ, unmapped = mismatched_pieces(self.element_map, expected, read)
        if unmapped:
            logger.warning("not checked: %s (no element map)", ", ".join(unmapped))
        return differ


def specs_typed(specs: Mapping[str, tuple[list[int], str]]) -> dict[str, tuple[list[int], torch.dtype]]:
    import torch

    return {name: (list(shape), getattr(torch, dtype)) for name, (shape, dtype) in specs.items()}
