"""Tests for the O(1) offset allocator: invariants under random use, bounded waste, misuse.

The oracle for a reservation is written here independently of the allocator's bin code: a
request of ``n >= 8`` granules rounds up to a multiple of ``2 ** (n.bit_length() - 4)``, the
step of a float with a 3-bit mantissa.
"""

from __future__ import annotations

import itertools
import pickle
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from ray_velo.memory.allocator import (
    _BIN_SIZES,
    GRANULE_BYTES,
    MAX_ARENA_GRANULES,
    Allocation,
    OffsetAllocator,
    _bin_round_down,
    _bin_round_up,
    bytes_to_granules,
)


def expected_reservation(requested: int) -> int:
    """What a request of ``requested`` granules should reserve: up to the next float step."""
    if requested < 8:
        return requested
    step = 1 << (requested.bit_length() - 4)
    return -(-requested // step) * step


def assert_no_overlap(allocations: list[Allocation], arena: int) -> None:
    spans = sorted((a.offset, a.offset + a.size) for a in allocations)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start, f"live allocations overlap: {spans}"
    if spans:
        assert spans[0][0] >= 0 and spans[-1][1] <= arena, f"allocation outside arena: {spans}"


# --- the small float -----------------------------------------------------------------------


def test_bin_sizes_are_strictly_increasing_and_cover_the_largest_arena() -> None:
    assert list(_BIN_SIZES) == sorted(set(_BIN_SIZES))
    assert _BIN_SIZES[:9] == (0, 1, 2, 3, 4, 5, 6, 7, 8)
    assert MAX_ARENA_GRANULES == _BIN_SIZES[255] == 15 << 30


@settings(deadline=None, max_examples=300)
@given(st.integers(1, 4096) | st.integers(1, MAX_ARENA_GRANULES))
def test_round_up_and_down_bracket_the_size(size: int) -> None:
    up, down = _bin_round_up(size), _bin_round_down(size)
    assert _BIN_SIZES[up] >= size > _BIN_SIZES[up - 1]
    assert _BIN_SIZES[down] <= size
    assert down == 255 or _BIN_SIZES[down + 1] > size
    assert _BIN_SIZES[up] == expected_reservation(size)


# --- random use never breaks an invariant -------------------------------------------------


class AllocatorMachine(RuleBasedStateMachine):
    """An owner allocating and freeing staged payloads of random sizes in one arena."""

    def __init__(self) -> None:
        super().__init__()
        self.allocator = OffsetAllocator(1)
        self.live: list[tuple[Allocation, int]] = []

    @initialize(
        size=st.integers(1, 64) | st.integers(1, 2048),
        max_allocs=st.none() | st.integers(1, 40),
    )
    def start(self, size: int, max_allocs: int | None) -> None:
        self.allocator = OffsetAllocator(size, max_allocs)
        self.max_allocs = size if max_allocs is None else max_allocs

    @rule(granules=st.integers(1, 8) | st.integers(1, 300) | st.integers(1, 2100))
    def allocate(self, granules: int) -> None:
        allocation = self.allocator.allocate(granules)
        reserve = expected_reservation(granules)
        if allocation is None:
            # "Full" must be true: no free block can hold the rounded request, or the cap is hit.
            assert (
                self.allocator.largest_free_granules() < reserve
                or self.allocator.allocation_count == self.max_allocs
            ), f"refused {granules} granules with a free block that fits"
            return
        assert allocation.size == reserve
        assert (allocation.size - granules) / granules <= 0.125
        self.live.append((allocation, granules))

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 10_000))
    def free(self, pick: int) -> None:
        allocation, _ = self.live.pop(pick % len(self.live))
        self.allocator.free(allocation)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 10_000))
    def double_free_is_refused_and_changes_nothing(self, pick: int) -> None:
        allocation, _ = self.live.pop(pick % len(self.live))
        self.allocator.free(allocation)
        with pytest.raises(ValueError):
            self.allocator.free(allocation)

    @invariant()
    def invariants_hold(self) -> None:
        a = self.allocator
        a.validate()
        assert a.free_granules + a.used_granules == a.size
        assert a.used_granules == sum(alloc.size for alloc, _ in self.live)
        assert a.allocation_count == len(self.live)
        assert a.is_empty() == (not self.live)
        assert_no_overlap([alloc for alloc, _ in self.live], a.size)


AllocatorMachine.TestCase.settings = settings(
    deadline=None, max_examples=60, stateful_step_count=60
)
TestAllocatorMachine = AllocatorMachine.TestCase


@settings(deadline=None, max_examples=100)
@given(st.lists(st.integers(1, 1 << 20) | st.integers(1, 100), min_size=1, max_size=50))
def test_reservation_waste_is_at_most_one_eighth(requests: list[int]) -> None:
    """Staging payloads of any size wastes at most 12.5% of each to bin rounding."""
    allocator = OffsetAllocator(1 << 26)
    for requested in requests:
        allocation = allocator.allocate(requested)
        assert allocation is not None
        assert allocation.size >= requested
        assert (allocation.size - requested) / requested <= 0.125
    allocator.validate()


# --- scenarios -------------------------------------------------------------------------------


def test_fragmented_arena_with_room_still_allocates() -> None:
    """Every other granule is live: the node pool must still hold a node for each block."""
    arena = 1024
    allocator = OffsetAllocator(arena)
    singles = [allocator.allocate(1) for _ in range(arena)]
    assert all(s is not None for s in singles)
    assert allocator.allocate(1) is None
    for single in singles[::2]:
        assert single is not None
        allocator.free(single)
    allocator.validate()
    assert allocator.free_granules == arena // 2
    assert allocator.largest_free_granules() == 1
    refill = [allocator.allocate(1) for _ in range(arena // 2)]
    assert all(r is not None for r in refill)
    assert allocator.allocate(1) is None
    allocator.validate()


def test_full_arena_returns_none_not_an_exception() -> None:
    allocator = OffsetAllocator(256)
    whole = allocator.allocate(256)
    assert whole is not None and (whole.offset, whole.size) == (0, 256)
    assert allocator.allocate(1) is None
    assert allocator.allocate(10_000) is None
    assert allocator.free_granules == 0 and allocator.largest_free_granules() == 0
    allocator.validate()


def test_request_larger_than_arena_returns_none() -> None:
    allocator = OffsetAllocator(100)
    assert allocator.allocate(101) is None
    assert allocator.allocate(MAX_ARENA_GRANULES * 4) is None
    assert allocator.is_empty()


def test_free_space_that_cannot_hold_the_rounded_request_is_refused() -> None:
    """17 free granules cannot serve 17: the request reserves its bin size, 18."""
    allocator = OffsetAllocator(17)
    assert allocator.allocate(17) is None
    assert allocator.largest_free_granules() == 17
    sixteen = allocator.allocate(16)
    assert sixteen is not None and (sixteen.offset, sixteen.size) == (0, 16)
    assert allocator.allocate(1) is not None
    assert allocator.free_granules == 0
    allocator.validate()


def test_free_everything_leaves_one_block() -> None:
    rng = random.Random(7)
    allocator = OffsetAllocator(5000)
    live = []
    for _ in range(500):
        allocation = allocator.allocate(rng.randint(1, 200))
        if allocation is not None:
            live.append(allocation)
    rng.shuffle(live)
    for allocation in live:
        allocator.free(allocation)
    allocator.validate()
    assert allocator.is_empty()
    assert allocator.allocation_count == 0
    assert allocator.used_granules == 0
    assert allocator.largest_free_granules() == allocator.free_granules == allocator.size == 5000


def test_double_free_raises_value_error() -> None:
    allocator = OffsetAllocator(64)
    allocation = allocator.allocate(3)
    assert allocation is not None
    allocator.free(allocation)
    with pytest.raises(ValueError, match="not a live allocation"):
        allocator.free(allocation)
    allocator.validate()


def test_stale_token_is_refused_after_its_node_is_reused() -> None:
    """Same offset, size and node as a freed allocation: the serial in the token tells them apart."""
    allocator = OffsetAllocator(64)
    first = allocator.allocate(4)
    assert first is not None
    allocator.free(first)
    second = allocator.allocate(4)
    assert second is not None
    assert (second.offset, second.size) == (first.offset, first.size)
    with pytest.raises(ValueError):
        allocator.free(first)
    assert allocator.allocation_count == 1
    allocator.free(second)
    assert allocator.is_empty()


@pytest.mark.parametrize(
    "foreign",
    [
        Allocation(0, 1, 0),
        Allocation(0, 1, -1),
        Allocation(0, 1, 1 << 40),
        Allocation(5, 1, 12345),
    ],
)
def test_foreign_token_is_refused(foreign: Allocation) -> None:
    allocator = OffsetAllocator(64)
    live = allocator.allocate(1)
    with pytest.raises(ValueError):
        allocator.free(foreign)
    assert live is not None and allocator.allocation_count == 1
    allocator.validate()


def test_token_from_another_allocator_is_refused() -> None:
    one, other = OffsetAllocator(64), OffsetAllocator(64)
    mine = one.allocate(2)
    other.allocate(1)
    assert mine is not None
    with pytest.raises(ValueError):
        other.free(mine)
    other.validate()


def test_max_allocs_caps_live_allocations() -> None:
    allocator = OffsetAllocator(100, max_allocs=3)
    taken = [allocator.allocate(1) for _ in range(3)]
    assert allocator.allocate(1) is None
    first = taken[0]
    assert first is not None
    allocator.free(first)
    assert allocator.allocate(1) is not None
    allocator.validate()


def test_free_gaps_between_capped_allocations_fit_the_node_pool() -> None:
    """Three live blocks with free gaps around them need six nodes, more than max_allocs + 1."""
    allocator = OffsetAllocator(200, max_allocs=3)
    steps: list[tuple[int, tuple[int, int]]] = [
        (16, (0, 16)),
        (36, (16, 36)),
        (17, (52, 18)),  # 17 rounds up to 18; the 16-granule hole at 0 is too small
        (26, (70, 26)),
        (36, (96, 36)),
    ]
    live: dict[int, Allocation] = {}
    for requested, (offset, size) in steps:
        allocation = allocator.allocate(requested)
        assert allocation is not None and (allocation.offset, allocation.size) == (offset, size)
        live[offset] = allocation
        if offset == 16:
            allocator.free(live.pop(0))  # hole [0, 16)
        if offset == 70:
            allocator.free(live.pop(52))  # hole [52, 70)
        allocator.validate()
    # free [0,16) live [16,52) free [52,70) live [70,96) live [96,132) free [132,200)
    assert allocator.allocation_count == 3
    assert allocator.free_granules == 16 + 18 + 68
    assert allocator.largest_free_granules() == 68


@pytest.mark.parametrize("granules", [0, -1])
def test_allocate_below_one_granule_raises(granules: int) -> None:
    with pytest.raises(ValueError):
        OffsetAllocator(8).allocate(granules)


@pytest.mark.parametrize(
    ("size", "max_allocs"),
    [(0, None), (-5, None), (MAX_ARENA_GRANULES + 1, None), (10, 0)],
)
def test_bad_construction_raises_value_error(size: int, max_allocs: int | None) -> None:
    with pytest.raises(ValueError):
        OffsetAllocator(size, max_allocs)


def test_validate_catches_a_corrupted_counter() -> None:
    allocator = OffsetAllocator(32)
    allocator.allocate(5)
    allocator._free_granules += 1  # simulate a bug
    with pytest.raises(AssertionError, match="free"):
        allocator.validate()


def test_allocation_is_a_frozen_picklable_token() -> None:
    allocation = OffsetAllocator(8).allocate(2)
    assert allocation is not None
    with pytest.raises(AttributeError):
        allocation.size = 3  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(allocation)) == allocation


@pytest.mark.parametrize(
    ("nbytes", "granules"),
    [(0, 1), (1, 1), (GRANULE_BYTES, 1), (GRANULE_BYTES + 1, 2), (10 * GRANULE_BYTES, 10)],
)
def test_bytes_to_granules_rounds_up_to_at_least_one(nbytes: int, granules: int) -> None:
    assert bytes_to_granules(nbytes) == granules


def test_bytes_to_granules_refuses_negative_and_non_integers() -> None:
    with pytest.raises(ValueError):
        bytes_to_granules(-1)
    with pytest.raises(TypeError):
        bytes_to_granules(1.5)  # type: ignore[arg-type]


# --- speed ---------------------------------------------------------------------------------


def measure_pairs_per_second(n: int = 200_000) -> float:
    """Allocate+free pairs per second, sizes 1..4096 granules, 16384-granule arena, ~50% full."""
    rng = random.Random(1)
    sizes = [rng.randint(1, 4096) for _ in range(n)]
    picks = [rng.random() for _ in range(n)]
    allocator = OffsetAllocator(16384)
    allocate, free = allocator.allocate, allocator.free
    half = allocator.size // 2
    live: list[Allocation] = []
    allocations = frees = 0
    start = time.perf_counter()
    for size, pick in zip(sizes, picks, strict=True):
        if allocator.free_granules > half:  # below half full: allocate, else free one at random
            allocations += 1
            allocation = allocate(size)
            if allocation is not None:
                live.append(allocation)
                continue
        if live:
            index = int(pick * len(live))
            live[index], live[-1] = live[-1], live[index]
            free(live.pop())
            frees += 1
    elapsed = time.perf_counter() - start
    return min(allocations, frees) / elapsed


@pytest.mark.slow
def test_allocate_free_rate_sanity_floor() -> None:
    """Reports the rate; the floor only catches an accidental O(n) hot path."""
    rate = measure_pairs_per_second()
    print(f"offset allocator: {rate:,.0f} allocate+free pairs/s")
    assert rate > 20_000
