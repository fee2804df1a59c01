"""The engine adapters on the real engines: vLLM (CPU build) and Hugging Face
transformers, over several versions of a small Qwen3 model delivered as aurora deltas.

After each activation the weights vLLM computes with, read back from its layers, must hash
to the trainer's export, and its greedy tokens and log-probabilities must match
transformers' on the same weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import aurora_rl
from aurora_rl.engines import TensorChange, fused_group_names, Sampling, takes_changes_first, with_fused_groups
from aurora_rl.engines.hf import TransformersEngine
from aurora_rl.engines.vllm import VllmEngine

HERE = Path(__file__).parent
PROMPTS = [[5, 17, 300, 42], [1000, 2, 3], [7] * 9, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
GREEDY = Sampling(max_tokens=12, temperature=0.0)
# Both engines compute in BF16 with FP32 accumulation, in different kernels and orders, and
# round activations and logits to BF16 (8 significant bits) along the way. Measured on this
# model over five versions: on the same weights, log-probabilities differ by at most 0.10
# and vLLM's greedy token trails the reference's best by at most 0.13 (near ties); one
# version behind, they differ by 2.4 to 4.9. The test checks that it tells the versions
# apart.
LOGPROB_TOLERANCE = 0.3


def small_qwen3(directory: Path, **overrides: object) -> Path:
    """A random Qwen3ForCausalLM from a config (no downloads; ``overrides`` change it),
    saved in BF16. The head is scaled so greedy choices are clear of rounding noise."""
    import transformers

    config = transformers.Qwen3Config(
        **{
            "vocab_size": 2048,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "max_position_embeddings": 256,
            "tie_word_embeddings": False,
            **overrides,
        }
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    model.to(torch.bfloat16).save_pretrained(directory, safe_serialization=True)
    return directory


def next_version(state: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """A new version: every weight nudged by about 10% of itself, so most BF16 elements
    move and the outputs change clearly (a far larger step than RL's, on purpose: the
    check of the engines must be able to tell two versions apart)."""
    generator = torch.Generator().manual_seed(100 + step)
    return {
        name: (t.float() * (1 + 0.1 * torch.randn(t.shape, generator=generator))).to(t.dtype)
        for name, t in state.items()
    }


def sparse_step(state: dict[str, torch.Tensor], density: float, seed: int) -> dict[str, torch.Tensor]:
    """An RL-sized step: about ``density`` of each tensor's elements move (by about 1%,
    which a BF16 element shows), the rest stay bit-identical."""
    generator = torch.Generator().manual_seed(seed)
    stepped = {}
    for name, t in state.items():
        moved = torch.rand(t.shape, generator=generator) < density
        stepped[name] = torch.where(moved, (t.float() * 1.01 + 1e-3).to(t.dtype), t)
    return stepped


def element_changes(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, TensorChange]:
    """What an actor hands an engine between two versions: each tensor's changed
    elements (fused groups whole, their unchanged parts with no elements)."""
    moved = {
        name: torch.nonzero(t.view(torch.int16).reshape(-1) != before[name].view(torch.int16).reshape(-1)).reshape(-1)
        for name, t in after.items()
    }
    names = fused_group_names([name for name, indices in moved.items() if indices.numel()])
    return {name: TensorChange(after[name], moved[name]) for name in names}


def changed_names(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> list[str]:
    return [name for name, t in after.items() if not torch.equal(t.view(torch.int16), before[name].view(torch.int16))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_qwen3(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def vllm_engine(model_dir: Path) -> VllmEngine:
    return VllmEngine.start(
        str(model_dir), max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256
    )


def generation_mismatch(completions, reference: TransformersEngine) -> str | None:
    """What is wrong with greedy ``completions`` of PROMPTS as the reference sees them
    (teacher-forced, so one near tie cannot make the sequences diverge), or None: every
    token must be the reference's greedy choice up to rounding, with the reference's
    log-probability."""
    scores = reference.score(PROMPTS, [c.token_ids for c in completions])
    for index, (completion, steps) in enumerate(zip(completions, scores, strict=True)):
        assert len(completion.token_ids) == GREEDY.max_tokens
        for step, (logprob, (expected, best)) in enumerate(zip(completion.logprobs, steps, strict=True)):
            if abs(logprob - expected) > LOGPROB_TOLERANCE:
                return f"prompt {index}, token {step}: log-probability {logprob}, the reference's {expected}"
            if expected < best - LOGPROB_TOLERANCE:
                return f"prompt {index}, token {step}: not greedy ({expected} against {best})"
    return None


def test_vllm_serves_every_version_bit_for_bit(model_dir, vllm_engine):
    reference = TransformersEngine.start(str(model_dir))
    host = load_file(str(model_dir / "model.safetensors"))
    assert aurora_rl.weights_hash(vllm_engine.held_weights()) == aurora_rl.weights_hash(host)
    assert generation_mismatch(vllm_engine.generate(PROMPTS, GREEDY), reference) is None

    outputs = [vllm_engine.generate(PROMPTS, GREEDY)]
    for version in range(1, 5):
        export = next_version(host, version)
        delta = aurora_rl.diff(host, export, base_version=version - 1)
        applied = aurora_rl.apply(host, delta)
        changed = changed_names(host, applied)
        assert changed, "every version changes something"
        vllm_engine.load_weights(with_fused_groups(changed, applied))
        # Against the previous version the comparison fails: it has the power to catch an
        # engine that missed an update.
        assert generation_mismatch(vllm_engine.generate(PROMPTS, GREEDY), reference) is not None
        reference.load_weights(with_fused_groups(changed, applied))
        host = applied

        held = vllm_engine.held_weights()
        assert sorted(held) == sorted(export)
        assert aurora_rl.weights_hash(held) == aurora_rl.weights_hash(export)
        assert aurora_rl.weights_hash(reference.held_weights()) == aurora_rl.weights_hash(export)
        generated = vllm_engine.generate(PROMPTS, GREEDY)
        assert generation_mismatch(generated, reference) is None
        outputs.append(generated)
    # The versions are told apart by what they generate, so the reload took effect.
    assert len({tuple(tuple(c.token_ids) for c in o) for o in outputs}) == len(outputs)


def test_vllm_takes_changed_elements_in_place_bit_for_bit(model_dir, vllm_engine):
    """RL-sized steps written element by element into the parameters vLLM computes from
    (load format aurora): no tensor goes whole, and the weights read back are each
    version's, bit for bit, from generation to generation."""
    assert vllm_engine.writes_in_place and takes_changes_first(vllm_engine)
    reference = TransformersEngine.start(str(model_dir))
    host = dict(vllm_engine.held_weights())
    for version in range(1, 4):
        stepped = sparse_step(host, 0.01, version)
        vllm_engine.load_changes(element_changes(host, stepped))
        assert vllm_engine.loaded_whole == set(), "every tensor of the model has an element map"
        assert aurora_rl.weights_hash(vllm_engine.held_weights()) == aurora_rl.weights_hash(stepped)
        reference.load_weights(stepped)
        assert generation_mismatch(vllm_engine.generate(PROMPTS, GREEDY), reference) is None
        host = stepped
    # A tensor changed whole (as by a snapshot) is reloaded, with its fused group.
    whole = dict(host, **{"model.layers.1.self_attn.k_proj.weight": -host["model.layers.1.self_attn.k_proj.weight"]})
    changes = element_changes(host, whole)
    changes["model.layers.1.self_attn.k_proj.weight"] = TensorChange(whole["model.layers.1.self_attn.k_proj.weight"], None)
    vllm_engine.load_changes(changes)
    assert vllm_engine.loaded_whole == {"model.layers.1.self_attn.k_proj.weight"}
    assert aurora_rl.weights_hash(vllm_engine.held_weights()) == aurora_rl.weights_hash(whole)
    # Elements still land in place after that reload processed the layer again.
    stepped = sparse_step(whole, 0.01, 9)
    vllm_engine.load_changes(element_changes(whole, stepped))
    assert aurora_rl.weights_hash(vllm_engine.held_weights()) == aurora_rl.weights_hash(stepped)


def test_a_change_vllm_cannot_take_leaves_its_weights_as_they_were(model_dir, vllm_engine):
    held = dict(vllm_engine.held_weights())
    changes = element_changes(held, sparse_step(held, 0.01, 11))
    name = "model.layers.0.mlp.down_proj.weight"
    change = changes[name]
    beyond = change.indices.clone()
    beyond[-1] = change.tensor.numel()  # one element past the tensor's end
    changes[name] = TensorChange(change.tensor, beyond)
    with pytest.raises(IndexError):
        vllm_engine.load_changes(changes)
    assert aurora_rl.weights_hash(vllm_engine.held_weights()) == aurora_rl.weights_hash(held)


def stale_copy_check(worker, expected: dict, name: str) -> tuple[list[str], list[str]]:
    """What the read-back finds on the engine as it is, then with the layer of ``name``
    computing from a copy of its weight that differs in one element (as a layer repacked
    after the writes would), put back after."""
    from aurora_rl.engines.vllm_worker import worker_writer

    writer = worker_writer(worker)
    clean = writer.mismatched(expected)
    module = writer.model.get_submodule(name.removesuffix(".weight"))
    stale = module.weight.detach().clone()
    stale.view(-1)[0] += 1
    module.cpu_linear = lambda x, weight, bias=None: torch.nn.functional.linear(x, stale, bias)
    try:
        return clean, writer.mismatched(expected)
    finally:
        module.cpu_linear = torch.nn.functional.linear


def test_the_read_back_finds_a_layer_computing_from_a_copy_its_parameter_is_not(vllm_engine):
    held = dict(vllm_engine.held_weights())
    assert vllm_engine.mismatched(held) == []
    name = "model.layers.0.mlp.down_proj.weight"
    clean, stale = vllm_engine.llm.collective_rpc(stale_copy_check, args=(held, name))[0]
    assert (clean, stale) == ([], [name])
    # An element of the parameter itself.
    changed = dict(held, **{name: held[name].clone()})
    changed[name].view(-1)[7] += 1
    assert vllm_engine.mismatched(changed) == [name]


def test_a_fused_group_is_sent_whole(model_dir, vllm_engine):
    state = load_file(str(model_dir / "model.safetensors"))
    held = vllm_engine.held_weights()
    name = "model.layers.1.self_attn.k_proj.weight"
    group = with_fused_groups([name], held)
    assert sorted(group) == [
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.self_attn.v_proj.weight",
    ]
    group = {n: t.clone() for n, t in group.items()}
    group[name] = -group[name]
    vllm_engine.load_weights(group)
    after = vllm_engine.held_weights()
    for part, tensor in group.items():
        assert torch.equal(after[part].view(torch.int16), tensor.view(torch.int16)), part
    # Everything else is as it was.
    for other in set(held) - set(group):
        assert torch.equal(after[other].view(torch.int16), held[other].view(torch.int16)), other
    with pytest.raises(KeyError, match="no model.layers.9"):
        with_fused_groups(["model.layers.9.mlp.up_proj.weight"], state)


def test_vllm_in_its_own_engine_process_takes_versions_through_shared_memory(model_dir):
    """vLLM's default: the engine in a separate process, reached with the changed
    tensors as a file. Run as a script, which spawning needs."""
    result = subprocess.run(
        [sys.executable, str(HERE / "vllm_engine_process.py"), str(model_dir)],
        capture_output=True,
        text=True,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
        timeout=540,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    assert "versions served: 3" in result.stdout, result.stdout


def next_work(actor: aurora_rl.Actor) -> aurora_rl.Work:
    """The actor's next work: ``claim`` until the control plane hands some out."""
    work = None
    while work is None:
        work = actor.claim()
    return work


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def running_server(command: list[str], ready: str, env: dict, timeout: float = 300) -> Iterator[None]:
    """An engine's server started with ``command``, once its output shows ``ready``;
    terminated at the end of the block."""
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in server.stdout], daemon=True).start()
    try:
        seen: list[str] = []
        while not any(ready in line for line in seen[-1:]):
            try:
                seen.append(lines.get(timeout=timeout))
            except queue.Empty:
                raise AssertionError("the server did not start:\n" + "".join(seen[-40:])) from None
        yield
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_the_openai_server_serves_each_version_it_is_given(model_dir):
    """vLLM's OpenAI-compatible server, its generation paused around each reload."""
    from aurora_rl.engines.vllm import VllmServerEngine

    port = free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", "small", "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "256",
               "--skip-tokenizer-init", "--host", "127.0.0.1", "--port", str(port)]
    with running_server(command, "Application startup complete", env):
        engine = VllmServerEngine(f"http://127.0.0.1:{port}", "small")
        assert engine.held_weights() is None
        reference = TransformersEngine.start(str(model_dir))
        host = load_file(str(model_dir / "model.safetensors"))
        assert generation_mismatch(engine.generate(PROMPTS, GREEDY), reference) is None
        for version in range(1, 3):
            applied = aurora_rl.apply(host, aurora_rl.diff(host, next_version(host, version), base_version=version - 1))
            update = with_fused_groups(changed_names(host, applied), applied)
            engine.load_weights(update)
            assert generation_mismatch(engine.generate(PROMPTS, GREEDY), reference) is not None
            reference.load_weights(update)
            assert generation_mismatch(engine.generate(PROMPTS, GREEDY), reference) is None
            host = applied


def test_a_model_directory_whose_config_names_no_architecture_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    with pytest.raises(ValueError, match='names no "architectures"'):
        VllmEngine.start(str(tmp_path))


def test_a_block_of_runs_is_recognised_from_the_copy_the_loader_made():
    """The probe's pieces that are runs of elements on both sides: a whole tensor or a
    shard's rows (one run), a shard of a row-parallel layer (part of every row); a block
    laid out otherwise (a transposed copy) is not."""
    from aurora_rl.engines.element_map import Piece, Runs

    rows_shard = Piece("qkv", (4, 6), 24, (6, 1), 48, (6, 1))
    assert rows_shard.runs == Runs((24, 48), 24, 1, 0, 0)
    columns_shard = Piece("o", (4, 3), 3, (6, 1), 0, (3, 1))
    assert columns_shard.runs == Runs((3, 6), -3, 4, 6, 3)
    assert Piece("o", (1, 4, 1, 3), 3, (99, 6, 7, 1), 0, (99, 3, 5, 1)).runs == Runs((3, 6), -3, 4, 6, 3)
    transposed = Piece("t", (4, 6), 0, (1, 4), 0, (6, 1))
    assert transposed.runs is None
    # Such a block is placed index by index: source element 4 is (0, 1), target 1.
    inside, placed = transposed.place(torch.tensor([0, 4, 5, 23]))
    assert inside.tolist() == [True] * 4 and placed.tolist() == [0, 1, 7, 23]


@pytest.mark.parametrize("group", [2, 1])
def test_a_kernels_packing_is_found_by_packing_a_sample_and_aurora_writes_land_where_it_put_them(group):
    """``Packing.of_kernel`` recognises a kernel's row blocks (here a VNNI packing written
    in torch, 32 rows a block, ``group`` columns at a time, the last block shorter) by
    writing a sample through aurora's core, and a version's elements written into the
    packed memory read back, unpacked, as the matrix with the changes."""
    from aurora_rl.engines import ElementWrite, write_elements
    from aurora_rl.engines.element_map import Packing

    def pack(weight: torch.Tensor) -> torch.Tensor:
        rows, columns = weight.shape
        blocks = [weight[start : start + 32] for start in range(0, rows, 32)]
        return torch.cat([
            block.reshape(block.shape[0], columns // group, group).permute(1, 0, 2).reshape(-1) for block in blocks
        ])

    rows, columns = 100, 48
    packing = Packing.of_kernel(rows, columns, torch.bfloat16, pack)
    assert packing == Packing(rows, columns, 32, group)
    generator = torch.Generator().manual_seed(group)
    matrix = torch.randn(rows, columns, generator=generator).to(torch.bfloat16)
    memory = pack(matrix)
    indices = (torch.rand(rows * columns, generator=generator) < 0.1).nonzero().flatten()
    values = torch.randn(indices.numel(), generator=generator).to(torch.bfloat16)
    undo = write_elements([ElementWrite(memory, indices, values, packing.layout)])
    changed = matrix.clone().view(-1).index_copy_(0, indices, values)
    assert torch.equal(packing.unpacked(memory).view(torch.int16), changed.view(torch.int16))
    undo()
    assert torch.equal(memory.view(torch.int16), pack(matrix).view(torch.int16))


def test_a_row_parallel_shard_takes_its_runs_of_the_whole_tensor_on_host_and_device():
    """Each rank's shard of a matrix split by columns is written from every changed
    element of the matrix (``ElementWrite.runs``): aurora's host kernel and the device
    path's torch ops each leave exactly the shard of the changed matrix, and their undos
    the shard as it was; indices the runs could not be placed from are refused first."""
    from aurora_rl.engines import ElementWrite, _scatter_on_device, _swap_on_host

    generator = torch.Generator().manual_seed(7)
    rows, columns, ranks = 30, 24, 2
    matrix = torch.randn(rows, columns, generator=generator).to(torch.bfloat16)
    indices = (torch.rand(rows * columns, generator=generator) < 0.2).nonzero().flatten()
    values = torch.randn(indices.numel(), generator=generator).to(torch.bfloat16)
    changed = matrix.clone().view(-1).index_copy_(0, indices, values).view(rows, columns)
    width = columns // ranks
    for rank in range(ranks):
        columns_of = slice(rank * width, (rank + 1) * width)
        write_into = lambda memory, indices=indices, values=values: ElementWrite(  # noqa: E731
            memory,
            indices,
            values,
            shift=-rank * width,
            within=(rank * width, (rank + 1) * width),
            tensor="o_proj",
            runs=(rows, columns, width, rows * columns),
        )
        on_host, on_device = (matrix[:, columns_of].contiguous().view(-1) for _ in range(2))
        undo_host, undo_device = _swap_on_host([write_into(on_host)]), _scatter_on_device([write_into(on_device)])
        for memory in (on_host, on_device):
            assert torch.equal(memory.view(torch.int16), changed[:, columns_of].reshape(-1).view(torch.int16))
        undo_host()
        undo_device()
        for memory in (on_host, on_device):
            assert torch.equal(memory.view(torch.int16), matrix[:, columns_of].reshape(-1).view(torch.int16))
    overlapping = dataclasses.replace(write_into(on_host), runs=(rows, columns, width - 1, rows * columns))
    with pytest.raises(aurora_rl.AuroraError, match="o_proj: .* are not disjoint blocks"):
        _swap_on_host([overlapping])
    with pytest.raises(ValueError, match="o_proj: .* are not disjoint blocks"):
        _scatter_on_device([dataclasses.replace(overlapping, target=on_device)])
    unordered = indices.flip(0)
    with pytest.raises(aurora_rl.AuroraError, match="o_proj: indices not strictly ascending"):
        _swap_on_host([write_into(on_host, unordered)])
    with pytest.raises(ValueError, match="o_proj: element indices not strictly ascending"):
        _scatter_on_device([write_into(on_device, unordered)])
    beyond = torch.cat([indices, torch.tensor([rows * columns])]), torch.cat([values, values[:1]])
    with pytest.raises(aurora_rl.AuroraError, match=f"o_proj: index {rows * columns} is beyond its"):
        _swap_on_host([write_into(on_host, *beyond)])
    with pytest.raises(IndexError, match=f"o_proj: an element index beyond its {rows * columns} elements"):
        _scatter_on_device([write_into(on_device, *beyond)])
    assert torch.equal(on_host.view(torch.int16), matrix[:, columns_of].reshape(-1).view(torch.int16))


def test_the_device_scatter_lands_shifted_blocks_where_the_host_kernel_does():
    """The GPU path's scatter (torch ops, run here on host tensors) and aurora's host
    kernel put fused parts' shifted writes in the same places, leaving the values handed
    in as they were, and each undo restores the memory; a block that does not fit is refused by both before anything lands."""
    from aurora_rl.engines import ElementWrite, _scatter_on_device, _swap_on_host

    generator = torch.Generator().manual_seed(5)
    memory = torch.randn(3 * 1000, generator=generator).to(torch.bfloat16)
    writes_of = lambda target: [  # noqa: E731
        ElementWrite(
            target,
            torch.randperm(1000, generator=torch.Generator().manual_seed(part))[:37].sort().values,
            torch.full((37,), float(part + 1), dtype=torch.bfloat16),
            shift=part * 1000,
            within=(0, 1000),
            tensor=f"part {part}",
            parameter="fused",
        )
        for part in range(3)
    ]
    on_host, on_device = memory.clone(), memory.clone()
    host_writes = writes_of(on_host)
    undo_host = _swap_on_host(host_writes)
    undo_device = _scatter_on_device(writes_of(on_device))
    assert torch.equal(on_host.view(torch.int16), on_device.view(torch.int16))
    # The caller's values are only read (the node's change set, which the read-back uses).
    assert all(bool((write.values == float(part + 1)).all()) for part, write in enumerate(host_writes))
    assert not torch.equal(on_host.view(torch.int16), memory.view(torch.int16))
    undo_host()
    undo_device()
    assert torch.equal(on_host.view(torch.int16), memory.view(torch.int16))
    assert torch.equal(on_device.view(torch.int16), memory.view(torch.int16))
    beyond = ElementWrite(on_device, torch.tensor([5]), torch.ones(1, dtype=torch.bfloat16), shift=2500, within=(0, 1000))
    with pytest.raises(IndexError, match="outside the 3000 elements"):
        _scatter_on_device([beyond])
    with pytest.raises(aurora_rl.AuroraError, match="fall outside the target's 3000 elements"):
        _swap_on_host([ElementWrite(on_host, beyond.indices, beyond.values, shift=2500, within=(0, 1000))])
    assert torch.equal(on_host.view(torch.int16), memory.view(torch.int16))
    assert torch.equal(on_device.view(torch.int16), memory.view(torch.int16))
    unordered = ElementWrite(on_device, torch.tensor([7, 3]), torch.ones(2, dtype=torch.bfloat16), tensor="part 0")
    with pytest.raises(ValueError, match="part 0: element indices not strictly ascending"):
        _scatter_on_device([unordered])
    # Every write is checked before the first lands: the good ones before it wrote nothing.
    with pytest.raises(ValueError, match="part 0: element indices not strictly ascending"):
        _scatter_on_device([*writes_of(on_device), unordered])
    assert torch.equal(on_device.view(torch.int16), memory.view(torch.int16))
