"""LoRA training end to end: a trainer trains a PEFT adapter on a pinned base model and
publishes the adapter's tensors only; an actor serves each version through vLLM's LoRA
support, reading every version back from vLLM's adapter slot before serving it, with the
base weights untouched; what it generates is what the merged model generates."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest
import torch
from safetensors.torch import load_file
from grpo_steps import grpo_steps, verifying_actor
from test_engines import GREEDY, PROMPTS, generation_mismatch, small_qwen3

import aurora_rl
from aurora_rl.engines.hf import TransformersEngine
from aurora_rl.engines.vllm_lora import VllmLora
from aurora_rl.export import export_adapter

RANK = 8


def lora_model(base_dir):
    import peft
    import transformers

    model = transformers.Qwen3ForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    # lora_alpha twice the rank: vLLM scales lora_B by 2, which the read-back accounts for.
    config = peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = peft.get_peft_model(model, config)
    with torch.no_grad():
        # PEFT starts lora_B at zero (the adapter a no-op); a trained one is not.
        generator = torch.Generator().manual_seed(0)
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model, config


def merged(model) -> TransformersEngine:
    """The reference: the base with the adapter merged into it, in BF16."""
    import copy

    return TransformersEngine(copy.deepcopy(model).merge_and_unload().to(torch.bfloat16))


def test_a_trainer_and_a_vllm_actor_run_grpo_steps_on_a_lora_adapter(tmp_path):
    base_dir = small_qwen3(tmp_path / "base")
    base = load_file(str(base_dir / "model.safetensors"))
    model, config = lora_model(base_dir)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0)
    adapter = export_adapter(model)
    assert adapter and all(".lora_A." in n or ".lora_B." in n for n in adapter)
    engine = VllmLora.start(str(base_dir), config.to_dict(), tmp_path / "adapter", max_model_len=256,
                            max_num_seqs=4, max_num_batched_tokens=256)
    engine.load_weights(adapter)
    assert engine.mismatched(adapter) == []
    assert generation_mismatch(engine.generate(PROMPTS, GREEDY), merged(model)) is None
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    with aurora_rl.Trainer(tmp_path / "trainer", insecure_plaintext=True) as trainer:
        trainer.publish(adapter)
        with verifying_actor(trainer, engine, adapter) as actor:
            published = grpo_steps(trainer, actor, model, optimizer, export_adapter, steps=3)
    # Only the adapter travels: its delta, never more than the adapter itself.
    assert all(0 < p.artifact_bytes <= 1.2 * adapter_bytes for p, _ in published)
    adapter = published[-1][1]
    assert engine.mismatched(adapter) == []
    assert engine.engine.mismatched(base) == [], "the base weights are untouched"
    assert generation_mismatch(engine.generate(PROMPTS, GREEDY), merged(model)) is None


def test_a_tensor_that_is_not_an_adapters_is_refused_by_name(tmp_path):
    base_dir = small_qwen3(tmp_path / "base")
    _, config = lora_model(base_dir)
    engine = VllmLora(None, config.to_dict(), tmp_path / "adapter")
    with pytest.raises(KeyError, match="model.norm.weight"):
        engine.load_weights({"model.norm.weight": torch.ones(4)})
