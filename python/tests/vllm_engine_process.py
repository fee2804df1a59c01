"""vLLM with its engine in a separate process (its default), taking three versions as
aurora deltas: each activation's greedy tokens and log-probabilities must match Hugging Face
transformers' on the same weights. Run by test_engines.py; a script because vLLM spawns
its engine process, which re-imports the main module."""

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from test_engines import GREEDY, PROMPTS, changed_names, generation_mismatch, next_version

import aurora_rl
from aurora_rl.engines import takes_changes_first, with_fused_groups
from aurora_rl.engines.hf import TransformersEngine
from aurora_rl.engines.vllm import VllmEngine


def main(model_dir: Path) -> None:
    engine = VllmEngine.start(str(model_dir), max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256)
    assert not engine.in_process and engine.held_weights() is None
    # It loads changed tensors whole: its actor hands them over after its own copy has them.
    assert not takes_changes_first(engine)
    reference = TransformersEngine.start(str(model_dir))
    host = load_file(str(model_dir / "model.safetensors"))
    served = 0
    for version in range(1, 4):
        applied = aurora_rl.apply(host, aurora_rl.diff(host, next_version(host, version), base_version=version - 1))
        update = with_fused_groups(changed_names(host, applied), applied)
        engine.load_weights(update)
        reference.load_weights(update)
        host = applied
        mismatch = generation_mismatch(engine.generate(PROMPTS, GREEDY), reference)
        assert mismatch is None, f"version {version}: {mismatch}"
        served += 1
    print(f"versions served: {served}")


if __name__ == "__main__":
    torch.manual_seed(0)
    main(Path(sys.argv[1]))
