"""Memory types (host or CUDA) as UCX numbers them, and the torch device of each, in one table
for the payload layer, the rkey pre-parse and the registrar (docs/gpu.md). Pure."""

from __future__ import annotations

from enum import IntEnum

__all__ = [
    "DEVICE_KINDS",
    "SUPPORTED_MEMORY_TYPES",
    "UCS_MEMORY_TYPE_LAST",
    "MemoryType",
    "device_kind",
    "memory_type_name",
]


class MemoryType(IntEnum):
    """``ucs_memory_type_t`` (UCX 1.22 ``src/ucs/memory/memory_type.h``), in its order."""

    HOST = 0
    CUDA = 1
    CUDA_MANAGED = 2
    ROCM = 3
    ROCM_MANAGED = 4
    RDMA = 5
    ZE_HOST = 6
    ZE_DEVICE = 7
    ZE_MANAGED = 8
    GAUDI = 9


UCS_MEMORY_TYPE_LAST = 10
"""One past the last memory type UCX 1.22 knows: a key byte at or above it is garbage."""

SUPPORTED_MEMORY_TYPES = frozenset({MemoryType.HOST, MemoryType.CUDA, MemoryType.CUDA_MANAGED})
"""The memory types this library registers, describes and GETs."""

DEVICE_KINDS = ("cpu", "cuda")
"""The torch device kinds a ``TypeHeader.device`` may name (no index: the consumer picks one)."""

_DEVICE_OF_TYPE = {
    MemoryType.HOST: "cpu",
    MemoryType.CUDA: "cuda",
    MemoryType.CUDA_MANAGED: "cuda",
}


def memory_type_name(value: int) -> str:
    """``"host"``, ``"cuda"``, ... for a memory-type number; ``"unknown(N)"`` for garbage."""
    try:
        return MemoryType(value).name.lower()
    except ValueError:
        return f"unknown({value})"


def device_kind(memory_type: int) -> str:
    """The torch device kind (``"cpu"`` / ``"cuda"``) whose memory has this type.

    Raises:
        ValueError: the memory type is not one this library moves.
    """
    try:
        return _DEVICE_OF_TYPE[MemoryType(memory_type)]
    except (ValueError, KeyError):
        raise ValueError(
            f"memory type {memory_type_name(memory_type)} is not one ray_velo moves "
            f"({', '.join(sorted(memory_type_name(t) for t in SUPPORTED_MEMORY_TYPES))})"
        ) from None
