"""Mixture-of-experts steps through aurora: bytes on the wire and activation into vLLM,
against the dense alternatives, in one run.

A Hugging Face ``Qwen3MoeForCausalLM`` (built from a config, FP32 master weights, AdamW)
takes real training steps on random tokens; its router is restricted, per layer and per
step, to a random ``--seen`` fraction of the experts (a forward hook on each router: top-k
among the allowed experts), so exactly those experts see tokens and get gradients. Each
step's BF16 export (``aurora_rl.export.export_bf16``: per-expert tensors under the
checkpoint's names) is diffed against the previous one. Measured per step:

- bytes: the aurora delta, against the whole BF16 checkpoint and against the delta of a
  dense ``Qwen3ForCausalLM`` with as many parameters (its MLP as wide as all the experts
  together), trained on the same tokens at the same learning rate;
- the expert tensors that changed, of all (AdamW keeps moving an expert that saw tokens
  in an earlier step: ``--routing rotating`` draws a new quarter each step,
  ``fixed`` keeps one per layer, as a task that favours the same experts does);
- activation of the last step into vLLM's CPU build (in this process, load format
  ``aurora``): the changed elements written in place (``load_changes``, the fused expert
  parameters written through vLLM's AMX packing), best of ``--rounds`` forward and back,
  against vLLM's own reload of every tensor from memory (``reload_weights``, what
  weight-sync loops that send the whole state do). The weights vLLM computes with are
  read back and compared after each in-place activation. (On this CPU build vLLM's
  reload leaves the expert weights unpacked where its kernel reads them packed, so its
  outputs are wrong afterwards; it is timed as the cost users pay on a GPU, and aurora
  writes the weights back before the next round.)

    python python/benchmarks/moe.py [--layers 8] [--experts 32] [--steps 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--expert-width", type=int, default=384, help="each expert's intermediate size")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--seen", type=float, default=0.25, help="fraction of each layer's experts that see tokens")
    parser.add_argument("--routing", choices=["fixed", "rotating"], default="fixed")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--weight-decay", type=float, default=0.0, help="AdamW's (RL recipes mostly use none)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per training step")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    return parser.parse_args()


def configs(args: argparse.Namespace):
    import transformers

    common = dict(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=16,
        num_key_value_heads=4, head_dim=64, max_position_embeddings=512, tie_word_embeddings=False,
    )
    moe = transformers.Qwen3MoeConfig(
        **common, intermediate_size=args.expert_width * args.top_k, moe_intermediate_size=args.expert_width,
        num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True,
        architectures=["Qwen3MoeForCausalLM"],
    )
    dense = transformers.Qwen3Config(
        **common, intermediate_size=args.expert_width * args.experts, architectures=["Qwen3ForCausalLM"]
    )
    return moe, dense


def restrict_routing(model, seen: float, generator) -> callable:
    """Hooks every router so that tokens go to the top-k of an allowed ``seen`` fraction
    of its experts; returns the function that draws a new allowed set per layer."""
    import torch

    allowed: dict[int, torch.Tensor] = {}

    def draw() -> None:
        for index, layer in enumerate(model.model.layers):
            experts = layer.mlp.gate.num_experts
            chosen = torch.randperm(experts, generator=generator)[: max(layer.mlp.gate.top_k, round(seen * experts))]
            allowed[index] = torch.zeros(experts, dtype=torch.bool).index_fill_(0, chosen, True)

    def hook_for(index: int):
        def hook(router, inputs, output):
            logits = output[0].masked_fill(~allowed[index], float("-inf"))
            probabilities = torch.softmax(logits, dim=-1, dtype=torch.float)
            top, chosen = torch.topk(probabilities, router.top_k, dim=-1)
            if router.norm_topk_prob:
                top = top / top.sum(dim=-1, keepdim=True)
            return output[0], top.to(output[0].dtype), chosen

        return hook

    for index, layer in enumerate(model.model.layers):
        layer.mlp.gate.register_forward_hook(hook_for(index))
    draw()
    return draw


def train_step(model, optimizer, tokens) -> None:
    loss = model(input_ids=tokens, labels=tokens).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def element_changes(before, after):
    """What an actor hands its engine: each changed tensor's changed elements and their
    new values (read from the staged delta, so the engine gathers nothing)."""
    import torch

    from aurora_rl.engines import TensorChange

    changes = {}
    for name, tensor in after.items():
        moved = torch.nonzero(tensor.view(torch.int16).reshape(-1) != before[name].view(torch.int16).reshape(-1)).reshape(-1)
        if moved.numel():
            changes[name] = TensorChange(tensor, moved, tensor.reshape(-1)[moved])
    return changes


def timed(action) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def main() -> None:
    import torch
    import transformers

    import aurora_rl
    from aurora_rl.engines.vllm import VllmEngine
    from aurora_rl.export import export_bf16

    args = arguments()
    torch.manual_seed(0)
    moe_config, dense_config = configs(args)
    moe = transformers.Qwen3MoeForCausalLM(moe_config)
    dense = transformers.Qwen3ForCausalLM(dense_config)
    parameters = {"moe": sum(p.numel() for p in moe.parameters()), "dense": sum(p.numel() for p in dense.parameters())}
    draw = restrict_routing(moe, args.seen, torch.Generator().manual_seed(1))
    optimizers = {
        name: torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
        for name, model in (("moe", moe), ("dense", dense))
    }
    exports = {"moe": [export_bf16(moe)], "dense": [export_bf16(dense)]}
    expert_names = [name for name in exports["moe"][0] if ".mlp.experts." in name]
    tokens_generator = torch.Generator().manual_seed(2)
    steps = []
    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, args.vocab, (max(args.tokens // 128, 1), min(args.tokens, 128)), generator=tokens_generator)
        if args.routing == "rotating" and step > 1:
            draw()
        for name, model in (("moe", moe), ("dense", dense)):
            train_step(model, optimizers[name], tokens)
            exports[name].append(export_bf16(model))
        moe_before, moe_after = exports["moe"][-2:]
        delta = aurora_rl.diff(moe_before, moe_after, base_version=step - 1)
        dense_delta = aurora_rl.diff(*exports["dense"][-2:], base_version=step - 1)
        changed_experts = sum(not torch.equal(moe_before[n].view(torch.int16), moe_after[n].view(torch.int16)) for n in expert_names)
        elements = sum(t.numel() for t in moe_after.values())
        moved = sum(int((moe_after[n].view(torch.int16) != moe_before[n].view(torch.int16)).sum()) for n in moe_after)
        steps.append({
            "step": step,
            "delta_bytes": len(delta),
            "dense_model_delta_bytes": len(dense_delta),
            "checkpoint_bytes": sum(t.numel() * t.element_size() for t in moe_after.values()),
            "density": moved / elements,
            "expert_tensors_changed": changed_experts,
            "expert_tensors": len(expert_names),
        })
        print(json.dumps(steps[-1]), flush=True)
        for name in ("moe", "dense"):
            del exports[name][:-2]
    del dense, optimizers, exports["dense"]

    before, after = exports["moe"]
    with tempfile.TemporaryDirectory(prefix="aurora-bench-moe-") as scratch:
        model_dir = Path(scratch)
        moe_config.save_pretrained(model_dir)
        engine = VllmEngine.start(str(model_dir), max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256)
        engine.load_weights(before)
        forward, back = element_changes(before, after), element_changes(after, before)
        in_place, whole = [], []
        for _ in range(args.rounds):
            in_place.append(timed(lambda: engine.load_changes(forward)))
            assert engine.loaded_whole == set(), engine.loaded_whole
            differ = engine.mismatched(after)
            assert differ == [], f"vLLM does not compute with the step's weights: {differ[:4]} ({len(differ)})"
            engine.load_changes(back)
        everything = list(after.items())
        for _ in range(args.rounds):
            whole.append(timed(lambda: engine.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": everything, "is_checkpoint_format": True}
            )))
            engine.load_weights(before)
    last = steps[-1]
    report = {
        "config": {key: value for key, value in vars(args).items() if key != "json"},
        "parameters": parameters,
        "cores": os.cpu_count(),
        "steps": steps,
        "bytes_vs_dense_model_delta": statistics.mean(s["delta_bytes"] / s["dense_model_delta_bytes"] for s in steps),
        "bytes_vs_checkpoint": statistics.mean(s["delta_bytes"] / s["checkpoint_bytes"] for s in steps),
        "activation": {
            "changed_tensors": len(forward),
            "in_place_s": min(in_place),
            "whole_reload_s": min(whole),
            "ratio": min(in_place) / min(whole),
            "density": last["density"],
        },
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
