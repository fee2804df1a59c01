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
compares them with. Per quantized tensor the wrapper keeps each block's scale, largest
magnitude and where that lies, so that finding the blocks to rescale reads only the
changed elements (and the blocks whose largest element shrank); no FP8 image, unless the
engine may read one. The work is one call into aurora's core per tensor
(``aurora_delta::fp8::requantize``, tensors side by side), which rounds as torch does.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from aurora_rl.engines import (
    Completion,
    ElementWrite,
    Sampling,
    TensorChange,
    fused_group_names,
    write_elements,
)

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
    """What the wrapper keeps of one quantized tensor: per block its scale, its largest
    magnitude and the flat index of an element holding it; and, for an engine that may
    read them (one that does not say what it loaded whole), the FP8 image it holds."""

    fp8: Optional[torch.Tensor]
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

    def without_image(self) -> _Quantized:
        return dataclasses.replace(self, fp8=None)

    def for_update(self) -> _Quantized:
        """A copy whose statistics an update may change (the image, if kept, is shared:
        its writes are undone apart)."""
        return _Quantized(self.fp8, self.scales.clone(), self.largest.clone(), self.where.clone(), self.block)

    def update(
        self, tensor: torch.Tensor, indices: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Takes the new BF16 ``tensor``, whose elements at ``indices`` (ascending) changed
        to ``values``, into the scales and largest magnitudes. Returns the blocks whose
        scale moved (flat numbers, ascending) and their new scales, and the FP8 elements
        to write (flat indices, ascending) with their values."""
        import torch

        from aurora_rl import _core

        # One call into the core: each change quantized under its block's scale, the
        # blocks whose largest magnitude may have moved measured again, those whose scale
        # moved quantized anew.
        written = torch.empty(indices.numel(), dtype=torch.float8_e4m3fn)
        rescaled, scales, merged = _core.fp8_requantize(
            (*tensor.shape, *self.block),
            tensor.contiguous().view(-1).view(torch.uint8),
            indices.contiguous().view(torch.uint8),
            values.contiguous().view(torch.uint8),
            tuple(stat.view(-1).view(torch.uint8) for stat in (self.scales, self.largest, self.where)),
            written.view(torch.uint8),
        )
        rescaled, scales = torch.tensor(rescaled, dtype=torch.int64), torch.tensor(scales, dtype=torch.float32)
        if merged is None:
            return rescaled, scales, indices, written
        merged_indices, merged_values = merged
        return (
            rescaled,
            scales,
            torch.frombuffer(merged_indices, dtype=torch.int64),
            torch.frombuffer(merged_values, dtype=torch.uint8).view(torch.float8_e4m3fn),
        )


class Fp8Rollout:
    """An engine serving block-scaled FP8 weights, fed BF16 versions (see the module).
    ``weights``: the BF16 weights the engine's FP8 checkpoint was quantized from, where it
    was started from one (as for an actor started from local weights); without them the
    first version's tensors are quantized whole, and a join's snapshot sets them.
    ``quantized`` says which tensors the engine holds in FP8 (``quantized_linear``: those
    FP8 checkpoints of Qwen3 and DeepSeek quantize); the others pass through as they are.
    Anything else is the wrapped engine's."""

    #: Each changed tensor is requantized from the whole new BF16 tensor
    #: (``ElementEngine``).
    needs_new_tensors = True

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
        # An engine that says which tensors it loaded whole (``loaded_whole``, as
        # ``VllmEngine`` does) reads a tensor's FP8 image only then: such a tensor is
        # loaded again, quantized from the version's BF16, and no image is kept. Any other
        # engine may read the images, which are kept current.
        self._keeps_images = not hasattr(engine, "loaded_whole")
        self._held: dict[str, _Quantized] = {
            name: self._kept(_Quantized.of(t, block)) for name, t in (weights or {}).items() if quantized(name, t.shape)
        }
        self._pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="aurora-fp8")

    def __getattr__(self, name: str) -> Any:
        if name == "map_elements":
            # The engine is handed FP8 tensors and their scales, not the version's BF16
            # ones the actor would name: it maps those as they come.
            raise AttributeError(name)
        return getattr(self.engine, name)

    def _kept(self, quantized: _Quantized) -> _Quantized:
        return quantized if self._keeps_images else quantized.without_image()

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        held = {name: _Quantized.of(t, self.block) for name, t in tensors.items() if self._is_quantized(name, t.shape)}
        passed: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            if name in held:
                passed[name], passed[scale_name(name)] = held[name].fp8, held[name].scales
            else:
                passed[name] = tensor
        self.engine.load_weights(passed)
        self._held.update({name: self._kept(q) for name, q in held.items()})

    def load_changes(self, changes: Mapping[str, TensorChange]) -> None:
        """Each quantized tensor's changes as the FP8 elements and scales they move
        (see the module); a tensor changed whole is quantized whole. Transactional, as
        the wrapped engine is: on an error the kept statistics and images are as they
        were."""
        import torch

        passed: dict[str, TensorChange] = {}
        kept: dict[str, _Quantized] = {}
        updates: list[tuple[str, TensorChange]] = []
        for name, change in changes.items():
            if not self._is_quantized(name, change.shape):
                passed[name] = change
                continue
            if change.dtype != torch.bfloat16:
                raise ValueError(f"{name}: FP8 rollout weights come from BF16 versions, not {change.dtype}")
            held = self._held.get(name)
            if change.indices is None or held is None:
                whole = _Quantized.of(change.tensor, self.block)
                passed[name] = TensorChange(whole.fp8, None)
                passed[scale_name(name)] = TensorChange(whole.scales, None)
                kept[name] = self._kept(whole)
                continue
            kept[name] = held.for_update()
            updates.append((name, change))

        def requantized(update: tuple[str, TensorChange]) -> tuple[str, tuple[torch.Tensor, ...]]:
            name, change = update
            return name, kept[name].update(change.tensor, change.indices, change.values())

        image_writes: list[ElementWrite] = []
        # Tensors side by side: the core lets go of the GIL.
        for name, (rescaled, scales, written, values) in self._pool.map(requantized, updates):
            image = kept[name].fp8
            if image is None:
                # Never read: the engine writes the elements given, and a tensor it loads
                # whole instead is loaded again below.
                image = torch.zeros((), dtype=torch.float8_e4m3fn).expand(changes[name].tensor.shape)
            else:
                image_writes.append(ElementWrite(image.view(-1), written, values))
            passed[name] = TensorChange(image, written, values)
            if rescaled.numel():
                passed[scale_name(name)] = TensorChange(kept[name].scales, rescaled, scales)
        undo = write_elements(image_writes)
        try:
            self.engine.load_changes(passed)
            # A tensor loaded whole takes its fused group with it (q, k, v; gate, up): every
            # member read from what it was passed, a stand-in included.
            loaded = fused_group_names(getattr(self.engine, "loaded_whole", ()))
            stale = {name for name, _ in updates} & loaded
            if stale:
                self.engine.load_weights({
                    n: t
                    for name in stale
                    for n, t in zip((name, scale_name(name)), quantize_blocks(changes[name].tensor, self.block))
                })
        except BaseException:
            undo()
            raise
        self._held.update(kept)

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
