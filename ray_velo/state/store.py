"""The owner's slot table: slots, references, claims, read leases, deadlines and TTLs.

Theory of operation (after dask's worker state machine): :class:`SlotStore` is a plain object
with no I/O, no threads and no clock. The owner calls its methods with ``now`` and performs
what they return: a slot whose bytes may go comes back as a :class:`FreedSlot`, whose memory
the owner state gives back once no read is in progress. Everything that changes slot state
lives in this file. ``validate()`` checks the invariants; tests call it after every step.

A handle ends before its bytes (docs/architecture.md §5). The **handle ends** when its last
reference is released, its TTL fires, its job ends, or it is evicted (its region went away,
its owner shut down); from then on every new acquire, ref, claim and metadata call is refused
with ``HandleNotFound`` naming why. The **bytes end** when the handle has ended and no lease
is left on the slot: only then does the store hand the slot back (``FreedSlot``).

Rules, from the protocol (docs/protocol.md §3, §11) and the lifetime issue:

* A slot starts with refcount 1 (or N for fan-out). ``ref`` adds one, ``release`` drops a
  lease and one reference; at zero the handle ends.
* A consuming acquire (a ``fetch`` that releases, a transparent resolution) *claims* one
  unclaimed reference (``refcount - claimed >= 1``) or is refused with ``HandleReleased``: N
  references allow exactly N consumers, however many race. A claim ends with a
  ``release(claim=True)`` (its reference consumed) or ``unclaim`` (given back).
* An RDMA lease always has a deadline (``lease_timeout``), renewed while its GET runs; so
  does a wire lease (the owner sends the bytes over the agents' wire, checking the lease
  before each piece); a chunked lease has one only when the acquire asked for it
  (``lease_ms``), renewed by each pull; a local lease (a process on this node reading in
  place) has none and ends when its holder process dies (a detach: the reference was dealt
  with at acquire).
* A remote lease past its deadline is force-released like a consumer's ``release`` (lock, one
  reference, and its claim if it carried one): its consumer is gone or gave up.
* A TTL ends the handle and its chunked and wire leases (the owner is their sender: it stops,
  and a piece it is sending holds the bytes in the read gate); RDMA and local leases keep
  the bytes until they end, since a GET or a view may still read them.
* A slot records the Ray job that staged it (``job``); :meth:`end_job` ends its handles as a
  TTL does, unless it was staged ``detached``. ``followed_jobs()`` names the jobs whose end
  the owner must watch for; ``next_deadline()`` says when the next deadline falls, so the
  driver arms a timer only while one exists.

Cost (a node may hold a hundred thousand live handles): every operation touches only the
slot, lease or job it names. Counts are kept as the work happens, leases are indexed by
consumer agent and by holder process, and deadlines and TTLs sit in one heap whose stale
entries are dropped as they surface (a renewal only moves the lease's deadline; its entry,
when due, is pushed again). ``validate()`` checks every count and index against a recount.
"""

from __future__ import annotations

import heapq
import secrets
from collections import Counter, OrderedDict
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol, TypeAlias, TypeVar

from ray_velo.errors import (
    RELEASED_BY_CONSUMERS,
    HandleNotFound,
    HandleReleased,
    LeaseNotFound,
    ProtocolError,
)
from ray_velo.protocol.handle import U64_MAX, DataHandle, HandleMetadata
from ray_velo.protocol.ids import ID_KEY_BYTES, IdSequence
from ray_velo.protocol.messages import TypeHeader

if TYPE_CHECKING:
    from ray_velo.memory.windows import WindowSet
    from ray_velo.state.ledger import Buffer
    from ray_velo.state.owner import RegionSlot

#: Where a slot's bytes are: a pool buffer, a caller's region, or nowhere (zero bytes).
#: Opaque to the store; the owner state gives it back (FreedSlot) when the bytes may go.
Location: TypeAlias = "Buffer | RegionSlot | None"

__all__ = [
    "JOB_ENDED",
    "RELEASED_BY_CONSUMERS",
    "TTL_EXPIRED",
    "FreedSlot",
    "Lease",
    "LeaseKind",
    "Location",
    "Slot",
    "SlotKind",
    "SlotStore",
    "SlotView",
    "StoreCounters",
    "SweepResult",
]

SlotKind = Literal["empty", "plain", "pooled", "dedicated", "region"]
LeaseKind = Literal["rdma", "chunked", "local", "wire"]
#: Leases whose reader the owner serves (it sends their bytes): a TTL ends them at once.
_SENT_TO: frozenset[str] = frozenset({"chunked", "wire"})

TTL_EXPIRED = "its TTL expired"
JOB_ENDED = "its job ended"
#: How many ended slot ids the store remembers, to say *why* a handle is gone.
_TOMBSTONES = 4096
_K = TypeVar("_K")
#: Timer heap tags: a lease's deadline, a slot's TTL.
_LEASE, _TTL = 0, 1


@dataclass(slots=True)
class Lease:
    """A read lock on a slot. ``lease_id`` doubles as the chunked transfer id.

    ``claimed``: the acquire that granted it claimed a reference; a force-release of the
    lease consumes that claim too.
    """

    lease_id: int
    slot_id: int
    kind: LeaseKind
    timeout: float | None  # renewal window (s); None: no deadline
    deadline: float | None
    holder_pid: int = 0
    claimed: bool = False
    consumer: tuple[str, int] | None = None  # the consumer agent (node, incarnation)
    #: An RDMA lease on a plain slot: the windows registered for it (a WindowSet); they
    #: are unregistered when the lease ends, before the slot's bytes may go.
    windows: WindowSet | None = None


@dataclass(slots=True)
class Slot:
    """One staged payload. ``location`` is opaque here: the owner's placement record.

    ``ended`` is None while the handle lives, else why it ended (its bytes may still be held
    by leases). ``given`` counts every reference ever given (initial + ``ref``): the number of
    consumers the handle allows.
    """

    slot_id: int
    total_len: int
    type_header: TypeHeader
    kind: SlotKind
    pinned: bool
    location: Location
    refcount: int
    ttl_deadline: float | None
    given: int = 1
    claimed: int = 0
    ended: str | None = None
    leases: set[int] = field(default_factory=set)
    #: Its producer asked for registered memory and got plain (the budget could not take
    #: it): consumers that can may GET it through windows (``ray_velo.memory.windows``).
    windowable: bool = False
    job: str = ""  # the Ray job that staged it (hex); "": none known, followed by nothing
    detached: bool = False  # outlives its job on purpose (lifetime="detached")

    @property
    def follows_job(self) -> bool:
        """Whether the handle ends when its job does."""
        return bool(self.job) and not self.detached


class SlotView(Protocol):
    """A slot as the store lends it out: read-only (only the store's methods change a slot),
    and read under the lock the caller holds; what the other roles read of it."""

    @property
    def slot_id(self) -> int: ...
    @property
    def total_len(self) -> int: ...
    @property
    def type_header(self) -> TypeHeader: ...
    @property
    def kind(self) -> SlotKind: ...
    @property
    def pinned(self) -> bool: ...
    @property
    def location(self) -> Location: ...
    @property
    def refcount(self) -> int: ...
    @property
    def claimed(self) -> int: ...
    @property
    def ended(self) -> str | None: ...
    @property
    def leases(self) -> AbstractSet[int]: ...
    @property
    def windowable(self) -> bool: ...
    @property
    def job(self) -> str: ...
    @property
    def detached(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class FreedSlot:
    """A slot whose bytes may go: return ``location`` to its memory. ``why`` for logs.

    ``abandoned``: its last lease ended by a deadline or a TTL, not by its consumer, so a
    chunk handed out just before may still be on its way (the owner keeps a grace).
    """

    slot_id: int
    kind: SlotKind
    pinned: bool
    total_len: int
    location: Location
    why: str
    abandoned: bool = False


@dataclass(slots=True)
class SweepResult:
    """What one ``sweep`` did."""

    freed: list[FreedSlot] = field(default_factory=list)
    rdma_leases_reaped: int = 0
    chunked_leases_expired: int = 0
    wire_leases_expired: int = 0
    slots_expired: int = 0


@dataclass(slots=True)
class StoreCounters:
    """Plain integers counted where the work happens; the metrics layer exports them."""

    slots_staged: int = 0
    slots_freed: int = 0
    handles_ended: int = 0
    bytes_staged: int = 0
    leases_granted: int = 0
    leases_superseded: int = 0
    claims_refused: int = 0
    rdma_leases_reaped: int = 0
    chunked_leases_expired: int = 0
    wire_leases_expired: int = 0
    local_leases_reaped: int = 0
    slots_expired: int = 0
    slots_job_ended: int = 0


class SlotStore:
    """The slot table of one owner (one agent incarnation, ``worker_id``)."""

    def __init__(self, worker_id: int, *, node: str = "", id_key: bytes | None = None) -> None:
        """``id_key``: the key of this store's slot and lease ids (random by default; a test
        passes one to replay a run)."""
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
        self._job_slots: dict[str, dict[int, Slot]] = {}  # job -> its live followed slots
        self._tombstones: OrderedDict[int, str] = OrderedDict()
        self._consumers: dict[str, int] = {}  # consumer node -> its latest incarnation
        self._late_reads: set[int] = set()  # local leases granted while draining
        self._live_handles = 0
        self._staged_bytes = 0
        self._lease_kinds: Counter[str] = Counter()
        self._timers: list[tuple[float, int, int]] = []  # (due, _LEASE or _TTL, id): a heap
        self._by_consumer: dict[tuple[str, int], set[int]] = {}  # consumer -> its lease ids
        self._by_holder: dict[int, set[int]] = {}  # holder pid -> its lease ids
        self._ended_windows: list[WindowSet] = []  # window sets of ended leases, to close
        # Slot and lease ids are capabilities: random-looking and never repeated, so one
        # handle or lease names no other (protocol/ids.py).
        key = secrets.token_bytes(ID_KEY_BYTES) if id_key is None else id_key
        self._slot_ids = IdSequence(key, b"slot")
        self._lease_ids = IdSequence(key, b"lease")

    # --- staging ---------------------------------------------------------------------

    def reserve_slot_id(self) -> int:
        """A slot id for a slot staged later (``stage(slot_id=...)``), so a producer can hand
        out the handle while its commit is still on the way."""
        return next(self._slot_ids)

    def forget_reserved(self, slot_id: int, why: str) -> None:
        """A reserved slot id that will never be staged: remember why, for HandleNotFound."""
        self._remember(slot_id, why)

    def stage(
        self,
        total_len: int,
        type_header: TypeHeader,
        location: Location,
        *,
        kind: SlotKind,
        pinned: bool,
        now: float,
        ttl: float | None = None,
        refcount: int = 1,
        slot_id: int | None = None,
        job: str = "",
        detached: bool = False,
        windowable: bool = False,
    ) -> DataHandle:
        """Add a slot; it starts with ``refcount`` references. ``ttl`` in seconds.

        ``slot_id`` is one from :meth:`reserve_slot_id`; by default a fresh one. ``job``: the
        Ray job that staged it (its handle ends with that job unless ``detached``).
        ``windowable``: see :attr:`Slot.windowable`.
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
            given=refcount,
            job=job,
            detached=detached,
            windowable=windowable,
        )
        self._slots[slot.slot_id] = slot
        self._live_handles += 1
        self._staged_bytes += total_len
        if slot.ttl_deadline is not None:
            self._ttl_slots[slot.slot_id] = slot
            heapq.heappush(self._timers, (slot.ttl_deadline, _TTL, slot.slot_id))
        if slot.follows_job:
            self._job_slots.setdefault(job, {})[slot.slot_id] = slot
        self.counters.slots_staged += 1
        self.counters.bytes_staged += total_len
        return DataHandle(self.worker_id, slot.slot_id)

    # --- lookups ---------------------------------------------------------------------

    def _gone(self, handle: DataHandle, reason: str) -> HandleNotFound:
        return HandleNotFound(handle=str(handle), node=self.node, reason=reason)

    def held(self, handle: DataHandle) -> SlotView:
        """The slot for ``handle`` while its bytes are held, ended handle or not (for the
        leases already granted on it). Raises HandleNotFound once its bytes are gone."""
        return self._held(handle)

    def slot(self, handle: DataHandle) -> SlotView:
        """The slot of a live handle. Raises HandleNotFound (with the reason if known) once
        the handle ended, even while leases still hold its bytes."""
        return self._slot(handle)

    def _held(self, handle: DataHandle) -> Slot:
        if handle.worker_id != self.worker_id:
            raise self._gone(handle, "issued by another agent incarnation (the owner restarted?)")
        slot = self._slots.get(handle.slot_id)
        if slot is None:
            raise self._gone(handle, self._tombstones.get(handle.slot_id, "never staged here"))
        return slot

    def _slot(self, handle: DataHandle) -> Slot:
        slot = self._held(handle)
        if slot.ended is not None:
            raise self._gone(handle, slot.ended)
        return slot

    def is_live(self, handle: DataHandle) -> bool:
        """Whether ``handle`` names a slot of this store that has not ended."""
        if handle.worker_id != self.worker_id:
            return False
        slot = self._slots.get(handle.slot_id)
        return slot is not None and slot.ended is None

    def metadata(self, handle: DataHandle) -> HandleMetadata:
        """Size, refcount and pinned of ``handle``'s slot. Raises HandleNotFound."""
        slot = self._slot(handle)
        return HandleMetadata(size=slot.total_len, refcount=slot.refcount, pinned=slot.pinned)

    def lease(self, lease_id: int) -> Lease:
        """The held lease ``lease_id``. Raises LeaseNotFound."""
        lease = self._leases.get(lease_id)
        if lease is None:
            raise LeaseNotFound(handle="?", lease_id=lease_id)
        return lease

    def slots(self) -> Iterable[SlotView]:
        """Every slot whose bytes are held (a live view: do not change the store meanwhile)."""
        return self._slots.values()

    @property
    def live_slots(self) -> int:
        """Slots whose bytes are held (live handles and ended ones still being read)."""
        return len(self._slots)

    @property
    def live_handles(self) -> int:
        """Slots whose handle has not ended."""
        return self._live_handles

    @property
    def live_leases(self) -> int:
        """Leases held on slots."""
        return len(self._leases)

    @property
    def staged_bytes(self) -> int:
        """Bytes of every slot whose bytes are held."""
        return self._staged_bytes

    def leases_of(self, kind: LeaseKind, now: float | None = None) -> int:
        """Leases of ``kind`` held (shutdown drains ``rdma``, then ``chunked``); with ``now``,
        only those whose deadline has not passed (an expired one has no consumer left: a
        count over the timed leases, for shutdown's drain only)."""
        if now is None:
            return self._lease_kinds[kind]
        return sum(
            1 for lease in self._leases.values()
            if lease.kind == kind and (lease.deadline is None or lease.deadline > now)
        )  # fmt: skip

    @property
    def late_reads(self) -> int:
        """Local leases granted while draining, still held: a fetch that finished during the
        drain, whose reader maps the copy before the files go."""
        return len(self._late_reads)

    # --- leases and claims -----------------------------------------------------------

    def acquire(
        self,
        handle: DataHandle,
        now: float,
        *,
        kind: LeaseKind,
        timeout: float | None = None,
        holder_pid: int = 0,
        claim: bool = False,
        consumer: tuple[str, int] | None = None,
        windows: WindowSet | None = None,
    ) -> Lease:
        """Take a read lease on a live handle. ``timeout`` (s) arms a deadline renewed by
        renew/pull; ``claim`` also claims one unclaimed reference; ``consumer`` names the
        consumer agent it is for (see :meth:`supersede`); ``windows``: the window set the
        lease's GET reads through (closed when it ends: :meth:`take_ended_windows`).

        An RDMA lease must have a timeout (the owner cannot see a GET stop), and so must a
        wire lease (its reader may stop reading).

        Raises:
            HandleNotFound: the handle ended (or never was).
            HandleReleased: ``claim`` and every reference is claimed already.
        """
        slot = self._slot(handle)
        if kind in ("rdma", "wire") and timeout is None:
            raise ProtocolError(f"an {kind} lease always carries a deadline")
        if claim:
            self._claim(slot, handle)
        lease = Lease(
            lease_id=next(self._lease_ids),
            slot_id=slot.slot_id,
            kind=kind,
            timeout=timeout,
            deadline=None if timeout is None else now + timeout,
            holder_pid=holder_pid,
            claimed=claim,
            consumer=consumer,
            windows=windows,
        )
        self._leases[lease.lease_id] = lease
        self._lease_kinds[kind] += 1
        if self.draining and kind == "local":
            self._late_reads.add(lease.lease_id)
        slot.leases.add(lease.lease_id)
        if lease.deadline is not None:
            self._timed_leases[lease.lease_id] = lease
            heapq.heappush(self._timers, (lease.deadline, _LEASE, lease.lease_id))
        if consumer is not None:
            self._by_consumer.setdefault(consumer, set()).add(lease.lease_id)
        if holder_pid:
            self._by_holder.setdefault(holder_pid, set()).add(lease.lease_id)
        self.counters.leases_granted += 1
        return lease

    def supersede(self, node: str, worker: int) -> tuple[list[FreedSlot], int]:
        """Consumer agent ``worker`` now speaks for ``node``: an older incarnation there is
        gone, so its leases end now (detached, their claims given back: it consumed nothing).
        Returns the slots whose bytes may go and how many RDMA leases ended."""
        previous = self._consumers.get(node)
        self._consumers[node] = worker
        if previous is None or previous == worker:
            return [], 0
        freed: list[FreedSlot] = []
        rdma = 0
        for lease_id in list(self._by_consumer.get((node, previous), ())):
            lease = self._leases[lease_id]
            slot = self._slots[lease.slot_id]
            self._drop_lease(slot, lease)
            self.counters.leases_superseded += 1
            rdma += lease.kind == "rdma"
            if lease.claimed and slot.ended is None and slot.claimed > 0:
                slot.claimed -= 1
            done = self._free_if_done(slot, "its consumer agent restarted", abandoned=True)
            if done is not None:
                freed.append(done)
        return freed, rdma

    def _claim(self, slot: Slot, handle: DataHandle) -> None:
        if slot.refcount - slot.claimed < 1:
            self.counters.claims_refused += 1
            raise HandleReleased(
                handle=str(handle),
                allowed=slot.given,
                option="rv.ref_handle(h) once per extra consumer (consumers=N under @rv.transfer)",
            )
        slot.claimed += 1

    def unclaim(self, handle: DataHandle) -> FreedSlot | None:
        """Give one claim back (its consumer will not consume it: a retried task, a dead
        resolver). A handle that ended meanwhile has nothing to give back to."""
        slot = self._held(handle)
        if slot.ended is None and slot.claimed > 0:
            slot.claimed -= 1
        return None

    def _lease_on(self, handle: DataHandle, lease_id: int) -> tuple[Slot, Lease]:
        slot = self._held(handle)
        lease = self._leases.get(lease_id)
        if lease is None or lease.slot_id != slot.slot_id:
            raise LeaseNotFound(handle=str(handle), lease_id=lease_id)
        return slot, lease

    def renew(self, handle: DataHandle, lease_id: int, now: float) -> None:
        """Push the lease's deadline one timeout past ``now`` (no-op without a deadline)."""
        _, lease = self._lease_on(handle, lease_id)
        if lease.timeout is not None:
            lease.deadline = now + lease.timeout

    def pull(self, transfer_id: int, now: float) -> SlotView:
        """A chunk pull on ``transfer_id`` (a chunked lease id): renews its deadline."""
        lease = self._leases.get(transfer_id)
        if lease is None or lease.kind in ("rdma", "wire"):
            raise LeaseNotFound(handle="?", lease_id=transfer_id)
        if lease.timeout is not None:
            lease.deadline = now + lease.timeout
        return self._slots[lease.slot_id]

    def sending(self, handle: DataHandle, lease_id: int, now: float) -> SlotView:
        """The slot of wire lease ``lease_id`` on ``handle``, while the owner may send its
        bytes: the lease is a wire lease on that handle and its deadline has not passed
        (the sweep may not have run yet). Renews nothing: its reader does.

        Raises:
            LeaseNotFound: no such live wire lease (it ended, expired, or is of another
                kind, or on another handle).
        """
        lease = self._leases.get(lease_id)
        slot = self._slots.get(handle.slot_id) if handle.worker_id == self.worker_id else None
        if (
            lease is None
            or slot is None
            or lease.slot_id != slot.slot_id
            or lease.kind != "wire"
            or (lease.deadline is not None and lease.deadline <= now)
        ):
            raise LeaseNotFound(handle=str(handle), lease_id=lease_id)
        return slot

    def ref(self, handle: DataHandle) -> int:
        """One more reference, for one more consumer. Returns the new refcount."""
        slot = self._slot(handle)
        slot.refcount += 1
        slot.given += 1
        return slot.refcount

    def detach(self, handle: DataHandle, lease_id: int, *, claim: bool = False) -> FreedSlot | None:
        """Drop the read lock (``lease_id`` 0: none); the handle stays usable while it has
        references. ``claim``: also give one claim back.

        Returns the slot if its bytes may go now (an ended handle's last lease).
        """
        if lease_id == 0:
            if not claim:
                raise LeaseNotFound(handle=str(handle), lease_id=0)
            return self.unclaim(handle)
        slot, lease = self._lease_on(handle, lease_id)
        self._drop_lease(slot, lease)
        if claim and slot.claimed > 0 and slot.ended is None:
            slot.claimed -= 1
        return self._free_if_done(slot, RELEASED_BY_CONSUMERS)

    def release(
        self, handle: DataHandle, lease_id: int, *, claim: bool = False
    ) -> FreedSlot | None:
        """Drop the read lock and one reference; the handle ends at zero.

        ``lease_id == 0`` drops a reference without a lease. ``claim``: the reference is one
        this consumer claimed. Returns the slot if its bytes may go now.
        """
        if lease_id == 0:
            slot = self._held(handle)
        else:
            slot, lease = self._lease_on(handle, lease_id)
            self._drop_lease(slot, lease)
        return self._unref(slot, RELEASED_BY_CONSUMERS, claim=claim)

    def lease_windows(self, handle: DataHandle, lease_id: int) -> WindowSet | None:
        """The window set of RDMA lease ``lease_id`` on ``handle`` (None: it has none).

        Raises:
            HandleNotFound, LeaseNotFound: the handle or the lease is gone.
        """
        return self._lease_on(handle, lease_id)[1].windows

    def take_ended_windows(self) -> list[WindowSet]:
        """The window sets of the leases ended since the last call: the caller closes them
        before it frees any slot those calls returned."""
        ended, self._ended_windows = self._ended_windows, []
        return ended

    def _drop_lease(self, slot: Slot, lease: Lease) -> None:
        if lease.windows is not None:
            self._ended_windows.append(lease.windows)
        lease_id = lease.lease_id
        del self._leases[lease_id]
        self._lease_kinds[lease.kind] -= 1
        self._timed_leases.pop(lease_id, None)  # its timer entry goes when it surfaces
        self._late_reads.discard(lease_id)
        slot.leases.discard(lease_id)
        if lease.consumer is not None:
            _unindex(self._by_consumer, lease.consumer, lease_id)
        if lease.holder_pid:
            _unindex(self._by_holder, lease.holder_pid, lease_id)

    def _unref(
        self, slot: Slot, why: str, *, claim: bool = False, abandoned: bool = False
    ) -> FreedSlot | None:
        if slot.ended is None:
            slot.refcount = max(0, slot.refcount - 1)
            if claim and slot.claimed > 0:
                slot.claimed -= 1
            slot.claimed = min(slot.claimed, slot.refcount)
            if slot.refcount == 0:
                self._end(slot, why)
        return self._free_if_done(slot, why, abandoned=abandoned)

    def _end(self, slot: Slot, why: str) -> None:
        """The handle ends (its bytes stay while leases hold them)."""
        slot.ended = why
        slot.claimed = 0
        self._live_handles -= 1
        self._ttl_slots.pop(slot.slot_id, None)
        job_slots = self._job_slots.get(slot.job, {})
        job_slots.pop(slot.slot_id, None)
        if not job_slots:
            self._job_slots.pop(slot.job, None)
        self.counters.handles_ended += 1

    def _expire(self, slot: Slot, why: str) -> FreedSlot | None:
        """End a live handle as a TTL does: its chunked and wire leases end with it (their
        consumers gave up; the owner sends them nothing more); an RDMA lease (a GET may
        still read) or a local one (a view) keeps the bytes until it ends."""
        self._end(slot, why)
        for lease_id in list(slot.leases):
            lease = self._leases[lease_id]
            if lease.kind in _SENT_TO:
                self._drop_lease(slot, lease)
        return self._free_if_done(slot, why, abandoned=True)

    def _free_if_done(self, slot: Slot, why: str, *, abandoned: bool = False) -> FreedSlot | None:
        if slot.ended is None or slot.leases:
            return None
        del self._slots[slot.slot_id]
        self._staged_bytes -= slot.total_len
        self._remember(slot.slot_id, slot.ended)
        self.counters.slots_freed += 1
        return FreedSlot(
            slot.slot_id, slot.kind, slot.pinned, slot.total_len, slot.location, why, abandoned
        )

    def _remember(self, slot_id: int, why: str) -> None:
        self._tombstones[slot_id] = why
        while len(self._tombstones) > _TOMBSTONES:
            self._tombstones.popitem(last=False)

    # --- deadlines -------------------------------------------------------------------

    def _current(self, tag: int, item_id: int) -> float | None:
        """The deadline a timer entry stands for now (None: it ended)."""
        if tag == _TTL:
            slot = self._ttl_slots.get(item_id)
            return None if slot is None else slot.ttl_deadline
        lease = self._timed_leases.get(item_id)
        return None if lease is None else lease.deadline

    def next_deadline(self) -> float | None:
        """The earliest lease deadline or TTL, or None when nothing is timed. Drops the
        stale entries on top of the heap (ended, or renewed to later: pushed again)."""
        timers = self._timers
        while timers:
            due, tag, item_id = timers[0]
            current = self._current(tag, item_id)
            if current is None:
                heapq.heappop(timers)
            elif current > due:
                heapq.heapreplace(timers, (current, tag, item_id))
            else:
                return due
        return None

    def _due(self, now: float) -> tuple[list[Slot], list[Lease]]:
        """The TTL slots and timed leases due at ``now``, taken off the heap (the entries of
        leases renewed past ``now`` go back at their new deadline)."""
        slots: list[Slot] = []
        leases: list[Lease] = []
        timers = self._timers
        while timers and timers[0][0] <= now:
            _, tag, item_id = heapq.heappop(timers)
            current = self._current(tag, item_id)
            if current is None:
                continue
            if current > now:
                heapq.heappush(timers, (current, tag, item_id))
            elif tag == _TTL:
                slots.append(self._ttl_slots[item_id])
            else:
                leases.append(self._timed_leases[item_id])
        return slots, leases

    def sweep(self, now: float) -> SweepResult:
        """Expire TTLs (the handle ends, its chunked leases with it) and force-release
        remote leases past their deadline."""
        result = SweepResult()
        due_slots, due_leases = self._due(now)
        for slot in due_slots:
            result.slots_expired += 1
            freed = self._expire(slot, TTL_EXPIRED)
            if freed is not None:
                result.freed.append(freed)
        for lease in due_leases:
            if lease.lease_id not in self._timed_leases:
                continue  # ended by a TTL above (a chunked lease)
            slot = self._slots[lease.slot_id]
            self._drop_lease(slot, lease)
            if lease.kind == "rdma":
                result.rdma_leases_reaped += 1
                why = "its RDMA lease was reaped: no renewal within lease_timeout"
            elif lease.kind == "wire":
                result.wire_leases_expired += 1
                why = "its wire lease expired: no renewal within lease_timeout"
            else:
                result.chunked_leases_expired += 1
                why = "its chunked lease expired: no pull within the fetch bound"
            freed = self._unref(slot, why, claim=lease.claimed, abandoned=True)
            if freed is not None:
                result.freed.append(freed)
        self.counters.rdma_leases_reaped += result.rdma_leases_reaped
        self.counters.chunked_leases_expired += result.chunked_leases_expired
        self.counters.wire_leases_expired += result.wire_leases_expired
        self.counters.slots_expired += result.slots_expired
        return result

    # --- jobs ------------------------------------------------------------------------

    def followed_jobs(self) -> set[str]:
        """The jobs with a live handle that ends with them (the agent watches these)."""
        return set(self._job_slots)

    def follows(self, job: str) -> bool:
        """Whether a live handle of ``job`` ends with it."""
        return job in self._job_slots

    def end_job(self, job: str) -> tuple[list[int], list[FreedSlot]]:
        """Job ``job`` ended: end its handles (not the detached ones) as a TTL does. Returns
        the slot ids whose handles ended and the slots whose bytes may go now."""
        ended: list[int] = []
        freed: list[FreedSlot] = []
        for slot in list(self._job_slots.get(job, {}).values()):
            ended.append(slot.slot_id)
            done = self._expire(slot, JOB_ENDED)
            if done is not None:
                freed.append(done)
        self.counters.slots_job_ended += len(ended)
        return ended, freed

    # --- local readers ---------------------------------------------------------------

    def holder_pids(self) -> set[int]:
        """Processes on this node holding local leases (the agent checks they live)."""
        return set(self._by_holder)

    def read_by(self, pids: Iterable[int]) -> set[int]:
        """The slots that processes ``pids`` hold local leases on."""
        return {
            self._leases[lease_id].slot_id
            for pid in set(pids)
            for lease_id in self._by_holder.get(pid, ())
        }

    def reap_holders(self, dead_pids: Iterable[int]) -> list[FreedSlot]:
        """End every local lease held by a process that died (a detach: a reader's
        reference was consumed, or not, when it acquired)."""
        freed: list[FreedSlot] = []
        held = [lease_id for pid in set(dead_pids) for lease_id in self._by_holder.get(pid, ())]
        for lease_id in held:
            lease = self._leases[lease_id]
            slot = self._slots[lease.slot_id]
            self._drop_lease(slot, lease)
            self.counters.local_leases_reaped += 1
            done = self._free_if_done(slot, "its reader process died")
            if done is not None:
                freed.append(done)
        return freed

    # --- drain and eviction ----------------------------------------------------------

    def begin_drain(self) -> None:
        """From now on the owner answers no descriptor (reason ``draining``)."""
        self.draining = True

    def relocate(
        self, slot_id: int, location: Location, *, kind: SlotKind, pinned: bool
    ) -> Location:
        """Move a held slot's bytes elsewhere (shutdown demotes registered slots to plain
        memory); returns the old location, or None when the slot's bytes are gone."""
        slot = self._slots.get(slot_id)
        if slot is None:
            return None
        old = slot.location
        slot.location, slot.kind, slot.pinned = location, kind, pinned
        return old

    def end(self, handle: DataHandle, why: str) -> FreedSlot | None:
        """End a live handle now (e.g. its node-local copy's last reader is gone); its bytes
        go when its leases do. Returns the slot if they may go at once."""
        slot = self._slot(handle)
        self._end(slot, why)
        return self._free_if_done(slot, why)

    def evict(self, handle: DataHandle, why: str) -> FreedSlot:
        """End a slot and drop every lease on it now (its memory went away, e.g. a region)."""
        slot = self._held(handle)
        if slot.ended is None:
            self._end(slot, why)
        for lease_id in list(slot.leases):
            self._drop_lease(slot, self._leases[lease_id])
        freed = self._free_if_done(slot, why)
        assert freed is not None
        return freed

    def clear(self) -> list[FreedSlot]:
        """End and free every slot (shutdown). Returns them, for their memory to go."""
        out = []
        for slot in list(self._slots.values()):
            out.append(self.evict(DataHandle(self.worker_id, slot.slot_id), "its owner shut down"))
        return out

    # --- invariants ------------------------------------------------------------------

    def validate(self) -> None:
        """Check the store's invariants; tests call this after every step.

        Every lease sits on a held slot that lists it; a lease is timed iff it has a
        deadline, and an RDMA lease always has one. A live handle has references, and no
        more claims than references; an ended one still has leases (else its bytes would
        have gone) and no TTL. No held slot id is a tombstone; staged minus freed equals held.

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
            if lease.kind in ("rdma", "wire"):
                _check(lease.deadline is not None, f"{lease.kind} lease {lease_id} has no deadline")
        for slot_id, slot in self._slots.items():
            self._validate_slot(slot_id, slot)
        for lease_id in self._timed_leases:
            _check(lease_id in self._leases, f"timed lease {lease_id} is not held")
        for lease_id in self._late_reads:
            _check(self._leases.get(lease_id) is not None, f"late read {lease_id} is not held")
        for slot_id in self._ttl_slots:
            _check(slot_id in self._slots, f"TTL on freed slot {slot_id}")
        followed = {(s.job, i) for i, s in self._slots.items() if s.follows_job and not s.ended}
        indexed = {(job, i) for job, slots in self._job_slots.items() for i in slots}
        _check(followed == indexed, f"job index {sorted(indexed)} != followed {sorted(followed)}")
        _check(all(self._job_slots.values()), "a job index entry without slots")
        self._validate_counts()
        counters = self.counters
        _check(
            counters.slots_staged - counters.slots_freed == len(self._slots),
            f"{counters.slots_staged} staged - {counters.slots_freed} freed "
            f"!= {len(self._slots)} held",
        )

    def _validate_counts(self) -> None:
        """The counts and indexes kept as the work happens equal a recount."""
        slots = self._slots.values()
        live = sum(1 for s in slots if s.ended is None)
        _check(self._live_handles == live, f"live handles {self._live_handles} != {live}")
        staged = sum(s.total_len for s in slots)
        _check(self._staged_bytes == staged, f"staged bytes {self._staged_bytes} != {staged}")
        kinds = Counter(lease.kind for lease in self._leases.values())
        _check(+self._lease_kinds == kinds, f"lease kinds {self._lease_kinds} != {kinds}")
        by_consumer: dict[tuple[str, int], set[int]] = {}
        by_holder: dict[int, set[int]] = {}
        for lease_id, lease in self._leases.items():
            if lease.consumer is not None:
                by_consumer.setdefault(lease.consumer, set()).add(lease_id)
            if lease.holder_pid:
                by_holder.setdefault(lease.holder_pid, set()).add(lease_id)
        _check(self._by_consumer == by_consumer, "the leases-by-consumer index disagrees")
        _check(self._by_holder == by_holder, "the leases-by-holder index disagrees")
        earliest: dict[tuple[int, int], float] = {}
        for due, tag, item_id in self._timers:
            earliest[(tag, item_id)] = min(due, earliest.get((tag, item_id), due))
        for tag, items in ((_LEASE, self._timed_leases), (_TTL, self._ttl_slots)):
            for item_id in items:
                current = self._current(tag, item_id)
                entry = earliest.get((tag, item_id))
                _check(
                    current is not None and entry is not None and entry <= current,
                    f"timer of {('lease', 'TTL')[tag]} {item_id}: entry {entry}, due {current}",
                )

    def _validate_slot(self, slot_id: int, slot: Slot) -> None:
        _check(slot.slot_id == slot_id, f"slot {slot_id} filed as {slot.slot_id}")
        _check(slot.refcount >= 0, f"slot {slot_id} refcount {slot.refcount}")
        if slot.ended is None:
            _check(slot.refcount > 0, f"slot {slot_id} unreferenced but its handle lives")
            _check(
                0 <= slot.claimed <= slot.refcount,
                f"slot {slot_id}: {slot.claimed} claims on {slot.refcount} references",
            )
        else:
            _check(bool(slot.leases), f"ended slot {slot_id} has no lease but was not freed")
            _check(slot.slot_id not in self._ttl_slots, f"ended slot {slot_id} keeps a TTL")
        for lease_id in slot.leases:
            held = self._leases.get(lease_id)
            _check(
                held is not None and held.slot_id == slot_id,
                f"slot {slot_id} lists lease {lease_id}, which is not on it",
            )
        if slot.ended is None:
            _check(
                (slot.ttl_deadline is not None) == (self._ttl_slots.get(slot_id) is slot),
                f"slot {slot_id}: ttl {slot.ttl_deadline}, TTL index disagrees",
            )
        _check(slot_id not in self._tombstones, f"held slot {slot_id} has a tombstone")


def _check(condition: bool, message: str) -> None:
    # Not `assert`: validate() must check under `python -O` as well.
    if not condition:
        raise AssertionError(message)


def _unindex(index: dict[_K, set[int]], key: _K, lease_id: int) -> None:
    """Take ``lease_id`` out of ``index[key]``, and the key out once its set is empty."""
    ids = index.get(key)
    if ids is not None:
        ids.discard(lease_id)
        if not ids:
            del index[key]
