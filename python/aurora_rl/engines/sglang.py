"""SGLang as an aurora engine: its Python ``Engine`` (``sglang.Engine``), whose scheduler
and model run in processes of their own.

A version goes in through SGLang's own weight-update lifecycle: ``begin_weight_update``,
``update_weights_from_tensor`` with the changed tensors under Hugging Face names (each
fused group whole, see ``with_fused_groups``: SGLang's loader stacks q/k/v and gate/up as
vLLM's does), then ``end_weight_update``, which brings the weights into the layout its
kernels compute from (on a CPU with AMX, packed). The tensors travel to the scheduler
through shared memory (SGLang's own serializer); nothing leaves the machine, and the
adapter never opens SGLang's HTTP routes. The actor calls ``load_weights`` only at its
safe point, between ``generate`` calls, so no request runs on two versions.

``SglangEngine.start`` gives defaults for token-id prompts in BF16 on the CPU build; any
``sglang.Engine`` option overrides them. SGLang starts processes with ``spawn``: a script
that starts one must do so under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Optional

from aurora_rl.engines import Completion, Sampling

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
        params: dict[str, Any] = {
            "max_new_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
        }
        if sampling.seed is not None:
            params["sampling_seed"] = sampling.seed
        outputs = self.engine.generate(
            input_ids=[list(prompt) for prompt in prompts], sampling_params=params, return_logprob=True
        )
        completions = []
        for output in outputs:
            # (log-probability, token id, text) per generated token.
            logprobs = [step[0] for step in output["meta_info"]["output_token_logprobs"]]
            completions.append(Completion(list(output["output_ids"]), logprobs))
        return completions

    def held_weights(self) -> Optional[Mapping[str, torch.Tensor]]:
        """None: SGLang's model runs in another process, in its kernels' layout."""
        return None

    def shutdown(self) -> None:
        self.engine.shutdown()
