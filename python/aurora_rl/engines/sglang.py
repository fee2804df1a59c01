"""SGLang as an aurora engine: its Python ``Engine`` (``sglang.Engine``), whose scheduler
and model run in processes of their own, and its HTTP server on this machine.

A version goes in through SGLang's own weight-update lifecycle: ``begin_weight_update``,
``update_weights_from_tensor`` with the changed tensors under Hugging Face names (each
fused group whole, see ``with_fused_groups``: SGLang's loader stacks q/k/v and gate/up as
vLLM's does), then ``end_weight_update``, which brings the weights into the layout its
kernels compute from (on a CPU with AMX, packed). The tensors travel to the scheduler
through shared memory (SGLang's own serializer); nothing leaves the machine, and the
adapter never opens SGLang's HTTP routes. The actor calls ``load_weights`` only at its
safe point, between ``generate`` calls, so no request runs on two versions.

The server (``SglangServerEngine``) takes a version as a safetensors file of the changed
tensors in shared memory, through ``/update_weights_from_disk``: SGLang holds new requests
and lets those in flight finish before it loads, so none runs on two versions. Its routes
have no authentication: the adapter speaks to a server on loopback only, and the WAN stays
aurora's.

``SglangEngine.start`` gives defaults for token-id prompts in BF16 on the CPU build; any
``sglang.Engine`` option overrides them. SGLang starts processes with ``spawn``: a script
that starts one must do so under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import ipaddress
import logging
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Optional

from aurora_rl.engines import Completion, Sampling, post_json, tensors_file

if TYPE_CHECKING:
    import sglang
    import torch

logger = logging.getLogger("aurora_rl.sglang")



class SglangEngine:
    """An aurora engine over an ``sglang.Engine``."""

    def __init__(self, engine: sglang.Engine) -> None:
        self.engine = engine

    @classmethod
    def start(cls, model: str, **options: Any) -> SglangEngine:
        """An ``sglang.Engine`` on the Hugging Face checkpoint directory ``model``."""
        import sglang

        settings: dict[str, Any] = {
            "dtype": "bfloat16",
            "skip_tokenizer_init": True,
            "random_seed": 0,
            # Weight updates run between generate calls; the overlap scheduler would keep
            # a batch in flight across them.
            "disable_overlap_schedule": True,
            "log_level": "warning",
        }
        settings.update(options)
        return cls(sglang.Engine(model_path=model, **settings))

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        started = time.perf_counter()
        self._succeeded("begin_weight_update", self.engine.begin_weight_update())
        try:
            self._succeeded(
                "update_weights_from_tensor",
                self.engine.update_weights_from_tensor([(name, t.contiguous()) for name, t in tensors.items()]),
            )
        finally:
            self._succeeded("end_weight_update", self.engine.end_weight_update())
        logger.debug("SGLang loaded %d tensors in %.3f s", len(tensors), time.perf_counter() - started)

    @staticmethod
    def _succeeded(call: str, outcome: Any) -> None:
        """SGLang answers its update calls with ``(success, message)``."""
        success, message = outcome if isinstance(outcome, tuple) else (True, None)
        if not success:
            raise RuntimeError(f"SGLang's {call} failed: {message}")

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[Completion]:
        outputs = self.engine.generate(
            input_ids=[list(prompt) for prompt in prompts], sampling_params=_sampling_params(sampling), return_logprob=True
        )
        return _completions(outputs)

    def held_weights(self) -> Optional[Mapping[str, torch.Tensor]]:
        """None: SGLang's model runs in another process, in its kernels' layout."""
        return None

    def shutdown(self) -> None:
        self.engine.shutdown()


class SglangServerEngine:
    """An aurora engine over SGLang's HTTP server on this machine (``python -m
    sglang.launch_server ... --skip-tokenizer-init``: prompts are token ids)."""

    def __init__(self, base_url: str, *, timeout: float = 600.0) -> None:
        host = urllib.parse.urlsplit(base_url).hostname or ""
        if not _is_loopback(host):
            raise ValueError(
                f"{base_url}: SGLang's weight routes have no authentication; aurora drives a server on "
                "loopback only (the actor runs beside it)"
            )
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout

    def _post(self, path: str, body: dict) -> Any:
        return post_json(self.base_url + path, body, self.timeout)

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        started = time.perf_counter()
        with tensors_file(tensors) as directory:
            answer = self._post("/update_weights_from_disk", {"model_path": directory})
        if not answer.get("success"):
            raise RuntimeError(f"SGLang's update_weights_from_disk failed: {answer.get('message')}")
        logger.debug("SGLang server loaded %d tensors in %.3f s", len(tensors), time.perf_counter() - started)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[Completion]:
        return _completions(
            self._post(
                "/generate",
                {"input_ids": [list(p) for p in prompts], "sampling_params": _sampling_params(sampling), "return_logprob": True},
            )
        )

    def held_weights(self) -> Optional[Mapping[str, torch.Tensor]]:
        """None: the server's model runs in another process, in its kernels' layout."""
        return None


def _sampling_params(sampling: Sampling) -> dict[str, Any]:
    params: dict[str, Any] = {
        "max_new_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
    }
    if sampling.seed is not None:
        params["sampling_seed"] = sampling.seed
    return params


def _completions(outputs: list[dict]) -> list[Completion]:
    """SGLang's outputs, one per prompt: each generated token's (log-probability, token
    id, text) is in ``output_token_logprobs``."""
    return [
        Completion(list(o["output_ids"]), [step[0] for step in o["meta_info"]["output_token_logprobs"]])
        for o in outputs
    ]


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
