"""Hugging Face transformers as an aurora engine: the reference the other engines are
checked against, and the CPU fallback.

Each checkpoint tensor is a view of the parameter the model computes from: the parameter
itself, or, where the model fuses what checkpoints store apart (a mixture-of-experts
layer's experts in one 3-D parameter), the part transformers' own reversal of its loading
conversions cuts out of it (``aurora_rl.export.checkpoint_places``). Loading copies into
the views and writes changed elements through them, so an expert no version touched is
never written. It computes wherever the model is (``model.to("cuda")``): loading copies
the host tensors an actor hands it onto that device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from aurora_rl.engines import Completion, ElementWrite, Sampling, TensorChange, same_bits, write_elements

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel


class TransformersEngine:
    """An aurora engine over a ``PreTrainedModel`` (a causal language model)."""

    def __init__(self, model: PreTrainedModel) -> None:
        from aurora_rl.export import checkpoint_places

        self.model = model.eval()
        #: Where each checkpoint tensor lies in the model's state.
        self._places = checkpoint_places(model)

    @classmethod
    def start(cls, model: str, **options: object) -> TransformersEngine:
        """The checkpoint directory ``model`` in BF16 on the CPU; a directory with only
        its ``config.json`` gives a model whose weights an actor then loads from aurora."""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        settings: dict[str, object] = {"dtype": torch.bfloat16}
        settings.update(options)
        if not any(Path(model).glob("*.safetensors")):
            return cls(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model), **settings))
        return cls(AutoModelForCausalLM.from_pretrained(model, **settings))

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        import torch

        views = self._held(tensors)
        with torch.no_grad():
            for name, tensor in tensors.items():
                views[name].copy_(tensor)

    def load_changes(self, changes: Mapping[str, TensorChange]) -> None:
        """Writes the changed elements into the parameters through the checkpoint
        tensors' views (``aurora_rl.engines.ElementEngine``), so every element lands where
        the model computes from it; a tensor changed whole is copied in."""
        views = self._held(changes)
        by_element = {
            name: change for name, change in changes.items() if change.indices is not None and views[name].is_contiguous()
        }
        undo = write_elements(
            [ElementWrite(views[name].view(-1), change.indices, change.values()) for name, change in by_element.items()]
        )
        try:
            self.load_weights({name: c.tensor for name, c in changes.items() if name not in by_element})
        except BaseException:
            undo()
            raise

    def _held(self, names: Mapping[str, object]) -> dict[str, torch.Tensor]:
        """The checkpoint tensors, as views of where the model holds them now."""
        from aurora_rl.export import checkpoint_views

        unknown = sorted(set(names) - set(self._places))
        if unknown:
            raise KeyError(f"the model has no {', '.join(unknown)}")
        return checkpoint_views(self.model, self._places)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[Completion]:
        """Token by token with a KV cache, one prompt at a time (no padding, so each
        prompt's numbers are those of a batch of one)."""
        import torch

        device = self.model.device
        generator = torch.Generator(device).manual_seed(sampling.seed) if sampling.seed is not None else None
        completions = []
        with torch.no_grad():
            for prompt in prompts:
                tokens = torch.tensor([list(prompt)], device=device)
                past = None
                completion = Completion([], [])
                for _ in range(sampling.max_tokens):
                    output = self.model(input_ids=tokens, past_key_values=past, use_cache=True)
                    past = output.past_key_values
                    logprobs = torch.log_softmax(output.logits[0, -1].float(), dim=-1)
                    if sampling.temperature == 0:
                        token = int(torch.argmax(logprobs))
                    else:
                        probabilities = torch.softmax(logprobs / sampling.temperature, dim=-1)
                        token = int(torch.multinomial(probabilities, 1, generator=generator))
                    completion.token_ids.append(token)
                    completion.logprobs.append(float(logprobs[token]))
                    tokens = torch.tensor([[token]], device=device)
                completions.append(completion)
        return completions

    def score(self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]) -> list[list[tuple[float, float]]]:
        """For each completion of each prompt, teacher-forced: per token, its
        log-probability and the highest log-probability of any token at that step. How
        another engine's generation is checked against this one without letting one near
        tie make the two sequences diverge."""
        import torch

        device = self.model.device
        scores = []
        with torch.no_grad():
            for prompt, completion in zip(prompts, completions, strict=True):
                tokens = torch.tensor([list(prompt) + list(completion)], device=device)
                logits = self.model(input_ids=tokens).logits[0, len(prompt) - 1 : -1].float()
                logprobs = torch.log_softmax(logits, dim=-1)
                chosen = logprobs.gather(1, torch.tensor(list(completion), device=device).unsqueeze(1)).squeeze(1)
                scores.append(list(zip(chosen.tolist(), logprobs.max(dim=-1).values.tolist())))
        return scores

    def mismatched(self, expected: Mapping[str, torch.Tensor]) -> list[str]:
        """See ``aurora_rl.engines.CheckedEngine``: each tensor compared where the model
        holds it."""
        views = self._held(expected)
        return [name for name, tensor in expected.items() if not same_bits(views[name].detach().cpu(), tensor)]

    def held_weights(self) -> Optional[Mapping[str, torch.Tensor]]:
        from aurora_rl.export import checkpoint_views

        held = checkpoint_views(self.model, self._places)
        if getattr(self.model.config, "tie_word_embeddings", False):
            # The head is the embedding, which checkpoints store once.
            held.pop("lm_head.weight", None)
        return held
