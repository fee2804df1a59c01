"""Publishing from torch tensors against the CLI's extraction from files, on the same
synthetic checkpoints, in one run.

For the 0.6B shape (``aurora synth``: realistic magnitudes, one Adam-style step at about
1% density), in turns, best of ``--rounds``:

- ``aurora delta diff`` on the two safetensors files (the baseline: the Rust extraction
  that ``aurora bench codec`` times, from memory-mapped files);
- ``aurora_rl.diff`` on the same checkpoints as BF16 torch tensors;
- ``aurora_rl.Trainer.publish`` of the target after the base (extraction streamed to the
  trainer node's hub and store).

Each Python variant runs in a fresh process that first loads both checkpoints (and
publishes the base), then resets the peak resident size and reports the peak beyond what
was resident: what the measured call costs in memory, where a copy of the model would
show as its size.

    python python/benchmarks/publish.py [--preset 0.6b] [--rounds 3] [--json FILE]
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


def status_bytes(field: str) -> int:
    """A memory figure of /proc/self/status (VmRSS now, VmHWM the peak), in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> None:
    """Makes the peak resident size (VmHWM) start again from the current one (Linux)."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def child(variant: str, base_path: str, target_path: str, scratch: str) -> None:
    """One measurement in this process: prints JSON with seconds and memory."""
    import torch
    from safetensors.torch import load_file

    import aurora_rl

    base, target = load_file(base_path), load_file(target_path)
    # Touch every page, so the loaded tensors are resident before the baseline is read.
    checksum = sum(int(t.view(-1)[:: 4096].float().sum().item() != 0) for t in [*base.values(), *target.values()])
    if variant == "publish":
        trainer = aurora_rl.Trainer(Path(scratch) / "trainer", snapshot_every=0, insecure_plaintext=True)
        trainer.publish(base)
    loaded = status_bytes("VmRSS")
    reset_peak()
    if variant == "diff":
        started = time.perf_counter()
        artifact = aurora_rl.diff(base, target)
        seconds = time.perf_counter() - started
        size = len(artifact)
    else:
        started = time.perf_counter()
        size = trainer.publish(target).artifact_bytes
        seconds = time.perf_counter() - started
    print(json.dumps({
        "seconds": seconds,
        "artifact_bytes": size,
        "loaded_bytes": loaded,
        "peak_beyond_loaded_bytes": status_bytes("VmHWM") - loaded,
        "model_bytes": sum(t.numel() * t.element_size() for t in target.values()),
        "touched": checksum,
    }))
    del torch


def measure(variant: str, files: list[Path], aurora_bin: str, scratch: Path) -> dict:
    if variant == "cli":
        out = scratch / "cli.adelta"
        started = time.perf_counter()
        subprocess.run([aurora_bin, "delta", "diff", str(files[0]), str(files[1]), "-o", str(out)],
                       check=True, capture_output=True, env={**os.environ, "AURORA_LOG": "warn"})
        # The process's start and the mapping of the files are in this time; they are a
        # few milliseconds next to extraction.
        return {"seconds": time.perf_counter() - started, "artifact_bytes": out.stat().st_size}
    with tempfile.TemporaryDirectory(dir=scratch) as directory:
        result = subprocess.run([sys.executable, __file__, "--child", variant, str(files[0]), str(files[1]), directory],
                                check=True, capture_output=True, text=True)
    return json.loads(result.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="0.6b")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--aurora-bin", default=str(REPO / "target" / "release" / "aurora"))
    parser.add_argument("--child", nargs=4, metavar=("VARIANT", "BASE", "TARGET", "SCRATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    with tempfile.TemporaryDirectory(prefix="aurora-bench-publish-") as scratch:
        scratch = Path(scratch)
        subprocess.run([args.aurora_bin, "synth", "--preset", args.preset, "--steps", "1", "--out", str(scratch / "synth")],
                       check=True, capture_output=True)
        files = sorted((scratch / "synth").glob("*.safetensors"))
        runs: dict[str, list[dict]] = {"cli": [], "diff": [], "publish": []}
        for _ in range(args.rounds):
            for variant in runs:
                runs[variant].append(measure(variant, files, args.aurora_bin, scratch))
    best = {variant: min(results, key=lambda r: r["seconds"]) for variant, results in runs.items()}
    assert len({r["artifact_bytes"] for r in (best["cli"], best["diff"])}) == 1, "diff must write the CLI's bytes"
    report = {
        "preset": args.preset,
        "rounds": args.rounds,
        "model_bytes": best["diff"]["model_bytes"],
        "artifact_bytes": best["cli"]["artifact_bytes"],
        "cli_diff_s": best["cli"]["seconds"],
        "python_diff_s": best["diff"]["seconds"],
        "python_publish_s": best["publish"]["seconds"],
        "python_diff_over_cli": best["diff"]["seconds"] / best["cli"]["seconds"],
        "python_publish_over_cli": best["publish"]["seconds"] / best["cli"]["seconds"],
        "diff_peak_beyond_loaded_bytes": best["diff"]["peak_beyond_loaded_bytes"],
        "publish_peak_beyond_loaded_bytes": best["publish"]["peak_beyond_loaded_bytes"],
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
