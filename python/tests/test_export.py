"""The trainer-side export: from a plain model and from an FSDP2-sharded one on a
two-process gloo group (CPU), both equal to the unsharded model's BF16 state under
Hugging Face names; only the publishing rank gets it."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from test_engines import small_qwen3

import aurora_rl
from aurora_rl.export import export_bf16, hugging_face_name


def reference_export(model_dir: Path) -> dict[str, torch.Tensor]:
    import transformers

    model = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return {name: t.to(torch.bfloat16) for name, t in model.state_dict().items()}


def test_names_lose_the_prefixes_wrappers_add():
    assert hugging_face_name("_orig_mod.module.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert hugging_face_name("lm_head.weight") == "lm_head.weight"


def test_a_plain_model_exports_new_bf16_tensors(tmp_path):
    import transformers

    model_dir = small_qwen3(tmp_path / "model")
    model = torch.compile(transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    exported = export_bf16(model)
    expected = reference_export(model_dir)
    assert aurora_rl.weights_hash(exported) == aurora_rl.weights_hash(expected)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1)
    assert aurora_rl.weights_hash(exported) == aurora_rl.weights_hash(expected), "the export is a copy"


def sharded_rank(rank: int, world: int, store: str, model_dir: str, out: str) -> None:
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        model = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert any(hasattr(p, "full_tensor") for p in model.parameters()), "the model is sharded"
        exported = export_bf16(model, publishing_rank=1)
        if rank == 1:
            save_file(exported, out)
        else:
            assert exported is None
    finally:
        dist.destroy_process_group()


def test_an_fsdp2_model_is_gathered_on_the_publishing_rank_only(tmp_path):
    model_dir = small_qwen3(tmp_path / "model")
    out = tmp_path / "export.safetensors"
    with tempfile.TemporaryDirectory() as scratch:
        mp.spawn(sharded_rank, args=(2, f"{scratch}/store", str(model_dir), str(out)), nprocs=2)
    exported = load_file(str(out))
    assert aurora_rl.weights_hash(exported) == aurora_rl.weights_hash(reference_export(model_dir))
