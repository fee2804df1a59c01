"""LoRA adapters as aurora versions, served by vLLM: the base model is a pinned checkpoint
every actor starts its engine from, and the trainer publishes the adapter's tensors only
(``aurora_rl.export.export_adapter``: PEFT's names), so a step's delta is the adapter's.
Each version is loaded as vLLM's adapter (its LoRA support, ``enable_lora``), replacing
the one it serves between batches; the base weights are never touched.

vLLM computes with the adapter from its per-slot buffers, ``lora_B`` scaled by the
adapter's ``lora_alpha / r``; ``mismatched`` reads those buffers back and compares them
with the version's tensors (``lora_B`` scaled as vLLM scales it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from aurora_rl.engines import Completion, Sampling, same_bits

if TYPE_CHECKING:
    import torch

    from aurora_rl.engines.vllm import VllmEngine

#: The one adapter an actor serves, under vLLM's adapter id.
ADAPTER_ID = 1
_PREFIX = "base_model.model."


class VllmLora:
    """vLLM serving a pinned base model with the adapter versions aurora carries. Its
    weights are the adapter's tensors under PEFT's names; ``adapter_config`` is the
    adapter's ``adapter_config.json`` (PEFT's ``LoraConfig.to_dict()``); each version is
    written to ``directory`` for vLLM to load."""

    def __init__(self, engine: VllmEngine, adapter_config: Mapping[str, Any], directory: Path, name: str = "aurora") -> None:
        self.engine = engine
        # As PEFT saves it: sets as lists; what JSON cannot hold (PEFT's runtime objects) left out.
        config = {key: sorted(value) if isinstance(value, set) else value for key, value in adapter_config.items()}
        self.config = {key: value for key, value in config.items() if _json_value(value)}
        self.directory = Path(directory)
        self.name = name
        self.scaling = float(adapter_config["lora_alpha"]) / float(adapter_config["r"])
        self._tensors: dict[str, torch.Tensor] = {}
        self._request: Any = None

    @classmethod
    def start(cls, base_model: str, adapter_config: Mapping[str, Any], directory: Path, **options: Any) -> VllmLora:
        """vLLM on the base checkpoint ``base_model``, with LoRA for one adapter of the
        config's rank (``VllmEngine.start``'s options otherwise)."""
        from aurora_rl.engines.vllm import VllmEngine

        settings = {"enable_lora": True, "max_loras": 1, "max_lora_rank": int(adapter_config["r"]), **options}
        return cls(VllmEngine.start(base_model, **settings), adapter_config, directory)

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Takes ``tensors`` (the adapter's, those that changed) into the adapter and has
        vLLM load it in place of the one it served."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        unknown = [name for name in tensors if not name.startswith(_PREFIX) or ".lora_" not in name]
        if unknown:
            raise KeyError(f"not a LoRA adapter's tensor: {', '.join(sorted(unknown)[:3])}")
        adapter = {**self._tensors, **{name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()}}
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "adapter_config.json").write_text(json.dumps(self.config, indent=2))
        save_file(adapter, str(self.directory / "adapter_model.safetensors"))
        request = LoRARequest(self.name, ADAPTER_ID, str(self.directory), load_inplace=True)
        if not self.engine.llm.llm_engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the adapter in {self.directory}")
        self._tensors = adapter
        self._request = LoRARequest(self.name, ADAPTER_ID, str(self.directory))

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[Completion]:
        if self._request is None:
            raise RuntimeError("no adapter loaded yet")
        return self.engine.generate(prompts, sampling, lora_request=self._request)

    def mismatched(self, expected: Mapping[str, torch.Tensor]) -> Optional[list[str]]:
        """The adapter tensors of ``expected`` vLLM does not compute with, read back from
        its adapter slot (``lora_B`` compared scaled, as vLLM scales it); None when vLLM's
        engine runs in a process of its own."""
        if not self.engine.in_process:
            return None
        held = self.engine.llm.collective_rpc(read_adapter, args=({n: list(t.shape) for n, t in expected.items()},))[0]
        return [name for name, tensor in expected.items() if not same_bits(held[name], self._as_served(name, tensor))]

    def _as_served(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if ".lora_B." not in name or self.scaling == 1:
            return tensor
        # vLLM folds the scaling into lora_B with an in-place product in the adapter's dtype.
        return tensor.clone().mul_(self.scaling)

    def held_weights(self) -> Optional[Mapping[str, torch.Tensor]]:
        """None: vLLM holds ``lora_B`` scaled, which no published version hashes to
        (``mismatched`` compares it)."""
        return None


def _json_value(value: Any) -> bool:
    try:
        json.dumps(value)
    except TypeError:
        return False
    return True


def read_adapter(worker: Any, shapes: Mapping[str, list[int]]) -> dict[str, torch.Tensor]:
    """``collective_rpc`` entry: each adapter tensor (PEFT's name: its shape) as vLLM's
    adapter slot for ``ADAPTER_ID`` holds it (one rank), from the buffers its LoRA layers
    compute with."""
    manager = worker.model_runner.lora_manager._adapter_manager
    slot = manager.lora_index_to_id.index(ADAPTER_ID)
    packed = getattr(manager.model, "packed_modules_mapping", {})
    held = {}
    for name, shape in shapes.items():
        path, _, kind = name.removeprefix(_PREFIX).rpartition(".lora_")
        parent, _, leaf = path.rpartition(".")
        module_name, part = path, 0
        for fused, parts in packed.items():
            if leaf in parts:
                module_name, part = f"{parent}.{fused}", parts.index(leaf)
        module = manager.modules[module_name]
        if kind.startswith("A"):
            held[name] = module.lora_a_stacked[part][slot, 0, : shape[0], : shape[1]].clone()
        else:
            held[name] = module.lora_b_stacked[part][slot, 0, : shape[0], : shape[1]].clone()
    return held
