"""The arena pool: growth, dedicated arenas, the budget, may_map, reclamation and teardown order."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from ray_velo.config import RdmaPoolConfig
from ray_velo.memory.allocator import GRANULE_BYTES, OffsetAllocator
from ray_velo.memory.arena import PAGE_BYTES, SegmentMap
from ray_velo.memory.pool import (
    ArenaPool,
    Fallback,
    NoopRegistrar,
    Placement,
    Registration,
    RegistrationBudget,
    bin_reserved_granules,
    page_range,
)
from tests.unit.conftest import segments as _segments

MiB = 1 << 20

OWNER = 0xFEED_0000_0000_0001


def small_config(**changes: object) -> RdmaPoolConfig:
    """The default shape scaled down: 1 MiB first arena, 4 MiB cap, 4 MiB dedicated."""
    fields: dict[str, object] = {
        "initial_arena_bytes": 1 * MiB,
        "max_arena_bytes": 4 * MiB,
        "dedicated_arena_min": 4 * MiB,
        "registered_bytes_budget": 64 * MiB,
        "arena_reclaim_after": None,
        "retain_arena_bytes": 1 * MiB,
        "warm_dedicated_bytes": 0,  # the spec's behaviour; warm reuse has its own tests
    }
    fields.update(changes)
    return RdmaPoolConfig(**fields)  # type: ignore[arg-type]


@dataclass(frozen=True)
class FakeRegistration:
    address: int
    nbytes: int
    packed_key: bytes
    effective_range: tuple[int, int]


class RecordingRegistrar:
    """Records register/unregister, and what was true at each unregister."""

    def __init__(self, budget: RegistrationBudget | None = None) -> None:
        self.events: list[tuple[str, int]] = []
        self.live: set[int] = set()
        self.budget = budget
        self.unregister_saw: list[tuple[bool, int | None]] = []  # (file exists, budget bytes)
        self.paths: dict[int, str] = {}
        self.fail_register = False
        self.fail_unregister = False

    def register(self, address: int, nbytes: int) -> FakeRegistration:
        if self.fail_register:
            raise RuntimeError("ucp_mem_map failed")
        self.events.append(("register", address))
        self.live.add(address)
        return FakeRegistration(address, nbytes, b"key", page_range(address, nbytes))

    def unregister(self, registration: Registration) -> None:
        assert isinstance(registration, FakeRegistration)
        if self.fail_unregister:
            raise RuntimeError("ucp_mem_unmap not confirmed")
        path = self.paths.get(registration.address)
        self.unregister_saw.append(
            (
                path is not None and os.path.exists(path),
                None if self.budget is None else self.budget.registered_bytes,
            )
        )
        self.events.append(("unregister", registration.address))
        self.live.remove(registration.address)


def make_pool(
    shm_dir: Path,
    config: RdmaPoolConfig | None = None,
    *,
    budget_bytes: int | None = 64 * MiB,
) -> tuple[ArenaPool, RecordingRegistrar, RegistrationBudget | None]:
    budget = None if budget_bytes is None else RegistrationBudget(budget_bytes)
    registrar = RecordingRegistrar(budget)
    pool = ArenaPool(config or small_config(), shm_dir, OWNER, registrar, budget, prefault=False)
    return pool, registrar, budget


def placed(result: Placement | Fallback, registrar: RecordingRegistrar | None = None) -> Placement:
    assert isinstance(result, Placement), result
    if registrar is not None:
        registrar.paths[result.arena.address] = result.arena.path
    return result


def test_growth_sequence_doubles_up_to_the_cap(shm_dir: Path) -> None:
    """A busy owner stages 1 MiB payloads: arenas of 1, 2, 4 and 4 MiB are mapped (the first
    is initial_arena_bytes, each later one doubles the newest, capped at max_arena_bytes),
    each registered once and charged to the budget."""
    pool, registrar, budget = make_pool(shm_dir)
    assert budget is not None
    held = []
    for _ in range(1 + 2 + 4 + 4):
        held.append(placed(pool.allocate(1 * MiB, 0.0), registrar))
        pool.validate()
    assert pool.pooled_arena_sizes == [1 * MiB, 2 * MiB, 4 * MiB, 4 * MiB]
    assert pool.arenas == 4
    assert pool.registrations_total == {"arena": 4}
    assert pool.mapped_bytes == 11 * MiB == pool.registered_bytes == budget.registered_bytes
    assert pool.used_bytes == 11 * MiB
    assert len(_segments(shm_dir)) == 4
    assert all(not p.dedicated and p.allocation is not None for p in held)
    for placement in held:
        pool.free(placement, 1.0)
        pool.validate()
    assert pool.used_bytes == 0
    assert pool.arenas == 4  # no reclamation configured: empty arenas stay registered
    pool.close()
    pool.validate()
    assert registrar.live == set()
    assert budget.registered_bytes == 0


def test_default_first_arena_is_64_mib(shm_dir: Path) -> None:
    """With the spec's defaults one small pinned payload maps one 64 MiB arena."""
    pool, registrar, _ = make_pool(shm_dir, RdmaPoolConfig(), budget_bytes=1 << 30)
    placement = placed(pool.allocate(100, 0.0), registrar)
    assert pool.pooled_arena_sizes == [64 * MiB]
    assert placement.capacity_bytes == GRANULE_BYTES
    pool.validate()
    pool.close()


def test_placement_is_shared_memory_other_processes_can_map(shm_dir: Path) -> None:
    """The producer writes through the placement's view; a consumer on the node maps the
    arena file and reads the bytes at the same offset; the address is arena base + offset."""
    pool, registrar, _ = make_pool(shm_dir)
    first = placed(pool.allocate(5000, 0.0), registrar)
    second = placed(pool.allocate(10, 0.0), registrar)
    assert second.offset_bytes >= first.capacity_bytes
    assert second.offset_bytes % GRANULE_BYTES == 0
    assert second.address == second.arena.address + second.offset_bytes
    assert second.registration is not None and second.registration.packed_key == b"key"
    view = second.view()
    view[:] = b"0123456789"
    view.release()
    segments = SegmentMap()
    try:
        assert bytes(segments.view(second.arena.path, second.offset_bytes, 10)) == b"0123456789"
    finally:
        segments.close_all()
    pool.close()


def test_dedicated_arena_is_unmapped_as_soon_as_it_is_freed(shm_dir: Path) -> None:
    """A 4 MiB object (>= dedicated_arena_min) gets its own arena sized to the request
    (rounded to pages); freeing it unregisters (confirmed, while the file still exists and
    before the budget drops), unmaps and unlinks at once, with no timer."""
    pool, registrar, budget = make_pool(shm_dir)
    assert budget is not None
    nbytes = 4 * MiB + 123
    placement = placed(pool.allocate(nbytes, 0.0), registrar)
    pool.validate()
    assert placement.dedicated and placement.allocation is None
    assert placement.offset_bytes == 0
    assert placement.arena.nbytes == -(-nbytes // PAGE_BYTES) * PAGE_BYTES
    assert pool.pooled_arena_sizes == []
    assert budget.registered_bytes == placement.arena.nbytes
    assert pool.used_bytes == placement.arena.nbytes
    path = placement.arena.path
    pool.free(placement, 1.0)
    pool.validate()
    assert not os.path.exists(path)
    assert placement.arena.closed
    assert pool.arenas == 0
    assert budget.registered_bytes == 0
    assert registrar.unregister_saw == [(True, placement.arena.nbytes)]
    assert registrar.live == set()
    with pytest.raises(ValueError):
        pool.free(placement, 2.0)  # double free
    pool.close()


def test_budget_fallback_never_raises(shm_dir: Path) -> None:
    """The registered-bytes budget is spent: pinned staging gets Fallback("budget") and maps
    nothing; bytes that fit an arena already mapped are still placed."""
    pool, registrar, budget = make_pool(shm_dir, budget_bytes=2 * MiB)
    assert budget is not None
    first = placed(pool.allocate(512 * 1024, 0.0), registrar)  # maps the 1 MiB arena
    result = pool.allocate(1 * MiB, 0.0)  # would map a 2 MiB arena: 3 MiB > 2 MiB
    assert isinstance(result, Fallback) and result.reason == "budget"
    assert result.requested_bytes == 1 * MiB
    assert pool.arenas == 1 and len(_segments(shm_dir)) == 1
    assert budget.registered_bytes == 1 * MiB
    dedicated = pool.allocate(8 * MiB, 0.0)
    assert isinstance(dedicated, Fallback) and dedicated.reason == "budget"
    second = placed(pool.allocate(256 * 1024, 0.0), registrar)  # fits the mapped arena
    pool.validate()
    pool.free(first, 1.0)
    pool.free(second, 1.0)
    pool.close()


def test_may_map_false_uses_only_mapped_arenas(shm_dir: Path) -> None:
    """Transparent staging inside a send never maps an arena: with none mapped it falls back
    (pool_exhausted); after one explicit pinned staging mapped the first arena, transparent
    payloads use it, and when it is full they fall back instead of growing the pool."""
    pool, registrar, _ = make_pool(shm_dir)
    result = pool.allocate(300 * 1024, 0.0, may_map=False)
    assert isinstance(result, Fallback) and result.reason == "pool_exhausted"
    assert pool.arenas == 0 and _segments(shm_dir) == []

    explicit = placed(pool.allocate(300 * 1024, 0.0), registrar)
    transparent = placed(pool.allocate(300 * 1024, 0.0, may_map=False), registrar)
    assert transparent.arena is explicit.arena
    full = pool.allocate(600 * 1024, 0.0, may_map=False)
    assert isinstance(full, Fallback) and full.reason == "pool_exhausted"
    big = pool.allocate(4 * MiB, 0.0, may_map=False)  # would need a dedicated arena
    assert isinstance(big, Fallback) and big.reason == "pool_exhausted"
    assert pool.arenas == 1
    pool.validate()
    pool.close()


def test_shm_too_small_and_registration_failure_fall_back(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/dev/shm too small for the next arena, or a registration the backend refuses: the
    call falls back with pool_exhausted, the budget charge is given back, no file remains."""
    pool, registrar, budget = make_pool(shm_dir)
    assert budget is not None
    real_statvfs = os.statvfs

    class Full:
        f_frsize = PAGE_BYTES
        f_bavail = 1

    monkeypatch.setattr(os, "statvfs", lambda path: Full())
    result = pool.allocate(1000, 0.0)
    assert isinstance(result, Fallback) and result.reason == "pool_exhausted"
    assert "shared-memory directory" in result.detail
    monkeypatch.setattr(os, "statvfs", real_statvfs)
    assert budget.registered_bytes == 0

    registrar.fail_register = True
    result = pool.allocate(1000, 0.0)
    assert isinstance(result, Fallback) and result.reason == "pool_exhausted"
    assert "registration failed" in result.detail
    assert budget.registered_bytes == 0 and pool.arenas == 0
    pool.validate()
    registrar.fail_register = False
    placed(pool.allocate(1000, 0.0), registrar)
    pool.close()


def test_reclaim_newest_first_keeps_the_retain_floor(shm_dir: Path) -> None:
    """A burst mapped 1, 2 and 4 MiB arenas, then everything was freed. After
    arena_reclaim_after the sweep unmaps the newest first and stops at retain_arena_bytes:
    the small first arena survives as the warm floor, and no timer is wanted after that."""
    config = small_config(max_arena_bytes=8 * MiB, arena_reclaim_after=10.0)
    pool, registrar, budget = make_pool(shm_dir, config)
    assert budget is not None
    held = [placed(pool.allocate(1 * MiB, 0.0), registrar) for _ in range(1 + 2 + 4)]
    assert pool.pooled_arena_sizes == [1 * MiB, 2 * MiB, 4 * MiB]
    assert pool.next_reclaim_deadline(0.0) is None  # nothing empty
    for placement in held:
        pool.free(placement, 100.0)
        pool.validate()
    assert pool.next_reclaim_deadline(100.0) == 110.0
    assert pool.reclaim(105.0) == 0
    newest, middle = held[-1].arena, held[1].arena
    expected = [("unregister", newest.address), ("unregister", middle.address)]
    assert pool.reclaim(110.0) == 6 * MiB
    pool.validate()
    assert pool.pooled_arena_sizes == [1 * MiB]
    assert pool.arenas_reclaimed == 2
    assert registrar.events[-2:] == expected  # newest first
    assert [saw[0] for saw in registrar.unregister_saw] == [True, True]  # file still there
    assert newest.closed and middle.closed and not held[0].arena.closed
    assert budget.registered_bytes == 1 * MiB
    assert pool.next_reclaim_deadline(200.0) is None  # only the floor is left
    assert pool.reclaim(1000.0) == 0
    pool.close()


def test_reclaim_order_is_newest_first(shm_dir: Path) -> None:
    """Unregistration order of a reclaim sweep: the newest arena goes first."""
    config = small_config(max_arena_bytes=8 * MiB, arena_reclaim_after=1.0, retain_arena_bytes=0)
    pool, registrar, _ = make_pool(shm_dir, config)
    held = [placed(pool.allocate(1 * MiB, 0.0), registrar) for _ in range(3)]
    arenas = [held[0].arena, held[1].arena]
    addresses = [a.address for a in arenas]
    for placement in held:
        pool.free(placement, 0.0)
    assert pool.reclaim(1.0) == 3 * MiB
    assert [address for kind, address in registrar.events if kind == "unregister"] == list(
        reversed(addresses)
    )
    pool.close()


def test_used_arena_is_never_reclaimed_and_reclaim_off_by_default(shm_dir: Path) -> None:
    """Registrations are not evicted on a timer: with arena_reclaim_after unset nothing is
    ever reclaimed, and with it set an arena holding a placement stays mapped."""
    pool, registrar, _ = make_pool(shm_dir)
    placement = placed(pool.allocate(10, 0.0), registrar)
    pool.free(placement, 0.0)
    assert pool.reclaim(1e9) == 0 and pool.next_reclaim_deadline(1e9) is None
    pool.close()

    config = small_config(arena_reclaim_after=1.0, retain_arena_bytes=0)
    pool, registrar, _ = make_pool(shm_dir, config)
    kept = placed(pool.allocate(10, 0.0), registrar)
    assert pool.reclaim(1e9) == 0 and pool.next_reclaim_deadline(1e9) is None
    pool.free(kept, 5.0)
    assert pool.next_reclaim_deadline(5.0) == 6.0
    placed(pool.allocate(10, 5.5), registrar)  # in use again: the deadline goes away
    assert pool.next_reclaim_deadline(5.5) is None
    assert pool.reclaim(1e9) == 0
    pool.close()


@pytest.mark.parametrize("emptied_at", [0.0, 0.3, 0.49, 0.5, 0.51, 0.99])
def test_reclaim_timing_between_one_and_two_intervals(shm_dir: Path, emptied_at: float) -> None:
    """The driver sweeps every arena_reclaim_after / 2: an arena that became empty at any
    moment is unmapped between one and two arena_reclaim_after intervals later."""
    after = 1.0
    config = small_config(arena_reclaim_after=after, retain_arena_bytes=0)
    pool, registrar, _ = make_pool(shm_dir, config)
    placement = placed(pool.allocate(10, 0.0), registrar)
    pool.free(placement, emptied_at)
    tick, unmapped_at = 0.0, None
    while unmapped_at is None and tick < 10.0:
        tick += after / 2
        if pool.reclaim(tick):
            unmapped_at = tick
        pool.validate()
    assert unmapped_at is not None
    assert after <= unmapped_at - emptied_at <= 2 * after
    pool.close()


def test_teardown_unregisters_before_unlinking(shm_dir: Path) -> None:
    """Pages outlive their registration: close() unregisters every arena (confirmed) while
    its file still exists and its budget is still charged, then unmaps, unlinks and releases
    the budget; it is idempotent, and the closed pool falls back and ignores frees."""
    pool, registrar, budget = make_pool(shm_dir)
    assert budget is not None
    small = placed(pool.allocate(1000, 0.0), registrar)
    dedicated = placed(pool.allocate(4 * MiB, 0.0), registrar)
    charged = budget.registered_bytes
    pool.close()
    pool.validate()
    assert [saw[0] for saw in registrar.unregister_saw] == [True, True]
    assert registrar.unregister_saw[0][1] == charged
    assert registrar.live == set() and budget.registered_bytes == 0
    assert small.arena.closed and dedicated.arena.closed
    pool.close()
    result = pool.allocate(10, 1.0)
    assert isinstance(result, Fallback) and result.reason == "pool_exhausted"
    pool.free(small, 1.0)  # no-op after close
    pool.free(dedicated, 1.0)


def test_unconfirmed_unregister_leaks_on_purpose(shm_dir: Path) -> None:
    """The backend cannot confirm an unmap: the arena stays mapped and charged (a leak is
    the safe failure; freeing pages UCX may still pin is the hazard)."""
    pool, registrar, budget = make_pool(shm_dir)
    assert budget is not None
    placement = placed(pool.allocate(4 * MiB, 0.0), registrar)
    registrar.fail_unregister = True
    pool.free(placement, 1.0)
    assert not placement.arena.closed and os.path.exists(placement.arena.path)
    assert pool.leaked_arenas == 1
    assert budget.registered_bytes == placement.arena.nbytes == pool.registered_bytes
    pool.validate()
    pool.close()
    placement.arena.close()  # the test's own cleanup of the leaked file


def test_frees_that_are_bugs_raise(shm_dir: Path) -> None:
    """A double free, or a placement from another pool, is a bookkeeping bug: ValueError."""
    pool, registrar, _ = make_pool(shm_dir)
    other, other_registrar, _ = make_pool(shm_dir)
    mine = placed(pool.allocate(10, 0.0), registrar)
    keep = placed(pool.allocate(10, 0.0), registrar)
    theirs = placed(other.allocate(10, 0.0), other_registrar)
    pool.free(mine, 1.0)
    with pytest.raises(ValueError):
        pool.free(mine, 1.0)
    with pytest.raises(ValueError):
        pool.free(theirs, 1.0)
    with pytest.raises(ValueError):
        pool.allocate(0, 1.0)
    pool.validate()
    pool.free(keep, 1.0)
    pool.close()
    other.close()


def test_plain_pool_has_no_registrar_and_no_budget(shm_dir: Path) -> None:
    """The agent's plain pool (register_data): same arenas, nothing registered or charged;
    a budget without a registrar is refused."""
    pool = ArenaPool(small_config(), shm_dir, OWNER, None, None, prefault=False)
    placement = pool.allocate(2 * MiB, 0.0)
    assert isinstance(placement, Placement) and placement.registration is None
    assert pool.registered_bytes == 0 and pool.registrations_total == {"arena": 0}
    pool.validate()
    pool.free(placement, 1.0)
    pool.close()
    with pytest.raises(ValueError):
        ArenaPool(small_config(), shm_dir, OWNER, None, RegistrationBudget(MiB), prefault=False)


def test_noop_registrar_books() -> None:
    """The no-op registrar pins whole pages on paper and refuses a double unregister."""
    registrar = NoopRegistrar()
    registration = registrar.register(PAGE_BYTES + 10, 20)
    assert registration.effective_range == (PAGE_BYTES, 2 * PAGE_BYTES)
    assert registrar.live_registrations == 1
    registrar.unregister(registration)
    with pytest.raises(ValueError):
        registrar.unregister(registration)
    assert registrar.live_registrations == 0


def test_budget_counts_whole_pages() -> None:
    """The budget charges what the kernel pins, whole pages, and refuses past the cap."""
    budget = RegistrationBudget(3 * PAGE_BYTES)
    assert budget.reserve(1)
    assert budget.registered_bytes == PAGE_BYTES
    assert budget.reserve(2 * PAGE_BYTES)
    assert not budget.reserve(1)
    assert budget.available_bytes == 0
    budget.release(1)
    assert budget.registered_bytes == 2 * PAGE_BYTES
    budget.adjust(2 * PAGE_BYTES)  # the backend pinned more than asked
    assert budget.registered_bytes == 4 * PAGE_BYTES and budget.available_bytes == 0
    with pytest.raises(ValueError):
        budget.release(5 * PAGE_BYTES)


def test_fresh_arena_sizing_serves_the_request() -> None:
    """A request larger than the geometric next arena maps one large enough: the pool's
    model of the allocator's bin rounding matches the allocator, and a fresh arena of that
    many granules serves the request (so "at least large enough" holds, and no more)."""
    for granules in [*range(1, 3000), 2**20 - 1, 2**20 + 1, 123_457, 9_999_999]:
        reserved = bin_reserved_granules(granules)
        assert granules <= reserved < granules + max(1, granules / 8)
        allocation = OffsetAllocator(reserved).allocate(granules)
        assert allocation is not None and allocation.size == reserved, granules


def test_request_larger_than_the_cap_still_gets_an_arena(shm_dir: Path) -> None:
    """dedicated_arena_min above max_arena_bytes: a 3 MiB request under it maps a pooled
    arena big enough for it (past the cap) rather than failing."""
    config = small_config(max_arena_bytes=1 * MiB, dedicated_arena_min=16 * MiB)
    pool, registrar, _ = make_pool(shm_dir, config)
    placement = placed(pool.allocate(3 * MiB + 5, 0.0), registrar)
    assert not placement.dedicated
    assert placement.arena.nbytes >= 3 * MiB + 5
    pool.validate()
    pool.close()


def test_a_send_does_not_wait_behind_a_registration(shm_dir: Path) -> None:
    """One thread maps and registers a new arena (slow ibv_reg_mr); meanwhile a transparent
    send on another thread allocates with may_map=False and answers at once."""
    pool, registrar, _ = make_pool(shm_dir)
    first = placed(pool.allocate(700 * 1024, 0.0), registrar)
    entered, proceed = threading.Event(), threading.Event()
    real_register = registrar.register

    def slow_register(address: int, nbytes: int) -> FakeRegistration:
        entered.set()
        assert proceed.wait(10)
        return real_register(address, nbytes)

    registrar.register = slow_register  # type: ignore[method-assign]
    results: list[Placement | Fallback] = []
    mapper = threading.Thread(target=lambda: results.append(pool.allocate(900 * 1024, 0.0)))
    mapper.start()
    try:
        assert entered.wait(10)
        started = time.monotonic()
        quick = placed(pool.allocate(100 * 1024, 0.0, may_map=False), registrar)
        no_room = pool.allocate(500 * 1024, 0.0, may_map=False)
        assert time.monotonic() - started < 1.0
        assert quick.arena is first.arena
        assert isinstance(no_room, Fallback) and no_room.reason == "pool_exhausted"
    finally:
        proceed.set()
        mapper.join(10)
    assert isinstance(results[0], Placement)
    assert pool.arenas == 2
    pool.validate()
    pool.close()


def test_emptied_dedicated_arena_is_reused_warm(shm_dir: Path) -> None:
    """With warm_dedicated_bytes set, a freed dedicated arena stays mapped and registered,
    and the next request of about its size (at most 1/8 smaller) reuses it: no new file,
    no new registration. A request it cannot serve maps a fresh arena."""
    pool, registrar, budget = make_pool(shm_dir, small_config(warm_dedicated_bytes=16 * MiB))
    assert budget is not None
    first = placed(pool.allocate(6 * MiB, 0.0), registrar)
    path = first.arena.path
    pool.free(first, 1.0)
    pool.validate()
    assert os.path.exists(path) and pool.used_bytes == 0
    assert budget.registered_bytes == first.arena.nbytes  # still registered: it is warm
    again = placed(pool.allocate(6 * MiB - 4096, 2.0), registrar)
    assert again.arena.path == path and pool.registrations_total["arena"] == 1
    other = placed(pool.allocate(12 * MiB, 3.0), registrar)  # too big for the warm one
    assert other.arena.path != path
    pool.free(again, 4.0)
    pool.free(other, 5.0)
    pool.validate()
    small = placed(pool.allocate(4 * MiB, 6.0), registrar)  # 6 MiB warm is > 1/8 too big
    assert small.arena.path != path
    pool.free(small, 7.0)
    pool.close()
    assert budget.registered_bytes == 0 and registrar.live == set()


def test_warm_arenas_make_room_under_the_budget(shm_dir: Path) -> None:
    """The budget is full of warm arenas: a new request evicts (unregisters) the oldest
    instead of falling back to plain memory."""
    pool, registrar, budget = make_pool(
        shm_dir, small_config(warm_dedicated_bytes=16 * MiB), budget_bytes=16 * MiB
    )
    assert budget is not None
    for size in (5 * MiB, 7 * MiB):
        pool.free(placed(pool.allocate(size, 0.0), registrar), 0.0)
    assert budget.registered_bytes == 12 * MiB
    big = placed(pool.allocate(10 * MiB, 1.0), registrar)
    pool.validate()
    assert budget.registered_bytes <= 16 * MiB
    pool.free(big, 2.0)
    pool.close()
    assert budget.registered_bytes == 0
