"""GPU arenas: one device-memory arena per GPU, allocated and registered once, carved in granules
(docs/gpu.md, "GPU arenas")."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from ray_velo.errors import ConfigError
from ray_velo.memory.allocator import GRANULE_BYTES, Allocation, OffsetAllocator, bytes_to_granules
from ray_velo.memory.pool import Registration, RegistrationBudget
from ray_velo.protocol.memtype import MemoryType, memory_type_name

__all__ = [
    "DeviceAllocator",
    "DeviceArena",
    "DeviceArenaPool",
    "DeviceFallback",
    "DeviceFallbackReason",
    "DeviceMemory",
    "DevicePlacement",
    "DeviceRegistrar",
    "GpuArenas",
    "TorchCudaAllocator",
]

#: Why a CUDA payload did not get GPU arena memory (``DEVICE_STAGING_REASONS``).
DeviceFallbackReason = Literal["no_gpu_arena", "gpu_budget", "gpu_pool_exhausted"]


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """One allocation of device memory, as an allocator hands it out.

    Attributes:
        address: its device address (what ``ucp_mem_map`` is given).
        nbytes: its size in bytes.
        device_index: the GPU it is on.
        owner: the allocator's handle keeping it alive (a torch tensor; host memory in fakes).
    """

    address: int
    nbytes: int
    device_index: int
    owner: Any


class DeviceAllocator(Protocol):
    """Where GPU arenas come from: allocates and frees device memory, views ranges of it."""

    @property
    def memory_type(self) -> MemoryType:
        """What its memory is (``MemoryType.CUDA``), as the registrar must say to UCX."""
        ...

    def device_count(self) -> int:
        """GPUs this process can allocate on."""
        ...

    def allocate(self, device_index: int, nbytes: int) -> DeviceMemory:
        """``nbytes`` of device memory on GPU ``device_index``; raise if there is none."""
        ...

    def free(self, memory: DeviceMemory) -> None:
        """Give ``memory`` back (only after its registration is gone)."""
        ...

    def view(self, memory: DeviceMemory, offset: int, nbytes: int) -> Any:
        """A writable view of ``nbytes`` bytes of ``memory`` from ``offset`` (a uint8 tensor)."""
        ...


class DeviceRegistrar(Protocol):
    """A :class:`~ray_velo.memory.pool.Registrar` that maps one memory type
    (``ray_velo.ucx.backend.UcxRegistrar(context, MemoryType.CUDA)``)."""

    @property
    def memory_type(self) -> MemoryType: ...

    def register(self, address: int, nbytes: int) -> Registration: ...

    def unregister(self, registration: Registration) -> None: ...


class TorchCudaAllocator:
    """Device memory from torch's CUDA caching allocator (one uint8 tensor per arena).

    Raises (when built):
        ImportError: torch is not installed.
        RuntimeError: this process sees no CUDA device.
    """

    memory_type = MemoryType.CUDA

    def __init__(self) -> None:
        import torch  # only here: a host without a GPU never loads CUDA

        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device: GPU arenas need one (torch.cuda.is_available())")
        self._torch = torch

    def device_count(self) -> int:
        return int(self._torch.cuda.device_count())

    def allocate(self, device_index: int, nbytes: int) -> DeviceMemory:
        tensor = self._torch.empty(nbytes, dtype=self._torch.uint8, device=f"cuda:{device_index}")
        return DeviceMemory(int(tensor.data_ptr()), nbytes, device_index, tensor)

    def free(self, memory: DeviceMemory) -> None:
        # Dropping the last reference returns the block to torch's cache, which reuses it;
        # the registration is gone by now (the pool unregisters first).
        del memory

    def view(self, memory: DeviceMemory, offset: int, nbytes: int) -> Any:
        return memory.owner[offset : offset + nbytes]


@dataclass(eq=False, slots=True)
class DeviceArena:
    """A GPU's arena: its memory, its registration, and the granule allocator over it."""

    memory: DeviceMemory
    registration: Registration
    allocator: OffsetAllocator

    @property
    def address(self) -> int:
        return self.memory.address

    @property
    def nbytes(self) -> int:
        return self.memory.nbytes


@dataclass(frozen=True, slots=True)
class DevicePlacement:
    """A byte range of a GPU arena: where a CUDA payload lives.

    Attributes:
        device_index: the GPU.
        address: the range's device address (a descriptor's ``addr``).
        offset_bytes: its start in the arena.
        nbytes: the bytes requested.
        allocation: the private free token (never sent to peers).
    """

    device_index: int
    address: int
    offset_bytes: int
    nbytes: int
    allocation: Allocation


@dataclass(frozen=True, slots=True)
class DeviceFallback:
    """No GPU arena memory for the request: stage through host memory, count ``reason``."""

    reason: DeviceFallbackReason
    requested_bytes: int
    detail: str


class DeviceArenaPool:
    """The arena of one GPU. Thread-safe; time plays no part."""

    def __init__(
        self,
        device_index: int,
        allocator: DeviceAllocator,
        registrar: DeviceRegistrar,
        budget: RegistrationBudget,
        arena_bytes: int,
    ) -> None:
        """A closed pool: :meth:`open` allocates and registers the arena.

        Raises:
            ConfigError: ``arena_bytes`` is not a positive multiple of 4 KiB, or the
                registrar maps another memory type than the allocator hands out.
        """
        if arena_bytes <= 0 or arena_bytes % GRANULE_BYTES:
            raise ConfigError(
                field="arena_bytes", value=arena_bytes, rule="a positive multiple of 4 KiB"
            )
        if registrar.memory_type != allocator.memory_type:
            raise ConfigError(
                field="registrar",
                value=memory_type_name(registrar.memory_type),
                rule=f"must map {memory_type_name(allocator.memory_type)} memory",
            )
        self.device_index = device_index
        self.budget = budget
        self._allocator = allocator
        self._registrar = registrar
        self._arena_bytes = arena_bytes
        self._lock = threading.Lock()
        self._arena: DeviceArena | None = None
        self._open_failure = "not opened"
        self._live: dict[int, DevicePlacement] = {}  # by allocation node

    @property
    def arena(self) -> DeviceArena | None:
        """The arena while the pool is open."""
        return self._arena

    def open(self) -> DeviceFallback | None:
        """Charge the budget, allocate the arena, register it: once. None when the pool is
        open (now or before); else why not (the pool stays closed and every request falls
        back with that reason)."""
        with self._lock:
            if self._arena is not None:
                return None
            if not self.budget.reserve(self._arena_bytes, reclaim=False):
                return self._closed("gpu_budget", f"{self._arena_bytes} bytes over the budget")
            try:
                memory = self._allocator.allocate(self.device_index, self._arena_bytes)
            except Exception as exc:  # out of device memory, a driver error: fall back
                self.budget.release(self._arena_bytes)
                return self._closed("no_gpu_arena", f"allocation failed: {exc}")
            try:
                registration = self._registrar.register(memory.address, memory.nbytes)
            except Exception as exc:  # UCX without CUDA support refuses device memory
                self._allocator.free(memory)
                self.budget.release(self._arena_bytes)
                return self._closed("no_gpu_arena", f"registration failed: {exc}")
            granules = self._arena_bytes // GRANULE_BYTES
            self._arena = DeviceArena(memory, registration, OffsetAllocator(granules))
            self._open_failure = ""
            return None

    def _closed(self, reason: DeviceFallbackReason, detail: str) -> DeviceFallback:
        self._open_failure = detail
        return DeviceFallback(reason, self._arena_bytes, f"GPU {self.device_index}: {detail}")

    def allocate(self, nbytes: int) -> DevicePlacement | DeviceFallback:
        """A range of ``nbytes`` (>= 1) of the arena, or why there is none."""
        with self._lock:
            arena = self._arena
            if arena is None:
                return DeviceFallback(
                    "no_gpu_arena", nbytes, f"GPU {self.device_index}: {self._open_failure}"
                )
            got = arena.allocator.allocate(bytes_to_granules(nbytes))
            if got is None:
                return DeviceFallback(
                    "gpu_pool_exhausted",
                    nbytes,
                    f"GPU {self.device_index}: no free range of {nbytes} bytes in its arena",
                )
            offset = got.offset * GRANULE_BYTES
            placement = DevicePlacement(
                self.device_index, arena.address + offset, offset, nbytes, got
            )
            self._live[got.node] = placement
            return placement

    def view(self, placement: DevicePlacement) -> Any:
        """A writable view of the placement's bytes (a uint8 tensor on the GPU).

        Raises:
            KeyError: the placement is not live in this pool.
        """
        with self._lock:
            if self._live.get(placement.allocation.node) != placement or self._arena is None:
                raise KeyError(f"{placement!r} is not live in GPU {self.device_index}'s pool")
            memory = self._arena.memory
        return self._allocator.view(memory, placement.offset_bytes, placement.nbytes)

    def free(self, placement: DevicePlacement) -> None:
        """Give a placement's range back (its readers are done: the caller's lease rules).

        Raises:
            KeyError: the placement is not live in this pool (a double free).
        """
        with self._lock:
            if self._live.get(placement.allocation.node) != placement or self._arena is None:
                raise KeyError(f"{placement!r} is not live in GPU {self.device_index}'s pool")
            del self._live[placement.allocation.node]
            self._arena.allocator.free(placement.allocation)

    @property
    def live_placements(self) -> int:
        return len(self._live)

    def close(self) -> None:
        """Unregister the arena, free it, release its charge (in that order). Placements
        still live are abandoned with it: close only after every reader is done.

        Raises:
            Exception: what the registrar raised; the arena then stays allocated, registered
                and charged (do not free what UCX may still serve).
        """
        with self._lock:
            arena, self._arena = self._arena, None
            self._live.clear()
            self._open_failure = "closed"
        if arena is None:
            return
        try:
            self._registrar.unregister(arena.registration)
        except BaseException:
            with self._lock:
                self._arena = arena  # leaked on purpose: still registered
            raise
        self._allocator.free(arena.memory)
        self.budget.release(arena.nbytes)

    def validate(self) -> None:
        """Invariants: the allocator's books, every live placement inside the arena, and the
        arena charged to the budget while it is open.

        Raises:
            AssertionError: one does not hold (checked under ``-O`` too).
        """
        with self._lock:
            arena = self._arena
            if arena is None:
                _check(not self._live, "live placements in a closed pool")
                return
            arena.allocator.validate()
            used = sum(p.allocation.size for p in self._live.values())
            _check(used == arena.allocator.used_granules, "live placements != used granules")
            for p in self._live.values():
                _check(p.offset_bytes + p.nbytes <= arena.nbytes, f"{p!r} past the arena")
            _check(self.budget.registered_bytes >= arena.nbytes, "the arena is not charged")


class GpuArenas:
    """A node's GPU arenas: one :class:`DeviceArenaPool` per GPU the allocator sees, each
    charged to a budget of its own (``budget_bytes_per_device``). :meth:`none` is a node
    without any (no GPU, or no CUDA-capable UCX): every request falls back, ``no_gpu_arena``.
    """

    def __init__(
        self,
        allocator: DeviceAllocator | None,
        registrar: DeviceRegistrar | None,
        arena_bytes: int,
        budget_bytes_per_device: int,
    ) -> None:
        """Closed pools, one per GPU (none without an allocator and a registrar).

        Raises:
            ConfigError: as for :class:`DeviceArenaPool`.
        """
        self.pools: dict[int, DeviceArenaPool] = {}
        if allocator is None or registrar is None:
            return
        for index in range(allocator.device_count()):
            budget = RegistrationBudget(budget_bytes_per_device)
            self.pools[index] = DeviceArenaPool(index, allocator, registrar, budget, arena_bytes)

    @classmethod
    def none(cls) -> GpuArenas:
        """No GPU arenas at all."""
        return cls(None, None, GRANULE_BYTES, 0)

    def open(self) -> dict[int, DeviceFallback]:
        """Open every GPU's pool; the ones that could not open, with why (they fall back)."""
        failed = {}
        for index, pool in self.pools.items():
            why = pool.open()
            if why is not None:
                failed[index] = why
        return failed

    def allocate(self, device_index: int, nbytes: int) -> DevicePlacement | DeviceFallback:
        """A range of GPU ``device_index``'s arena (the tensor's own GPU), or why not."""
        pool = self.pools.get(device_index)
        if pool is None:
            return DeviceFallback("no_gpu_arena", nbytes, f"no GPU arena on GPU {device_index}")
        return pool.allocate(nbytes)

    def free(self, placement: DevicePlacement) -> None:
        """Give a placement back to its GPU's pool. Raises KeyError for a stranger."""
        self.pools[placement.device_index].free(placement)

    def registered_bytes(self) -> dict[int, int]:
        """Device bytes charged, per GPU (each against its own budget)."""
        return {index: pool.budget.registered_bytes for index, pool in self.pools.items()}

    def close(self) -> None:
        """Close every pool (each unregisters, frees, releases its charge). The first failure
        is raised after every pool was tried; a failed pool stays allocated (leaked)."""
        errors = []
        for pool in self.pools.values():
            try:
                pool.close()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
