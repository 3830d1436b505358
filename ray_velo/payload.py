"""Typed payloads: an object to (type header, contiguous bytes) and back, without pickling.

``put`` stages numpy arrays of any dtype and shape (non-contiguous input is made contiguous),
bytes-likes (bytes, bytearray, memoryview) and CPU torch tensors. The type header travels
with the slot, so ``fetch`` rebuilds the same kind of object over the fetched bytes: a
read-only numpy view, ``bytes``, or a torch tensor sharing the view's memory.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ray_velo.errors import UnsupportedPayload
from ray_velo.protocol.messages import TypeHeader

__all__ = ["as_bytes_view", "from_bytes_view", "payload_nbytes"]


def _torch() -> Any:
    # torch is optional: only look at it if the caller already imported it.
    return sys.modules.get("torch")


def as_bytes_view(obj: Any) -> tuple[TypeHeader, memoryview]:
    """The object's type header and a flat, C-contiguous byte view of its data.

    A non-contiguous numpy array is copied once to become contiguous.

    Raises:
        UnsupportedPayload: for any other type (object arrays included).
    """
    torch = _torch()
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu":
            raise UnsupportedPayload(type_name=f"torch tensor on {obj.device}")
        array = obj.detach().contiguous().numpy()
        header = TypeHeader("torch", array.dtype.str, tuple(array.shape))
        return header, memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise UnsupportedPayload(type_name=f"numpy array of dtype {obj.dtype} (Python objects)")
        array = np.ascontiguousarray(obj)
        header = TypeHeader("numpy", array.dtype.str, tuple(array.shape))
        return header, memoryview(array.reshape(-1).view(np.uint8))
    if isinstance(obj, (bytes, bytearray, memoryview)):
        view = memoryview(obj)
        if not view.c_contiguous:
            view = memoryview(view.tobytes())
        return TypeHeader("bytes"), view.cast("B") if view.ndim != 1 or view.format != "B" else view
    raise UnsupportedPayload(type_name=type(obj).__name__)


def payload_nbytes(obj: Any) -> int | None:
    """Size in bytes of a stageable object, or None if ``put`` cannot stage it."""
    torch = _torch()
    if torch is not None and isinstance(obj, torch.Tensor):
        return int(obj.numel() * obj.element_size()) if obj.device.type == "cpu" else None
    if isinstance(obj, np.ndarray):
        return None if obj.dtype.hasobject else int(obj.nbytes)
    if isinstance(obj, (bytes, bytearray)):
        return len(obj)
    if isinstance(obj, memoryview):
        return obj.nbytes
    return None


def from_bytes_view(header: TypeHeader, data: Any, *, copy: bool = False) -> Any:
    """Rebuild the object ``header`` describes over ``data`` (a buffer of exactly its bytes).

    Without ``copy`` the result shares ``data``'s memory (numpy and torch); ``bytes`` is
    always a copy, because that is the type the producer put.
    """
    if header.kind == "bytes":
        return bytes(data)
    array = np.frombuffer(data, dtype=np.dtype(header.dtype))
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
