"""The arena pool: a few large shared-memory arenas, registered once and suballocated in
granules, falling back instead of raising (docs/protocol.md §10, docs/architecture.md §14)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, Literal, Protocol

from ray_velo.config import RdmaPoolConfig
from ray_velo.errors import SharedMemoryTooSmall
from ray_velo.memory.allocator import (
    GRANULE_BYTES,
    Allocation,
    OffsetAllocator,
    bytes_to_granules,
)
from ray_velo.memory.arena import PAGE_BYTES, ShmArena, page_round_up

__all__ = [
    "ArenaPool",
    "Fallback",
    "FallbackReason",
    "NoopRegistrar",
    "NoopRegistration",
    "Placement",
    "Registrar",
    "Registration",
    "RegistrationBudget",
    "bin_reserved_granules",
    "page_range",
]

_log = logging.getLogger(__name__)

FallbackReason = Literal["budget", "pool_exhausted"]

# Records of pools dropped without close(): kept alive so their registered pages are never
# unmapped under UCX (docs/protocol.md §10: "leaks its arenas and logs at error").
_LEAKED_FOREVER: Final[list[object]] = []


def page_range(address: int, nbytes: int) -> tuple[int, int]:
    """The whole pages ``[start, end)`` that registering ``nbytes`` at ``address`` pins."""
    start = address - address % PAGE_BYTES
    return start, page_round_up(address + nbytes)


# --- registration backend ----------------------------------------------------------------


class Registration(Protocol):
    """A live registration of a memory range, as the backend (UCX) reports it."""

    @property
    def packed_key(self) -> bytes:
        """The packed remote key a peer needs to GET from the range."""
        ...

    @property
    def effective_range(self) -> tuple[int, int]:
        """``[start, end)`` addresses actually pinned (page-rounded, maybe wider)."""
        ...


class Registrar(Protocol):
    """Registers memory with the RDMA backend. UCX's implements it; :class:`NoopRegistrar` fakes it."""

    def register(self, address: int, nbytes: int) -> Registration:
        """Register ``nbytes`` bytes at ``address``; raise on failure (nothing registered)."""
        ...

    def unregister(self, registration: Registration) -> None:
        """Unregister; return only once the backend confirmed the unmap, else raise."""
        ...


@dataclass(frozen=True, slots=True)
class NoopRegistration:
    """What :class:`NoopRegistrar` hands out: the range, its pages, an empty key."""

    address: int
    nbytes: int
    effective_range: tuple[int, int]
    packed_key: bytes = b""


class NoopRegistrar:
    """A registrar that registers nothing but keeps the books (no UCX yet; tests).

    It refuses to unregister what it did not register, or twice, so a test catches a double
    unregister. Thread-safe.
    """

    def __init__(self) -> None:
        """No live registrations."""
        self._lock = threading.Lock()
        self._live: dict[int, NoopRegistration] = {}

    @property
    def live_registrations(self) -> int:
        """Registrations not yet unregistered."""
        with self._lock:
            return len(self._live)

    def register(self, address: int, nbytes: int) -> NoopRegistration:
        """Record a registration of ``nbytes`` at ``address`` (page-rounded effective range)."""
        registration = NoopRegistration(address, nbytes, page_range(address, nbytes))
        with self._lock:
            self._live[id(registration)] = registration
        return registration

    def unregister(self, registration: Registration) -> None:
        """Forget ``registration``.

        Raises:
            ValueError: it is not live here.
        """
        with self._lock:
            if self._live.get(id(registration)) is not registration:
                raise ValueError(f"{registration!r} is not a live registration of this registrar")
            del self._live[id(registration)]


class RegistrationBudget:
    """``registered_bytes_budget``: bytes pinned by the pool and external regions together.

    Counts whole pages (what the kernel pins). Callers reserve the page-rounded size before
    registering and :meth:`adjust` to the effective range the backend reports. Idle warm
    memory never causes a refusal: a reservation that does not fit first asks the
    *reclaimer* (the registered pool's :meth:`ArenaPool.evict_idle`) to unmap idle warm
    arenas. ``on_change`` is called (outside the lock) with the new count after every change,
    so a gauge always equals it. Thread-safe.
    """

    def __init__(
        self, budget_bytes: int, *, on_change: Callable[[int], object] | None = None
    ) -> None:
        """A budget of ``budget_bytes`` bytes, nothing registered.

        Raises:
            ValueError: ``budget_bytes`` < 0.
        """
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self._lock = threading.Lock()
        self._budget = budget_bytes
        self._registered = 0
        self._on_change = on_change
        self._reclaimer: Callable[[int], int] | None = None

    def set_reclaimer(self, reclaimer: Callable[[int], int] | None) -> None:
        """``reclaimer(short_bytes) -> bytes released``: frees idle registered memory (warm
        arenas) when a reservation does not fit. It must not be called with a lock held that
        it takes itself (the pool reserves with ``reclaim=False``)."""
        self._reclaimer = reclaimer

    @property
    def budget_bytes(self) -> int:
        """The cap, in bytes."""
        return self._budget

    @property
    def registered_bytes(self) -> int:
        """Bytes charged now (whole pages)."""
        return self._registered

    @property
    def available_bytes(self) -> int:
        """Bytes that can still be reserved (0 when over, after an upward adjustment)."""
        return max(0, self._budget - self._registered)

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self._registered)

    def reserve(self, nbytes: int, *, reclaim: bool = True) -> bool:
        """Charge ``nbytes`` rounded up to pages if that stays within the budget, evicting
        idle warm memory first when it would not (``reclaim``).

        Returns:
            False, charging nothing, when it would exceed the budget even then.
        """
        charge = page_round_up(nbytes)
        for attempt in range(2):
            with self._lock:
                if self._registered + charge <= self._budget:
                    self._registered += charge
                    break
                short = self._registered + charge - self._budget
            reclaimer = self._reclaimer
            if attempt or not reclaim or reclaimer is None or reclaimer(short) <= 0:
                return False
        self._changed()
        return True

    def release(self, nbytes: int) -> None:
        """Give back a charge of ``nbytes`` (rounded up to pages, as when reserved).

        Raises:
            ValueError: more would be released than is charged (a bookkeeping bug).
        """
        charge = page_round_up(nbytes)
        with self._lock:
            if charge > self._registered:
                raise ValueError(f"releasing {charge} bytes, only {self._registered} charged")
            self._registered -= charge
        self._changed()

    def adjust(self, delta_bytes: int) -> None:
        """Reconcile a reservation with what the backend really pinned (may pass the cap).

        The registration exists by then, so the count follows the truth rather than refusing.
        """
        with self._lock:
            self._registered = max(0, self._registered + delta_bytes)
        self._changed()


# --- what allocate() returns --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a payload lives: a byte range of one arena.

    Attributes:
        arena: the arena (its ``path`` is what processes of this node map).
        offset_bytes: start of the range in the arena.
        nbytes: the bytes requested (the reservation may be larger, see ``capacity_bytes``).
        allocation: the private free token; None for a dedicated arena. Never sent to peers:
            a descriptor names the range, it cannot free it.
        dedicated: True when the arena serves this placement alone.
        registration: the arena's registration (None in an unregistered pool).
    """

    arena: ShmArena
    offset_bytes: int
    nbytes: int
    allocation: Allocation | None
    dedicated: bool
    registration: Registration | None = None

    @property
    def capacity_bytes(self) -> int:
        """Bytes reserved for this placement (granule/bin rounding, or the whole arena)."""
        if self.allocation is None:
            return self.arena.nbytes
        return self.allocation.size * GRANULE_BYTES

    @property
    def key(self) -> tuple[str, int]:
        """What names this range among every placement of a node (arena path, offset)."""
        return (self.arena.path, self.offset_bytes)

    @property
    def address(self) -> int:
        """Address of the first byte in this process (the RDMA descriptor's remote address)."""
        return self.arena.address + self.offset_bytes

    def view(self) -> memoryview:
        """A writable view of the ``nbytes`` placed bytes."""
        return self.arena.view(self.offset_bytes, self.nbytes)


@dataclass(frozen=True, slots=True)
class Fallback:
    """The pool could not place the bytes; stage them in plain memory and record ``reason``.

    Attributes:
        reason: ``"budget"`` (registered_bytes_budget spent) or ``"pool_exhausted"``
            (anything else: no room and may not map, shm too small, registration failed,
            pool closed). The protocol's path label (docs/protocol.md §9).
        requested_bytes: the request.
        detail: why, for a log line.
        error: the error behind it, when one says more (``SharedMemoryTooSmall``).
    """

    reason: FallbackReason
    requested_bytes: int
    detail: str = ""
    error: Exception | None = field(default=None, compare=False)


# --- the pool -----------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class _ArenaRecord:
    arena: ShmArena
    allocator: OffsetAllocator | None  # None: dedicated
    registration: Registration | None
    charged_bytes: int  # budget charge (effective range), 0 without a registrar
    empty_since: float | None = None  # pooled only: when the last allocation went
    live: set[Allocation] = field(default_factory=set)

    @property
    def dedicated(self) -> bool:
        return self.allocator is None


class ArenaPool:
    """Registered (or plain) shared-memory arenas, suballocated in granules.

    Counters (plain integers/properties, exported by the metrics layer): ``registered_bytes``,
    ``arenas``, ``used_bytes``, ``mapped_bytes``, ``registrations_total``,
    ``arenas_reclaimed``, ``leaked_arenas``.
    """

    def __init__(
        self,
        config: RdmaPoolConfig,
        directory: str | os.PathLike[str],
        owner_tag: int,
        registrar: Registrar | None = None,
        budget: RegistrationBudget | None = None,
        prefault: bool = False,
    ) -> None:
        """A pool with no arena mapped yet.

        Args:
            config: sizes, budget knobs and reclamation (``registered_bytes_budget`` is read by
                whoever builds the shared ``budget``, not here).
            directory: the shared-memory directory arenas are created in.
            owner_tag: the agent's 64-bit worker id, named in every arena file.
            registrar: registers each arena; None for the plain (unregistered) pool.
            budget: charged for every registered arena; shared with external regions.
            prefault: pre-fault each new arena (see :class:`ShmArena`).

        Raises:
            ValueError: a budget without a registrar (there is nothing to charge).
        """
        if budget is not None and registrar is None:
            raise ValueError("a RegistrationBudget needs a registrar: plain memory is not charged")
        self._config = config
        self._directory = os.fspath(directory)
        self._owner_tag = owner_tag
        self._registrar = registrar
        self._budget = budget
        self._prefault = prefault
        self._lock = threading.Lock()  # tables; held briefly
        self._map_lock = threading.Lock()  # mapping/registration/unregistration; before _lock
        self._records: dict[str, _ArenaRecord] = {}  # by arena path
        self._pooled: list[_ArenaRecord] = []  # oldest first
        self._leaked: list[_ArenaRecord] = []
        #: Emptied dedicated arenas kept mapped (and registered) for reuse, oldest first.
        self._warm: list[_ArenaRecord] = []
        self._evicting: list[_ArenaRecord] = []
        self._closed = False
        self._registrations = 0
        self._arenas_reclaimed = 0

    # --- counters ----------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran; ``allocate`` then falls back."""
        return self._closed

    @property
    def registered_bytes(self) -> int:
        """Bytes this pool has charged to the budget (live, warm and leaked arenas)."""
        with self._lock:
            records = [*self._records.values(), *self._warm, *self._evicting, *self._leaked]
        return sum(r.charged_bytes for r in records)

    @property
    def arenas(self) -> int:
        """Arenas mapped now, pooled, dedicated and warm (not counting leaked ones)."""
        with self._lock:
            return len(self._records) + len(self._warm) + len(self._evicting)

    @property
    def pooled_arena_sizes(self) -> list[int]:
        """Sizes in bytes of the mapped pooled arenas, oldest first."""
        with self._lock:
            return [r.arena.nbytes for r in self._pooled]

    @property
    def used_bytes(self) -> int:
        """Bytes reserved by live placements (granule rounding counts; dedicated: whole arena)."""
        with self._lock:
            return sum(
                r.arena.nbytes if r.allocator is None else r.allocator.used_granules * GRANULE_BYTES
                for r in self._records.values()
            )

    @property
    def mapped_bytes(self) -> int:
        """Bytes of every arena still mapped, leaked ones included."""
        with self._lock:
            return sum(
                r.arena.nbytes for r in (*self._records.values(), *self._warm, *self._leaked)
            )

    @property
    def registrations_total(self) -> dict[str, int]:
        """Registrations made, by kind (the pool only makes ``"arena"`` ones)."""
        return {"arena": self._registrations}

    @property
    def arenas_reclaimed(self) -> int:
        """Pooled arenas unmapped by :meth:`reclaim`."""
        return self._arenas_reclaimed

    @property
    def leaked_arenas(self) -> int:
        """Arenas kept mapped because their unregistration could not be confirmed."""
        with self._lock:
            return len(self._leaked)

    # --- allocate / free ---------------------------------------------------------------

    def allocate(self, nbytes: int, now: float, *, may_map: bool = True) -> Placement | Fallback:
        """Place ``nbytes`` bytes in an arena; never raises for lack of memory.

        Args:
            nbytes: bytes to place, >= 1 (zero-length data goes to plain memory, not here).
            now: the caller's clock (seconds).
            may_map: False for transparent staging: use only arenas already mapped (pooled
                ones, or a warm dedicated one), never map (nor register) a new one, so a send
                never stalls on a registration.

        Returns:
            A :class:`Placement`, or a :class:`Fallback` with reason ``"budget"`` (mapping an
            arena would pass ``registered_bytes_budget``) or ``"pool_exhausted"`` (anything
            else). Nothing is left allocated on a fallback.

        Raises:
            ValueError: ``nbytes`` < 1.
        """
        if nbytes < 1:
            raise ValueError(f"nbytes must be >= 1, got {nbytes}")
        dedicated = nbytes >= self._config.dedicated_arena_min
        granules = bytes_to_granules(nbytes)
        if not dedicated:
            with self._lock:
                if self._closed:
                    return Fallback("pool_exhausted", nbytes, "pool closed")
                placed = self._place(nbytes, granules)
            if placed is not None:
                return placed
        if not may_map:
            if dedicated:  # a warm arena is already mapped and registered: take it
                with self._lock:
                    warm = None if self._closed else self._take_warm(nbytes)
                if warm is not None:
                    return warm
            what = "needs a dedicated arena" if dedicated else "fits no mapped arena"
            return Fallback("pool_exhausted", nbytes, f"{what}, and this caller may not map one")
        with self._map_lock:
            found = self._reuse_or_size(nbytes, granules, dedicated)
            if not isinstance(found, int):
                return found
            if not self._reserve(found):
                assert self._budget is not None
                return Fallback(
                    "budget",
                    nbytes,
                    f"an arena of {found} bytes would pass registered_bytes_budget "
                    f"({self._budget.registered_bytes} of {self._budget.budget_bytes} used)",
                )
            return self._map_and_place(found, dedicated, nbytes, granules, now)

    def _reuse_or_size(
        self, nbytes: int, granules: int, dedicated: bool
    ) -> Placement | Fallback | int:
        # _map_lock held. A warm arena, or a place another thread mapped while we waited;
        # else the size of the arena to map.
        with self._lock:
            if self._closed:
                return Fallback("pool_exhausted", nbytes, "pool closed")
            if dedicated:
                warm = self._take_warm(nbytes)
                return page_round_up(nbytes) if warm is None else warm
            placed = self._place(nbytes, granules)
            return placed if placed is not None else self._next_arena_bytes(granules)

    def _reserve(self, size: int) -> bool:
        # _map_lock held. Registrations are evicted by the byte budget, never by a timer
        # (docs/protocol.md §10): warm arenas make room for a new one, if all of them together
        # would.
        if self._budget is None:
            return True
        with self._lock:
            if self._budget.reserve(size, reclaim=False):
                return True
            short = size - self._budget.available_bytes
            evicted = self._take_warm_victims(short, all_or_nothing=True) or []
        for record in evicted:
            self._unmap(record)
        return bool(evicted) and self._budget.reserve(size, reclaim=False)

    def _map_and_place(
        self, size: int, dedicated: bool, nbytes: int, granules: int, now: float
    ) -> Placement | Fallback:
        # _map_lock held; the budget holds `size`.
        mapped = self._map_arena(size, dedicated, nbytes)
        if isinstance(mapped, Fallback):
            return mapped
        with self._lock:
            self._records[mapped.arena.path] = mapped
            if dedicated:
                return Placement(mapped.arena, 0, nbytes, None, True, mapped.registration)
            self._pooled.append(mapped)
            placed = self._place_in(mapped, nbytes, granules)
            if placed is None:  # cannot happen: _next_arena_bytes sized it for the request
                mapped.empty_since = now
                return Fallback("pool_exhausted", nbytes, "a fresh arena refused the request")
            return placed

    def free(self, placement: Placement, now: float) -> None:
        """Return ``placement``'s bytes to the pool.

        A dedicated arena is unregistered (confirmed), unmapped and unlinked, and its budget
        released, before this returns. A pooled arena that becomes empty records ``now``; only
        :meth:`reclaim` unmaps it. After :meth:`close` this is a no-op.

        Raises:
            ValueError: ``placement`` is not live in this pool (double free, another pool's).
        """
        if placement.dedicated:
            with self._map_lock:
                with self._lock:
                    record = self._live_record(placement)
                    if record is None:
                        return
                    if not record.dedicated:
                        raise ValueError(f"{placement} names a pooled arena as dedicated")
                    self._detach(record)
                    kept = self._keep_warm(record, now)
                self._drain_evicting()
                if not kept:
                    self._unmap(record)
            return
        with self._lock:
            record = self._live_record(placement)
            if record is None:
                return
            allocation = placement.allocation
            if record.allocator is None or allocation is None or allocation not in record.live:
                raise ValueError(f"{placement} is not live in this pool (double free?)")
            record.allocator.free(allocation)
            record.live.remove(allocation)
            if record.allocator.is_empty():
                record.empty_since = now

    def evict_idle(self, nbytes: int) -> int:
        """Unmap idle warm arenas (oldest first) until ``nbytes`` of budget are released or
        none is left; the budget's reclaimer. Returns the bytes released."""
        with self._map_lock:
            with self._lock:
                victims = self._take_warm_victims(nbytes, all_or_nothing=False) or []
            freed = 0
            for record in victims:
                if self._unmap(record):
                    freed += record.charged_bytes
            return freed

    # --- reclamation -------------------------------------------------------------------

    def reclaim(self, now: float) -> int:
        """Unmap pooled arenas empty for at least ``arena_reclaim_after`` seconds.

        Only when ``arena_reclaim_after`` is set. Newest arenas are considered first, and an
        arena stays when unmapping it would leave less than ``retain_arena_bytes`` of pooled
        arenas (empty or used) mapped, so the small first arena survives as the warm floor.
        An empty arena has no live descriptor into it, so the unmap is safe.

        Returns:
            Bytes unmapped.
        """
        if self._config.arena_reclaim_after is None:
            return 0
        with self._map_lock:
            with self._lock:
                if self._closed:
                    return 0
                victims = self._reclaimable(now)
                for record in victims:
                    self._detach(record)
                after = self._config.arena_reclaim_after
                stale = [
                    r
                    for r in self._warm
                    if r.empty_since is not None and now >= r.empty_since + after
                ]
                for record in stale:
                    self._warm.remove(record)
                victims += stale
            unmapped = 0
            for record in victims:
                if self._unmap(record):
                    unmapped += record.arena.nbytes
                    self._arenas_reclaimed += 1
            return unmapped

    def next_reclaim_deadline(self, now: float) -> float | None:
        """When :meth:`reclaim` next has something to unmap, or None (arm no timer).

        The value may be ``<= now``: a reclaim is due. Recompute after every allocate/free.
        """
        after = self._config.arena_reclaim_after
        if after is None:
            return None
        with self._lock:
            if self._closed:
                return None
            mapped = sum(r.arena.nbytes for r in self._pooled)
            deadlines = [
                r.empty_since + after
                for r in self._pooled
                if r.empty_since is not None
                and mapped - r.arena.nbytes >= self._config.retain_arena_bytes
            ]
            deadlines += [r.empty_since + after for r in self._warm if r.empty_since is not None]
        return min(deadlines) if deadlines else None

    # --- invariants and shutdown ---------------------------------------------------------

    def validate(self) -> None:
        """Check every invariant; tests call it after each step.

        Per pooled arena: the allocator's own invariants, used + free == arena size, the live
        token set matches the allocation count, "empty" and ``empty_since`` agree. Dedicated
        arenas carry no allocator. Every arena is registered iff the pool has a registrar, and
        charged its effective range. The shared budget holds at least this pool's charges
        (external regions and other pools charge it too).

        Raises:
            AssertionError: an invariant is broken; the message names it.
        """
        with self._map_lock, self._lock:
            _check(
                set(self._records) == {r.arena.path for r in self._records.values()},
                "records keyed by the wrong path",
            )
            pooled_ids = {id(r) for r in self._pooled}
            _check(len(pooled_ids) == len(self._pooled), "a pooled arena is listed twice")
            for path, record in self._records.items():
                self._validate_record(path, record, pooled_ids)
            if self._budget is not None:
                own = sum(
                    r.charged_bytes for r in (*self._records.values(), *self._warm, *self._leaked)
                )
                _check(
                    self._budget.registered_bytes >= own,
                    f"budget holds {self._budget.registered_bytes} bytes, this pool alone "
                    f"charged {own}",
                )
            if self._closed:
                _check(not self._records, "a closed pool still has arenas")

    def _validate_record(self, path: str, record: _ArenaRecord, pooled_ids: set[int]) -> None:
        # Both locks held (validate).
        arena = record.arena
        _check(not arena.closed, f"live record of closed arena {path}")
        _check(arena.nbytes % PAGE_BYTES == 0, f"arena {path} is not whole pages")
        allocator = record.allocator
        if allocator is None:
            _check(id(record) not in pooled_ids, f"dedicated arena {path} is pooled")
            _check(not record.live, f"dedicated arena {path} holds tokens")
            _check(record.empty_since is None, f"dedicated arena {path} marked empty")
        else:
            _check(id(record) in pooled_ids, f"pooled arena {path} is not listed")
            allocator.validate()  # its own books, used + free == size among them
            _check(
                allocator.size * GRANULE_BYTES == arena.nbytes,
                f"arena {path}: allocator covers {allocator.size} granules",
            )
            _check(
                allocator.allocation_count == len(record.live),
                f"arena {path}: {allocator.allocation_count} allocations, "
                f"{len(record.live)} live tokens",
            )
            _check(
                allocator.is_empty() == (record.empty_since is not None),
                f"arena {path}: empty={allocator.is_empty()}, empty_since={record.empty_since}",
            )
        if self._registrar is None:
            _check(record.registration is None, f"arena {path} registered in plain pool")
            _check(record.charged_bytes == 0, f"arena {path} charged in plain pool")
        else:
            registration = record.registration
            _check(registration is not None, f"arena {path} is not registered")
            if registration is not None:
                start, end = registration.effective_range
                _check(record.charged_bytes == end - start, f"arena {path} mischarged")

    def close(self) -> None:
        """Unregister, unmap and unlink every arena, live placements included; idempotent.

        Waits for a mapping in progress to finish first. After close, ``allocate`` returns a
        ``pool_exhausted`` fallback and ``free`` does nothing. An arena whose unregistration
        fails stays mapped (leaked, logged at error).
        """
        with self._map_lock:
            with self._lock:
                if self._closed:
                    return
                self._closed = True
                records = list(reversed(self._records.values()))
                for record in records:
                    self._detach(record)
                records += self._warm + self._evicting
                self._warm, self._evicting = [], []
            for record in records:
                self._unmap(record)

    def abandon(self) -> int:
        """Close without unmapping: every file is unlinked, every mapping and registration
        stays, for the life of the process (shutdown when a GET into this memory may still
        be running; UCX's teardown drops the registrations). Logged at error. Returns the
        bytes left mapped."""
        with self._map_lock:
            with self._lock:
                if self._closed:
                    return 0
                self._closed = True
                records = [*self._records.values(), *self._warm, *self._evicting]
                self._records, self._pooled, self._warm, self._evicting = {}, [], [], []
                _LEAKED_FOREVER.extend(records)
            for record in records:
                record.arena.unlink()
        nbytes = sum(r.arena.nbytes for r in records)
        if records:
            _log.error(
                "a GET may still write %d arenas (%d bytes): left mapped until the process ends",
                len(records),
                nbytes,
            )
        return nbytes

    def __del__(self) -> None:
        # A pool torn down without close(): registered pages must not be unmapped under the
        # backend, so keep them (the protocol's leak, logged at error: docs/protocol.md §10).
        # Plain arenas just close.
        try:
            records = [*self._records.values(), *self._warm, *self._evicting]
        except AttributeError:  # __init__ failed
            return
        if self._closed or not records:
            return
        if self._registrar is None:
            for record in records:
                with contextlib.suppress(Exception):  # may run at interpreter exit
                    record.arena.close()
            return
        _LEAKED_FOREVER.extend(records)
        _log.error(
            "arena pool dropped without close(): leaking %d registered arenas (%d bytes)",
            len(records),
            sum(r.arena.nbytes for r in records),
        )

    # --- internals (callers hold the locks named) --------------------------------------

    def _place(self, nbytes: int, granules: int) -> Placement | None:
        # _lock held. Oldest arena first: newer ones stay emptier, so reclamation frees them.
        for record in self._pooled:
            placed = self._place_in(record, nbytes, granules)
            if placed is not None:
                return placed
        return None

    def _place_in(self, record: _ArenaRecord, nbytes: int, granules: int) -> Placement | None:
        # _lock held.
        assert record.allocator is not None
        allocation = record.allocator.allocate(granules)
        if allocation is None:
            return None
        record.live.add(allocation)
        record.empty_since = None
        return Placement(
            record.arena,
            allocation.offset * GRANULE_BYTES,
            nbytes,
            allocation,
            False,
            record.registration,
        )

    def _keep_warm(self, record: _ArenaRecord, now: float) -> bool:
        # _lock held. An emptied dedicated arena stays mapped for the next request of about
        # its size (mapping, reserving and first-touch faulting a fresh one costs more than
        # the copy it serves), up to warm_dedicated_bytes, oldest evicted first. No peer
        # holds a descriptor into it: its slot's leases ended with the slot.
        limit = self._config.warm_dedicated_bytes or 0  # None: NodeMemory sets the budget's
        size = record.arena.nbytes
        if size > limit:
            return False
        held = sum(r.arena.nbytes for r in self._warm)
        victims = []
        for old in self._warm:
            if held + size <= limit:
                break
            victims.append(old)
            held -= old.arena.nbytes
        for old in victims:
            self._warm.remove(old)
            self._evicting.append(old)
        record.empty_since = now
        self._warm.append(record)
        return True

    @property
    def warm_bytes(self) -> int:
        """Bytes of the warm dedicated arenas mapped now."""
        with self._lock:
            return sum(r.arena.nbytes for r in self._warm)

    def has_warm(self, nbytes: int) -> bool:
        """Whether a warm dedicated arena would take a payload of ``nbytes`` now."""
        size = page_round_up(nbytes)
        with self._lock:
            return any(size <= r.arena.nbytes <= size + size // 8 for r in self._warm)

    def _take_warm(self, nbytes: int) -> Placement | None:
        # _lock held. Place `nbytes` in the smallest warm arena that holds them with at most
        # 1/8 to spare (the allocator's own bound on round-up waste), live again.
        size = page_round_up(nbytes)
        fits = [r for r in self._warm if size <= r.arena.nbytes <= size + size // 8]
        if not fits:
            return None
        record = min(fits, key=lambda r: r.arena.nbytes)
        self._warm.remove(record)
        record.empty_since = None
        self._records[record.arena.path] = record
        return Placement(record.arena, 0, nbytes, None, True, record.registration)

    def _take_warm_victims(self, short: int, *, all_or_nothing: bool) -> list[_ArenaRecord] | None:
        # _lock held. Take warm arenas, oldest first, until `short` bytes of budget are
        # covered (or, unless all_or_nothing, until none is left).
        victims: list[_ArenaRecord] = []
        for record in self._warm:
            if short <= 0:
                break
            victims.append(record)
            short -= record.charged_bytes
        if short > 0 and all_or_nothing:
            return None
        for record in victims:
            self._warm.remove(record)
        return victims

    def _drain_evicting(self) -> None:
        # _map_lock held, _lock not: unmap warm arenas pushed out by newer ones.
        with self._lock:
            victims, self._evicting = self._evicting, []
        for record in victims:
            self._unmap(record)

    def _next_arena_bytes(self, granules: int) -> int:
        # _lock held. Double the newest mapped pooled arena, capped; the first is initial.
        config = self._config
        if self._pooled:
            size = min(2 * self._pooled[-1].arena.nbytes, config.max_arena_bytes)
        else:
            size = config.initial_arena_bytes
        need = bin_reserved_granules(granules) * GRANULE_BYTES
        return _round_up(max(size, need), max(PAGE_BYTES, GRANULE_BYTES))

    def _map_arena(self, size: int, dedicated: bool, nbytes: int) -> _ArenaRecord | Fallback:
        # _map_lock held, _lock not. The budget already holds `size`; give it back on failure.
        def give_back() -> None:
            if self._budget is not None:
                self._budget.release(size)

        try:
            arena = ShmArena(self._directory, size, self._owner_tag, prefault=self._prefault)
        except SharedMemoryTooSmall as exc:
            give_back()
            _log.warning("arena pool cannot map %d bytes: %s", size, exc)
            return Fallback("pool_exhausted", nbytes, str(exc), error=exc)
        except OSError as exc:
            give_back()
            _log.warning("arena pool cannot create an arena of %d bytes: %s", size, exc)
            return Fallback("pool_exhausted", nbytes, f"cannot create an arena: {exc}")
        registration: Registration | None = None
        charged = 0
        if self._registrar is not None:
            try:
                registration = self._registrar.register(arena.address, arena.nbytes)
            except Exception as exc:  # the backend's failure is a fallback, never an error
                arena.close()
                give_back()
                _log.warning("registering an arena of %d bytes failed", size, exc_info=True)
                return Fallback("pool_exhausted", nbytes, f"registration failed: {exc}")
            start, end = registration.effective_range
            charged = end - start
            if self._budget is not None and charged != size:
                self._budget.adjust(charged - size)  # count what the backend really pinned
            self._registrations += 1
        allocator = None if dedicated else OffsetAllocator(arena.nbytes // GRANULE_BYTES)
        return _ArenaRecord(arena, allocator, registration, charged)

    def _live_record(self, placement: Placement) -> _ArenaRecord | None:
        # _lock held. None only after close(); a stranger's placement raises.
        record = self._records.get(placement.arena.path)
        if record is None or record.arena is not placement.arena:
            if self._closed:
                return None
            raise ValueError(f"{placement} is not live in this pool (double free?)")
        return record

    def _detach(self, record: _ArenaRecord) -> None:
        # _lock held: no allocation can land in the arena after this.
        del self._records[record.arena.path]
        if record.allocator is not None:
            self._pooled.remove(record)

    def _unmap(self, record: _ArenaRecord) -> bool:
        # _map_lock held, _lock not. Unregister (confirmed) -> unmap + unlink -> budget.
        if record.registration is not None and self._registrar is not None:
            try:
                self._registrar.unregister(record.registration)
            except Exception:  # cannot prove the pages are unpinned: leak them on purpose
                _log.error(
                    "unregistering arena %s failed; leaking it (%d bytes stay mapped)",
                    record.arena.path,
                    record.arena.nbytes,
                    exc_info=True,
                )
                with self._lock:
                    self._leaked.append(record)
                return False
        if not record.arena.close():
            _log.debug("arena %s unmaps when its last exported view goes", record.arena.path)
        if self._budget is not None and record.charged_bytes:
            self._budget.release(record.charged_bytes)
        return True

    def _reclaimable(self, now: float) -> list[_ArenaRecord]:
        # _lock held. Newest first, keeping retain_arena_bytes of pooled arenas mapped.
        after = self._config.arena_reclaim_after
        assert after is not None
        mapped = sum(r.arena.nbytes for r in self._pooled)
        victims: list[_ArenaRecord] = []
        for record in reversed(self._pooled):
            if record.empty_since is None or now < record.empty_since + after:
                continue
            if mapped - record.arena.nbytes < self._config.retain_arena_bytes:
                continue
            victims.append(record)
            mapped -= record.arena.nbytes
        return victims


def bin_reserved_granules(granules: int) -> int:
    """Granules the offset allocator reserves for a request of ``granules`` (>= 1).

    Its bins are floats with a 3-bit mantissa: a request is rounded up to a multiple of
    ``2 ** (bit_length - 4)`` (exact below 16). A fresh arena of at least this many granules
    is sure to serve the request. Mirrors the allocator's rounding; a test checks the two
    agree.
    """
    step = 1 << max(0, granules.bit_length() - 4)
    return _round_up(granules, step)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _check(condition: bool, message: str) -> None:
    # Not `assert`: validate() must check under `python -O` as well.
    if not condition:
        raise AssertionError(message)
