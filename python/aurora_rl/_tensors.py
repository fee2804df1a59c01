"""Tensors in and out of the extension module.

The Rust side reads every tensor as flat ``uint8`` host memory borrowed through DLPack
(``python/src/dlpack.rs``); this module turns torch tensors and numpy arrays into that
without copying host memory that is already contiguous, and builds results in memory the
caller's framework owns. A tensor on a GPU is copied to the host once.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Optional, Union

if TYPE_CHECKING:
    import numpy
    import torch

    Tensor = Union[torch.Tensor, numpy.ndarray]
else:
    Tensor = Any

#: What the extension takes for one tensor: name, dtype (its safetensors name), shape,
#: and its bytes as a flat uint8 host tensor.
HostTensor = tuple[str, str, list[int], Any]

# Safetensors dtype names by torch dtype attribute, and by numpy dtype name (bfloat16 is
# the ml_dtypes extension type, when installed).
_TORCH_NAMES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "int16": "I16",
    "uint16": "U16",
    "float16": "F16",
    "bfloat16": "BF16",
    "int32": "I32",
    "uint32": "U32",
    "float32": "F32",
    "float64": "F64",
    "int64": "I64",
    "uint64": "U64",
    "float8_e5m2": "F8_E5M2",
    "float8_e4m3fn": "F8_E4M3",
}
# numpy names its dtypes as torch does, and has no float8 types.
_NUMPY_NAMES = {name: code for name, code in _TORCH_NAMES.items() if not name.startswith("float8")}

_TORCH_ATTRIBUTES = {name: attribute for attribute, name in _TORCH_NAMES.items()}
_NUMPY_ATTRIBUTES = {name: attribute for attribute, name in _NUMPY_NAMES.items()}


def _is_torch(value: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _is_numpy(value: object) -> bool:
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.ndarray)


def dtype_name(dtype: Any) -> str:
    """The safetensors name of a torch dtype."""
    name = _TORCH_NAMES.get(str(dtype).removeprefix("torch."))
    if name is None:
        raise TypeError(f"dtype {dtype} has no counterpart in the delta format")
    return name


def host_tensors(state: Mapping[str, Tensor]) -> list[HostTensor]:
    """The extension's view of a mapping from tensor names to tensors."""
    if not isinstance(state, Mapping):
        raise TypeError(f"expected a mapping of tensor names to tensors, got {type(state).__name__}")
    return [host_tensor(name, tensor) for name, tensor in state.items()]


def write_counts(tensors: list[HostTensor]) -> Optional[tuple[int, ...]]:
    """torch's count of the in-place writes made through torch to each tensor's memory (a
    view's count is its base's), or None unless every tensor is torch's. Writes that
    bypass torch's counter (through ``.data`` or a NumPy view) are not counted."""
    counts = []
    for _, _, _, flat in tensors:
        try:
            count = flat._version
        except (AttributeError, RuntimeError):
            # NumPy's arrays have no counter; inference-mode tensors refuse to give one.
            return None
        counts.append(count)
    return tuple(counts)


def shares_memory(tensors: list[HostTensor], others: list[HostTensor]) -> bool:
    """Whether any of ``tensors`` lies in the storage of any of ``others`` (torch's; a
    NumPy array counts as shared): the base and the target of a publish that alias the
    same parameters, written between the two whatever the write counts say."""
    def storages(of: list[HostTensor]) -> Optional[set[int]]:
        found = set()
        for _, _, _, flat in of:
            storage = getattr(flat, "untyped_storage", None)
            if storage is None:
                return None
            found.add(storage().data_ptr())
        return found

    mine, theirs = storages(tensors), storages(others)
    return mine is None or theirs is None or not mine.isdisjoint(theirs)


def host_tensor(name: str, tensor: Tensor) -> HostTensor:
    if not isinstance(name, str):
        raise TypeError(f"tensor names must be str, got {type(name).__name__}")
    if _is_torch(tensor):
        import torch

        host = tensor.detach()
        if host.device.type != "cpu":
            host = host.to("cpu")
        try:
            dtype = dtype_name(host.dtype)
        except TypeError as error:
            raise TypeError(f"tensor {name!r}: {error}") from None
        flat = host.contiguous().reshape(-1).view(torch.uint8)
        return (name, dtype, list(host.shape), flat)
    if _is_numpy(tensor):
        import numpy

        array = numpy.ascontiguousarray(tensor)
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        if not array.flags.writeable:
            # DLPack cannot export read-only memory.
            array = array.copy()
        dtype = _NUMPY_NAMES.get(array.dtype.name)
        if dtype is None:
            raise TypeError(f"tensor {name!r}: dtype {array.dtype} has no counterpart in the delta format")
        return (name, dtype, list(array.shape), array.reshape(-1).view(numpy.uint8))
    raise TypeError(f"tensor {name!r}: expected a torch tensor or a numpy array, got {type(tensor).__name__}")


class OutputBuffer:
    """One host allocation of the caller's framework holding a checkpoint's tensors at
    the places the extension chose, and views of each as its dtype and shape."""

    def __init__(self, like: Mapping[str, Tensor], length: int) -> None:
        self.kind = _kind_of(like)
        self.device = _device_of(like) if self.kind == "torch" else None
        if self.kind == "torch":
            import torch

            self.flat = torch.empty(length, dtype=torch.uint8)
        else:
            import numpy

            self.flat = numpy.empty(length, dtype=numpy.uint8)

    def view(self, name: str, dtype: str, shape: list[int], start: int, end: int) -> Tensor:
        part = self.flat[start:end]
        if self.kind == "torch":
            import torch

            tensor = part.view(getattr(torch, _TORCH_ATTRIBUTES[dtype])).reshape(shape)
            return tensor if self.device is None else tensor.to(self.device)
        return part.view(_numpy_dtype(name, dtype)).reshape(shape)


def _kind_of(state: Mapping[str, Tensor]) -> str:
    """torch or numpy: what the caller gave, or torch when it gave nothing and has it."""
    for tensor in state.values():
        return "torch" if _is_torch(tensor) else "numpy"
    try:
        import torch  # noqa: F401
    except ImportError:
        return "numpy"
    return "torch"


def _device_of(state: Mapping[str, Tensor]) -> Any:
    """The device every tensor of `state` is on, if it is one other than the host."""
    devices = {tensor.device for tensor in state.values()}
    if len(devices) == 1:
        (device,) = devices
        if device.type != "cpu":
            return device
    return None


def _numpy_dtype(name: str, dtype: str) -> Any:
    import numpy

    attribute = _NUMPY_ATTRIBUTES.get(dtype)
    if attribute == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError(
                f"tensor {name!r} is BF16, which numpy has no dtype for without ml_dtypes: pass torch tensors"
            ) from None
        return ml_dtypes.bfloat16
    if attribute is None:
        raise TypeError(f"tensor {name!r} is {dtype}, which numpy has no dtype for: pass torch tensors")
    return numpy.dtype(attribute)


def torch_dtype(dtype: str) -> Any:
    """The torch dtype of a safetensors dtype name."""
    import torch

    return getattr(torch, _TORCH_ATTRIBUTES[dtype])


def torch_view(dtype: str, shape: list[int], data: Any) -> Any:
    """A torch tensor over flat uint8 host memory given as a DLPack capsule (no copy)."""
    import torch

    return torch.from_dlpack(data).view(torch_dtype(dtype)).reshape(shape)
