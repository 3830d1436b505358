"""Typed payloads: an object to (type header, contiguous bytes) and back, without pickling.

``put`` stages numpy arrays of any dtype and shape (non-contiguous input is made contiguous),
bytes-likes (bytes, bytearray, memoryview) and CPU torch tensors. The type header travels
with the slot, so ``fetch`` rebuilds the same kind of object over the fetched bytes: a
read-only numpy view, ``bytes``, or a torch tensor sharing the view's memory.
"""

from __future__ import annotations

import ast
import sys
from typing import Any

import numpy as np

from ray_velo.errors import UnsupportedPayload
from ray_velo.protocol.messages import TypeHeader

__all__ = [
    "as_bytes_view",
    "dtype_from_wire",
    "dtype_to_wire",
    "from_bytes_view",
    "payload_nbytes",
]


def _torch() -> Any:
    # torch is optional: only look at it if the caller already imported it.
    return sys.modules.get("torch")


def dtype_to_wire(dtype: np.dtype[Any]) -> str:
    """The ``TypeHeader.dtype`` string of ``dtype``.

    A plain dtype is its ``dtype.str`` (``"<f8"``, ``"|S5"``, ``"<M8[ns]"``). A structured
    dtype's ``str`` is only ``"|V<itemsize>"`` and would lose its fields, so it travels as the
    ``repr`` of its ``.npy`` descriptor (a Python literal list, as in an ``.npy`` header).
    """
    if dtype.fields is None:
        return dtype.str
    return repr(np.lib.format.dtype_to_descr(dtype))


def dtype_from_wire(text: str) -> np.dtype[Any]:
    """The dtype :func:`dtype_to_wire` wrote as ``text``.

    Raises:
        ValueError, TypeError: ``text`` names no dtype.
    """
    if text.startswith("["):
        # A literal, never code: ast.literal_eval is what numpy itself reads .npy headers with.
        return np.lib.format.descr_to_dtype(ast.literal_eval(text))
    return np.dtype(text)


def _flat_bytes(array: np.ndarray[Any, Any]) -> memoryview:
    # A C-contiguous array's bytes as a 1-D "B" view (``.data`` of a uint8 view).
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8).data


def as_bytes_view(obj: Any) -> tuple[TypeHeader, memoryview]:
    """The object's type header and a flat, C-contiguous byte view of its data.

    A non-contiguous numpy array or memoryview is copied once to become contiguous; the
    header keeps the original shape (a 0-d array stays 0-d).

    Raises:
        UnsupportedPayload: for any other type (object arrays and GPU tensors included).
    """
    torch = _torch()
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu":
            raise UnsupportedPayload(type_name=f"torch tensor on {obj.device}")
        try:
            array = obj.detach().contiguous().numpy()
        except (TypeError, RuntimeError) as exc:  # e.g. bfloat16: numpy has no such dtype
            raise UnsupportedPayload(type_name=f"torch tensor of dtype {obj.dtype}") from exc
        header = TypeHeader("torch", array.dtype.str, tuple(array.shape))
        return header, _flat_bytes(array)
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise UnsupportedPayload(type_name=f"numpy array of dtype {obj.dtype} (Python objects)")
        header = TypeHeader("numpy", dtype_to_wire(obj.dtype), tuple(obj.shape))
        return header, _flat_bytes(obj)
    if isinstance(obj, (bytes, bytearray, memoryview)):
        view = memoryview(obj)
        if view.ndim == 1 and view.format == "B" and view.c_contiguous:
            return TypeHeader("bytes"), view
        if view.nbytes == 0:  # cast() refuses a shape with a zero in it
            return TypeHeader("bytes"), memoryview(b"")
        if not view.c_contiguous:
            return TypeHeader("bytes"), memoryview(view.tobytes())
        return TypeHeader("bytes"), view.cast("B")
    raise UnsupportedPayload(type_name=type(obj).__name__)


def payload_nbytes(obj: Any) -> int | None:
    """Size in bytes of a stageable object, or None if ``put`` cannot stage it."""
    torch = _torch()
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu" or not _numpy_can_hold(torch, obj.dtype):
            return None  # (bfloat16 has no numpy dtype): Ray pickles it as usual
        return int(obj.numel() * obj.element_size())
    if isinstance(obj, np.ndarray):
        return None if obj.dtype.hasobject else int(obj.nbytes)
    if isinstance(obj, (bytes, bytearray)):
        return len(obj)
    if isinstance(obj, memoryview):
        return obj.nbytes
    return None


_NUMPY_DTYPES: dict[Any, bool] = {}


def _numpy_can_hold(torch: Any, dtype: Any) -> bool:
    """Whether a torch dtype has a numpy equivalent (the staging path goes through numpy)."""
    known = _NUMPY_DTYPES.get(dtype)
    if known is None:
        try:
            torch.empty(0, dtype=dtype).numpy()
            known = True
        except (TypeError, RuntimeError):
            known = False
        _NUMPY_DTYPES[dtype] = known
    return known


def from_bytes_view(header: TypeHeader, data: Any, *, copy: bool = False) -> Any:
    """Rebuild the object ``header`` describes over ``data`` (a buffer of exactly its bytes).

    Without ``copy`` the result shares ``data``'s memory (numpy and torch); ``bytes`` is
    always a copy, because that is the type the producer put.
    """
    if header.kind == "bytes":
        return bytes(data)
    array = np.frombuffer(data, dtype=dtype_from_wire(header.dtype))
    array = array.reshape(header.shape)
    if copy:
        array = array.copy()
    if header.kind == "torch":
        import torch

        if not array.flags.writeable:
            # torch has no read-only tensors; sharing a read-only view would warn on every
            # fetch. The tensor gets its own copy instead.
            array = array.copy()
        return torch.from_numpy(array)
    return array
