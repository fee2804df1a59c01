"""Mixture-of-experts models end to end: a small Qwen3-MoE, whose transformers modules hold
each projection of all experts in one 3-D parameter while checkpoints and vLLM name each
expert's own tensors.

- The trainer's export names each expert as checkpoints do.
- A step that reaches a quarter of the experts leaves the others bit-identical: an expert
  no step touched costs the delta its header entry, no chunk.
- transformers and vLLM take each version's changed elements in place, into the fused
  expert parameters (vLLM's packed for its AMX kernel), never reloading an expert whole;
  every version is read back bit for bit and generates as the reference does.
- A trainer and a vLLM actor run GRPO-style steps on it, every version verified in full.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from grpo_steps import grpo_steps, verifying_actor
from test_engines import GREEDY, PROMPTS, element_changes, generation_mismatch, sparse_step

import aurora_rl
from aurora_rl.engines import TensorChange
from aurora_rl.engines.hf import TransformersEngine
from aurora_rl.engines.vllm import VllmEngine
from aurora_rl.export import export_bf16

EXPERTS = 16
LAYERS = 2


def moe_config():
    import transformers

    return transformers.Qwen3MoeConfig(
        vocab_size=2048, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=EXPERTS, num_experts_per_tok=2,
        max_position_embeddings=256, tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"],
    )


def small_qwen3_moe(directory: Path) -> Path:
    """A random Qwen3MoeForCausalLM from a config, saved in BF16 (as checkpoints store it:
    each expert's projections apart); the head scaled so greedy choices are clear."""
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(moe_config())
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    model.to(torch.bfloat16).save_pretrained(directory)
    return directory


def expert_names(layer: int, expert: int) -> list[str]:
    return [f"model.layers.{layer}.mlp.experts.{expert}.{p}_proj.weight" for p in ("gate", "up", "down")]


def expert_step(state: dict[str, torch.Tensor], seed: int) -> tuple[dict[str, torch.Tensor], set[str]]:
    """An RL-sized step (``sparse_step``) of every tensor but the experts, of which a
    quarter per layer move; returns it and the expert tensors left as they were."""
    generator = torch.Generator().manual_seed(seed)
    stepped = sparse_step(state, 0.01, seed)
    untouched = set()
    for layer in range(LAYERS):
        for expert in torch.randperm(EXPERTS, generator=generator)[EXPERTS // 4 :].tolist():
            untouched.update(expert_names(layer, expert))
    return {name: state[name] if name in untouched else t for name, t in stepped.items()}, untouched


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_qwen3_moe(tmp_path_factory.mktemp("qwen3-moe"))


@pytest.fixture(scope="module")
def vllm_moe(moe_dir: Path) -> VllmEngine:
    return VllmEngine.start(str(moe_dir), max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256)


def test_the_export_names_each_expert_as_checkpoints_do(moe_dir):
    import transformers

    model = transformers.Qwen3MoeForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    assert model.model.layers[0].mlp.experts.gate_up_proj.dim() == 3, "transformers fuses the experts"
    exported = export_bf16(torch.compile(model))
    stored = load_file(str(moe_dir / "model.safetensors"))
    assert sorted(exported) == sorted(stored)
    assert set(expert_names(1, EXPERTS - 1)) <= set(exported)
    assert aurora_rl.weights_hash(exported) == aurora_rl.weights_hash(stored)
    assert all(t.is_contiguous() for t in exported.values())


def test_an_untouched_expert_costs_the_delta_its_header_entry_only(moe_dir):
    base = load_file(str(moe_dir / "model.safetensors"))
    stepped, untouched = expert_step(base, 1)
    assert all(torch.equal(stepped[name], base[name]) for name in untouched)
    full = aurora_rl.diff(base, stepped)
    touched = [name for name in base if name not in untouched]
    only_touched = aurora_rl.diff({n: base[n] for n in touched}, {n: stepped[n] for n in touched})
    # Each tensor of the model is named in the header (its layout and hash); an untouched
    # one adds that entry and nothing else.
    per_untouched = (len(full) - len(only_touched)) / len(untouched)
    assert 0 < per_untouched <= max(len(name) for name in untouched) + 32, per_untouched
    assert aurora_rl.weights_hash(aurora_rl.apply(base, full)) == aurora_rl.weights_hash(stepped)


def test_transformers_writes_expert_elements_into_its_fused_parameters(moe_dir):
    engine = TransformersEngine.start(str(moe_dir))
    host = load_file(str(moe_dir / "model.safetensors"))
    for version in range(1, 4):
        if version == 3:
            # A model moved (as to a GPU) holds its parameters in new memory; the engine
            # writes where it holds them now. A round trip through float64 is exact.
            engine.model.to(torch.float64).to(torch.bfloat16)
        fused = engine.model.model.layers[1].mlp.experts.gate_up_proj
        stepped, untouched = expert_step(host, version)
        before = fused.detach().clone()
        engine.load_changes(element_changes(host, stepped))
        assert engine.mismatched(stepped) == []
        assert aurora_rl.weights_hash(engine.held_weights()) == aurora_rl.weights_hash(stepped)
        # The rows of the experts the step left alone are as they were.
        for expert in range(EXPERTS):
            if expert_names(1, expert)[0] in untouched:
                assert torch.equal(fused[expert], before[expert]), expert
        host = stepped
    # It computes with what it holds: as a model loaded from the last version's checkpoint.
    fresh = TransformersEngine.start(str(moe_dir))
    fresh.load_weights(host)
    assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == [c.token_ids for c in fresh.generate(PROMPTS, GREEDY)]


def test_vllm_writes_changed_expert_elements_through_its_packing(moe_dir, vllm_moe):
    reference = TransformersEngine.start(str(moe_dir))
    host = load_file(str(moe_dir / "model.safetensors"))
    assert vllm_moe.mismatched(host) == []
    assert generation_mismatch(vllm_moe.generate(PROMPTS, GREEDY), reference) is None
    for version in range(1, 4):
        stepped, untouched = expert_step(host, 10 + version)
        # Steps large enough to change what the model generates, so a missed write shows.
        stepped = {name: t if name in untouched else (t.float() * 1.1).to(t.dtype) for name, t in stepped.items()}
        changes = element_changes(host, stepped)
        assert not untouched & changes.keys(), "an untouched expert is handed to the engine"
        vllm_moe.load_changes(changes)
        assert vllm_moe.loaded_whole == set(), "every expert tensor is written element by element"
        assert vllm_moe.mismatched(stepped) == []
        assert aurora_rl.weights_hash(vllm_moe.held_weights()) == aurora_rl.weights_hash(stepped)
        assert generation_mismatch(vllm_moe.generate(PROMPTS, GREEDY), reference) is not None, "the reference lags"
        reference.load_weights(stepped)
        assert generation_mismatch(vllm_moe.generate(PROMPTS, GREEDY), reference) is None
        host = stepped


def test_a_whole_load_keeps_vllm_experts_packed_for_its_kernel(moe_dir, vllm_moe):
    """vLLM's own reload leaves a CPU build's experts unpacked (0.32): aurora writes them
    through the packing instead, also when a version changes an expert whole."""
    host = dict(vllm_moe.held_weights())
    stepped, _ = expert_step(host, 21)
    vllm_moe.load_weights(stepped)
    assert vllm_moe.mismatched(stepped) == []
    reference = TransformersEngine.start(str(moe_dir))
    reference.load_weights(stepped)
    assert generation_mismatch(vllm_moe.generate(PROMPTS, GREEDY), reference) is None
    name = expert_names(0, 3)[2]
    whole = dict(stepped, **{name: -stepped[name]})
    changes = element_changes(stepped, whole)
    changes[name] = TensorChange(whole[name], None)
    vllm_moe.load_changes(changes)
    assert vllm_moe.loaded_whole == {name}
    assert vllm_moe.mismatched(whole) == []


def test_a_trainer_and_a_vllm_actor_run_grpo_steps_on_a_moe_model(moe_dir, vllm_moe, tmp_path):
    """Real steps (``grpo_steps``): each version moves the experts its tokens reached, and
    the actor reads every version back in full before serving it."""
    import transformers

    model = transformers.Qwen3MoeForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    weights = export_bf16(model)
    vllm_moe.load_weights(weights)
    with aurora_rl.Trainer(tmp_path / "trainer", insecure_plaintext=True) as trainer:
        trainer.publish(weights)
        with verifying_actor(trainer, vllm_moe, weights) as actor:
            published = grpo_steps(trainer, actor, model, optimizer, export_bf16, steps=3)
    assert aurora_rl.weights_hash(vllm_moe.held_weights()) == published[-1][0].weights_hash
    experts = [name for name in weights if ".experts." in name]
    for previous, (_, current) in zip([weights] + [w for _, w in published], published):
        assert any(not torch.equal(current[n], previous[n]) for n in experts), "a step moves experts"
