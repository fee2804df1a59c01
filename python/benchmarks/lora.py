"""LoRA training through aurora: the bytes a step puts on the wire when the trainer
publishes the adapter only, against the adapter's own delta and the merged model's.

A Hugging Face ``Qwen3ForCausalLM`` built from a config (FP32) gets a PEFT LoRA adapter on
every linear layer and takes AdamW steps on random tokens. Per step: the aurora delta of
the adapter's BF16 export (``aurora_rl.export.export_adapter``, what ``Trainer.publish``
ships); the adapter's own delta, its changed elements at two bytes each (the least any
encoding of those values needs); the whole adapter in BF16; and the delta of the merged
model (base plus the adapter, in BF16), what a trainer that merges before publishing
ships.

    python python/benchmarks/lora.py [--layers 8] [--rank 16] [--steps 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", type=Path)
    return parser.parse_args()


def main() -> None:
    import peft
    import torch
    import transformers

    import aurora_rl
    from aurora_rl.export import export_adapter

    args = arguments()
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=16, num_key_value_heads=4, head_dim=64, max_position_embeddings=512, tie_word_embeddings=False,
    )
    lora = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = peft.get_peft_model(transformers.Qwen3ForCausalLM(config), lora)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)

    def merged() -> dict[str, torch.Tensor]:
        with torch.no_grad():
            model.merge_adapter()
            state = {n: t.to(torch.bfloat16).clone() for n, t in model.base_model.model.state_dict().items() if "lora_" not in n}
            model.unmerge_adapter()
        return state

    adapters, merges = [export_adapter(model)], [merged()]
    generator = torch.Generator().manual_seed(1)
    steps = []
    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, args.vocab, (max(args.tokens // 128, 1), min(args.tokens, 128)), generator=generator)
        loss = model(input_ids=tokens, labels=tokens).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        adapters.append(export_adapter(model))
        merges.append(merged())
        before, after = adapters[-2:]
        changed = sum(int((after[n].view(torch.int16) != before[n].view(torch.int16)).sum()) for n in after)
        elements = sum(t.numel() for t in after.values())
        steps.append({
            "step": step,
            "delta_bytes": len(aurora_rl.diff(before, after, base_version=step - 1)),
            "adapter_changed_elements_bytes": 2 * changed,
            "adapter_bytes": 2 * elements,
            "adapter_density": changed / elements,
            "merged_model_delta_bytes": len(aurora_rl.diff(*merges[-2:], base_version=step - 1)),
        })
        print(json.dumps(steps[-1]), flush=True)
        del adapters[:-1], merges[:-1]
    report = {
        "config": {key: value for key, value in vars(args).items() if key != "json"},
        "base_parameters": sum(p.numel() for p in model.parameters() if not p.requires_grad),
        "adapter_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "steps": steps,
        "delta_vs_adapter_own_delta": statistics.mean(s["delta_bytes"] / s["adapter_changed_elements_bytes"] for s in steps),
        "delta_vs_adapter": statistics.mean(s["delta_bytes"] / s["adapter_bytes"] for s in steps),
        "delta_vs_merged_model_delta": statistics.mean(s["delta_bytes"] / s["merged_model_delta_bytes"] for s in steps),
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
