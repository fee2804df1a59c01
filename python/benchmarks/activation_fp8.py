"""Activation into vLLM serving FP8 rollout weights, against the same versions into vLLM
serving BF16, in one run: what serving block-scaled FP8 from BF16 versions costs an actor.

The versions are ``aurora synth``'s (``activation.py``'s chain, Qwen3 shapes, one
Adam-style step at about 1% density). Each engine runs behind an actor node that joins a
trainer node over loopback, and each version is timed from the trainer's Commit until the
actor serves it (``activation.py``'s ``activations``), the engine's part on its own beside
it. BF16: vLLM on the BF16 checkpoint, changed elements written in place. FP8: vLLM on the
first version's FP8 checkpoint (128 x 128 blocks, ``aurora_rl.engines.fp8``), behind
``Fp8Rollout``: the changed elements re-quantized under their blocks' scales, blocks whose
scale moved re-quantized whole, all written in place; every version read back equal to its
quantization from scratch.

    python python/benchmarks/activation_fp8.py [--preset 0.6b] [--rounds 3] [--json FILE]
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from activation import activations, arguments, synth_chain  # noqa: E402


def main() -> None:
    args = arguments(__doc__).parse_args()

    from safetensors.torch import load_file

    import aurora_rl
    from aurora_rl.engines.fp8 import Fp8Rollout, save_checkpoint
    from aurora_rl.engines.vllm import VllmEngine

    options = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256)
    figures = {}
    with tempfile.TemporaryDirectory(prefix="aurora-bench-activation-fp8-") as scratch:
        scratch = Path(scratch)
        files, model_dir = synth_chain(args.aurora_bin, args.preset, args.rounds, args.lr, scratch)
        states = [load_file(str(path)) for path in files]
        fp8_dir = scratch / "fp8"
        save_checkpoint(fp8_dir, states[0], json.loads((model_dir / "config.json").read_text()))
        for kind in ("bf16", "fp8"):
            vllm = VllmEngine.start(str(model_dir if kind == "bf16" else fp8_dir), **options)
            engine = vllm if kind == "bf16" else Fp8Rollout(vllm)
            trainer = aurora_rl.Trainer(scratch / f"trainer-{kind}", snapshot_every=0, insecure_plaintext=True)
            aurora_s, engine_s, densities = activations(
                engine, trainer, states, lambda version: engine.mismatched(states[version]) == []
            )
            figures[kind] = {
                "commit_to_serving_s": min(aurora_s),
                "of_which_engine_s": min(engine_s),
                "elements_in_place": vllm.loaded_whole == set(),
            }
            trainer.close()
            del engine, vllm
            gc.collect()
    figures = {
        "preset": args.preset,
        "lr": args.lr,
        "density": sum(densities) / len(densities),
        **figures,
        "fp8_over_bf16": figures["fp8"]["commit_to_serving_s"] / figures["bf16"]["commit_to_serving_s"],
        "fp8_over_bf16_engine": figures["fp8"]["of_which_engine_s"] / figures["bf16"]["of_which_engine_s"],
    }
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
