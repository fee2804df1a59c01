"""vLLM as an aurora engine: the offline ``LLM``, in this process or in vLLM's engine
process.

Weights go in through the worker's ``reload_weights`` with Hugging Face names, which
restores the checkpoint layout of the layers it touches, loads, and processes them again:
on the CPU vLLM repacks its linear weights for oneDNN after loading, so writing into its
parameters would change nothing. Fused parameters (``qkv_proj``, ``gate_up_proj``) are
rebuilt from all their parts, so every group arrives whole (``with_fused_groups``).

With the engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) tensors are passed
as they are, and the weights it computes with can be read back (``held_weights``): each
linear layer applied to an identity matrix gives its weight exactly (one product per
output, accumulated with zeros), whatever layout it was repacked into. With vLLM's
engine process the changed tensors travel as a safetensors file in shared memory.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Optional

from aurora_rl import _core
from aurora_rl.engines import Completion, Sampling

if TYPE_CHECKING:
    import torch
    from vllm import LLM

logger = logging.getLogger("aurora_rl.vllm")

#: Where the changed tensors are written for an engine in another process: memory, not
#: disk, when the machine has it.
_SHARED_MEMORY = "/dev/shm"


class VllmEngine:
    """An aurora engine over a vLLM ``LLM``."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"

    @classmethod
    def start(cls, model: str, **options: Any) -> VllmEngine:
        """An ``LLM`` on the Hugging Face checkpoint directory ``model``, with defaults for
        token-id prompts in BF16 (any ``LLM`` option overrides them)."""
        from vllm import LLM

        settings: dict[str, Any] = {
            "dtype": "bfloat16",
            "skip_tokenizer_init": True,
            "enforce_eager": True,
            "seed": 0,
        }
        settings.update(options)
        started = time.perf_counter()
        llm = LLM(model=model, **settings)
        logger.info("vLLM started on %s in %.1f s", model, time.perf_counter() - started)
        return cls(llm)

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        started = time.perf_counter()
        if self.in_process:
            self.llm.collective_rpc(
                "reload_weights",
                kwargs={"weights_iterator": list(tensors.items()), "is_checkpoint_format": True},
            )
        else:
            from safetensors.torch import save_file

            where = _SHARED_MEMORY if os.path.isdir(_SHARED_MEMORY) else None
            with tempfile.TemporaryDirectory(prefix="aurora-weights-", dir=where) as directory:
                save_file({name: t.contiguous() for name, t in tensors.items()}, os.path.join(directory, "model.safetensors"))
                self.llm.collective_rpc(
                    "reload_weights", kwargs={"weights_path": directory, "is_checkpoint_format": True}
                )
        # Cached prefixes hold keys and values of the old weights.
        self.llm.reset_prefix_cache()
        logger.debug("vLLM reloaded %d tensors in %.3f s", len(tensors), time.perf_counter() - started)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[Completion]:
        from vllm import SamplingParams

        params = SamplingParams(
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            seed=sampling.seed,
            logprobs=0,
        )
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(prompt)} for prompt in prompts], params, use_tqdm=False
        )
        completions = []
        for output in outputs:
            sample = output.outputs[0]
            tokens = list(sample.token_ids)
            logprobs = [step[token].logprob for step, token in zip(sample.logprobs or [], tokens)]
            completions.append(Completion(tokens, logprobs))
        return completions

    def held_weights(self) -> Optional[Mapping[str, torch.Tensor]]:
        if not self.in_process:
            return None
        return self.llm.collective_rpc(_read_back_weights)[0]


def _read_back_weights(worker: Any) -> dict[str, torch.Tensor]:
    """Runs in the worker: the model's weights as it computes with them, under Hugging
    Face names (fused groups split into their parts)."""
    import torch

    model = worker.model_runner.get_model()
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
            inputs = _input_size(module)
            identity = torch.eye(inputs, dtype=getattr(module, "params_dtype", torch.bfloat16))
            weight = method.apply(module, identity).t().contiguous()
            parts = _core.unfused_names(f"{name}.weight")
            if parts is None:
                held[f"{name}.weight"] = weight
            else:
                for part, rows in zip(parts, weight.split(list(module.output_sizes), dim=0)):
                    held[part] = rows.contiguous()
        for name, parameter in model.named_parameters():
            # Embeddings and norms are used as stored.
            if name not in held and ("embed_tokens" in name or "norm" in name):
                held[name] = parameter.detach().clone()
    return held


def _input_size(module: Any) -> int:
    for attribute in ("input_size_per_partition", "embedding_dim"):
        value = getattr(module, attribute, None)
        if value:
            return int(value)
    return int(module.weight.shape[1])

