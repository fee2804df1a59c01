"""One actor of a mixed fleet: joins a trainer node, and until it has activated
``versions`` versions generates for every lease it is handed, reporting each activation
(``report(version, weights_hash)``) once its read-back check passed (``verify="full"``: a
mismatch fails the load and the actor leaves, so no report comes).

``serve`` runs in the test's process (the SGLang actor); run as a script, it is a vLLM
actor in vLLM's own environment (SGLang and vLLM pin different torch builds), reporting on
stdout, one line per activation: ``activated VERSION WEIGHTS_HASH`` (vLLM logs there too).

    python fleet_actor.py MODEL_DIR CONTROL TRANSPORT TOKEN VERSIONS ACTOR_ID
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

#: Token-id prompts, by prompt id modulo their number.
PROMPTS = [[5, 17, 300, 42], [1000, 2, 3], [7] * 9, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]


def serve(actor, engine, name: str, versions: int, report: Callable[[int, str], None],
          stop: Callable[[], bool] = lambda: False) -> None:
    from aurora_rl.engines import Sampling

    greedy = Sampling(max_tokens=4, temperature=0.0)
    activated = 0
    while activated < versions and not stop():
        # Blocks until a commit's activation starts (or a second passes), then claims.
        actor.safe_point(wait=1.0)
        work = actor.claim()
        version, weights_hash = actor.active
        if version > activated:
            activated = version
            report(version, weights_hash)
        if work is not None:
            completions = engine.generate([PROMPTS[lease.prompt % len(PROMPTS)] for lease in work.leases], greedy)
            actor.submit(
                work,
                [(lease, {"engine": name, "tokens": c.token_ids}, len(c.token_ids)) for lease, c in zip(work.leases, completions)],
            )


def join(engine, model_dir: str, control: str, transport: str, token: str, actor_id: int):
    """An actor for ``engine``, starting from the model directory's weights (version 0)."""
    from safetensors.torch import load_file

    import aurora_rl

    weights = load_file(os.path.join(model_dir, "model.safetensors"))
    return aurora_rl.Actor(engine, id=actor_id, region="here", weights=weights, version=0, control=control,
                           upstreams=[transport], token=token, insecure_plaintext=True, verify="full")


def main() -> None:
    model_dir, control, transport, token, versions, actor_id = sys.argv[1:]
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from aurora_rl.engines.vllm import VllmEngine

    engine = VllmEngine.start(model_dir, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256)
    with join(engine, model_dir, control, transport, token, int(actor_id)) as actor:
        serve(actor, engine, "vllm", int(versions), lambda v, h: print(f"activated {v} {h}", flush=True))


if __name__ == "__main__":
    main()
