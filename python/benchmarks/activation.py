"""Activation into vLLM: from the trainer's Commit to the engine serving the new version,
against reloading the whole checkpoint the way users do today, in one run.

A trainer node and an actor node run in this process (on loopback), the actor feeding
vLLM's CPU build in this process. The checkpoints are ``aurora synth``'s (Qwen3 shapes,
one Adam-style step at about 1% density) with a matching Qwen3 config. Measured, best of
``--rounds`` (each round publishes one more version):

- aurora: ``Trainer.commit`` until ``Actor.safe_point`` has loaded the version into
  vLLM (the host copy patched in place and its hash checked, the changed elements
  written into vLLM's parameters); the delta was published and staged beforehand, as it
  is behind generation. Of that, the engine's part (``load_changes``) on its own;
- the baseline: vLLM's ``reload_weights`` from the whole checkpoint file (what a trainer
  that saves checkpoints and tells its engines to reload does), and from the whole state
  in memory (what weight-sync loops that send every tensor do).

The density of a step follows ``--lr`` (``aurora synth``'s Adam-style step: 1e-6 gives
about 1%); the report gives the density measured.

    python python/benchmarks/activation.py [--preset 0.6b] [--rounds 3] [--lr 1e-6] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

REPO = Path(__file__).resolve().parents[2]

#: Qwen3 configurations of `aurora synth`'s presets (hidden, layers, heads, kv heads,
#: head dim, intermediate, vocabulary, tied embeddings).
SHAPES = {
    "small": (256, 4, 4, 2, 64, 768, 4096, True),
    "0.6b": (1024, 28, 16, 8, 128, 3072, 151936, True),
}


def write_config(directory: Path, preset: str) -> None:
    import transformers

    hidden, layers, heads, kv_heads, head_dim, intermediate, vocab, tied = SHAPES[preset]
    transformers.Qwen3Config(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, intermediate_size=intermediate, vocab_size=vocab, tie_word_embeddings=tied,
        max_position_embeddings=256, architectures=["Qwen3ForCausalLM"],
    ).save_pretrained(directory)


def synth_chain(aurora_bin: str, preset: str, steps: int, lr: str, scratch: Path) -> tuple[list[Path], Path]:
    """``aurora synth``'s chain of ``steps`` versions after the first in ``scratch``, and a
    model directory for vLLM: the preset's config with the first version's weights."""
    subprocess.run([aurora_bin, "synth", "--preset", preset, "--steps", str(steps), "--lr", lr,
                    "--out", str(scratch / "synth")], check=True, capture_output=True)
    files = sorted((scratch / "synth").glob("*.safetensors"))
    model_dir = scratch / "model"
    write_config(model_dir, preset)
    os.link(files[0], model_dir / "model.safetensors")
    return files, model_dir


def changed_fraction(before, after) -> float:
    import torch

    changed = sum(int((after[n].view(torch.int16) != t.view(torch.int16)).sum()) for n, t in before.items())
    return changed / sum(t.numel() for t in before.values())


def arguments(doc: str) -> argparse.ArgumentParser:
    """The options the activation benchmarks share."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--preset", default="0.6b", choices=sorted(SHAPES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--lr", default="1e-6", help="aurora synth's learning rate: sets the density")
    parser.add_argument("--aurora-bin", default=str(REPO / "target" / "debug" / "aurora"))
    return parser


def report(args, states: list, densities: list[float], aurora_s: list[float], engine_s: list[float],
           in_place: bool, **baselines: float) -> None:
    """Prints the figures (best of the rounds) as JSON, and writes them to ``--json``."""
    figures = {
        "preset": args.preset,
        "model_bytes": sum(t.numel() * t.element_size() for t in states[0].values()),
        "lr": args.lr,
        "density": sum(densities) / len(densities),
        "aurora_commit_to_serving_s": min(aurora_s),
        "of_which_engine_s": min(engine_s),
        "elements_in_place": in_place,
        **baselines,
    }
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


def settle() -> None:
    """Writes what earlier rounds left dirty (the trainer's store, the staged delta's
    spill, the node's image file) out to disk before a timed activation, as the minutes
    of generation between two steps do: otherwise the kernel's background writeback of
    about a model's size per round lands in some rounds' timings and not others."""
    os.sync()


def activations(engine, trainer, states: list, serves) -> tuple[list[float], list[float], list[float]]:
    """Publishes each of ``states`` after the first through ``trainer`` to an actor feeding
    ``engine``, staged before the Commit as behind generation, and times each from the
    Commit until the actor has it in the engine, and the engine's part (``load_changes``).
    ``serves(version)`` says whether the engine then serves it. Returns those times and
    each step's density."""
    import aurora_rl

    trainer.publish(states[0])
    engine_s: list[float] = []
    load_changes = engine.load_changes

    def timed_load_changes(changes):
        started = time.perf_counter()
        load_changes(changes)
        engine_s.append(time.perf_counter() - started)

    engine.load_changes = timed_load_changes
    actor = aurora_rl.Actor(engine, id=1, region="here", control=trainer.control_address,
                            upstreams=[trainer.transport_address], token=trainer.token, insecure_plaintext=True)
    aurora_s, densities = [], []
    for version in range(1, len(states)):
        densities.append(changed_fraction(states[version - 1], states[version]))
        trainer.publish(states[version])
        deadline = time.monotonic() + 300
        while trainer.status().actors[0].staged != version:
            assert time.monotonic() < deadline, "the delta was never staged"
            time.sleep(0.01)
        settle()
        started = time.perf_counter()
        trainer.commit()
        while actor.safe_point(wait=60.0) != version:
            pass
        aurora_s.append(time.perf_counter() - started)
        assert serves(version), f"the engine serves version {version}"
    # The first activation after the join is the snapshot's, whole.
    return aurora_s, engine_s[1:] or engine_s, densities


def main() -> None:
    args = arguments(__doc__).parse_args()

    from safetensors.torch import load_file

    import aurora_rl
    from aurora_rl.engines.vllm import VllmEngine

    with tempfile.TemporaryDirectory(prefix="aurora-bench-activation-") as scratch:
        scratch = Path(scratch)
        # The first version, as a user's engine would start from it.
        files, model_dir = synth_chain(args.aurora_bin, args.preset, args.rounds, args.lr, scratch)
        engine = VllmEngine.start(str(model_dir), max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256)
        trainer = aurora_rl.Trainer(scratch / "trainer", snapshot_every=0, insecure_plaintext=True)
        states = [load_file(str(path)) for path in files]
        aurora_s, engine_s, densities = activations(
            engine, trainer, states,
            # The engine serves each version (its weights read back through its layers).
            lambda version: aurora_rl.weights_hash(engine.held_weights()) == aurora_rl.weights_hash(states[version]),
        )
        reload_file_s, reload_memory_s = [], []
        for version, path in enumerate(files):
            # vLLM reloads from a directory of safetensors files.
            directory = scratch / f"version-{version}"
            directory.mkdir()
            os.link(path, directory / "model.safetensors")
            settle()
            started = time.perf_counter()
            engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(directory), "is_checkpoint_format": True})
            reload_file_s.append(time.perf_counter() - started)
            settle()
            started = time.perf_counter()
            engine.load_weights(states[version])
            reload_memory_s.append(time.perf_counter() - started)
    report(args, states, densities, aurora_s, engine_s, engine.loaded_whole == set(),
           reload_whole_checkpoint_file_s=min(reload_file_s), reload_whole_state_in_memory_s=min(reload_memory_s))

if __name__ == "__main__":
    main()
