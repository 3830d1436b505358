"""Typed payloads: an object to (type header, contiguous bytes) and back, without pickling
(docs/api.md ``put``/``fetch``, docs/gpu.md)."""

from __future__ import annotations

import ast
import sys
import warnings
from typing import Any

import numpy as np

from ray_velo.errors import ConfigError, UnsupportedPayload
from ray_velo.protocol.memtype import DEVICE_KINDS
from ray_velo.protocol.messages import TypeHeader

__all__ = [
    "as_bytes_view",
    "check_fetch_device",
    "dtype_from_wire",
    "dtype_to_wire",
    "fetch_device",
    "from_bytes_view",
    "host_tensor",
    "is_torch",
    "payload_nbytes",
    "to_fetch_device",
]


def _torch() -> Any:
    # torch is optional: only look at it if the caller already imported it.
    return sys.modules.get("torch")


def is_torch(obj: Any) -> bool:
    """Whether ``obj`` is a torch tensor (False where torch was never imported)."""
    torch = _torch()
    return torch is not None and isinstance(obj, torch.Tensor)


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

    A CUDA tensor is copied to host memory once (its header says ``device="cuda"``).

    Raises:
        UnsupportedPayload: for any other type (object arrays, tensors on other devices, and
            dtypes numpy cannot hold such as bfloat16, included).
    """
    torch = _torch()
    if torch is not None and isinstance(obj, torch.Tensor):
        device = obj.device.type
        if device not in DEVICE_KINDS:
            raise UnsupportedPayload(type_name=f"torch tensor on {obj.device}")
        if not _numpy_can_hold(torch, obj.dtype):  # checked first: no device copy in vain
            raise UnsupportedPayload(type_name=f"torch tensor of dtype {obj.dtype}")
        try:
            array = host_tensor(obj).numpy()
        except (TypeError, RuntimeError) as exc:  # e.g. a conjugate-bit tensor
            raise UnsupportedPayload(type_name=f"torch tensor ({exc})") from exc
        header = TypeHeader("torch", array.dtype.str, tuple(array.shape), device=device)
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
        if obj.device.type not in DEVICE_KINDS or not _numpy_can_hold(torch, obj.dtype):
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


def host_tensor(tensor: Any) -> Any:
    """A contiguous CPU tensor with ``tensor``'s values: for a CUDA tensor, one synchronous
    device-to-host copy (the staging fallback when the owner's node has no GPU arena)."""
    return tensor.detach().contiguous().cpu()


def to_fetch_device(tensor: Any, staged: str, requested: str | None = None) -> Any:
    """``tensor`` (a CPU tensor of fetched bytes) on the device :func:`fetch_device` picks
    for a tensor staged from ``staged``: itself when that is the CPU, else one synchronous
    host-to-device copy.

    Raises:
        ConfigError: ``requested`` names a device this process does not have.
    """
    target = fetch_device(staged, requested, *_cuda_facts())
    return tensor if target == "cpu" else tensor.to(target, non_blocking=False)


def _to_device(torch: Any, array: np.ndarray[Any, Any], device: str) -> Any:
    """A tensor on ``device`` with ``array``'s values (one host-to-device copy)."""
    with warnings.catch_warnings():
        # The host tensor over a read-only view is only read, by the copy below.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        host = torch.from_numpy(array)
    # Synchronous (pageable source): ``data`` is read in full before this returns, so the
    # caller may end its lease on the bytes at once.
    return host.to(device, non_blocking=False)


def fetch_device(
    staged: str, requested: str | None, cuda_device_count: int, current_cuda_device: int
) -> str:
    """Where ``fetch`` rebuilds a torch tensor (pure: the CUDA facts are arguments).

    - ``requested`` None: a tensor staged from CUDA goes to the current CUDA device
      (``"cuda:N"``) when this process has one, else to the CPU; a CPU tensor stays on the CPU.
    - ``requested`` ``"cpu"``, ``"cuda"`` (the current device) or ``"cuda:N"``: that device,
      whatever the tensor was staged from.

    Raises:
        ConfigError: ``requested`` names no device kind ray_velo rebuilds on, or a CUDA
            device this process does not have.
    """
    if requested is None:
        if staged == "cuda" and cuda_device_count > 0:
            return f"cuda:{current_cuda_device}"
        return "cpu"
    kind, _, index_text = requested.partition(":")
    if kind not in DEVICE_KINDS or (kind == "cpu" and index_text not in ("", "0")):
        raise ConfigError(field="device", value=requested, rule="must be cpu, cuda or cuda:N")
    if kind == "cpu":
        return "cpu"
    index = current_cuda_device if not index_text else _device_index(requested, index_text)
    if not 0 <= index < cuda_device_count:
        raise ConfigError(
            field="device",
            value=requested,
            rule=f"this process sees {cuda_device_count} CUDA device(s)",
        )
    return f"cuda:{index}"


def _device_index(requested: str, text: str) -> int:
    if not text.isdigit():
        raise ConfigError(field="device", value=requested, rule="must be cpu, cuda or cuda:N")
    return int(text)


def _cuda_facts(*, load_torch: bool = False) -> tuple[int, int]:
    """(CUDA devices this process sees, the current one); (0, 0) without torch or CUDA.
    Imports torch only with ``load_torch`` (a caller named a CUDA device): a numpy consumer
    never loads it."""
    torch = _torch()
    if torch is None and load_torch:
        try:
            import torch
        except ImportError:
            torch = None
    if torch is None or not torch.cuda.is_available():
        return 0, 0
    return int(torch.cuda.device_count()), int(torch.cuda.current_device())


def check_fetch_device(requested: Any) -> str | None:
    """``requested`` (None, a string or a ``torch.device``) as a device string, checked
    before a fetch consumes anything.

    Raises:
        ConfigError: see :func:`fetch_device`.
    """
    if requested is None:
        return None
    text = str(requested)
    fetch_device("cpu", text, *_cuda_facts(load_torch=text.startswith("cuda")))
    return text


def from_bytes_view(
    header: TypeHeader, data: Any, *, copy: bool = False, device: str | None = None
) -> Any:
    """Rebuild the object ``header`` describes over ``data`` (a buffer of exactly its bytes).

    Without ``copy`` the result shares ``data``'s memory (numpy and CPU torch); ``bytes`` is
    always a copy, because that is the type the producer put, and so is a tensor rebuilt on a
    CUDA device. ``device``: where a torch tensor goes (:func:`fetch_device`; numpy and
    bytes ignore it).

    Raises:
        ConfigError: ``device`` names a device this process does not have.
    """
    if header.kind == "bytes":
        return bytes(data)
    array = np.frombuffer(data, dtype=dtype_from_wire(header.dtype))
    array = array.reshape(header.shape)
    if header.kind == "torch":
        import torch

        target = fetch_device(header.device, device, *_cuda_facts())
        if target != "cpu":
            return _to_device(torch, array, target)
        if copy or not array.flags.writeable:
            # torch has no read-only tensors; sharing a read-only view would warn on every
            # fetch. The tensor gets its own copy instead.
            array = array.copy()
        return torch.from_numpy(array)
    if copy:
        array = array.copy()
    return array
