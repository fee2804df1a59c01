"""A version's changed elements written into model parameters on a GPU (issue 40's GPU
figure): ``aurora_rl.engines.write_elements`` with the indices and values in host memory,
as an actor's node hands them over, uploaded and scattered into the parameters, against
copying the whole state from host memory into the same parameters, in one run.

The model is the Qwen3 8B shape (36 layers, hidden 4096, untied head; 8.19 B BF16
parameters, 16.4 GB) with random weights; each round changes ``--density`` of every
tensor's elements. Each round is checked bit for bit: the weights hash of the parameters
read back from the GPU equals that of the host state with the same changes, and the undo
restores the hash before. Needs a CUDA GPU with about 20 GB free and about 55 GB of host
memory; ``--device cpu --preset 0.6b`` runs the same steps on the host kernel (a dry run).
The first round pays CUDA's warm-up: the figures are the best round's, and every
round's is in the JSON.

    python python/benchmarks/gpu_scatter.py [--preset 8b] [--density 0.01] [--rounds 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import aurora_rl
from aurora_rl.engines import ElementWrite, write_elements

#: (hidden, layers, heads, kv heads, head dim, intermediate, vocabulary), as `aurora synth`.
SHAPES = {
    "0.6b": (1024, 28, 16, 8, 128, 3072, 151_936),
    "8b": (4096, 36, 32, 8, 128, 12_288, 151_936),
}


def tensor_shapes(preset: str) -> dict[str, tuple[int, ...]]:
    hidden, layers, heads, kv_heads, head_dim, intermediate, vocabulary = SHAPES[preset]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocabulary, hidden),
        "lm_head.weight": (vocabulary, hidden),
        "model.norm.weight": (hidden,),
    }
    for layer in range(layers):
        prefix = f"model.layers.{layer}"
        shapes |= {
            f"{prefix}.self_attn.q_proj.weight": (heads * head_dim, hidden),
            f"{prefix}.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            f"{prefix}.self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            f"{prefix}.self_attn.o_proj.weight": (hidden, heads * head_dim),
            f"{prefix}.self_attn.q_norm.weight": (head_dim,),
            f"{prefix}.self_attn.k_norm.weight": (head_dim,),
            f"{prefix}.mlp.gate_proj.weight": (intermediate, hidden),
            f"{prefix}.mlp.up_proj.weight": (intermediate, hidden),
            f"{prefix}.mlp.down_proj.weight": (hidden, intermediate),
            f"{prefix}.input_layernorm.weight": (hidden,),
            f"{prefix}.post_attention_layernorm.weight": (hidden,),
        }
    return shapes


def changes_of(parameters: dict[str, torch.Tensor], density: float, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``density`` of each tensor's elements, new values for them, in host memory."""
    generator = torch.Generator(device=next(iter(parameters.values())).device).manual_seed(seed)
    changes = {}
    for name, parameter in parameters.items():
        chosen = torch.rand(parameter.numel(), generator=generator, device=parameter.device) < density
        indices = chosen.nonzero().flatten()
        values = torch.randn(indices.numel(), generator=generator, device=parameter.device).to(parameter.dtype)
        changes[name] = (indices.cpu(), values.cpu())
    return changes


def on_host(parameters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy in host memory (also of parameters already there: a dry run's)."""
    return {name: parameter.to("cpu", copy=True) for name, parameter in parameters.items()}


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="8b", choices=sorted(SHAPES))
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    assert args.device != "cuda" or torch.cuda.is_available(), "this benchmark needs a CUDA GPU (or --device cpu)"
    torch.manual_seed(0)
    parameters = {
        name: torch.randn(shape, device=args.device).to(torch.bfloat16).view(-1)
        for name, shape in tensor_shapes(args.preset).items()
    }
    host = on_host(parameters)
    # Every round starts from these weights: the parameters are put back after each.
    before = aurora_rl.weights_hash(host)
    model_bytes = sum(t.numel() * t.element_size() for t in host.values())
    scatter_s, upload_s, copy_s, changed = [], [], [], 0
    with torch.no_grad():
        for round_ in range(args.rounds):
            changes = changes_of(parameters, args.density, seed=round_)
            changed = sum(indices.numel() for indices, _ in changes.values())
            expected = dict(host)
            for name, (indices, values) in changes.items():
                expected[name] = host[name].clone().index_copy_(0, indices, values)
            writes = [
                ElementWrite(parameters[name], indices, values, tensor=name, parameter=name)
                for name, (indices, values) in changes.items()
            ]
            synchronize(args.device)
            started = time.perf_counter()
            undo = write_elements(writes)
            synchronize(args.device)
            scatter_s.append(time.perf_counter() - started)
            assert aurora_rl.weights_hash(on_host(parameters)) == aurora_rl.weights_hash(expected), "not bit-exact"
            undo()
            assert aurora_rl.weights_hash(on_host(parameters)) == before, "the undo did not restore the weights"
            # What of the scatter is the upload of indices and values alone.
            synchronize(args.device)
            started = time.perf_counter()
            uploaded = [(i.to(args.device), v.to(args.device)) for i, v in changes.values()]
            synchronize(args.device)
            upload_s.append(time.perf_counter() - started)
            del uploaded
            # The baseline: the whole state copied from host memory into the parameters.
            synchronize(args.device)
            started = time.perf_counter()
            for name, parameter in parameters.items():
                parameter.copy_(expected[name])
            synchronize(args.device)
            copy_s.append(time.perf_counter() - started)
            for name, parameter in parameters.items():
                parameter.copy_(host[name])
    figures = {
        "preset": args.preset,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
        "model_bytes": model_bytes,
        "density": args.density,
        "changed_elements": changed,
        "aurora_scatter_s": min(scatter_s),
        "of_which_upload_s": min(upload_s),
        "whole_state_copy_s": min(copy_s),
        "rounds": {"aurora_scatter_s": scatter_s, "upload_s": upload_s, "whole_state_copy_s": copy_s},
    }
    print(json.dumps(figures, indent=2))
    print(f"every round read back bit-exact and undone ({args.rounds} rounds, weights hashes compared)")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
