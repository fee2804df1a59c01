"""Activation into vLLM with tensor parallelism, through the weight-transfer backend: from
the trainer's Commit to vLLM's ``update_weights`` returning with the version in every
rank, against vLLM reloading the whole checkpoint, in one run.

vLLM (CPU build, ``tensor_parallel_size`` ranks, each in a process of its own with a core
of its own) starts with ``weight_transfer_config={"backend": "aurora"}``; the engine
joins a trainer node in this process as an actor (rank 0's worker runs the node, the
other ranks follow it). Every round publishes the next version of ``aurora synth``'s
chain (the 0.6B shape by default), waits until the actor has staged it (as it does
behind generation), then times ``Trainer.commit`` and the update calls a framework makes
(``start_weight_update``, ``update_weights``, ``finish_weight_update``): rank 0 sends the
other ranks the changed elements, each rank writes those of its shards, and a few tensors
are read back (the backend's default ``verify="sample"``). The baseline, after the aurora
rounds: vLLM's ``reload_weights`` of each version's checkpoint file (page-cached) in
every rank. Also reported: each rank's resident host memory after the aurora rounds.

    python python/benchmarks/activation_tp.py [--preset 0.6b] [--tensor-parallel 2] [--rounds 3] [--lr 1e-6] [--json FILE]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from activation import arguments, changed_fraction, settle, synth_chain  # noqa: E402


def resident_bytes(worker: object) -> int:
    """In each rank's worker: its resident memory (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--tensor-parallel", type=int, default=2)
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    # ``resident_bytes`` goes to the workers as a function, which vLLM refuses unless told.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # One core per rank: vLLM's CPU build otherwise wants a NUMA node per rank.
    cores = os.cpu_count() or 1
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(r % cores) for r in range(args.tensor_parallel)))

    from safetensors.torch import load_file
    from vllm import LLM

    import aurora_rl

    with tempfile.TemporaryDirectory(prefix="aurora-bench-activation-tp-") as scratch:
        scratch = Path(scratch)
        files, model_dir = synth_chain(args.aurora_bin, args.preset, args.rounds, args.lr, scratch)
        states = [load_file(str(path)) for path in files]
        with aurora_rl.Trainer(scratch / "trainer", snapshot_every=0, insecure_plaintext=True) as trainer:
            trainer.publish(states[0])
            trainer.commit()
            llm = LLM(model=str(model_dir), weight_transfer_config={"backend": "aurora"},
                      tensor_parallel_size=args.tensor_parallel, dtype="bfloat16", load_format="aurora",
                      skip_tokenizer_init=True, enforce_eager=True, max_model_len=256, max_num_seqs=4,
                      max_num_batched_tokens=256, seed=0)
            llm.init_weight_transfer_engine({"init_info": {
                "control": trainer.control_address, "upstreams": [trainer.transport_address], "token": trainer.token,
                "insecure_plaintext": True, "region": "here", "id": 1}})
            aurora_s, densities = [], []
            for version in range(1, len(states)):
                densities.append(changed_fraction(states[version - 1], states[version]))
                published = trainer.publish(states[version])
                deadline = time.monotonic() + 300
                while [a.staged for a in trainer.status().actors] != [version]:
                    assert time.monotonic() < deadline, "the delta was never staged in every rank"
                    time.sleep(0.01)
                settle()
                started = time.perf_counter()
                trainer.commit()
                llm.start_weight_update()
                llm.update_weights({"update_info": {"version": version, "weights_hash": published.weights_hash}})
                llm.finish_weight_update(f"{version}:{published.weights_hash}")
                aurora_s.append(time.perf_counter() - started)
            resident = llm.collective_rpc(resident_bytes)
            llm.shutdown_weight_transfer_engine()
        reload_s = []
        for version, path in enumerate(files):
            directory = scratch / f"version-{version}"
            directory.mkdir()
            os.link(path, directory / "model.safetensors")
            settle()
            started = time.perf_counter()
            llm.collective_rpc("reload_weights", kwargs={"weights_path": str(directory), "is_checkpoint_format": True})
            reload_s.append(time.perf_counter() - started)
    report = {
        "preset": args.preset,
        "tensor_parallel": args.tensor_parallel,
        "lr": args.lr,
        "density": sum(densities) / len(densities),
        "aurora_commit_to_serving_s": min(aurora_s),
        "reload_whole_checkpoint_file_s": min(reload_s),
        "resident_bytes_per_rank": resident,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
