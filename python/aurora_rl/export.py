"""The BF16 export a trainer publishes, from a PyTorch model: plain, or sharded with
FSDP2 (``fully_shard``, whose parameters are DTensors).

Every rank must call ``export_bf16`` (gathering a sharded tensor is a collective); only
the publishing rank keeps the result. Tensors are gathered one at a time and converted at
once, so the publishing rank holds one full FP32 tensor beyond the BF16 export.

A transformers model whose modules fuse what its checkpoints store apart (a
mixture-of-experts layer holds all its experts in one 3-D parameter, where checkpoints
and engines name each expert's projections) is exported under the checkpoint's names,
through transformers' own reversal of its loading conversions: the names actors and
engines load.
"""

from __future__ import annotations

import math
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
    if not publishing:
        return None
    return checkpoint_layout(model, exported)


def export_adapter(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """A PEFT model's adapter only (``peft.get_peft_model_state_dict``: its names, as
    ``adapter_model.safetensors`` stores them), floating-point tensors in ``dtype``, each
    a new tensor on the host: what a trainer that trains an adapter publishes."""
    from peft import get_peft_model_state_dict

    return {
        name: (tensor.detach().to(dtype) if tensor.is_floating_point() else tensor.detach()).to("cpu", copy=True).contiguous()
        for name, tensor in get_peft_model_state_dict(model).items()
    }


def checkpoint_layout(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (the model's state under its module names) as the model's checkpoints
    store it: for a transformers model, its loading conversions reversed (fused experts
    split into per-expert tensors, each a contiguous view of the exported one where
    possible); anything else as it is."""
    return {name: tensor.contiguous() for name, tensor in _reverted(model, state).items()}


#: Where a checkpoint tensor lies in a model's state: the state tensor's name, the first
#: of its elements the checkpoint tensor is, and the checkpoint tensor's shape.
Place = tuple[str, int, tuple[int, ...]]


def checkpoint_places(model: torch.nn.Module) -> dict[str, Place]:
    """Where each of the model's checkpoint tensors lies in its state: one run of one
    parameter's (or buffer's) elements. Found by reversing the loading conversions on each
    state tensor's element numbers, so nothing of the weights is read; a checkpoint
    tensor that is not one run is refused."""
    places: dict[str, Place] = {}
    for name, tensor in model.state_dict().items():
        dtype = torch.int32 if tensor.numel() < 2**31 else torch.int64
        numbers = torch.arange(tensor.numel(), dtype=dtype).view(tensor.shape)
        for stored, placed in _reverted(model, {name: numbers}).items():
            first = int(placed.reshape(-1)[0]) if placed.numel() else 0
            if not torch.equal(placed.reshape(-1), torch.arange(first, first + placed.numel(), dtype=dtype)):
                raise ValueError(f"{type(model).__name__}: {stored} is not one run of the elements of {name}")
            places[stored] = (name, first, tuple(placed.shape))
    return places


def checkpoint_views(model: torch.nn.Module, places: dict[str, Place]) -> dict[str, torch.Tensor]:
    """The model's checkpoint tensors (``places``), each a view of the memory the model
    holds it in now (a model moved to another device holds it elsewhere)."""
    state = model.state_dict()
    views = {}
    for stored, (name, first, shape) in places.items():
        tensor = state[name].detach()
        if not tensor.is_contiguous():
            raise ValueError(f"{type(model).__name__}: {name} is not contiguous")
        views[stored] = tensor.view(-1)[first : first + math.prod(shape)].view(shape)
    return views


def _reverted(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # Under torch.compile's and DDP's wrappers.
    while isinstance(getattr(model, "_orig_mod", None) or getattr(model, "module", None), torch.nn.Module):
        model = getattr(model, "_orig_mod", None) or model.module
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return state
    if not isinstance(model, PreTrainedModel):
        return state
    return revert_weight_conversion(model, state)
