"""The boundary between an aurora actor and an inference engine.

An actor keeps a host copy of its weights (what its weights hash is computed from),
applies each committed delta to it, and at the engine's safe point (between batches)
hands the engine the tensors that changed. An engine adapter is one class with the
methods of ``Engine``; adding an engine (SGLang, another server) is one module against it.

- ``aurora_rl.engines.vllm.VllmEngine``: vLLM, offline ``LLM`` (in this process or in
  vLLM's engine process) or the OpenAI-compatible server.
- ``aurora_rl.engines.hf.TransformersEngine``: Hugging Face transformers, the reference
  engine and the CPU fallback.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Protocol

from aurora_rl import _core

if TYPE_CHECKING:
    import torch


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
