"""What load format ``aurora`` costs generation on vLLM's CPU build: greedy decoding
throughput with every weight kept where the layer computes from it (``F.linear`` on the
parameter, so versions are written element by element) against vLLM's default (linear
weights packed for oneDNN), on the same model shape, in one run. Each engine runs in a
process of its own, one after the other.

    python python/benchmarks/generation.py [--preset 0.6b] [--prompts 8] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def measure(model_dir: str, load_format: str, prompts: int, tokens: int) -> float:
    """Generated tokens per second, best of three batches (after one warm-up)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=True, seed=0,
              load_format=load_format, max_model_len=256, max_num_seqs=prompts, max_num_batched_tokens=512)
    batch = [{"prompt_token_ids": [1 + i, 7, 100 + i]} for i in range(prompts)]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate(batch, params, use_tqdm=False)
    best = 0.0
    for _ in range(3):
        started = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=False)
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        best = max(best, generated / (time.perf_counter() - started))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="0.6b")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--measure", nargs=2, metavar=("MODEL_DIR", "LOAD_FORMAT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure[0], args.measure[1], args.prompts, args.tokens)))
        return
    sys.path.insert(0, str(HERE))
    from activation import write_config

    report: dict[str, object] = {"preset": args.preset, "prompts": args.prompts, "tokens": args.tokens}
    with tempfile.TemporaryDirectory(prefix="aurora-bench-generation-") as scratch:
        # Config only: both engines start on the same dummy weights.
        write_config(Path(scratch), args.preset)
        for load_format in ("aurora", "dummy"):
            env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
            result = subprocess.run(
                [sys.executable, __file__, "--prompts", str(args.prompts), "--tokens", str(args.tokens),
                 "--measure", scratch, load_format],
                capture_output=True, text=True, env=env, check=True,
            )
            report[f"{load_format}_tokens_per_s"] = json.loads(result.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
