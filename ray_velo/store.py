"""The owner's slot table: slots, references, read leases, deadlines, TTLs and drain.

Theory of operation (after dask's worker state machine): :class:`SlotStore` is a plain object
with no I/O, no threads and no clock. The agent calls its methods with ``now`` and performs
what they return: a freed slot comes back as a :class:`FreedSlot` whose memory the agent
returns to its pool. Everything that changes slot state lives in this file. ``validate()``
checks the invariants; tests call it after every step.

Rules, from the spec:

* A slot starts with refcount 1 (or N for fan-out). ``ref`` adds one, ``release`` drops a
  lease and one reference. A slot is freed when its refcount is 0 and no lease is left on it.
* An RDMA lease always has a deadline (``lease_timeout``); the consumer renews it while its
  GET runs. A chunked lease has one only when the acquire asked for it (``lease_ms``); each
  pull renews it. A local lease (a process on this node reading in place) has no deadline;
  it ends when its holder process dies.
* A lease that passes its deadline is force-released (lock and reference), like a consumer's
  ``release``: its consumer is gone or gave up.
* A TTL frees the slot with every lease on it, whether or not someone is still reading.
* ``next_deadline()`` says when the next deadline falls, so the driver arms a timer only
  while one exists.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from ray_velo.errors import HandleNotFound, LeaseNotFound, ProtocolError
from ray_velo.protocol.handle import U64_MAX, DataHandle, HandleMetadata
from ray_velo.protocol.messages import TypeHeader

__all__ = [
    "FreedSlot",
    "Lease",
    "LeaseKind",
    "Slot",
    "SlotKind",
    "SlotStore",
    "StoreCounters",
    "SweepResult",
]

SlotKind = Literal["empty", "plain", "pooled", "dedicated", "region"]
LeaseKind = Literal["rdma", "chunked", "local"]

#: Why a slot whose last reference was released is gone (HandleNotFound.reason).
RELEASED_BY_CONSUMERS = "released by its last consumer"
#: How many freed slot ids the store remembers, to say *why* a handle is gone.
_TOMBSTONES = 4096


@dataclass(slots=True)
class Lease:
    """A read lock on a slot. ``lease_id`` doubles as the chunked transfer id."""

    lease_id: int
    slot_id: int
    kind: LeaseKind
    timeout: float | None  # renewal window (s); None: no deadline
    deadline: float | None
    holder_pid: int = 0


@dataclass(slots=True)
class Slot:
    """One staged payload. ``location`` is opaque here: the agent's placement record."""

    slot_id: int
    total_len: int
    type_header: TypeHeader
    kind: SlotKind
    pinned: bool
    location: Any
    refcount: int
    ttl_deadline: float | None
    staged_at: float
    leases: set[int] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class FreedSlot:
    """A slot the store let go of: return ``location`` to its memory. ``why`` for logs."""

    slot_id: int
    kind: SlotKind
    pinned: bool
    total_len: int
    location: Any
    why: str


@dataclass(slots=True)
class SweepResult:
    """What one ``sweep`` did."""

    freed: list[FreedSlot] = field(default_factory=list)
    rdma_leases_reaped: int = 0
    chunked_leases_expired: int = 0
    slots_expired: int = 0


@dataclass(slots=True)
class StoreCounters:
    """Plain integers counted where the work happens; the metrics layer exports them."""

    slots_staged: int = 0
    slots_freed: int = 0
    bytes_staged: int = 0
    leases_granted: int = 0
    rdma_leases_reaped: int = 0
    chunked_leases_expired: int = 0
    local_leases_reaped: int = 0
    slots_expired: int = 0


class SlotStore:
    """The slot table of one owner (one agent incarnation, ``worker_id``)."""

    def __init__(self, worker_id: int, *, node: str = "") -> None:
        if not 0 < worker_id <= U64_MAX:
            raise ValueError(f"worker_id must be a non-zero u64, got {worker_id}")
        self.worker_id = worker_id
        self.node = node
        self.draining = False
        self.counters = StoreCounters()
        self._slots: dict[int, Slot] = {}
        self._leases: dict[int, Lease] = {}
        self._timed_leases: dict[int, Lease] = {}
        self._ttl_slots: dict[int, Slot] = {}
        self._tombstones: OrderedDict[int, str] = OrderedDict()
        self._slot_ids = itertools.count(1)
        self._lease_ids = itertools.count(1)

    # --- staging ---------------------------------------------------------------------

    def reserve_slot_id(self) -> int:
        """A slot id for a slot staged later (``stage(slot_id=...)``), so a producer can hand
        out the handle while its commit is still on the way."""
        return next(self._slot_ids)

    def forget_reserved(self, slot_id: int, why: str) -> None:
        """A reserved slot id that will never be staged: remember why, for HandleNotFound."""
        self._tombstones[slot_id] = why

    def stage(
        self,
        total_len: int,
        type_header: TypeHeader,
        location: Any,
        *,
        kind: SlotKind,
        pinned: bool,
        now: float,
        ttl: float | None = None,
        refcount: int = 1,
        slot_id: int | None = None,
    ) -> DataHandle:
        """Add a slot; it starts with ``refcount`` references. ``ttl`` in seconds.

        ``slot_id`` is one from :meth:`reserve_slot_id`; by default a fresh one.
        """
        if total_len < 0:
            raise ValueError(f"total_len must be >= 0, got {total_len}")
        if refcount < 1:
            raise ValueError(f"refcount must be >= 1, got {refcount}")
        if ttl is not None and ttl <= 0:
            raise ValueError(f"ttl must be > 0 seconds, got {ttl}")
        if slot_id is not None and (slot_id in self._slots or slot_id in self._tombstones):
            raise ValueError(f"slot id {slot_id} is already used")
        slot = Slot(
            slot_id=next(self._slot_ids) if slot_id is None else slot_id,
            total_len=total_len,
            type_header=type_header,
            kind=kind,
            pinned=pinned,
            location=location,
            refcount=refcount,
            ttl_deadline=None if ttl is None else now + ttl,
            staged_at=now,
        )
        self._slots[slot.slot_id] = slot
        if slot.ttl_deadline is not None:
            self._ttl_slots[slot.slot_id] = slot
        self.counters.slots_staged += 1
        self.counters.bytes_staged += total_len
        return DataHandle(self.worker_id, slot.slot_id)

    # --- lookups ---------------------------------------------------------------------

    def slot(self, handle: DataHandle) -> Slot:
        """The live slot for ``handle``. Raises HandleNotFound (with the reason if known)."""
        if handle.worker_id != self.worker_id:
            raise HandleNotFound(
                handle=str(handle),
                node=self.node,
                reason="issued by another agent incarnation (the owner restarted?)",
            )
        slot = self._slots.get(handle.slot_id)
        if slot is None:
            raise HandleNotFound(
                handle=str(handle),
                node=self.node,
                reason=self._tombstones.get(handle.slot_id, "never staged here"),
            )
        return slot

    def metadata(self, handle: DataHandle) -> HandleMetadata:
        """Size, refcount and pinned of ``handle``'s slot. Raises HandleNotFound."""
        slot = self.slot(handle)
        return HandleMetadata(size=slot.total_len, refcount=slot.refcount, pinned=slot.pinned)

    def lease(self, lease_id: int) -> Lease:
        """The held lease ``lease_id``. Raises LeaseNotFound."""
        lease = self._leases.get(lease_id)
        if lease is None:
            raise LeaseNotFound(handle="?", lease_id=lease_id)
        return lease

    def slots(self) -> Iterable[Slot]:
        """Every live slot (a live view: do not change the store while iterating)."""
        return self._slots.values()

    @property
    def live_slots(self) -> int:
        """Slots staged and not yet freed."""
        return len(self._slots)

    @property
    def live_leases(self) -> int:
        """Leases held on live slots."""
        return len(self._leases)

    @property
    def staged_bytes(self) -> int:
        """Bytes of every live slot."""
        return sum(s.total_len for s in self._slots.values())

    # --- leases ----------------------------------------------------------------------

    def acquire(
        self,
        handle: DataHandle,
        now: float,
        *,
        kind: LeaseKind,
        timeout: float | None = None,
        holder_pid: int = 0,
    ) -> Lease:
        """Take a read lease. ``timeout`` (s) arms a deadline renewed by renew/pull.

        An RDMA lease must have a timeout (the owner cannot see a GET stop).
        """
        slot = self.slot(handle)
        if kind == "rdma" and timeout is None:
            raise ProtocolError("an RDMA lease always carries a deadline")
        lease = Lease(
            lease_id=next(self._lease_ids),
            slot_id=slot.slot_id,
            kind=kind,
            timeout=timeout,
            deadline=None if timeout is None else now + timeout,
            holder_pid=holder_pid,
        )
        self._leases[lease.lease_id] = lease
        slot.leases.add(lease.lease_id)
        if lease.deadline is not None:
            self._timed_leases[lease.lease_id] = lease
        self.counters.leases_granted += 1
        return lease

    def _lease_on(self, handle: DataHandle, lease_id: int) -> tuple[Slot, Lease]:
        slot = self.slot(handle)
        lease = self._leases.get(lease_id)
        if lease is None or lease.slot_id != slot.slot_id:
            raise LeaseNotFound(handle=str(handle), lease_id=lease_id)
        return slot, lease

    def renew(self, handle: DataHandle, lease_id: int, now: float) -> None:
        """Push the lease's deadline one timeout past ``now`` (no-op without a deadline)."""
        _, lease = self._lease_on(handle, lease_id)
        if lease.timeout is not None:
            lease.deadline = now + lease.timeout

    def pull(self, transfer_id: int, now: float) -> Slot:
        """A chunk pull on ``transfer_id`` (a chunked lease id): renews its deadline."""
        lease = self._leases.get(transfer_id)
        if lease is None or lease.kind == "rdma":
            raise LeaseNotFound(handle="?", lease_id=transfer_id)
        if lease.timeout is not None:
            lease.deadline = now + lease.timeout
        return self._slots[lease.slot_id]

    def ref(self, handle: DataHandle) -> int:
        """One more reference, for one more consumer. Returns the new refcount."""
        slot = self.slot(handle)
        slot.refcount += 1
        return slot.refcount

    def detach(self, handle: DataHandle, lease_id: int) -> FreedSlot | None:
        """Drop the read lock; the handle stays usable while it has references.

        Returns the slot if this was the last lease on a slot whose references are gone.
        """
        slot, lease = self._lease_on(handle, lease_id)
        self._drop_lease(slot, lease)
        if slot.refcount == 0 and not slot.leases:
            return self._free(slot, RELEASED_BY_CONSUMERS)
        return None

    def release(self, handle: DataHandle, lease_id: int) -> FreedSlot | None:
        """Drop the read lock and one reference; the slot is freed at zero.

        ``lease_id == 0`` drops a reference without a lease (a consumer that read a copy
        it already had, e.g. a node-local cache hit).
        """
        if lease_id == 0:
            slot = self.slot(handle)
        else:
            slot, lease = self._lease_on(handle, lease_id)
            self._drop_lease(slot, lease)
        return self._unref(slot, RELEASED_BY_CONSUMERS)

    def _drop_lease(self, slot: Slot, lease: Lease) -> None:
        del self._leases[lease.lease_id]
        self._timed_leases.pop(lease.lease_id, None)
        slot.leases.discard(lease.lease_id)

    def _unref(self, slot: Slot, why: str) -> FreedSlot | None:
        slot.refcount = max(0, slot.refcount - 1)
        if slot.refcount == 0 and not slot.leases:
            return self._free(slot, why)
        return None

    def _free(self, slot: Slot, why: str) -> FreedSlot:
        for lease_id in list(slot.leases):
            self._drop_lease(slot, self._leases[lease_id])
        del self._slots[slot.slot_id]
        self._ttl_slots.pop(slot.slot_id, None)
        self._tombstones[slot.slot_id] = why
        while len(self._tombstones) > _TOMBSTONES:
            self._tombstones.popitem(last=False)
        self.counters.slots_freed += 1
        return FreedSlot(slot.slot_id, slot.kind, slot.pinned, slot.total_len, slot.location, why)

    # --- deadlines -------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """The earliest lease deadline or TTL, or None when nothing is timed."""
        deadlines = [lease.deadline for lease in self._timed_leases.values()]
        deadlines += [slot.ttl_deadline for slot in self._ttl_slots.values()]
        return min((d for d in deadlines if d is not None), default=None)

    def sweep(self, now: float) -> SweepResult:
        """Expire TTLs (free with every lease) and force-release leases past deadline."""
        result = SweepResult()
        for slot in [s for s in self._ttl_slots.values() if s.ttl_deadline is not None]:
            if slot.ttl_deadline is not None and slot.ttl_deadline <= now:
                result.freed.append(self._free(slot, "its TTL expired"))
                result.slots_expired += 1
        for lease in [lease for lease in self._timed_leases.values()]:
            if lease.deadline is None or lease.deadline > now:
                continue
            slot = self._slots[lease.slot_id]
            self._drop_lease(slot, lease)
            if lease.kind == "rdma":
                result.rdma_leases_reaped += 1
                why = "its RDMA lease was reaped: no renewal within lease_timeout"
            else:
                result.chunked_leases_expired += 1
                why = "its chunked lease expired: no pull within the fetch bound"
            freed = self._unref(slot, why)
            if freed is not None:
                result.freed.append(freed)
        self.counters.rdma_leases_reaped += result.rdma_leases_reaped
        self.counters.chunked_leases_expired += result.chunked_leases_expired
        self.counters.slots_expired += result.slots_expired
        return result

    # --- local readers ---------------------------------------------------------------

    def holder_pids(self) -> set[int]:
        """Processes on this node holding local leases (the agent checks they live)."""
        return {lease.holder_pid for lease in self._leases.values() if lease.holder_pid}

    def reap_holders(self, dead_pids: Iterable[int]) -> list[FreedSlot]:
        """Force-release every lease held by a process that died."""
        dead = set(dead_pids)
        freed: list[FreedSlot] = []
        for lease in [lease for lease in self._leases.values() if lease.holder_pid in dead]:
            slot = self._slots[lease.slot_id]
            self._drop_lease(slot, lease)
            self.counters.local_leases_reaped += 1
            done = self._unref(slot, "its reader process died")
            if done is not None:
                freed.append(done)
        return freed

    # --- drain -----------------------------------------------------------------------

    def begin_drain(self) -> None:
        """From now on the owner answers no descriptor (reason ``draining``)."""
        self.draining = True

    def relocate(self, handle: DataHandle, location: Any, *, kind: SlotKind, pinned: bool) -> Any:
        """Move a slot's bytes elsewhere (drain demotes pinned slots); returns the old location."""
        slot = self.slot(handle)
        old = slot.location
        slot.location, slot.kind, slot.pinned = location, kind, pinned
        return old

    def evict(self, handle: DataHandle, why: str) -> FreedSlot:
        """Free a slot now, with every lease on it (its memory went away, e.g. a region)."""
        return self._free(self.slot(handle), why)

    def clear(self) -> list[FreedSlot]:
        """Free every slot (shutdown). Returns them, for their memory to be released."""
        return [self._free(slot, "its owner shut down") for slot in list(self._slots.values())]

    # --- invariants ------------------------------------------------------------------

    def validate(self) -> None:
        """Check the store's invariants; tests call this after every step.

        Every lease sits on a live slot that lists it; a lease is timed iff it has a deadline,
        and an RDMA lease always has one; no live slot is unreferenced and unleased; a slot
        has a TTL iff it is in the TTL index; no live slot id is a tombstone; staged minus
        freed equals live.

        Raises:
            AssertionError: an invariant is broken; the message names it (checked under
                ``python -O`` too).
        """
        for lease_id, lease in self._leases.items():
            _check(lease.lease_id == lease_id, f"lease {lease_id} filed as {lease.lease_id}")
            slot = self._slots.get(lease.slot_id)
            if slot is None:
                raise AssertionError(f"lease {lease_id} on freed slot {lease.slot_id}")
            _check(lease_id in slot.leases, f"slot {slot.slot_id} does not list lease {lease_id}")
            timed = self._timed_leases.get(lease_id)
            _check(
                (lease.deadline is not None) == (timed is lease),
                f"lease {lease_id}: deadline {lease.deadline}, timed index {timed}",
            )
            if lease.kind == "rdma":
                _check(lease.deadline is not None, f"RDMA lease {lease_id} has no deadline")
        for slot_id, slot in self._slots.items():
            _check(slot.slot_id == slot_id, f"slot {slot_id} filed as {slot.slot_id}")
            _check(slot.refcount >= 0, f"slot {slot_id} refcount {slot.refcount}")
            _check(slot.refcount > 0 or bool(slot.leases), f"slot {slot_id} unreferenced but live")
            for lease_id in slot.leases:
                held = self._leases.get(lease_id)
                _check(
                    held is not None and held.slot_id == slot_id,
                    f"slot {slot_id} lists lease {lease_id}, which is not on it",
                )
            _check(
                (slot.ttl_deadline is not None) == (self._ttl_slots.get(slot_id) is slot),
                f"slot {slot_id}: ttl {slot.ttl_deadline}, TTL index disagrees",
            )
            _check(slot_id not in self._tombstones, f"live slot {slot_id} has a tombstone")
        for lease_id in self._timed_leases:
            _check(lease_id in self._leases, f"timed lease {lease_id} is not held")
        for slot_id in self._ttl_slots:
            _check(slot_id in self._slots, f"TTL on freed slot {slot_id}")
        counters = self.counters
        _check(
            counters.slots_staged - counters.slots_freed == len(self._slots),
            f"{counters.slots_staged} staged - {counters.slots_freed} freed "
            f"!= {len(self._slots)} live",
        )


def _check(condition: bool, message: str) -> None:
    # Not `assert`: validate() must check under `python -O` as well.
    if not condition:
        raise AssertionError(message)
