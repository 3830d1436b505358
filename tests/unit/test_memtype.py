"""The memory-type table shared by the payload layer, the rkey pre-parse and the registrar."""

from __future__ import annotations

import pytest

from ray_velo.protocol.memtype import (
    SUPPORTED_MEMORY_TYPES,
    UCS_MEMORY_TYPE_LAST,
    MemoryType,
    device_kind,
    memory_type_name,
)


def test_numbers_are_ucx_abi() -> None:
    """UCX 1.22's ucs_memory_type_t order: the numbers go on the wire inside every key."""
    assert [int(t) for t in MemoryType] == list(range(UCS_MEMORY_TYPE_LAST))
    assert (MemoryType.HOST, MemoryType.CUDA, MemoryType.CUDA_MANAGED) == (0, 1, 2)


def test_supported_types_map_to_torch_devices() -> None:
    """Host memory is a "cpu" tensor's, both CUDA types a "cuda" tensor's."""
    assert {device_kind(t) for t in SUPPORTED_MEMORY_TYPES} == {"cpu", "cuda"}
    assert device_kind(MemoryType.CUDA_MANAGED) == "cuda"


@pytest.mark.parametrize("value", [MemoryType.ROCM, MemoryType.ZE_DEVICE, 10, 127, -1])
def test_other_types_are_refused_by_name(value: int) -> None:
    """ROCm, Level Zero and numbers UCX does not know are not moved, and the error says so."""
    with pytest.raises(ValueError, match="is not one ray_velo moves"):
        device_kind(value)
    assert memory_type_name(127) == "unknown(127)"
