"""FP8 rollout weights: BF16 versions into an engine that serves block-scaled FP8 (128 x 128
blocks, one scale each, as FP8 checkpoints of Qwen3 and DeepSeek store them).

- Re-quantizing only what a version changed gives, bit for bit, the version quantized
  from scratch, also where a block's scale moves (its largest element grew, or shrank),
  and on blocks cut short by the tensor's edge; an engine's failure leaves nothing half
  written.
- vLLM's CPU build serves the FP8 checkpoint (its W8A16 AMX kernel), takes each version's
  FP8 writes in place, reads them back equal to the from-scratch quantization, and
  generates exactly as a vLLM started from that version's FP8 checkpoint. On a CPU
  without AMX tiles vLLM has no kernel for it: there the tests check that it refuses the
  model as its kernel selection says, and the actor's steps run over a host engine.
- A trainer trains GRPO-style on what an FP8 actor generates; the actor takes each BF16
  version into its FP8 engine, verified in full.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import json
from pathlib import Path

import pytest
import torch
from grpo_steps import grpo_steps, verifying_actor
from safetensors.torch import load_file
from test_engines import GREEDY, PROMPTS, element_changes, next_version, small_qwen3, sparse_step

import aurora_rl
from aurora_rl.engines import ElementWrite, fused_group_names, same_bits, write_elements
from aurora_rl.engines.fp8 import BLOCK, Fp8Rollout, quantize_blocks, quantized_checkpoint, save_checkpoint, scale_name
from aurora_rl.engines.hf import TransformersEngine
from aurora_rl.engines.vllm import VllmEngine
from aurora_rl.export import export_bf16

WEIGHT = "model.layers.0.mlp.down_proj.weight"


class HostEngine:
    """An element engine over host tensors: what it holds is what it was handed. It loads
    the tensors named in ``whole`` whole (from the change's tensor), and says so."""

    def __init__(self, tensors: dict[str, torch.Tensor], whole: set[str] = frozenset()) -> None:
        self.tensors = {name: t.clone() for name, t in tensors.items()}
        self.whole = set(whole)
        self.fail = False
        self.written: dict[str, int] = {}
        self.loaded_whole: set[str] = set()

    def load_weights(self, tensors) -> None:
        for name, tensor in tensors.items():
            self.tensors[name] = tensor.clone()

    def load_changes(self, changes) -> None:
        by_element = {name: c for name, c in changes.items() if c.indices is not None and name not in self.whole}
        undo = write_elements([ElementWrite(self.tensors[name].view(-1), c.indices, c.values()) for name, c in by_element.items()])
        if self.fail:
            undo()
            raise RuntimeError("the engine failed")
        self.loaded_whole = changes.keys() - by_element.keys()
        self.load_weights({name: changes[name].tensor for name in self.loaded_whole})
        self.written = {name: c.indices.numel() for name, c in by_element.items()}


class CheckedHostEngine(HostEngine):
    """A ``HostEngine`` that reads back what it holds, as a ``CheckedEngine`` does."""

    def mismatched(self, expected) -> list[str]:
        return [name for name, tensor in expected.items() if not same_bits(self.tensors[name], tensor)]


class DequantizingEngine(CheckedHostEngine):
    """Serves the FP8 checkpoint it holds by computing with its weights dequantized (each
    block times its scale) in transformers: where vLLM has no FP8 kernel (a CPU without
    AMX tiles), what the actor's steps run over."""

    def __init__(self, checkpoint: Path, bf16_dir: Path) -> None:
        super().__init__(load_file(str(checkpoint / "model.safetensors")))
        self.model = TransformersEngine.start(str(bf16_dir))

    def generate(self, prompts, sampling):
        weights = {}
        for name, tensor in self.tensors.items():
            if name.endswith("_scale_inv"):
                continue
            scales = self.tensors.get(scale_name(name))
            if scales is not None:
                rows, columns = tensor.shape
                expanded = scales.repeat_interleave(BLOCK[0], 0)[:rows].repeat_interleave(BLOCK[1], 1)[:, :columns]
                tensor = (tensor.float() * expanded).bfloat16()
            weights[name] = tensor
        self.model.load_weights(weights)
        return self.model.generate(prompts, sampling)


class ImageReader:
    """An engine that takes every change whole, from the change's tensor, and does not say
    what it loaded whole: it reads the wrapper's FP8 images, which must be current."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = {name: t.clone() for name, t in tensors.items()}

    def load_weights(self, tensors) -> None:
        for name, tensor in tensors.items():
            self.tensors[name] = tensor.clone()

    def load_changes(self, changes) -> None:
        self.load_weights({name: change.tensor for name, change in changes.items()})


def assert_quantized_from_scratch(engine: HostEngine, weights: dict[str, torch.Tensor]) -> None:
    for name, tensor in quantized_checkpoint(weights).items():
        assert same_bits(engine.tensors[name], tensor), name


def test_requantizing_the_changes_gives_the_version_quantized_from_scratch():
    generator = torch.Generator().manual_seed(0)
    # 300 x 260: the last row and column of blocks are cut short.
    weights = {WEIGHT: (torch.randn(300, 260, generator=generator) * 0.02).to(torch.bfloat16),
               "model.norm.weight": torch.ones(260, dtype=torch.bfloat16)}
    engine = HostEngine(quantized_checkpoint(weights))
    rollout = Fp8Rollout(engine, weights)
    assert_quantized_from_scratch(engine, weights)
    scales = quantize_blocks(weights[WEIGHT])[1]
    for step in range(1, 4):
        stepped = sparse_step(weights, 0.01, step)
        rollout.load_changes(element_changes(weights, stepped))
        assert_quantized_from_scratch(engine, stepped)
        weights = stepped

    # Block (0, 0)'s largest element shrinks, block (2, 2)'s (cut short) gets a larger one,
    # and block (1, 0) changes below its largest: two scales move, one does not.
    tensor = weights[WEIGHT].clone()
    values = tensor.float().view(-1)

    def block(row: int, column: int) -> torch.Tensor:
        rows = torch.arange(row * 128, min(row * 128 + 128, 300))
        columns = torch.arange(column * 128, min(column * 128 + 128, 260))
        return (rows[:, None] * 260 + columns[None, :]).reshape(-1)

    first = block(0, 0)
    tensor.view(-1)[first[values[first].abs().argmax()]] = 0
    edge = block(2, 2)
    tensor.view(-1)[edge[0]] = values[edge].abs().max() * 4
    tensor.view(-1)[block(1, 0)[5]] *= 0.5
    stepped = dict(weights, **{WEIGHT: tensor})
    rollout.load_changes(element_changes(weights, stepped))
    assert_quantized_from_scratch(engine, stepped)
    before, after = quantize_blocks(weights[WEIGHT])[1], quantize_blocks(tensor)[1]
    assert (before != after).nonzero().tolist() == [[0, 0], [2, 2]]
    # Written: the three changed elements, and those of the two rescaled blocks whose FP8
    # value the new scale moves (not all: a scale moves by little).
    written = set((tensor.view(-1) != weights[WEIGHT].view(-1)).nonzero().view(-1).tolist())
    for row, column in ((0, 0), (2, 2)):
        elements = block(row, column)
        old, new = (tensor.float().view(-1)[elements] / s[row, column] for s in (before, after))
        moved = old.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8) != new.clamp(-448, 448).to(
            torch.float8_e4m3fn).view(torch.uint8)
        written |= set(elements[moved].tolist())
    assert len(written) < 128 * 128 + 44 * 4 + 1
    assert engine.written[WEIGHT] == len(written)
    assert engine.written[scale_name(WEIGHT)] == 2
    assert not torch.equal(scales, engine.tensors[scale_name(WEIGHT)])

    # A failing engine leaves its weights and the wrapper's images as they were: the next
    # version still lands bit for bit.
    engine.fail = True
    with pytest.raises(RuntimeError, match="the engine failed"):
        rollout.load_changes(element_changes(stepped, sparse_step(stepped, 0.05, 9)))
    assert_quantized_from_scratch(engine, stepped)
    engine.fail = False
    final = sparse_step(stepped, 0.02, 10)
    rollout.load_changes(element_changes(stepped, final))
    assert_quantized_from_scratch(engine, final)


class GroupEngine(HostEngine):
    """As vLLM does: a tensor it loads whole takes its fused group (q, k, v) with it, each
    member read from the tensor it was passed, while it reports only the one it had to
    load whole."""

    def load_changes(self, changes) -> None:
        whole = {name for name, c in changes.items() if name in self.whole or c.indices is None}
        group = fused_group_names(whole)
        by_element = {name: c for name, c in changes.items() if c.indices is not None and name not in group}
        write_elements([ElementWrite(self.tensors[name].view(-1), c.indices, c.values()) for name, c in by_element.items()])
        self.load_weights({name: changes[name].tensor for name in group if name in changes})
        self.loaded_whole = whole


def test_a_fused_group_loaded_whole_for_one_member_gets_every_member_quantized():
    generator = torch.Generator().manual_seed(3)
    names = [f"model.layers.0.self_attn.{part}_proj.weight" for part in "qkv"]
    weights = {name: (torch.randn(256, 128, generator=generator) * 0.02).to(torch.bfloat16) for name in names}
    engine = GroupEngine(quantized_checkpoint(weights), whole={names[1]})
    rollout = Fp8Rollout(engine, weights)
    stepped = sparse_step(weights, 0.02, 40)
    rollout.load_changes(element_changes(weights, stepped))
    assert engine.loaded_whole == {names[1]}
    assert_quantized_from_scratch(engine, stepped)


def test_an_engine_that_reads_the_images_gets_them_current():
    generator = torch.Generator().manual_seed(2)
    weights = {WEIGHT: (torch.randn(256, 384, generator=generator) * 0.02).to(torch.bfloat16)}
    engine = ImageReader(quantized_checkpoint(weights))
    rollout = Fp8Rollout(engine, weights)
    for step in range(1, 4):
        stepped = sparse_step(weights, 0.02, 30 + step)
        rollout.load_changes(element_changes(weights, stepped))
        assert_quantized_from_scratch(engine, stepped)
        weights = stepped


def test_the_core_rounds_to_fp8_as_torch_does():
    """aurora's pass over the changes (``_core.fp8_requantize``) against torch's division,
    clamp and conversion, on every BF16 bit pattern (NaNs, infinities and subnormals
    included) under scales that land them across FP8's range: each pattern a block of
    its own, whose largest magnitude only a NaN moves."""
    from aurora_rl import _core

    values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    n = values.numel()
    for scale in (1.0, 0.37, 3e-3, 1e3, 2.0**-20, 7.1):
        scales = torch.full((n,), scale, dtype=torch.float32)
        largest, where = torch.full((n,), float("inf")), torch.full((n,), -1, dtype=torch.int64)
        quantized = torch.empty(n, dtype=torch.float8_e4m3fn)
        rescaled, _, merged = _core.fp8_requantize(
            (1, n, 1, 1), values.view(torch.uint8), torch.arange(n).view(torch.uint8), values.view(torch.uint8),
            (scales.view(torch.uint8), largest.view(torch.uint8), where.view(torch.uint8)),
            quantized.view(torch.uint8),
        )
        expected = (values.float() / scales).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert same_bits(quantized, expected), scale
        # A NaN's block takes scale 1, as quantizing it from scratch gives; no other moves.
        nans = torch.isnan(values.float()).nonzero().view(-1).tolist()
        assert rescaled == (nans if scale != 1.0 else []), scale
    with pytest.raises(aurora_rl.AuroraError, match="not strictly ascending"):
        _core.fp8_requantize(
            (1, 4, 1, 4), values[:4].view(torch.uint8), torch.tensor([2, 1]).view(torch.uint8),
            values[:2].view(torch.uint8),
            (scales[:1].view(torch.uint8), scales[:1].view(torch.uint8), torch.tensor([0]).view(torch.uint8)),
            quantized[:2].view(torch.uint8),
        )


def test_an_engine_that_loads_a_tensor_whole_gets_it_as_the_version_quantizes_it():
    """The kept FP8 image is updated after the engine took the changes: a tensor the
    engine loaded whole from it (the previous version's, then) is loaded again."""
    generator = torch.Generator().manual_seed(1)
    weights = {WEIGHT: (torch.randn(256, 384, generator=generator) * 0.02).to(torch.bfloat16)}
    engine = HostEngine(quantized_checkpoint(weights), whole={WEIGHT})
    rollout = Fp8Rollout(engine, weights)
    for step in range(1, 4):
        stepped = sparse_step(weights, 0.01, step)
        rollout.load_changes(element_changes(weights, stepped))
        assert engine.loaded_whole == {WEIGHT}
        assert_quantized_from_scratch(engine, stepped)
        weights = stepped


def fp8_model(directory: Path, weights: dict[str, torch.Tensor], bf16_dir: Path) -> Path:
    save_checkpoint(directory, weights, json.loads((bf16_dir / "config.json").read_text()))
    return directory


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every projection a whole number of 128-row blocks, as vLLM's FP8 layers require of
    each part of a fused one (real models' are)."""
    return small_qwen3(tmp_path_factory.mktemp("qwen3"), hidden_size=256, intermediate_size=512, head_dim=64)


#: vLLM's CPU build serves block-scaled FP8 through an AMX kernel only (its
#: ``CPUFp8BlockScaledMMKernel.is_supported`` asks for AMX tiles).
AMX = torch.cpu._is_amx_tile_supported()


def start(directory: Path) -> VllmEngine:
    return VllmEngine.start(str(directory), max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256)


def start_fp8(directory: Path) -> VllmEngine | None:
    """vLLM on the FP8 checkpoint in ``directory``; on a CPU without AMX tiles, None once
    vLLM has refused it for want of a kernel (and for no other reason)."""
    if AMX:
        return start(directory)
    with pytest.raises(ValueError, match="Failed to find a kernel that can implement the ScaledMM linear layer"):
        start(directory)
    return None


def test_vllm_serves_fp8_versions_written_in_place(bf16_dir, tmp_path):
    weights = load_file(str(bf16_dir / "model.safetensors"))
    engine = start_fp8(fp8_model(tmp_path / "fp8", weights, bf16_dir))
    if engine is None:
        return
    rollout = Fp8Rollout(engine, weights)
    assert rollout.mismatched(weights) == []
    for step in range(1, 4):
        stepped = sparse_step(weights, 0.01, step) if step < 3 else next_version(weights, step)
        before = [c.token_ids for c in rollout.generate(PROMPTS, GREEDY)]
        rollout.load_changes(element_changes(weights, stepped))
        assert engine.loaded_whole == set(), "every FP8 weight and scale is written element by element"
        assert rollout.mismatched(stepped) == []
        weights = stepped
    assert [c.token_ids for c in rollout.generate(PROMPTS, GREEDY)] != before, "the last version changes the output"
    served = rollout.generate(PROMPTS, GREEDY)
    del engine, rollout
    fresh = start(fp8_model(tmp_path / "fp8-last", weights, bf16_dir)).generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in served] == [c.token_ids for c in fresh]
    assert [c.logprobs for c in served] == [c.logprobs for c in fresh]


def test_an_fp8_actor_serves_grpo_steps_each_version_verified_in_full(bf16_dir, tmp_path):
    """A trainer trains the BF16 model GRPO-style on the rollouts an FP8 actor generates;
    the actor takes each BF16 version and reads it back, quantized, before serving it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    weights = export_bf16(model)
    checkpoint = fp8_model(tmp_path / "fp8", weights, bf16_dir)
    engine = start_fp8(checkpoint) or DequantizingEngine(checkpoint, bf16_dir)
    rollout = Fp8Rollout(engine, weights)
    with aurora_rl.Trainer(tmp_path / "trainer", insecure_plaintext=True) as trainer:
        trainer.publish(weights)
        with verifying_actor(trainer, rollout, weights) as actor:
            published = grpo_steps(trainer, actor, model, optimizer, export_bf16, steps=3)
    assert rollout.mismatched(published[-1][1]) == []
