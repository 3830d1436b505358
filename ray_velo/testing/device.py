"""Fake GPU memory for tests without a GPU, for :class:`~ray_velo.memory.device.DeviceArenaPool`:
host memory labelled CUDA, and a registrar that records what it "mapped" and as which type."""

from __future__ import annotations

import functools
import threading
from typing import Any

import numpy as np

from ray_velo.memory.device import DeviceMemory
from ray_velo.memory.pool import NoopRegistrar, NoopRegistration, Registration
from ray_velo.protocol.memtype import MemoryType

__all__ = ["FakeDeviceAllocator", "FakeDeviceRegistrar", "fake_cuda"]


class FakeDeviceAllocator:
    """Hands out host memory (numpy arrays) as if it were CUDA memory on ``devices`` GPUs.

    ``capacity_bytes``: each fake GPU's memory; an allocation past it raises as
    ``torch.cuda.OutOfMemoryError`` would (a RuntimeError). Refuses a double or foreign free.
    """

    memory_type = MemoryType.CUDA

    def __init__(self, devices: int = 1, capacity_bytes: int | None = None) -> None:
        self._devices = devices
        self._capacity = capacity_bytes
        self._lock = threading.Lock()
        self._live: dict[int, DeviceMemory] = {}  # by address

    def device_count(self) -> int:
        return self._devices

    def live_bytes(self, device_index: int) -> int:
        """Bytes allocated on fake GPU ``device_index`` now."""
        with self._lock:
            return sum(m.nbytes for m in self._live.values() if m.device_index == device_index)

    def allocate(self, device_index: int, nbytes: int) -> DeviceMemory:
        if not 0 <= device_index < self._devices:
            raise RuntimeError(f"CUDA error: invalid device ordinal {device_index} (fake)")
        if self._capacity is not None and self.live_bytes(device_index) + nbytes > self._capacity:
            raise RuntimeError(f"CUDA out of memory: {nbytes} bytes on GPU {device_index} (fake)")
        array = np.zeros(nbytes, dtype=np.uint8)
        memory = DeviceMemory(int(array.ctypes.data), nbytes, device_index, array)
        with self._lock:
            self._live[memory.address] = memory
        return memory

    def free(self, memory: DeviceMemory) -> None:
        with self._lock:
            if self._live.get(memory.address) is not memory:
                raise ValueError(f"{memory!r} is not live on this fake allocator")
            del self._live[memory.address]

    def view(self, memory: DeviceMemory, offset: int, nbytes: int) -> Any:
        array: np.ndarray[Any, Any] = memory.owner
        return array[offset : offset + nbytes]


class FakeDeviceRegistrar(NoopRegistrar):
    """A :class:`NoopRegistrar` that maps one memory type (CUDA by default) and records each
    registration's ``(address, nbytes, memory_type)``; ``fail_registrations`` makes the next
    that many fail as UCX without CUDA support does."""

    def __init__(self, memory_type: MemoryType = MemoryType.CUDA) -> None:
        super().__init__()
        self.memory_type = memory_type
        self.mapped: list[tuple[int, int, MemoryType]] = []
        self.fail_registrations = 0
        self.fail_unregistrations = 0

    def register(self, address: int, nbytes: int) -> NoopRegistration:
        if self.fail_registrations > 0:
            self.fail_registrations -= 1
            raise RuntimeError("ucp_mem_map: UCS_ERR_UNSUPPORTED (no cuda memory domain, fake)")
        self.mapped.append((address, nbytes, self.memory_type))
        return super().register(address, nbytes)

    def unregister(self, registration: Registration) -> None:
        if self.fail_unregistrations > 0:
            self.fail_unregistrations -= 1
            raise RuntimeError("ucp_mem_unmap failed (fake)")
        super().unregister(registration)


def fake_cuda(tensor: Any) -> Any:
    """A view of the CPU torch ``tensor`` whose ``device`` says ``cuda:0``: what the payload
    layer and the tensor transport branch on, without a GPU (torch must be installed)."""
    import torch

    return torch.Tensor._make_subclass(_fake_cuda_class(), tensor)


@functools.cache
def _fake_cuda_class() -> type:
    import torch

    class FakeCudaTensor(torch.Tensor):
        """A CPU tensor that reports a CUDA device."""

        @property
        def device(self) -> Any:  # type: ignore[override]
            return torch.device("cuda", 0)

    return FakeCudaTensor
