"""A rollout actor process: vLLM (or Hugging Face transformers) behind an aurora actor.

It joins over the wire (the newest snapshot from its region's relay, else the hub) into
an engine started without weights, then loops: claim (which activates any committed
version into the engine at this safe point), sample a group of completions per leased
prompt, submit them stamped with the version and weights hash they were generated on.
With vLLM in this process, after every activation it reads the weights the engine
computes with back from its layers and checks their hash against the version's.

    python actor.py --id 1 --region us --control HOST:PORT --upstream RELAY \
        --upstream HUB --model-dir DIR --ca CA --cert CERT --key KEY --trainer-key PUB
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

# vLLM's engine in this process: tensors pass to it directly, and its weights can be read
# back for the check above.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import addition  # noqa: E402

import aurora_rl  # noqa: E402
from aurora_rl.engines import Sampling  # noqa: E402

logger = logging.getLogger("grpo.actor")


def start_engine(kind: str, model_dir: str):
    if kind == "vllm":
        from aurora_rl.engines.vllm import VllmEngine

        # The directory holds the config only: vLLM starts on dummy weights, which the
        # snapshot replaces, and every version after goes in element by element.
        return VllmEngine.start(
            model_dir,
            max_model_len=32,
            max_num_seqs=256,
            max_num_batched_tokens=2048,
        )
    from aurora_rl.engines.hf import TransformersEngine

    return TransformersEngine.start(model_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--id", type=int, required=True)
    parser.add_argument("--region", required=True)
    parser.add_argument("--control", required=True)
    parser.add_argument("--upstream", action="append", required=True)
    parser.add_argument("--ca", required=True, help="the fleet CA's certificate (aurora certs init)")
    parser.add_argument("--cert", required=True, help="this actor's certificate (aurora certs issue)")
    parser.add_argument("--key", required=True, help="this actor's private key")
    parser.add_argument("--trainer-key", required=True, help="the trainer's public key: every version must be signed by it")
    parser.add_argument("--model-dir", required=True, help="the model's config.json (weights come from the hub)")
    parser.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    parser.add_argument("--samples", type=int, default=8, help="completions per prompt (the GRPO group)")
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s actor-{args.id} %(name)s %(message)s")

    engine = start_engine(args.engine, args.model_dir)
    actor = aurora_rl.Actor(
        engine,
        id=args.id,
        region=args.region,
        control=args.control,
        upstreams=args.upstream,
        ca=args.ca,
        cert=args.cert,
        key=args.key,
        trainer_key=args.trainer_key,
    )
    # One line on stdout tells the orchestrator the actor serves.
    print(f"joined {actor.active[0]}", flush=True)
    checked = None
    sampling = Sampling(max_tokens=addition.ANSWER_TOKENS, temperature=args.temperature)
    while True:
        work = actor.claim()
        if work is None:
            time.sleep(0.05)
            continue
        if work.version != checked:
            held = engine.held_weights()
            if held is not None:
                actual = aurora_rl.weights_hash(held)
                if actual != work.weights_hash:
                    sys.exit(f"the engine computes with weights {actual}, not version {work.version}'s {work.weights_hash}")
                logger.info("version %d: the engine's weights hash to the version's", work.version)
            checked = work.version
        problems = [addition.problem(lease.prompt) for lease in work.leases]
        prompts = [addition.prompt(a, b) for a, b in problems for _ in range(args.samples)]
        started = time.perf_counter()
        completions = engine.generate(prompts, sampling)
        seconds = time.perf_counter() - started
        results = []
        for index, lease in enumerate(work.leases):
            group = completions[index * args.samples : (index + 1) * args.samples]
            payload = {"samples": [c.token_ids for c in group], "logprobs": [c.logprobs for c in group]}
            results.append((lease, payload, sum(len(c.token_ids) for c in group)))
        outcomes = actor.submit(work, results)
        accepted = sum(outcome["status"] == "accepted" for outcome in outcomes)
        logger.info(
            "version %d: %d prompts in %.2f s, %d accepted", work.version, len(work.leases), seconds, accepted
        )


if __name__ == "__main__":
    main()
