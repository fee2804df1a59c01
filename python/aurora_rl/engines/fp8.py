"""FP8 rollout weights from BF16 versions: the trainer publishes BF16 deltas and the actor's
node holds BF16, while its engine serves block-scaled FP8, the layout FP8 checkpoints of
Qwen3 and DeepSeek use: each linear layer's weight in ``float8_e4m3fn`` with one float32
scale per 128 x 128 block (``<name>_scale_inv``: the factor that turns the FP8 values back
into the weight), the scale the block's largest magnitude over FP8's largest (448).

``Fp8Rollout`` wraps an engine started on such a checkpoint (or its config). A version's
changed BF16 elements become the FP8 writes they imply and no others: each changed element
quantized under its block's scale, and every element of a block whose scale moved (its
largest magnitude changed) with the new scale. The engine's weights are then bit for bit
the version quantized from scratch (``quantize_blocks``), which is what ``mismatched``
compares them with. Per quantized tensor the wrapper keeps the FP8 image it handed the
engine and each block's scale, largest magnitude and where that lies, so that finding the
blocks to rescale reads only the changed elements (and the blocks whose largest element
changed). The per-element work is one pass in aurora's core
(``aurora_delta::fp8::quantize_changes``), which rounds as torch does.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from aurora_rl.engines import Completion, ElementWrite, Sampling, TensorChange, write_elements

if TYPE_CHECKING:
    import torch

#: The largest magnitude ``float8_e4m3fn`` holds.
FP8_MAX = 448.0
#: Rows and columns of a scale's block.
BLOCK = (128, 128)
#: What FP8 checkpoints of Qwen3 and DeepSeek quantize: every linear layer of the decoder
#: (attention and MLP projections, experts included), not the embedding, the norms, the
#: router or the head.
_QUANTIZED = re.compile(r".*\.layers\.\d+\..*_proj\.weight$")


def quantized_linear(name: str, shape: Sequence[int]) -> bool:
    """Whether FP8 checkpoints of Qwen3 and DeepSeek store the tensor ``name`` quantized."""
    return len(shape) == 2 and _QUANTIZED.match(name) is not None


def scale_name(name: str) -> str:
    return f"{name}_scale_inv"


def _quantize(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``values`` under their blocks' ``scales``: the one rounding both quantizing from
    scratch and re-quantizing changed elements use, so the two agree bit for bit."""
    import torch

    return (values.float() / scales).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _scale(largest: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.where(largest > 0, largest / FP8_MAX, torch.ones_like(largest))


def _blocked(tensor: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``tensor`` as [block rows, rows, block columns, columns], zero-padded to whole
    blocks (a zero never is a block's largest magnitude, unless every element is zero)."""
    import torch

    rows, columns = tensor.shape
    grid = (math.ceil(rows / block[0]), math.ceil(columns / block[1]))
    padded = tensor.new_zeros(grid[0] * block[0], grid[1] * block[1])
    padded[:rows, :columns] = tensor
    return padded.view(grid[0], block[0], grid[1], block[1])


def quantize_blocks(tensor: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``tensor`` (2-D) quantized from scratch: its FP8 values and its blocks' scales."""
    blocks = _blocked(tensor.float(), block)
    scales = _scale(blocks.abs().amax(dim=(1, 3)))
    quantized = _quantize(blocks, scales[:, None, :, None]).view(blocks.shape[0] * block[0], -1)
    return quantized[: tensor.shape[0], : tensor.shape[1]].contiguous(), scales


def quantized_checkpoint(
    weights: Mapping[str, torch.Tensor],
    block: tuple[int, int] = BLOCK,
    quantized: Callable[[str, Sequence[int]], bool] = quantized_linear,
) -> dict[str, torch.Tensor]:
    """``weights`` (BF16) as an FP8 checkpoint stores them: each quantized tensor in FP8
    beside its scales, the others as they are."""
    stored: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if quantized(name, tensor.shape):
            stored[name], stored[scale_name(name)] = quantize_blocks(tensor, block)
        else:
            stored[name] = tensor
    return stored


def save_checkpoint(
    directory: Path, weights: Mapping[str, torch.Tensor], config: Mapping[str, Any], block: tuple[int, int] = BLOCK
) -> None:
    """An FP8 checkpoint of ``weights`` (BF16) in ``directory``, with ``config`` (a model's
    ``config.json``) saying how it is quantized, as FP8 checkpoints of Qwen3 do: what an
    engine that serves FP8 starts from."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    quantization = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    (directory / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}, indent=2))
    save_file(quantized_checkpoint(weights, block), str(directory / "model.safetensors"))


@dataclass
class _Quantized:
    """What the wrapper keeps of one quantized tensor: the FP8 image the engine holds, and
    per block its scale, its largest magnitude and the flat index of an element holding
    it."""

    fp8: torch.Tensor
    scales: torch.Tensor
    largest: torch.Tensor
    where: torch.Tensor
    block: tuple[int, int]

    @classmethod
    def of(cls, tensor: torch.Tensor, block: tuple[int, int]) -> _Quantized:
        import torch

        blocks = _blocked(tensor.float(), block).abs()
        grid = (blocks.shape[0], blocks.shape[2])
        flat = blocks.permute(0, 2, 1, 3).reshape(grid[0], grid[1], -1)
        largest, position = flat.max(dim=-1)
        # The position within the block, as a flat index of the tensor.
        rows = torch.arange(grid[0])[:, None] * block[0] + torch.div(position, block[1], rounding_mode="floor")
        columns = torch.arange(grid[1])[None, :] * block[1] + position % block[1]
        fp8, scales = quantize_blocks(tensor, block)
        return cls(fp8, scales, largest, rows * tensor.shape[1] + columns, block)

    def block_of(self, indices: torch.Tensor) -> torch.Tensor:
        """The flat block number of each flat element index."""
        import torch

        rows, columns = self.fp8.shape
        if rows * columns < 2**31:
            # Half the memory traffic of int64, for the one pass per changed element.
            indices = indices.to(torch.int32)
        row = torch.div(indices, columns, rounding_mode="floor")
        column = indices - row * columns
        return (
            torch.div(row, self.block[0], rounding_mode="floor") * self.scales.shape[1]
            + torch.div(column, self.block[1], rounding_mode="floor")
        ).long()

    def block_elements(self, blocks: torch.Tensor) -> torch.Tensor:
        """The flat element indices of ``blocks`` (flat block numbers, ascending),
        ascending."""
        import torch

        rows, columns = self.fp8.shape
        grid_columns = self.scales.shape[1]
        row_offsets = torch.arange(self.block[0])
        column_offsets = torch.arange(self.block[1])
        parts = []
        for number in blocks.tolist():
            first_row = number // grid_columns * self.block[0]
            first_column = number % grid_columns * self.block[1]
            block_rows = first_row + row_offsets[row_offsets < rows - first_row]
            block_columns = first_column + column_offsets[column_offsets < columns - first_column]
            parts.append((block_rows[:, None] * columns + block_columns[None, :]).reshape(-1))
        if not parts:
            return torch.empty(0, dtype=torch.int64)
        # Blocks side by side interleave by row: ascending only once sorted.
        return torch.cat(parts).sort().values

    def update(
        self, tensor: torch.Tensor, indices: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Takes the new BF16 ``tensor``, whose elements at ``indices`` (ascending) changed
        to ``values``, into the scales and largest magnitudes. Returns the blocks whose
        scale moved (flat numbers, ascending) and their new scales, and the FP8 elements
        to write (flat indices, ascending) with their values."""
        import torch

        from aurora_rl import _core

        largest, where, scales = self.largest.view(-1), self.where.view(-1), self.scales.view(-1)
        # One pass in the core: each changed element quantized under its block's scale, and
        # the blocks whose largest magnitude may have moved (an element exceeds it, or the
        # element that held it changed), measured again here.
        written = torch.empty(indices.numel(), dtype=torch.float8_e4m3fn)
        moved = _core.fp8_quantize_changes(
            (*self.fp8.shape, *self.block),
            indices.contiguous().view(torch.uint8),
            values.contiguous().view(torch.uint8),
            (scales.view(torch.uint8), largest.view(torch.uint8), where.view(torch.uint8)),
            written.view(torch.uint8),
        )
        moved = torch.tensor(moved, dtype=torch.int64)
        new_largest, new_where = self._measure(tensor, moved)
        new_scales = _scale(new_largest)
        rescaled = new_scales.view(torch.int32) != scales[moved].view(torch.int32)
        largest[moved], where[moved] = new_largest, new_where
        moved, new_scales = moved[rescaled], new_scales[rescaled]
        scales[moved] = new_scales
        if not moved.numel():
            return moved, new_scales, indices, written
        # Every element of a rescaled block, merged with the other changes in order.
        inside = torch.zeros(scales.numel(), dtype=torch.bool)
        inside[moved] = True
        kept = ~inside[self.block_of(indices)]
        others, other_values = indices[kept], written[kept]
        rescaled_elements = self.block_elements(moved)
        rescaled_values = _quantize(tensor.reshape(-1)[rescaled_elements], scales[self.block_of(rescaled_elements)])
        at = torch.searchsorted(others, rescaled_elements) + torch.arange(rescaled_elements.numel())
        merged = torch.ones(others.numel() + at.numel(), dtype=torch.bool)
        merged[at] = False
        all_indices = torch.empty(merged.numel(), dtype=indices.dtype)
        # Moved as bytes: torch places no FP8 values by mask.
        all_values = torch.empty(merged.numel(), dtype=torch.uint8)
        all_indices[merged], all_indices[at] = others, rescaled_elements
        all_values[merged], all_values[at] = other_values.view(torch.uint8), rescaled_values.view(torch.uint8)
        return moved, new_scales, all_indices, all_values.view(written.dtype)

    def _measure(self, tensor: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each of ``blocks``' largest magnitude in ``tensor`` and the flat index of an
        element holding it."""
        import torch

        flat = tensor.reshape(-1)
        largest, where = [], []
        for number in blocks.tolist():
            elements = self.block_elements(torch.tensor([number]))
            magnitude, position = flat[elements].float().abs().max(dim=0)
            largest.append(magnitude)
            where.append(elements[position])
        if not largest:
            return torch.empty(0), torch.empty(0, dtype=torch.int64)
        return torch.stack(largest), torch.stack(where)


class _Update(threading.Thread):
    """Element writes into host images on a thread of their own (aurora's swap lets go of
    the GIL); ``wait`` joins it and raises what it raised. Not a daemon: a process that
    exits meanwhile waits for it rather than killing it inside the swap."""

    def __init__(self, writes: list[ElementWrite]) -> None:
        super().__init__(name="aurora-fp8-images")
        self._writes = writes
        self._error: Optional[BaseException] = None
        self.start()

    def run(self) -> None:
        try:
            write_elements(self._writes)
        except BaseException as error:  # raised again by ``wait``
            self._error = error

    def wait(self) -> None:
        self.join()
        if self._error is not None:
            raise self._error


class Fp8Rollout:
    """An engine serving block-scaled FP8 weights, fed BF16 versions (see the module).
    ``weights``: the BF16 weights the engine's FP8 checkpoint was quantized from, where it
    was started from one (as for an actor started from local weights); without them the
    first version's tensors are quantized whole, and a join's snapshot sets them.
    ``quantized`` says which tensors the engine holds in FP8 (``quantized_linear``: those
    FP8 checkpoints of Qwen3 and DeepSeek quantize); the others pass through as they are.
    Anything else is the wrapped engine's."""

    def __init__(
        self,
        engine: Any,
        weights: Optional[Mapping[str, torch.Tensor]] = None,
        block: tuple[int, int] = BLOCK,
        quantized: Callable[[str, Sequence[int]], bool] = quantized_linear,
    ) -> None:
        self.engine = engine
        self.block = block
        self._is_quantized = quantized
        self._held: dict[str, _Quantized] = {
            name: _Quantized.of(t, block) for name, t in (weights or {}).items() if quantized(name, t.shape)
        }
        self._updating: Optional[_Update] = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._settle()
        held = {name: _Quantized.of(t, self.block) for name, t in tensors.items() if self._is_quantized(name, t.shape)}
        passed: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            if name in held:
                passed[name], passed[scale_name(name)] = held[name].fp8, held[name].scales
            else:
                passed[name] = tensor
        self.engine.load_weights(passed)
        self._held.update(held)

    def load_changes(self, changes: Mapping[str, TensorChange]) -> None:
        """Each quantized tensor's changes as the FP8 elements and scales they move
        (see the module); a tensor changed whole is quantized whole. Transactional, as
        the wrapped engine is: on an error the kept images are as they were.

        The kept FP8 images take the changes after the engine has them, on a thread of
        their own while the engine generates again, where the engine says which tensors
        it loaded whole (``loaded_whole``, as ``VllmEngine`` does): it reads an image only
        then, and such a tensor is loaded again from its updated image. Any other engine's
        images are updated first."""
        import torch

        self._settle()
        passed: dict[str, TensorChange] = {}
        kept: dict[str, _Quantized] = {}
        image_writes: dict[str, ElementWrite] = {}
        for name, change in changes.items():
            if not self._is_quantized(name, change.tensor.shape):
                passed[name] = change
                continue
            if change.tensor.dtype != torch.bfloat16:
                raise ValueError(f"{name}: FP8 rollout weights come from BF16 versions, not {change.tensor.dtype}")
            held = self._held.get(name)
            if change.indices is None or held is None:
                kept[name] = _Quantized.of(change.tensor, self.block)
                passed[name] = TensorChange(kept[name].fp8, None)
                passed[scale_name(name)] = TensorChange(kept[name].scales, None)
                continue
            kept[name] = _Quantized(held.fp8, held.scales.clone(), held.largest.clone(), held.where.clone(), self.block)
            rescaled, scales, written, values = kept[name].update(change.tensor, change.indices, change.values())
            passed[name] = TensorChange(held.fp8, written, values)
            passed[scale_name(name)] = TensorChange(kept[name].scales, rescaled, scales)
            image_writes[name] = ElementWrite(held.fp8.view(-1), written, values)
        reports = hasattr(self.engine, "loaded_whole")
        if not reports:
            undo = write_elements(list(image_writes.values()))
        try:
            self.engine.load_changes(passed)
        except BaseException:
            if not reports:
                undo()
            raise
        self._held.update(kept)
        if not reports:
            return
        stale = image_writes.keys() & set(self.engine.loaded_whole)
        if stale:
            write_elements(list(image_writes.values()))
            self.engine.load_weights({n: t for name in stale for n, t in ((name, kept[name].fp8), (scale_name(name), kept[name].scales))})
            return
        self._updating = _Update(list(image_writes.values()))

    def _settle(self) -> None:
        """Waits for the kept images' update from the last version, if it still runs."""
        if self._updating is not None:
            updating, self._updating = self._updating, None
            updating.wait()

    def mismatched(self, expected: Mapping[str, torch.Tensor]) -> Optional[list[str]]:
        """The tensors of ``expected`` (BF16, the version's) the engine does not compute
        with: each quantized one compared, FP8 values and scales, with the version
        quantized from scratch."""
        differ = self.engine.mismatched(quantized_checkpoint(expected, self.block, self._is_quantized))
        if differ is None:
            return None
        return sorted({name.removesuffix("_scale_inv") for name in differ})

    def held_weights(self) -> Optional[Mapping[str, torch.Tensor]]:
        """None: the engine holds FP8, which no BF16 version hashes to (``mismatched``
        checks it against each version quantized)."""
        return None

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[Completion]:
        return self.engine.generate(prompts, sampling)
