"""vLLM in this process with its parameters kept as loaded and computed from, as on a GPU,
taking a version written in place (fused rows included): the weights read back must hash
to the export, and greedy tokens and log-probabilities must match Hugging Face
transformers' on the same weights. Run by test_engines.py as a script: the engine's
linear layers must be set up so from their load, and on a CPU with AVX-512 BF16 vLLM's
default packs a copy of each for oneDNN and empties the parameter, which the engine
under test in test_engines.py keeps doing."""

import os
import sys
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import torch
from safetensors.torch import load_file
from test_engines import GREEDY, PROMPTS, generation_mismatch, next_version
from vllm.model_executor.layers import utils as layer_utils

import aurora_rl
from aurora_rl.engines.hf import TransformersEngine
from aurora_rl.engines.vllm import VllmEngine


def compute_from_the_parameter(layer: torch.nn.Module, remove_weight: bool) -> None:
    """vLLM's CPU dispatch of a linear layer, replaced by what it does on a GPU and on a
    CPU whose oneDNN takes no BF16: compute from the parameter as loaded."""
    layer.cpu_linear = torch.nn.functional.linear


def main(model_dir: Path) -> None:
    # Held for the engine's life: a reload processes the layers it loads again.
    layer_utils.dispatch_cpu_unquantized_gemm = compute_from_the_parameter
    engine = VllmEngine.start(str(model_dir), max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256)
    writer = VllmEngine(engine.llm, in_place=True)
    export = next_version(load_file(str(model_dir / "model.safetensors")), 7)
    writer.load_weights(export)
    assert aurora_rl.weights_hash(writer.held_weights()) == aurora_rl.weights_hash(export)
    reference = TransformersEngine.start(str(model_dir))
    reference.load_weights(export)
    mismatch = generation_mismatch(engine.generate(PROMPTS, GREEDY), reference)
    assert mismatch is None, mismatch
    try:
        writer.load_weights({"model.layers.9.mlp.up_proj.weight": export["model.layers.0.mlp.up_proj.weight"]})
    except KeyError as error:
        assert "no parameter for model.layers.9" in str(error), error
    else:
        raise AssertionError("a tensor the model does not have was written")
    print("written in place and computed with")


if __name__ == "__main__":
    torch.manual_seed(0)
    main(Path(sys.argv[1]))
