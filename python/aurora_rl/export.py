"""The BF16 export a trainer publishes, from a PyTorch model: plain, or sharded with
FSDP2 (``fully_shard``, whose parameters are DTensors).

Every rank must call ``export_bf16`` (gathering a sharded tensor is a collective); only
the publishing rank keeps the result. Tensors are gathered one at a time and converted at
once, so the publishing rank holds one full FP32 tensor beyond the BF16 export.
"""

from __future__ import annotations

from typing import Optional

import torch

#: Module names wrappers insert: torch.compile's and FSDP1's, at any depth.
_WRAPPER_PARTS = {"_orig_mod", "_fsdp_wrapped_module"}


def hugging_face_name(name: str) -> str:
    """``name`` without what wrappers add, so it is the checkpoint's name: the parts
    torch.compile and FSDP1 insert, and DDP's leading ``module.``."""
    parts = [part for part in name.split(".") if part not in _WRAPPER_PARTS]
    while parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def export_bf16(
    model: torch.nn.Module, *, publishing_rank: int = 0, dtype: torch.dtype = torch.bfloat16
) -> Optional[dict[str, torch.Tensor]]:
    """The model's state (parameters and persistent buffers) under Hugging Face names,
    floating-point tensors in ``dtype``, each a new tensor on the host: the publishing
    rank gets it, every other rank None. Without ``torch.distributed`` the caller is the
    publishing rank."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    publishing = not distributed or dist.get_rank() == publishing_rank
    exported: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach()
        if hasattr(tensor, "full_tensor"):
            # A DTensor: every rank takes part in the gather.
            tensor = tensor.full_tensor()
        if not publishing:
            continue
        if tensor.is_floating_point():
            tensor = tensor.to(dtype)
        # A new tensor even when nothing converted it: the export must not change when
        # training updates the model in place.
        exported[hugging_face_name(name)] = tensor.to("cpu", copy=True).contiguous()
    return exported if publishing else None
