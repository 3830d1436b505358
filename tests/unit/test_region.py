"""Caller-owned regions: anchors, the copy gate against the latch, drain, release, budget."""

from __future__ import annotations

import ctypes
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ray_velo.config import RdmaPoolConfig
from ray_velo.errors import BudgetExceeded, RegionDeregistered
from ray_velo.memory.arena import PAGE_BYTES
from ray_velo.memory.pool import (
    ArenaPool,
    Fallback,
    NoopRegistrar,
    Placement,
    Registration,
    RegistrationBudget,
)
from ray_velo.memory.region import (
    COPY_GATE_CHUNK_BYTES,
    Drained,
    DrainTimedOut,
    Region,
    RegionGuard,
    RegionState,
)

MiB = 1 << 20


class Memory:
    """Caller-owned memory: a ctypes buffer with a stable address."""

    def __init__(self, nbytes: int, fill: bytes = b"") -> None:
        self.buffer = ctypes.create_string_buffer(nbytes)
        if fill:
            ctypes.memmove(self.buffer, fill, min(len(fill), nbytes))
        self.address = ctypes.addressof(self.buffer)
        self.nbytes = nbytes


class RecordingRegistrar(NoopRegistrar):
    """A no-op registrar that logs calls and can fail on request."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []
        self.fail_register = False
        self.fail_unregister = False

    def register(self, address: int, nbytes: int) -> Any:
        if self.fail_register:
            raise RuntimeError("ucp_mem_map failed")
        self.events.append("register")
        return super().register(address, nbytes)

    def unregister(self, registration: Registration) -> None:
        if self.fail_unregister:
            raise RuntimeError("unmap not confirmed")
        self.events.append("unregister")
        super().unregister(registration)


def _dereg_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("ray_velo-region-dereg")]


@pytest.fixture(autouse=True)
def no_thread_left() -> Iterator[None]:
    """Background deregistrations end within the test that started them."""
    yield
    for thread in _dereg_threads():
        thread.join(5)
    assert _dereg_threads() == []


def make_region(
    nbytes: int = 3 * PAGE_BYTES + 100,
    *,
    offset_in_page: int = 123,
    budget: RegistrationBudget | None = None,
    fill: bytes = b"",
    on_released: Callable[[], None] | None = None,
) -> tuple[Region, RecordingRegistrar, Memory]:
    # Register from an unaligned pointer, so effective range and caller range differ.
    memory = Memory(nbytes + offset_in_page + PAGE_BYTES)
    start = memory.address + offset_in_page
    if fill:
        ctypes.memmove(start, fill, min(len(fill), nbytes))
    registrar = RecordingRegistrar()
    region = Region(start, nbytes, registrar, budget, on_released=on_released)
    return region, registrar, memory


def test_effective_range_is_whole_pages_and_offsets_are_the_callers() -> None:
    """register_data_in_region over an unaligned allocation: the backend pins whole pages
    (effective_range), but offsets count from the registered pointer and stop at nbytes,
    so the caller cannot name a pinned byte outside its own allocation."""
    payload = bytes(range(256)) * 64
    budget = RegistrationBudget(1 * MiB)
    region, _, _memory = make_region(len(payload), budget=budget, fill=payload)
    start, end = region.effective_range
    assert start % PAGE_BYTES == 0 and end % PAGE_BYTES == 0
    assert start <= region.address and region.address + region.nbytes <= end
    assert region.charged_bytes == end - start == budget.registered_bytes
    assert region.copy_out(0, 16) == payload[:16]
    assert region.copy_out(100, 50) == payload[100:150]
    assert region.copy_out(len(payload) - 1, 1) == payload[-1:]
    assert region.copy_out(5, 0) == b""
    with pytest.raises(ValueError):
        region.copy_out(len(payload) - 1, 2)  # inside the pinned page, outside the allocation
    with pytest.raises(ValueError):
        region.copy_out(-1, 1)
    region.check_range(0, len(payload))
    assert isinstance(region.deregister(1.0), Drained)
    assert budget.registered_bytes == 0


def test_large_copy_goes_through_the_gate_in_pieces() -> None:
    """A chunked read larger than one gate piece copies exactly, into a fresh buffer
    (copy_out) or the caller's (copy_into)."""
    nbytes = 2 * COPY_GATE_CHUNK_BYTES + 12345
    payload = bytes((i * 7) & 0xFF for i in range(nbytes))
    region, _, _memory = make_region(nbytes, fill=payload)
    assert region.copy_out(0, nbytes) == payload
    dest = bytearray(nbytes - 10)
    assert region.copy_into(10, dest) == nbytes - 10
    assert bytes(dest) == payload[10:]
    assert region.copy_into(0, bytearray()) == 0
    with pytest.raises(ValueError):
        region.copy_into(11, bytearray(nbytes - 10))
    region.deregister(1.0)


def test_unregister_without_anchors_is_drained_and_fires_deregistered() -> None:
    """The caller unregisters an idle region: Drained, the backend confirms the unmap, the
    budget is released, and deregistered() fires; only then may the caller free."""
    budget = RegistrationBudget(1 * MiB)
    region, registrar, _memory = make_region(budget=budget)
    guard = RegionGuard(region)
    watch = guard.watch()
    signal = guard.deregistered()
    assert not signal.is_set() and not signal.wait(0.01)
    assert watch.effective_range == guard.effective_range == region.effective_range
    with region.enter():
        assert region.in_flight == 1
    assert region.in_flight == 0
    assert guard.unregister(1.0) == Drained()
    assert registrar.events == ["register", "unregister"]
    assert signal.is_set() and watch.deregistered().wait(0)
    assert watch.state is RegionState.DEREGISTERED
    assert budget.registered_bytes == 0
    with pytest.raises(RegionDeregistered):
        guard.unregister(1.0)  # the guard is consumed
    with pytest.raises(RegionDeregistered):
        region.enter()
    with pytest.raises(RegionDeregistered):
        region.copy_out(0, 1)


def test_unregister_with_an_anchor_held_times_out_and_still_releases() -> None:
    """A slot still anchors the region when the caller unregisters with a 100 ms timeout:
    DrainTimedOut (velo did not wait), the memory is released all the same, and the slot's
    later chunked reads refuse instead of touching freed memory."""
    region, registrar, _memory = make_region()
    guard = RegionGuard(region)
    anchor = region.enter()
    started = time.monotonic()
    result = guard.unregister(0.1)
    assert time.monotonic() - started >= 0.1
    assert result == DrainTimedOut(in_flight=1)
    assert registrar.events[-1] == "unregister"
    assert guard.deregistered().is_set()
    with pytest.raises(RegionDeregistered):
        region.copy_out(0, 8)
    anchor.release()
    anchor.release()  # idempotent
    assert region.in_flight == 0


def test_anchor_released_during_the_drain_gives_drained() -> None:
    """The last in-flight transfer ends while unregister waits: it returns Drained as soon
    as the anchor goes, well before the timeout."""
    region, _, _memory = make_region()
    anchor = region.enter()
    timer = threading.Timer(0.05, anchor.release)
    timer.start()
    started = time.monotonic()
    assert region.deregister(5.0) == Drained()
    assert time.monotonic() - started < 4.0
    timer.join()


def test_enter_after_the_latch_refuses_and_leaves_no_count() -> None:
    """A slot stages into a region whose unregister has latched (it is draining another
    anchor): enter() refuses with RegionDeregistered and the count it took is undone, so
    the drain is not held up by it."""
    region, _, _memory = make_region()
    anchor = region.enter()
    done: list[object] = []
    worker = threading.Thread(target=lambda: done.append(region.deregister(5.0)))
    worker.start()
    deadline = time.monotonic() + 5
    while region.state is RegionState.REGISTERED and time.monotonic() < deadline:
        time.sleep(0.001)
    assert region.state is RegionState.DEREGISTERING
    with pytest.raises(RegionDeregistered):
        region.enter()
    assert region.in_flight == 1  # only the first anchor
    anchor.release()
    worker.join(5)
    assert done == [Drained()]


class BlockingMemmove:
    """Stands in for ctypes.memmove: the first ``block`` calls pause until released."""

    def __init__(self, block: int = 1) -> None:
        self.real = ctypes.memmove
        self.started = threading.Event()
        self.proceed = threading.Event()
        self.block = block
        self.calls = 0

    def __call__(self, dst: Any, src: Any, count: int) -> Any:
        self.calls += 1
        if self.calls <= self.block:
            self.started.set()
            assert self.proceed.wait(10)
        return self.real(dst, src, count)


def test_copy_in_progress_delays_the_latch_and_later_copies_refuse(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A chunked read is copying when the caller unregisters: the unmap waits for that copy
    (it completes with the right bytes), while a read that starts after the latch refuses."""
    payload = b"p" * 1000 + b"q" * 1000
    region, registrar, _memory = make_region(2000, fill=payload)
    memmove = BlockingMemmove()
    monkeypatch.setattr(ctypes, "memmove", memmove)
    dest = bytearray(2000)
    copier = threading.Thread(target=region.copy_into, args=(0, dest))
    copier.start()
    assert memmove.started.wait(5)

    results: list[object] = []
    unregistering = threading.Thread(target=lambda: results.append(region.deregister(5.0)))
    unregistering.start()
    deadline = time.monotonic() + 5
    while region.state is RegionState.REGISTERED and time.monotonic() < deadline:
        time.sleep(0.001)
    assert region.state is RegionState.DEREGISTERING  # latched
    with pytest.raises(RegionDeregistered):
        region.copy_out(0, 10)  # started after the latch
    time.sleep(0.05)
    assert "unregister" not in registrar.events  # the copy in progress holds the unmap back
    assert results == []

    memmove.proceed.set()
    copier.join(5)
    unregistering.join(5)
    assert bytes(dest) == payload
    assert results == [Drained()]
    assert registrar.events == ["register", "unregister"]


def test_latch_between_pieces_stops_a_long_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The latch falls while a two-piece read copies its first 512 KiB: that piece finishes,
    the second refuses, and the read fails with RegionDeregistered."""
    nbytes = COPY_GATE_CHUNK_BYTES + 100
    region, _, _memory = make_region(nbytes)
    memmove = BlockingMemmove()
    monkeypatch.setattr(ctypes, "memmove", memmove)
    errors: list[BaseException] = []

    def read() -> None:
        try:
            region.copy_out(0, nbytes)
        except BaseException as exc:
            errors.append(exc)

    copier = threading.Thread(target=read)
    copier.start()
    assert memmove.started.wait(5)
    unregistering = threading.Thread(target=region.deregister, args=(5.0,))
    unregistering.start()
    deadline = time.monotonic() + 5
    while region.state is RegionState.REGISTERED and time.monotonic() < deadline:
        time.sleep(0.001)
    memmove.proceed.set()
    copier.join(5)
    unregistering.join(5)
    assert memmove.calls == 1
    assert len(errors) == 1 and isinstance(errors[0], RegionDeregistered)
    assert region.state is RegionState.DEREGISTERED


def test_dropped_guard_deregisters_in_the_background(caplog: pytest.LogCaptureFixture) -> None:
    """The caller drops its guard with a slot still anchored: the drop returns at once, logs
    a warning, and the background deregistration unmaps after drop_dereg_timeout."""
    region, registrar, _memory = make_region()
    guard = RegionGuard(region, drop_dereg_timeout=0.2)
    watch = guard.watch()
    anchor = region.enter()
    with caplog.at_level(logging.WARNING, logger="ray_velo.memory.region"):
        started = time.monotonic()
        guard.close()
        assert time.monotonic() - started < 0.1
        guard.close()  # idempotent
    assert any("dropped without unregister" in r.getMessage() for r in caplog.records)
    assert not watch.deregistered().is_set()
    assert watch.deregistered().wait(5)
    assert registrar.events[-1] == "unregister"
    with pytest.raises(RegionDeregistered):
        guard.unregister(1.0)
    anchor.release()


def test_garbage_collected_guard_deregisters() -> None:
    """A guard that simply goes out of scope (no unregister, no close) still releases."""
    released = threading.Event()
    region, _, _memory = make_region(on_released=released.set)
    guard = RegionGuard(region, drop_dereg_timeout=1.0)
    signal = guard.deregistered()
    del guard
    gc.collect()
    assert signal.wait(5)
    assert released.is_set()


def test_on_released_runs_after_the_confirmed_unmap() -> None:
    """register_owned's buffer goes back only after the unmap is confirmed, just before the
    signal fires."""
    seen: list[tuple[str, bool]] = []
    holder: dict[str, Any] = {}

    def released() -> None:
        seen.append((holder["registrar"].events[-1], holder["region"].signal.is_set()))

    region, registrar, _memory = make_region(on_released=released)
    holder.update(region=region, registrar=registrar)
    region.deregister(1.0)
    assert seen == [("unregister", False)]
    assert region.signal.is_set()


def test_unconfirmed_unmap_never_fires_deregistered() -> None:
    """The backend cannot confirm the unmap: unregister raises, the region stays latched,
    the budget stays charged and deregistered() never fires; the caller must not free."""
    budget = RegistrationBudget(1 * MiB)
    region, registrar, _memory = make_region(budget=budget)
    registrar.fail_unregister = True
    guard = RegionGuard(region)
    with pytest.raises(RuntimeError):
        guard.unregister(0.1)
    assert region.state is RegionState.DEREGISTERING
    assert not guard.deregistered().is_set()
    assert budget.registered_bytes == region.charged_bytes


def test_registration_failure_gives_the_budget_back() -> None:
    """The backend refuses the registration: the error reaches the caller and the budget
    charge made for it is returned."""
    budget = RegistrationBudget(1 * MiB)
    memory = Memory(PAGE_BYTES)
    registrar = RecordingRegistrar()
    registrar.fail_register = True
    with pytest.raises(RuntimeError):
        Region(memory.address, PAGE_BYTES, registrar, budget)
    assert budget.registered_bytes == 0
    with pytest.raises(ValueError):
        Region(memory.address, 0, registrar, budget)


def test_budget_is_shared_between_pool_and_regions(tmp_path: Path) -> None:
    """Pool arenas and external regions draw on one registered_bytes_budget: a region that
    does not fit raises BudgetExceeded (register_data_in_region returns errors), while the
    pool falls back with reason "budget"; unregistering the region makes room again."""
    shm = tmp_path / "shm"
    shm.mkdir()
    budget = RegistrationBudget(3 * MiB)
    config = RdmaPoolConfig(
        initial_arena_bytes=1 * MiB,
        max_arena_bytes=4 * MiB,
        dedicated_arena_min=4 * MiB,
        registered_bytes_budget=3 * MiB,
        retain_arena_bytes=1 * MiB,
    )
    registrar = NoopRegistrar()
    pool = ArenaPool(config, shm, 0xB0B, registrar, budget, prefault=False)
    try:
        first = pool.allocate(1 * MiB, 0.0)  # 1 MiB arena
        assert isinstance(first, Placement)
        memory = Memory(2 * MiB + PAGE_BYTES)
        start = memory.address - memory.address % PAGE_BYTES + PAGE_BYTES
        region = Region(start, 2 * MiB, registrar, budget)  # exactly fills the budget
        assert budget.registered_bytes == 3 * MiB
        with pytest.raises(BudgetExceeded) as info:
            Region(start, PAGE_BYTES, registrar, budget)
        assert info.value.fields == {
            "requested_bytes": PAGE_BYTES,
            "registered_bytes": 3 * MiB,
            "budget_bytes": 3 * MiB,
        }
        result = pool.allocate(1 * MiB, 0.0)  # a 2 MiB arena does not fit
        assert isinstance(result, Fallback) and result.reason == "budget"
        pool.validate()  # tolerates the region's share of the budget
        RegionGuard(region).unregister(1.0)
        assert budget.registered_bytes == 1 * MiB
        second = pool.allocate(1 * MiB, 0.0)
        assert isinstance(second, Placement) and second.arena.nbytes == 2 * MiB
        pool.validate()
    finally:
        pool.close()
    assert budget.registered_bytes == 0
    assert registrar.live_registrations == 0
    assert not [p for p in shm.iterdir() if p.name.startswith("ray_velo-")]
