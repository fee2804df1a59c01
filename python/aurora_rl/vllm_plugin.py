"""aurora's vLLM plugin, loaded by vLLM itself in each of its processes (the entry point
``vllm.general_plugins`` in this package's metadata), before a model is built.

It registers the load format ``aurora`` (``aurora_rl.engines.vllm_worker``) and the
weight-transfer backend ``aurora`` (``aurora_rl.vllm_backend``), and on a
Linux x86 CPU with AMX it asks the kernel for the AMX tile state in the process. vLLM's CPU build picks its AMX attention kernel from the CPU's
flags alone (``torch.cpu._is_amx_tile_supported`` reads cpuinfo), but Linux lets a
process use AMX tiles only after it asked (``arch_prctl(ARCH_REQ_XCOMP_PERM)``), which
oneDNN does on its own schedule. In vLLM's worker processes the attention kernel can run
first and the worker dies of SIGILL (seen on vLLM 0.32's CPU build: about one run in two
of a few greedy generations). Asking is idempotent and free where AMX is absent.
"""

from __future__ import annotations

import logging
import platform
import sys

logger = logging.getLogger("aurora_rl.vllm")


def register() -> None:
    """vLLM's general-plugin hook: called once per vLLM process."""
    _request_amx_tiles()
    _register_model_loader()
    # The weight-transfer backend "aurora" (its module registers on import).
    import aurora_rl.vllm_backend  # noqa: F401


def _register_model_loader() -> None:
    """Load format ``aurora``: weights kept where the model computes from them, so an
    actor writes changed elements in place (``aurora_rl.engines.vllm_worker``)."""
    from vllm.model_executor.model_loader import register_model_loader

    from aurora_rl.engines.vllm_worker import aurora_model_loader

    register_model_loader("aurora")(aurora_model_loader())


def _request_amx_tiles() -> None:
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return
    try:
        import torch
    except ImportError:
        return
    if not torch.cpu._is_amx_tile_supported():
        return
    # torch's own request (arch_prctl with XFEATURE_XTILEDATA), the one oneDNN relies on.
    if not torch._C._cpu._init_amx():
        logger.warning("the CPU has AMX but the kernel refused its tile state: vLLM's AMX kernels may fail")
