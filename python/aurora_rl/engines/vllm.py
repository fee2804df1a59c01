"""vLLM as an aurora engine: the offline ``LLM``, in this process or in vLLM's engine
process, and its OpenAI-compatible server.

A version's changed elements are written into the parameters vLLM computes from, in
place, where the engine runs in this process with load format ``aurora``
(``VllmEngine.start``'s default; ``vllm_worker`` says how elements are placed through
vLLM's own loading code). Everything else goes in whole through the worker's
``reload_weights`` with Hugging Face names, which restores the checkpoint layout of the
layers it touches, loads, and processes them again; fused parameters (``qkv_proj``,
``gate_up_proj``) are rebuilt from all their parts, so every group arrives whole
(``with_fused_groups``).

With the engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) tensors are passed
as they are, and the weights it computes with can be read back (``held_weights``): each
linear layer applied to an identity matrix gives its weight exactly (one product per
output, accumulated with zeros), whatever layout it was repacked into. With vLLM's
engine process the changed tensors travel as a safetensors file in shared memory.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Optional

from aurora_rl.engines import Completion, Sampling, TensorChange, post_json, tensors_file
from aurora_rl.engines import vllm_worker

if TYPE_CHECKING:
    import torch
    from vllm import LLM

logger = logging.getLogger("aurora_rl.vllm")



class VllmEngine:
    """An aurora engine over a vLLM ``LLM``."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        #: The tensors the last ``load_changes`` reloaded whole (changed whole, or with no
        #: element map), before their fused groups were added.
        self.loaded_whole: set[str] = set()

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
            # Weights kept where the model computes from them: versions are written in
            # place, element by element (aurora_rl.engines.vllm_worker).
            "load_format": "aurora",
        }
        settings.update(options)
        _check_config(model)
        started = time.perf_counter()
        llm = LLM(model=model, **settings)
        logger.info("vLLM started on %s in %.1f s", model, time.perf_counter() - started)
        return cls(llm)

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        started = time.perf_counter()
        if self.writes_in_place:
            self.llm.collective_rpc(vllm_worker.load_weights, args=(dict(tensors),))
        elif self.in_process:
            self.llm.collective_rpc(
                "reload_weights",
                kwargs={"weights_iterator": list(tensors.items()), "is_checkpoint_format": True},
            )
        else:
            with tensors_file(tensors) as directory:
                self.llm.collective_rpc(
                    "reload_weights", kwargs={"weights_path": directory, "is_checkpoint_format": True}
                )
        # Cached prefixes hold keys and values of the old weights.
        self.llm.reset_prefix_cache()
        logger.debug("vLLM reloaded %d tensors in %.3f s", len(tensors), time.perf_counter() - started)

    @property
    def writes_in_place(self) -> bool:
        """Whether changed elements are written into the parameters: the engine in this
        process, loaded with load format ``aurora`` (``VllmEngine.start``'s default)."""
        load_format = self.llm.llm_engine.vllm_config.load_config.load_format
        return self.in_process and load_format == "aurora"

    @property
    def needs_new_tensors(self) -> bool:
        """An engine in vLLM's own process takes every changed tensor whole, so its actor
        hands them from its updated copy (``ElementEngine``)."""
        return not self.writes_in_place

    def map_elements(self, specs: Mapping[str, tuple[list[int], torch.dtype]]) -> None:
        """See ``aurora_rl.engines.MappedEngine`` (``vllm_worker.ModelWriter``): nothing
        to map for an engine in vLLM's own process, which takes tensors whole."""
        if self.writes_in_place:
            self.llm.collective_rpc(vllm_worker.map_elements, args=(dict(specs),))

    def load_changes(self, changes: Mapping[str, TensorChange]) -> None:
        """Writes changed elements in place where vLLM holds each tensor as loaded, found
        through vLLM's own loading code; tensors it cannot write so, and those changed
        whole, are reloaded whole with their fused groups (``vllm_worker.ModelWriter``).
        Written elements are undone if the reload fails."""
        started = time.perf_counter()
        if not self.writes_in_place:
            self.load_weights({name: change.tensor for name, change in changes.items()})
            self.loaded_whole = set(changes)
            return
        self.loaded_whole = self.llm.collective_rpc(vllm_worker.load_changes, args=(dict(changes),))[0]
        # Cached prefixes hold keys and values of the old weights.
        self.llm.reset_prefix_cache()
        written = sum(int(c.indices.numel()) for name, c in changes.items() if c.indices is not None and name not in self.loaded_whole)
        logger.debug(
            "vLLM took %d elements in place and %d tensors whole in %.3f s",
            written,
            len(self.loaded_whole),
            time.perf_counter() - started,
        )

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling, lora_request: Any = None) -> list[Completion]:
        """One batch; with ``lora_request``, on that adapter (``engines.vllm_lora``)."""
        from vllm import SamplingParams

        params = SamplingParams(
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            seed=sampling.seed,
            logprobs=0,
        )
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(prompt)} for prompt in prompts], params, use_tqdm=False, lora_request=lora_request
        )
        completions = []
        for output in outputs:
            sample = output.outputs[0]
            tokens = list(sample.token_ids)
            logprobs = [step[token].logprob for step, token in zip(sample.logprobs or [], tokens)]
            completions.append(Completion(tokens, logprobs))
        return completions

    def mismatched(self, expected: Mapping[str, torch.Tensor]) -> Optional[list[str]]:
        """See ``aurora_rl.engines.CheckedEngine`` (``vllm_worker.ModelWriter.mismatched``);
        None when vLLM's engine runs in a process of its own."""
        if not self.in_process:
            return None
        return self.llm.collective_rpc(vllm_worker.mismatched, args=(dict(expected),))[0]

    def held_weights(self) -> Optional[Mapping[str, torch.Tensor]]:
        if not self.in_process:
            return None
        return self.llm.collective_rpc(vllm_worker.held_weights)[0]


def _check_config(model: str) -> None:
    """A model directory's config must name its architecture: without one vLLM fails
    later with an unrelated message about the tokenizer."""
    import json

    config = os.path.join(model, "config.json")
    if os.path.isfile(config):
        with open(config) as file:
            if not json.load(file).get("architectures"):
                raise ValueError(
                    f"{config} names no \"architectures\" (for example [\"Qwen3ForCausalLM\"]): "
                    "vLLM picks the model class from it"
                )


class VllmServerEngine:
    """An aurora engine over vLLM's OpenAI-compatible server on this machine, started
    with ``VLLM_SERVER_DEV_MODE=1`` (its weight-reload routes) and ``--skip-tokenizer-init``
    (prompts are token ids).

    A version goes in with generation paused in ``wait`` mode: requests in flight finish
    on the old weights, new ones wait until the reload is done, so no request runs on a
    mix of two versions. The changed tensors travel as a safetensors file in shared
    memory, loaded by the worker's ``reload_weights``.
    """

    def __init__(self, base_url: str, model: str, *, timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeout = timeout

    def _post(self, path: str, body: Optional[dict] = None) -> Any:
        return post_json(self.base_url + path, body, self.timeout)

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        started = time.perf_counter()
        with tensors_file(tensors) as directory:
            self._post("/pause?mode=wait")
            try:
                self._post(
                    "/collective_rpc",
                    {"method": "reload_weights", "kwargs": {"weights_path": directory, "is_checkpoint_format": True}},
                )
                # Cached prefixes hold keys and values of the old weights.
                self._post("/reset_prefix_cache")
            finally:
                self._post("/resume")
        logger.debug("vLLM server reloaded %d tensors in %.3f s", len(tensors), time.perf_counter() - started)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[Completion]:
        answer = self._post(
            "/v1/completions",
            {
                "model": self.model,
                "prompt": [list(prompt) for prompt in prompts],
                "max_tokens": sampling.max_tokens,
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "seed": sampling.seed,
                "logprobs": 0,
                "return_token_ids": True,
                # Log-probabilities name their tokens by id: the server has no tokenizer.
                "return_tokens_as_token_ids": True,
            },
        )
        choices = sorted(answer["choices"], key=lambda choice: choice["index"])
        return [Completion(list(c["token_ids"]), list(c["logprobs"]["token_logprobs"])) for c in choices]

    def held_weights(self) -> Optional[Mapping[str, torch.Tensor]]:
        return None
