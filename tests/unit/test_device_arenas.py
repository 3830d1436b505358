"""GPU arena pools on fake device memory (host memory labelled CUDA): allocated and
registered once as CUDA memory, carved in granules, charged to a budget per GPU apart from
the host budget, every shortage a counted fallback, teardown in the safe order."""

from __future__ import annotations

import itertools
import typing

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_velo.errors import ConfigError
from ray_velo.memory.allocator import GRANULE_BYTES
from ray_velo.memory.device import (
    DeviceArenaPool,
    DeviceFallback,
    DeviceFallbackReason,
    DevicePlacement,
    GpuArenas,
)
from ray_velo.memory.pool import RegistrationBudget
from ray_velo.protocol.memtype import MemoryType
from ray_velo.protocol.path import DEVICE_STAGING_REASONS
from ray_velo.testing.device import FakeDeviceAllocator, FakeDeviceRegistrar

MiB = 1 << 20


def make_pool(
    arena_bytes: int = 8 * MiB, budget_bytes: int = 64 * MiB, **allocator: int
) -> tuple[DeviceArenaPool, FakeDeviceAllocator, FakeDeviceRegistrar]:
    devices = FakeDeviceAllocator(**allocator)
    registrar = FakeDeviceRegistrar()
    pool = DeviceArenaPool(0, devices, registrar, RegistrationBudget(budget_bytes), arena_bytes)
    return pool, devices, registrar


def test_fallback_reasons_are_the_counted_labels() -> None:
    """Every pool fallback reason is a velo_device_staged label (primed at 0)."""
    assert typing.get_args(DeviceFallbackReason) == DEVICE_STAGING_REASONS


def test_the_arena_is_allocated_and_registered_once_as_cuda_memory() -> None:
    pool, devices, registrar = make_pool()
    assert pool.open() is None and pool.open() is None  # the second open is a no-op
    arena = pool.arena
    assert arena is not None
    assert registrar.mapped == [(arena.address, 8 * MiB, MemoryType.CUDA)]
    assert devices.live_bytes(0) == 8 * MiB and pool.budget.registered_bytes == 8 * MiB
    pool.validate()
    pool.close()


def test_requests_are_carved_from_the_arena_and_reused() -> None:
    """Placements are granule ranges of the one arena: no new allocation or registration;
    a freed range is reused; the views are the arena's bytes."""
    pool, devices, registrar = make_pool()
    pool.open()
    first = pool.allocate(3 * MiB)
    second = pool.allocate(100)
    assert isinstance(first, DevicePlacement) and isinstance(second, DevicePlacement)
    arena = pool.arena
    assert arena is not None
    assert arena.address <= first.address < second.address < arena.address + arena.nbytes
    assert second.offset_bytes % GRANULE_BYTES == 0
    pool.view(second)[:] = 7  # a write through the view lands in the arena
    arena_bytes = arena.memory.owner
    assert np.all(arena_bytes[second.offset_bytes : second.offset_bytes + 100] == 7)
    pool.validate()
    pool.free(first)
    again = pool.allocate(3 * MiB)
    assert isinstance(again, DevicePlacement) and again.offset_bytes == first.offset_bytes
    assert len(registrar.mapped) == 1 and devices.live_bytes(0) == 8 * MiB
    pool.free(again)
    pool.free(second)
    assert pool.live_placements == 0
    pool.validate()
    pool.close()


def test_a_full_arena_falls_back_and_never_grows() -> None:
    pool, devices, _ = make_pool(arena_bytes=4 * MiB)
    pool.open()
    whole = pool.allocate(4 * MiB)
    assert isinstance(whole, DevicePlacement)
    short = pool.allocate(1)
    assert isinstance(short, DeviceFallback) and short.reason == "gpu_pool_exhausted"
    assert devices.live_bytes(0) == 4 * MiB
    pool.free(whole)
    pool.close()


@pytest.mark.parametrize(
    ("setup", "reason", "detail"),
    [
        ("over_budget", "gpu_budget", "over the budget"),
        ("out_of_memory", "no_gpu_arena", "CUDA out of memory"),
        ("ucx_without_cuda", "no_gpu_arena", "registration failed"),
    ],
)
def test_a_pool_that_cannot_open_falls_back_with_why(setup: str, reason: str, detail: str) -> None:
    """The budget refuses, the GPU is full, or UCX cannot map CUDA memory: nothing stays
    allocated or charged, and every request falls back with the same reason."""
    pool, devices, registrar = make_pool(
        budget_bytes=4 * MiB if setup == "over_budget" else 64 * MiB,
        capacity_bytes=MiB if setup == "out_of_memory" else 1 << 40,
    )
    registrar.fail_registrations = 1 if setup == "ucx_without_cuda" else 0
    why = pool.open()
    assert why is not None and why.reason == reason and detail in why.detail
    assert devices.live_bytes(0) == 0 and pool.budget.registered_bytes == 0
    later = pool.allocate(MiB)
    assert isinstance(later, DeviceFallback) and later.reason == "no_gpu_arena"
    assert detail in later.detail
    pool.validate()


def test_close_unregisters_before_freeing_and_leaks_on_failure() -> None:
    """A failed unregister leaves the arena allocated, registered and charged (UCX may
    still serve it); a retry that succeeds frees it all."""
    pool, devices, registrar = make_pool()
    pool.open()
    registrar.fail_unregistrations = 1
    with pytest.raises(RuntimeError, match="ucp_mem_unmap"):
        pool.close()
    assert registrar.live_registrations == 1 and devices.live_bytes(0) == 8 * MiB
    assert pool.budget.registered_bytes == 8 * MiB and pool.arena is not None
    pool.close()
    assert registrar.live_registrations == 0 and devices.live_bytes(0) == 0
    assert pool.budget.registered_bytes == 0


def test_double_free_and_stale_placements_are_refused() -> None:
    pool, _, _ = make_pool()
    pool.open()
    placement = pool.allocate(MiB)
    assert isinstance(placement, DevicePlacement)
    pool.free(placement)
    with pytest.raises(KeyError):
        pool.free(placement)
    with pytest.raises(KeyError):
        pool.view(placement)
    pool.close()


def test_config_is_checked() -> None:
    devices = FakeDeviceAllocator()
    budget = RegistrationBudget(MiB)
    with pytest.raises(ConfigError, match="multiple of 4 KiB"):
        DeviceArenaPool(0, devices, FakeDeviceRegistrar(), budget, 1000)
    with pytest.raises(ConfigError, match="must map cuda memory"):
        DeviceArenaPool(0, devices, FakeDeviceRegistrar(MemoryType.HOST), budget, 4 * MiB)


def test_each_gpu_has_its_own_pool_and_budget() -> None:
    """Two GPUs: each arena on its own device, charged to its own budget (never the host's);
    a tensor on a GPU without an arena falls back."""
    arenas = GpuArenas(FakeDeviceAllocator(devices=2), FakeDeviceRegistrar(), 4 * MiB, 6 * MiB)
    assert arenas.open() == {}
    assert arenas.registered_bytes() == {0: 4 * MiB, 1: 4 * MiB}
    on_gpu1 = arenas.allocate(1, MiB)
    assert isinstance(on_gpu1, DevicePlacement) and on_gpu1.device_index == 1
    assert arenas.pools[0].live_placements == 0
    missing = arenas.allocate(2, MiB)
    assert isinstance(missing, DeviceFallback) and missing.reason == "no_gpu_arena"
    arenas.free(on_gpu1)
    arenas.close()
    assert arenas.registered_bytes() == {0: 0, 1: 0}


def test_a_node_without_gpu_arenas_falls_back() -> None:
    arenas = GpuArenas.none()
    assert arenas.open() == {} and arenas.pools == {}
    got = arenas.allocate(0, MiB)
    assert isinstance(got, DeviceFallback) and got.reason == "no_gpu_arena"
    arenas.close()


def test_the_torch_allocator_refuses_loudly_without_a_gpu() -> None:
    """The real allocator imports torch only when built, and says why it cannot be."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this process has a CUDA device: tests/gpu covers the real allocator")
    from ray_velo.memory.device import TorchCudaAllocator

    with pytest.raises(RuntimeError, match="no CUDA device"):
        TorchCudaAllocator()


@settings(max_examples=60)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 3 * MiB)), max_size=40))
def test_any_sequence_of_allocations_and_frees_keeps_the_books(
    steps: list[tuple[bool, int]],
) -> None:
    """Model: allocate (True) or free the oldest live placement (False), validating after
    every step; placements never overlap; closing gives every byte and charge back."""
    pool, devices, registrar = make_pool(arena_bytes=8 * MiB)
    assert pool.open() is None
    live: list[DevicePlacement] = []
    for allocate, nbytes in steps:
        if allocate:
            got = pool.allocate(nbytes)
            if isinstance(got, DevicePlacement):
                live.append(got)
            else:
                assert got.reason == "gpu_pool_exhausted"
        elif live:
            pool.free(live.pop(0))
        pool.validate()
        spans = sorted((p.offset_bytes, p.offset_bytes + p.nbytes) for p in live)
        assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
    pool.close()
    assert (devices.live_bytes(0), registrar.live_registrations) == (0, 0)
    assert pool.budget.registered_bytes == 0
