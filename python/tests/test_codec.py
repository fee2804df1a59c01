"""The codec bindings against the CLI's bytes, on torch BF16 above all, numpy too, special
values, layout changes, and hostile bytes."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run
from safetensors.torch import load_file

import aurora_rl


def load(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def raw(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def assert_bit_equal(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        got = actual[name]
        assert got.dtype == tensor.dtype, name
        assert tuple(got.shape) == tuple(tensor.shape), name
        if isinstance(tensor, torch.Tensor):
            assert torch.equal(raw(got), raw(tensor)), f"{name} differs"
        else:
            assert got.tobytes() == tensor.tobytes(), f"{name} differs"


def snapshot(state: dict) -> dict:
    return {name: tensor.clone() for name, tensor in state.items()}


@pytest.mark.parametrize("encoding", ["aurora", "leb128", "dense"])
def test_diff_writes_the_bytes_of_the_cli(aurora_bin, synth_steps, tmp_path, encoding):
    written = tmp_path / "cli.adelta"
    run(
        aurora_bin, "delta", "diff", synth_steps[1], synth_steps[2], "-o", written,
        "--encoding", encoding, "--base-version", 7,
    )
    ours = aurora_rl.diff(load(synth_steps[1]), load(synth_steps[2]), encoding=encoding, base_version=7)
    assert ours == written.read_bytes()


def test_weights_hash_is_the_one_the_cli_records(aurora_bin, synth_steps, tmp_path):
    written = tmp_path / "cli.adelta"
    run(aurora_bin, "delta", "diff", synth_steps[0], synth_steps[1], "-o", written)
    stats = json.loads(run(aurora_bin, "delta", "inspect", written, "--json"))
    assert aurora_rl.weights_hash(load(synth_steps[0])) == stats["base_hash"]
    assert aurora_rl.weights_hash(load(synth_steps[1])) == stats["target_hash"]


def test_a_delta_the_cli_wrote_applies_to_the_cli_result(aurora_bin, synth_steps, tmp_path):
    written, applied = tmp_path / "cli.adelta", tmp_path / "applied.safetensors"
    run(aurora_bin, "delta", "diff", synth_steps[0], synth_steps[1], "-o", written)
    run(aurora_bin, "delta", "apply", synth_steps[0], written, "-o", applied)
    assert_bit_equal(aurora_rl.apply(load(synth_steps[0]), written.read_bytes()), load(applied))


def test_every_step_is_reproduced_bit_for_bit_and_base_is_left_alone(synth_steps):
    states = [load(path) for path in synth_steps]
    current = states[0]
    for version, target in enumerate(states[1:]):
        before = snapshot(current)
        delta = aurora_rl.diff(current, target, base_version=version)
        result = aurora_rl.apply(current, delta)
        assert_bit_equal(current, before)
        assert_bit_equal(result, target)
        assert aurora_rl.weights_hash(result) == aurora_rl.weights_hash(target)
        current = result
    assert {t.dtype for t in current.values()} == {torch.bfloat16, torch.float32}


def one_step(state: dict[str, torch.Tensor], seed: int, lr: float = 1e-3) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: (t.float() + lr * torch.randn(t.shape, generator=generator) * t.float().abs()).to(t.dtype)
        for name, t in state.items()
    }


def test_torch_bf16_in_and_out_without_a_file():
    generator = torch.Generator().manual_seed(1)
    base = {
        "model.embed_tokens.weight": (torch.randn(512, 64, generator=generator) * 0.02).bfloat16(),
        "model.layers.0.self_attn.q_proj.weight": (torch.randn(64, 64, generator=generator) * 0.05).bfloat16(),
        "model.norm.weight": torch.ones(64, dtype=torch.bfloat16),
        "scalar": torch.tensor(0.5, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 3, dtype=torch.bfloat16),
    }
    target = one_step(base, seed=2)
    # A transposed view is read as the tensor it shows.
    base["model.layers.0.self_attn.q_proj.weight"] = base["model.layers.0.self_attn.q_proj.weight"].t().contiguous().t()
    result = aurora_rl.apply(base, aurora_rl.diff(base, target))
    assert_bit_equal(result, target)
    assert all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in result.values())


def test_tensors_requiring_grad_are_read_as_their_values():
    weight = torch.nn.Parameter(torch.randn(32, 32).bfloat16())
    base = {"w": weight}
    target = {"w": weight.detach() + torch.ones(32, 32).bfloat16()}
    assert_bit_equal(aurora_rl.apply(base, aurora_rl.diff(base, target)), target)


def test_numpy_arrays_in_and_out():
    rng = np.random.default_rng(3)
    base = {
        "f16": rng.standard_normal((40, 50)).astype(np.float16),
        "f32": rng.standard_normal(300).astype(np.float32),
        "i64": np.arange(10, dtype=np.int64),
        "big_endian": rng.standard_normal(8).astype(">f4"),
    }
    target = {name: a.copy() for name, a in base.items()}
    target["f16"][::7] += np.float16(0.01)
    target["f32"][5] = np.nan
    target["i64"][3] = -1
    target["big_endian"] = target["big_endian"].astype("<f4") * 2
    base["read_only"] = np.frombuffer(b"\x01\x02\x03\x04", dtype=np.uint8)
    target["read_only"] = base["read_only"]
    result = aurora_rl.apply(base, aurora_rl.diff(base, target))
    assert all(isinstance(a, np.ndarray) for a in result.values())
    for name, expected in target.items():
        assert result[name].tobytes() == expected.astype(expected.dtype.newbyteorder("<")).tobytes(), name


def special_values(dtype: torch.dtype) -> torch.Tensor:
    """Zeros of both signs, subnormals, infinities, NaNs with payloads, extremes."""
    if dtype == torch.float32:
        bits = [0x0, 0x80000000, 0x1, 0x807FFFFF, 0x7F800000, 0xFF800000, 0x7FC00001, 0xFFFFFFFF, 0x7F7FFFFF, 0x3F800000]
        return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    bits = {
        torch.bfloat16: [0x0, 0x8000, 0x1, 0x807F, 0x7F80, 0xFF80, 0x7FC1, 0xFFFF, 0x7F7F, 0x3F80],
        torch.float16: [0x0, 0x8000, 0x1, 0x83FF, 0x7C00, 0xFC00, 0x7E01, 0xFFFF, 0x7BFF, 0x3C00],
    }[dtype]
    return torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("encoding", ["aurora", "leb128"])
def test_every_transition_between_special_values(dtype, encoding):
    values = special_values(dtype)
    count = len(values)
    base = {"x": values.repeat_interleave(count)}
    target = {"x": values.repeat(count)}
    assert_bit_equal(aurora_rl.apply(base, aurora_rl.diff(base, target, encoding=encoding)), target)


def test_tensors_added_removed_and_reshaped():
    base = {"kept": torch.ones(4, 4).bfloat16(), "removed": torch.ones(3), "reshaped": torch.arange(6.0)}
    target = {"kept": torch.ones(4, 4).bfloat16() * 2, "added": torch.full((2, 5), 7, dtype=torch.int32), "reshaped": torch.arange(6.0).reshape(2, 3).half()}
    result = aurora_rl.apply(base, aurora_rl.diff(base, target, base_version=4, target_version=9))
    assert_bit_equal(result, target)


def test_arguments_are_checked():
    state = {"w": torch.ones(2)}
    with pytest.raises(ValueError, match="unknown encoding"):
        aurora_rl.diff(state, state, encoding="zip")
    with pytest.raises(TypeError, match="expected a torch tensor or a numpy array"):
        aurora_rl.weights_hash({"w": [1.0, 2.0]})
    with pytest.raises(TypeError, match="expected a mapping"):
        aurora_rl.weights_hash([("w", torch.ones(2))])
    with pytest.raises(TypeError, match="no counterpart"):
        aurora_rl.weights_hash({"w": torch.ones(2, dtype=torch.complex64)})
    with pytest.raises(ValueError, match="give target_version"):
        aurora_rl.diff(state, state, base_version=2**64 - 1)


# Hostile bytes: every failure is an AuroraError naming what is wrong, never a crash, and
# the base is as it was.


@pytest.fixture
def small_delta():
    generator = torch.Generator().manual_seed(5)
    base = {"a": torch.randn(300, generator=generator).bfloat16(), "b": torch.randn(20, 20, generator=generator)}
    target = one_step(base, seed=6, lr=0.05)
    return base, target, aurora_rl.diff(base, target)


def test_every_truncation_is_refused_with_the_base_untouched(small_delta):
    base, _, delta = small_delta
    before = snapshot(base)
    for cut in range(len(delta)):
        with pytest.raises(aurora_rl.DeltaError):
            aurora_rl.apply(base, delta[:cut])
    assert_bit_equal(base, before)
    with pytest.raises(aurora_rl.TruncatedDeltaError, match="truncated"):
        aurora_rl.apply(base, delta[: len(delta) // 2])


def test_every_flipped_byte_is_refused(small_delta):
    base, _, delta = small_delta
    before = snapshot(base)
    for at in range(len(delta)):
        damaged = bytearray(delta)
        damaged[at] ^= 0x40
        with pytest.raises(aurora_rl.DeltaError):
            aurora_rl.apply(base, bytes(damaged))
    assert_bit_equal(base, before)
    damaged = bytearray(delta)
    damaged[len(delta) // 2] ^= 1
    with pytest.raises(aurora_rl.CorruptedDeltaError, match="corrupted"):
        aurora_rl.apply(base, damaged)


def test_the_wrong_base_is_named(small_delta):
    base, target, delta = small_delta
    with pytest.raises(aurora_rl.WrongBaseError, match="wrong base"):
        aurora_rl.apply(target, delta)
    with pytest.raises(aurora_rl.WrongBaseError, match="missing"):
        aurora_rl.apply({"a": base["a"]}, delta)


def test_random_bytes_never_crash(small_delta):
    base, _, delta = small_delta
    rng = random.Random(7)
    for length in [0, 1, 7, 8, 64, 1000]:
        for _ in range(20):
            with pytest.raises(aurora_rl.DeltaError):
                aurora_rl.apply(base, bytes(rng.getrandbits(8) for _ in range(length)))
    for _ in range(200):
        # The real preamble, then garbage.
        noise = bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 400)))
        with pytest.raises(aurora_rl.DeltaError):
            aurora_rl.apply(base, delta[:16] + noise)


def test_errors_form_one_hierarchy():
    for error in [
        aurora_rl.DeltaError,
        aurora_rl.TruncatedDeltaError,
        aurora_rl.CorruptedDeltaError,
        aurora_rl.WrongBaseError,
        aurora_rl.TargetMismatchError,
        aurora_rl.CheckpointError,
    ]:
        assert issubclass(error, aurora_rl.AuroraError)
    assert issubclass(aurora_rl.TruncatedDeltaError, aurora_rl.DeltaError)
    assert issubclass(aurora_rl.CorruptedDeltaError, aurora_rl.DeltaError)
