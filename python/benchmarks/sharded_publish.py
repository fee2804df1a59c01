"""Publishing from shards (``aurora_rl.sharded``) against extracting the gathered model on
one rank, on the same synthetic checkpoints, in one run.

For ``aurora synth``'s 0.6B shape (realistic magnitudes, one Adam-style step at about 1%
density), best of ``--rounds``, each measurement in a fresh process with
``--threads`` encoding threads (a rank's share of the machine):

- the baseline: ``aurora_rl.diff`` of the whole checkpoints on one rank (encoding and
  both weights hashes: what a publishing rank does after the gather);
- each rank of ``--ranks`` ranks: ``_core.extract_shard`` of its FSDP2 dim-0 shards
  (``ceil(rows / ranks)`` rows of every tensor), encoding and hashing its share;
- the publishing rank's assembly of every rank's part (``_core.shards_weights_hash``:
  parsing the parts, checking them, composing both hashes).

The ranks run in turns, so the figure does not depend on the cores this machine has: the
sharded publish takes the slowest rank plus the assembly on a machine where every rank
has its threads (``ranks * threads`` cores), against the baseline's one rank with the
same threads. ``--concurrent`` also runs the ranks at once, where the machine has the
cores for it.

    python python/benchmarks/sharded_publish.py [--ranks 2 4] [--threads 1] [--rounds 3] [--json FILE]
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

REPO = Path(__file__).resolve().parents[2]


def shard_pieces(base: dict, target: dict, rank: int, ranks: int) -> list:
    """Rank ``rank``'s FSDP2 dim-0 shard of every tensor, as ``extract_shard`` pieces
    (views of the loaded tensors: nothing copied)."""
    from aurora_rl._tensors import host_tensor

    pieces = []
    for name, t in target.items():
        rows = t.shape[0]
        per_rank = -(-rows // ranks)
        first, end = min(rank * per_rank, rows), min((rank + 1) * per_rank, rows)
        if first < end:
            row = t[0].numel()
            pieces.append((name, first * row, host_tensor(name, base[name][first:end])[3],
                           host_tensor(name, t[first:end])[3]))
    return pieces


def table(target: dict) -> list:
    from aurora_rl._tensors import dtype_name

    return [(name, dtype_name(t.dtype), list(t.shape)) for name, t in target.items()]


def child(variant: str, base_path: str, target_path: str, rank: int, ranks: int, scratch: str) -> None:
    """One measurement in this process: prints JSON with its seconds."""
    from safetensors.torch import load_file

    import aurora_rl
    from aurora_rl import _core

    base, target = load_file(base_path), load_file(target_path)
    # Resident before the clock starts.
    for t in [*base.values(), *target.values()]:
        t.view(-1)[::4096].float().sum()
    if variant == "gathered":
        started = time.perf_counter()
        size = len(aurora_rl.diff(base, target))
        print(json.dumps({"seconds": time.perf_counter() - started, "bytes": size}))
        return
    if variant == "rank":
        pieces = shard_pieces(base, target, rank, ranks)
        started = time.perf_counter()
        part = _core.extract_shard(table(target), pieces, "aurora")
        seconds = time.perf_counter() - started
        Path(scratch, f"part-{rank}").write_bytes(part)
        print(json.dumps({"seconds": seconds, "bytes": len(part)}))
        return
    parts = [Path(scratch, f"part-{r}").read_bytes() for r in range(ranks)]
    started = time.perf_counter()
    composed = _core.shards_weights_hash(table(target), parts, "aurora")
    seconds = time.perf_counter() - started
    assert composed == aurora_rl.weights_hash(target), "the parts must compose the target's weights hash"
    print(json.dumps({"seconds": seconds, "bytes": sum(len(p) for p in parts)}))


def spawn(variant: str, files: list[Path], rank: int, ranks: int, scratch: Path, threads: int) -> subprocess.Popen:
    env = {**os.environ, "RAYON_NUM_THREADS": str(threads), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, __file__, "--child", variant, str(files[0]), str(files[1]), str(rank),
                             str(ranks), str(scratch)], stdout=subprocess.PIPE, text=True, env=env)


def finished(process: subprocess.Popen) -> dict:
    out, _ = process.communicate()
    if process.returncode:
        raise SystemExit(f"a measurement failed ({process.args})")
    return json.loads(out.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="0.6b")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--threads", type=int, default=1, help="encoding threads per rank")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrent", action="store_true", help="also run each group's ranks at once")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--aurora-bin", default=str(REPO / "target" / "debug" / "aurora"))
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        variant, base, target, rank, ranks, scratch = args.child
        child(variant, base, target, int(rank), int(ranks), scratch)
        return
    with tempfile.TemporaryDirectory(prefix="aurora-bench-sharded-") as scratch:
        scratch = Path(scratch)
        subprocess.run([args.aurora_bin, "synth", "--preset", args.preset, "--steps", "1", "--out",
                        str(scratch / "synth")], check=True, capture_output=True)
        files = sorted((scratch / "synth").glob("*.safetensors"))
        gathered, sharded = [], {ranks: [] for ranks in args.ranks}
        concurrent = {ranks: [] for ranks in args.ranks}
        for _ in range(args.rounds):
            gathered.append(finished(spawn("gathered", files, 0, 1, scratch, args.threads)))
            for ranks in args.ranks:
                per_rank = [finished(spawn("rank", files, rank, ranks, scratch, args.threads)) for rank in range(ranks)]
                assembly = finished(spawn("assemble", files, 0, ranks, scratch, args.threads))
                sharded[ranks].append({
                    "slowest_rank_s": max(r["seconds"] for r in per_rank),
                    "ranks_s": [r["seconds"] for r in per_rank],
                    "assembly_s": assembly["seconds"],
                    "parts_bytes": assembly["bytes"],
                    "seconds": max(r["seconds"] for r in per_rank) + assembly["seconds"],
                })
                if args.concurrent:
                    started = time.perf_counter()
                    processes = [spawn("rank", files, rank, ranks, scratch, args.threads) for rank in range(ranks)]
                    slowest = max(finished(p)["seconds"] for p in processes)
                    concurrent[ranks].append({"seconds": slowest, "wall_s": time.perf_counter() - started})
    baseline = min(gathered, key=lambda r: r["seconds"])
    report = {
        "preset": args.preset,
        "threads_per_rank": args.threads,
        "machine_cores": os.cpu_count(),
        "rounds": args.rounds,
        "gathered_extraction_s": baseline["seconds"],
        "gathered_delta_bytes": baseline["bytes"],
    }
    for ranks in args.ranks:
        best = min(sharded[ranks], key=lambda r: r["seconds"])
        report[f"ranks_{ranks}"] = {**best, "over_gathered": best["seconds"] / baseline["seconds"]}
        if args.concurrent:
            fastest = min(concurrent[ranks], key=lambda r: r["seconds"])
            report[f"ranks_{ranks}"]["concurrent_slowest_rank_s"] = fastest["seconds"]
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
