"""Activation into SGLang: from the trainer's Commit to SGLang serving the new version,
against SGLang's own tensor update of the whole state, in one run.

As ``activation.py`` does for vLLM: a trainer node and an actor node run in this process
(on loopback), the actor feeding an ``sglang.Engine`` (its CPU build: scheduler and model
in a process of their own). The checkpoints are ``aurora synth``'s (Qwen3 shapes, one
Adam-style step at about 1% density). Measured, best of ``--rounds``:

- aurora: ``Trainer.commit`` until ``Actor.safe_point`` has loaded the version into
  SGLang (the host copy patched and its hash checked, the changed elements written into
  the parameters SGLang computes from, packed or not, and a sample of tensors read back);
  the delta was published and staged beforehand, as it is behind generation. Of that,
  the engine's part (``load_changes``) on its own;
- the baseline: SGLang's own update of every tensor from memory (``begin_weight_update``,
  ``update_weights_from_tensor`` with the whole state, ``end_weight_update``, which packs
  every linear weight again on an AMX CPU): what a weight-sync loop sending every tensor
  pays.

Run it in SGLang's environment (README, "SGLang"):

    .venv-sglang/bin/python python/benchmarks/activation_sglang.py [--preset 0.6b] [--rounds 3] [--json FILE]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
os.environ.setdefault("SGLANG_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from activation import activations, arguments, report, settle, synth_chain  # noqa: E402

#: SGLang's CPU settings for a benchmark that serves nothing long (README, "SGLang").
OPTIONS = dict(device="cpu", attention_backend="torch_native", max_total_tokens=2048, max_running_requests=4,
               context_length=256)


def main() -> None:
    args = arguments(__doc__).parse_args()

    from safetensors.torch import load_file

    import aurora_rl
    from aurora_rl.engines.sglang import SglangEngine

    with tempfile.TemporaryDirectory(prefix="aurora-bench-activation-sglang-") as scratch:
        scratch = Path(scratch)
        files, model_dir = synth_chain(args.aurora_bin, args.preset, args.rounds, args.lr, scratch)
        engine = SglangEngine.start(str(model_dir), **OPTIONS)
        try:
            trainer = aurora_rl.Trainer(scratch / "trainer", snapshot_every=0, insecure_plaintext=True)
            states = [load_file(str(path)) for path in files]
            aurora_s, engine_s, densities = activations(
                engine, trainer, states,
                # Every tensor read back from SGLang's scheduler equals the version's.
                lambda version: engine.mismatched(states[version]) == [],
            )
            in_place = engine.loaded_whole == []
            # SGLang's own update of the whole state. The adapter's session is open: the
            # first round closes it (packing every layer anew), the next ones open their own.
            reload_s = []
            for round_ in range(args.rounds):
                tensors = list(states[round_ % len(states)].items())
                settle()
                started = time.perf_counter()
                if round_:
                    engine.engine.begin_weight_update()
                engine.engine.update_weights_from_tensor(tensors)
                engine.engine.end_weight_update()
                reload_s.append(time.perf_counter() - started)
        finally:
            engine.shutdown()
    report(args, states, densities, aurora_s, engine_s, in_place, sglang_update_whole_state_s=min(reload_s))

if __name__ == "__main__":
    main()
