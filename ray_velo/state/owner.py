"""The owner's state: an agent's slots, the leases on them, and the buffers under them; pure, the
only user of the slot table (docs/architecture.md §4)."""

from __future__ import annotations

import heapq
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, TypeGuard

from ray_velo.errors import HandleNotFound, ProtocolError
from ray_velo.protocol.handle import DataHandle
from ray_velo.protocol.ids import ID_KEY_BYTES
from ray_velo.protocol.messages import TypeHeader
from ray_velo.state.ledger import Buffer, BufferLedger, Effects, Holder, HolderKind, Holdings
from ray_velo.state.progress import ReadGate, StreamedWrites
from ray_velo.state.relays import CopySources
from ray_velo.state.store import (
    FreedSlot,
    Lease,
    LeaseKind,
    SlotKind,
    SlotStore,
    SlotView,
    StoreCounters,
)

if TYPE_CHECKING:
    from ray_velo.memory.region import InFlight, Region
    from ray_velo.memory.windows import WindowSet

__all__ = [
    "PRODUCER_DIED",
    "PRODUCER_FAILED",
    "PULL_GRACE_S",
    "Buffer",
    "Effects",
    "OwnerCounts",
    "OwnerState",
    "PullPlan",
    "ReadMode",
    "RegionSlot",
    "SendPlan",
    "SlotWatcher",
]

#: How long a slot's bytes stay out of the pool after its last chunk was handed out as a view
#: (Ray serializes a returned view after the method returns: milliseconds for 16 MiB).
PULL_GRACE_S = 1.0
PRODUCER_DIED = "the process that staged it died"
PRODUCER_FAILED = "the process that staged it failed to write its bytes"
#: The ledger's holder kinds this state keeps (the quarantine is the ledger's own).
HOLDS: tuple[HolderKind, ...] = ("slot", "parked", "grace", "demoted")

ReadMode = Literal["release", "detach", "hold", "claim"]


@dataclass(frozen=True, slots=True)
class RegionSlot:
    """A slot staged in a caller's region: no copy; an in-flight anchor held while it lives."""

    region: Region
    anchor: InFlight
    offset: int


@dataclass(frozen=True, slots=True)
class PullPlan:
    """One chunk to serve: ``[start, start + length)`` of ``slot``'s bytes.

    ``view``: a pool slot: hand out a view (the grace protects it). Otherwise a region slot:
    copy under its copy gate, then :meth:`OwnerState.end_read`.
    """

    slot: SlotView
    start: int
    length: int
    view: bool


@dataclass(frozen=True, slots=True)
class SendPlan:
    """Bytes ``[start, stop)`` of ``slot`` to send to the reader of a wire lease: a read in
    progress (the bytes stay) until :meth:`OwnerState.end_read`. ``location`` is where they
    were when the send began (shutdown may move the slot; the read keeps these)."""

    slot: SlotView
    location: Buffer | RegionSlot
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class OwnerCounts:
    """What the owner state holds, for ``ray-velo status``, the gauges and the drain.
    ``rdma_leases`` / ``chunked_leases`` / ``wire_leases``: those whose deadline has not
    passed."""

    live_slots: int
    live_handles: int
    live_leases: int
    staged_bytes: int
    rdma_leases: int
    chunked_leases: int
    wire_leases: int
    late_reads: int
    quarantined_bytes: int
    copy_sources: int
    draining: bool
    counters: StoreCounters


class SlotWatcher(Protocol):
    """Who hears of this state's slots (the node's consumer-side state, which keeps some of
    them as copies of other nodes' payloads)."""

    def slot_ended(self, slot_id: int) -> None:
        """Slot ``slot_id``'s bytes may go now."""

    def reader_left(self, slot_id: int, now: float, fx: Effects) -> None:
        """A reader of slot ``slot_id`` ended its lease (or died)."""


class _NoWatcher:
    def slot_ended(self, slot_id: int) -> None:
        return None

    def reader_left(self, slot_id: int, now: float, fx: Effects) -> None:
        return None


class OwnerState:
    """One agent's slots and the buffers under them. Not
    thread-safe: the agent holds one lock around every call."""

    def __init__(
        self,
        worker_id: int,
        node: str = "",
        *,
        pull_grace_s: float = PULL_GRACE_S,
        id_key: bytes | None = None,
    ) -> None:
        """``id_key``: the key of the slot, lease and relay-lease ids (random by default; a
        test passes one to replay a run)."""
        self.id_key = secrets.token_bytes(ID_KEY_BYTES) if id_key is None else id_key
        self._store = SlotStore(worker_id, node=node, id_key=self.id_key)
        self.worker_id = worker_id
        self.node = node
        self.pull_grace_s = pull_grace_s
        self.ledger = BufferLedger()
        #: Set by the consumer-side state built over this one.
        self.watcher: SlotWatcher = _NoWatcher()
        #: Reads in progress (a copy out of a slot, a region's chunk, a producer writing):
        #: the bytes of a slot freed meanwhile are parked until the last one ends.
        self.reads = ReadGate()
        #: Slots committed before their producer wrote all their bytes (streamed staging):
        #: each write holds a read, so the buffer cannot go back while it may be written.
        self.writes = StreamedWrites(worker_id, node)
        self._pulled_at: dict[int, float] = {}
        self._grace: list[tuple[float, int, FreedSlot]] = []  # a heap: (end, slot id, ...)
        self._followed: dict[int, set[DataHandle]] = {}  # pid -> handles that end with it
        self._demoted: list[FreedSlot] = []  # registered bytes of slots shutdown demoted
        #: The copies of our handles on other nodes (see ray_velo.state.relays).
        self.sources = CopySources()

    # --- staging ---------------------------------------------------------------------

    def reserve_slot_id(self) -> int:
        """A slot id for a slot :meth:`stage` makes later (a producer's handle is known
        before its commit lands)."""
        return self._store.reserve_slot_id()

    def forget_reserved(self, slot_id: int, why: str) -> None:
        """A reserved slot id that will never be staged: remember why, for HandleNotFound."""
        self._store.forget_reserved(slot_id, why)

    def stage(
        self,
        location: Buffer | RegionSlot | None,
        holder: Holder | None,
        total_len: int,
        type_header: TypeHeader,
        now: float,
        fx: Effects,
        *,
        kind: SlotKind,
        pinned: bool,
        ttl: float | None = None,
        refcount: int = 1,
        slot_id: int | None = None,
        job: str = "",
        detached: bool = False,
        windowable: bool = False,
        follow_pid: int = 0,
    ) -> SlotView:
        """A new slot over ``location``: a pool buffer that ``holder`` (its ledger entry)
        hands over, a caller's region, or None (zero bytes); ``holder`` is None for the last
        two, which no ledger entry holds. ``job``: the Ray job that
        staged it (the handle ends with it unless ``detached``); ``follow_pid``: the handle
        ends when that process dies (a Ray Direct Transport object's source); ``windowable``:
        its producer asked for registered memory and got plain.

        Raises:
            ValueError: the store refused it (the buffer went back to its pool, in ``fx``).
        """
        new_job = bool(job) and not detached and not self._store.follows(job)
        buffer = location if _is_buffer(location) else None
        try:
            handle = self._store.stage(
                total_len, type_header, location, kind=kind, pinned=pinned, now=now, ttl=ttl,
                refcount=refcount, slot_id=slot_id, job=job, detached=detached,
                windowable=windowable,
            )  # fmt: skip
        except Exception:
            if buffer is not None and holder is not None:
                self.ledger.give_back(buffer, holder, pinned, fx)
            raise
        slot = self._store.held(handle)
        if buffer is not None and holder is not None:
            self.ledger.move(buffer, holder, Holder("slot", slot.slot_id))
        fx.poke = fx.poke or ttl is not None or new_job  # a new job: the timer watches it
        if follow_pid:
            followed = self._followed.setdefault(follow_pid, set())
            followed.add(handle)
            if len(followed) >= 64 and len(followed) & (len(followed) - 1) == 0:
                # A long-lived producer: forget its handles that already ended (amortised).
                followed.intersection_update({h for h in followed if self._store.is_live(h)})
        return slot

    # --- streamed staging -------------------------------------------------------------

    def begin_writing(self, slot_id: int, pid: int, total_len: int) -> None:
        """Slot ``slot_id`` was committed before process ``pid`` wrote its bytes: readers
        wait for them (``writes.through``), and its buffer stays until :meth:`written`
        says all of them are there, or ``pid`` dies."""
        self.writes.begin(slot_id, pid, total_len)
        self.reads.begin(slot_id)

    def written(self, slot_id: int, upto: int, now: float, fx: Effects) -> None:
        """The producer wrote bytes ``[0, upto)`` of slot ``slot_id``; ``upto`` < 0: it
        failed to, and the handle ends (its readers hear why)."""
        if upto < 0:
            if self.writes.active(slot_id):
                self._stop_writing(slot_id, PRODUCER_FAILED, now, fx)
        elif self.writes.advance(slot_id, upto):
            self.end_read(slot_id, now, fx)

    def _stop_writing(self, slot_id: int, why: str, now: float, fx: Effects) -> None:
        """The producer will write no more of slot ``slot_id``: its handle ends (``why``),
        and its bytes go once no reader holds them."""
        self.writes.stop(slot_id, why)
        handle = DataHandle(self.worker_id, slot_id)
        if self._store.is_live(handle):
            self._bytes_end(self._store.end(handle, why), now, fx)
        self.end_read(slot_id, now, fx)

    # --- lookups ---------------------------------------------------------------------

    def slot(self, handle: DataHandle) -> SlotView:
        """The slot of a live handle. Raises HandleNotFound (with the reason if known)."""
        return self._store.slot(handle)

    def held_slot(self, slot_id: int) -> SlotView | None:
        """Slot ``slot_id`` while its bytes are held (its handle may have ended), or None."""
        try:
            return self._store.held(DataHandle(self.worker_id, slot_id))
        except HandleNotFound:
            return None

    def slots(self) -> Iterable[SlotView]:
        """Every slot whose bytes are held (a live view: do not change the state meanwhile)."""
        return self._store.slots()

    def followed_jobs(self) -> set[str]:
        """The Ray jobs whose end ends some live handle here (the agent watches them)."""
        return self._store.followed_jobs()

    def counts(self, now: float | None = None) -> OwnerCounts:
        """What the state holds now (with ``now``: leases past their deadline not counted)."""
        store = self._store
        return OwnerCounts(
            live_slots=store.live_slots,
            live_handles=store.live_handles,
            live_leases=store.live_leases,
            staged_bytes=store.staged_bytes,
            rdma_leases=store.leases_of("rdma", now),
            chunked_leases=store.leases_of("chunked", now),
            wire_leases=store.leases_of("wire", now),
            late_reads=store.late_reads,
            quarantined_bytes=self.ledger.quarantined_bytes,
            copy_sources=self.sources.count(),
            draining=store.draining,
            counters=store.counters,
        )

    # --- leases ----------------------------------------------------------------------

    def grant(
        self,
        handle: DataHandle,
        now: float,
        *,
        kind: LeaseKind,
        timeout: float | None = None,
        claim: bool = False,
        consumer: tuple[str, int] | None = None,
        windows: WindowSet | None = None,
        holder_pid: int = 0,
    ) -> Lease:
        """A lease for a consumer agent (RDMA or chunked) on a live handle; see
        :meth:`SlotStore.acquire <ray_velo.state.store.SlotStore.acquire>` for the arguments.

        Raises:
            HandleNotFound: the handle ended (or never was).
            HandleReleased: ``claim`` and every reference is claimed already.
        """
        return self._store.acquire(
            handle, now, kind=kind, timeout=timeout, holder_pid=holder_pid, claim=claim,
            consumer=consumer, windows=windows,
        )  # fmt: skip

    def ref(self, handle: DataHandle) -> int:
        """One more reference, for one more consumer. Returns the new refcount."""
        return self._store.ref(handle)

    def renew(self, handle: DataHandle, lease_id: int, now: float) -> WindowSet | None:
        """Push the lease's deadline on; returns its window set (None: none).

        Raises:
            HandleNotFound, LeaseNotFound: the handle or the lease is gone.
        """
        self._store.renew(handle, lease_id, now)
        windows: WindowSet | None = self._store.lease_windows(handle, lease_id)
        return windows

    def local_acquire(
        self, handle: DataHandle, pid: int, mode: ReadMode, now: float
    ) -> tuple[SlotView, Lease]:
        """A local lease for process ``pid`` reading ``handle`` in place.

        ``release``: the reader consumes a reference now (a claimed one: refused with
        HandleReleased when all are claimed), so the handle may end while the view lives
        (a fresh slot read so is the reader's alone: it ends with the lease).
        ``claim``: the reader claims one, consumed or given back later (the consumer state's
        ``claim_end``). ``detach`` / ``hold``: no reference changes hands.
        """
        claim = mode in ("release", "claim")
        lease = self._store.acquire(handle, now, kind="local", holder_pid=pid, claim=claim)
        slot = self._store.held(handle)
        if mode == "release":
            self._store.release(handle, 0, claim=True)  # the lease keeps the bytes
        return slot, lease

    def end_lease(
        self,
        handle: DataHandle,
        lease_id: int,
        release: bool,
        now: float,
        fx: Effects,
        *,
        claim: bool = False,
    ) -> None:
        """End a lease (``lease_id`` 0: none): ``release`` also drops one reference (with
        ``claim``: a claimed one); a detach with ``claim`` gives a claim back. The watcher
        hears that a reader left."""
        end = self._store.release if release else self._store.detach
        freed = end(handle, lease_id, claim=claim)
        self._bytes_end(freed, now, fx)
        if freed is None and lease_id:
            self.watcher.reader_left(handle.slot_id, now, fx)

    def end_slot(self, slot_id: int, why: str, now: float, fx: Effects) -> None:
        """End live slot ``slot_id``'s handle now (a node-local copy nobody reads); its
        bytes go when its leases do."""
        self._bytes_end(self._store.end(DataHandle(self.worker_id, slot_id), why), now, fx)

    def evict(self, handle: DataHandle, why: str, now: float, fx: Effects) -> None:
        """End ``handle`` and every lease on it now (its memory went away)."""
        self._bytes_end(self._store.evict(handle, why), now, fx)

    def supersede(self, node: str, worker: int, now: float, fx: Effects) -> int:
        """A consumer agent's new incarnation on ``node`` acquires: end the old one's
        leases (see :meth:`SlotStore.supersede`). Returns the RDMA leases ended."""
        freed, rdma = self._store.supersede(node, worker)
        self.sources.superseded(node, worker)
        for item in freed:
            self._bytes_end(item, now, fx)
        return rdma

    # --- reads out of a slot ---------------------------------------------------------

    def pull(self, transfer_id: int, index: int, chunk_size: int, now: float) -> PullPlan:
        """Chunk ``index`` of chunked transfer ``transfer_id`` (renews its lease). A region
        slot's chunk is a read in progress until :meth:`end_read`.

        Raises:
            LeaseNotFound: the transfer's lease is gone.
            ProtocolError: ``index`` is outside the payload.
        """
        slot = self._store.pull(transfer_id, now)
        start = index * chunk_size
        if index < 0 or start >= max(slot.total_len, 1):
            raise ProtocolError(
                f"chunk {index} is outside transfer {transfer_id} "
                f"({slot.total_len} bytes in chunks of {chunk_size})"
            )
        length = min(chunk_size, slot.total_len - start)
        if isinstance(slot.location, RegionSlot) or slot.location is None:
            self.reads.begin(slot.slot_id)
            return PullPlan(slot, start, length, view=False)
        self._pulled_at[slot.slot_id] = now
        return PullPlan(slot, start, length, view=True)

    def begin_send(
        self, handle: DataHandle, lease_id: int, start: int, stop: int, now: float
    ) -> SendPlan:
        """The owner starts sending bytes ``[start, stop)`` of ``handle`` to the reader of wire
        lease ``lease_id`` (over the agents' wire): a read in progress until
        :meth:`end_read`, so bytes freed meanwhile (the lease ended, the TTL fired) stay
        until the piece being sent is out.

        Raises:
            LeaseNotFound: no live wire lease ``lease_id`` on ``handle``.
            ProtocolError: the range is outside the payload, or empty.
        """
        slot = self._store.sending(handle, lease_id, now)
        location = slot.location
        if not 0 <= start < stop <= slot.total_len or location is None:
            raise ProtocolError(
                f"bytes [{start}, {stop}) are outside the {slot.total_len} bytes of {handle}"
            )
        self.reads.begin(slot.slot_id)
        return SendPlan(slot, location, start, stop)

    def still_sending(self, handle: DataHandle, lease_id: int, now: float) -> None:
        """Check, before each piece, that wire lease ``lease_id`` still lets the owner send.

        Raises:
            LeaseNotFound: it ended (released, expired, superseded, the handle's TTL or job).
        """
        self._store.sending(handle, lease_id, now)

    def take_ended_windows(self) -> list[WindowSet]:
        """The window sets of the leases ended since the last call: the caller closes them
        before it frees any buffer those calls gave back."""
        return self._store.take_ended_windows()

    def end_read(self, slot_id: int, now: float, fx: Effects) -> None:
        """A read of slot ``slot_id`` (``reads.begin``) ended: bytes freed meanwhile may go
        now."""
        for freed in self.reads.end(slot_id):
            _move_out(self.ledger, freed, Holder("parked", slot_id), fx)

    # --- timers and liveness ---------------------------------------------------------

    def sweep(self, now: float, fx: Effects) -> tuple[int, int]:
        """Expire TTLs and deadlines, and end the pull graces that are due. Returns the
        RDMA leases reaped and the chunked leases expired."""
        result = self._store.sweep(now)
        for freed in result.freed:
            self._bytes_end(freed, now, fx)
        while self._grace and self._grace[0][0] <= now:
            _, _, freed = heapq.heappop(self._grace)
            _move_out(self.ledger, freed, Holder("grace", freed.slot_id), fx)
        return result.rdma_leases_reaped, result.chunked_leases_expired

    def next_due(self) -> float | None:
        """The earliest deadline, TTL or grace end, or None."""
        due = [self._grace[0][0]] if self._grace else []
        store_due = self._store.next_deadline()
        if store_due is not None:
            due.append(store_due)
        return min(due, default=None)

    def watched_pids(self) -> set[int]:
        """Processes whose death the owner must notice: local readers, followed producers."""
        writers = self.writes.pids()
        return (self._store.holder_pids() | set(self._followed) | writers) - {0}

    def reap(self, dead: Iterable[int], now: float, fx: Effects) -> None:
        """Processes ``dead`` died: their local leases end (the watcher hears each slot they
        read), and the handles that followed them end."""
        dead = set(dead)
        for slot_id in self.writes.written_by(dead):
            self._stop_writing(slot_id, PRODUCER_DIED, now, fx)
        read = self._store.read_by(dead)
        for freed in self._store.reap_holders(dead):
            self._bytes_end(freed, now, fx)
        for slot_id in read:  # as if each reader's lease had ended
            self.watcher.reader_left(slot_id, now, fx)
        for pid in dead & set(self._followed):
            for handle in self._followed.pop(pid):
                if self._store.is_live(handle):
                    self._bytes_end(self._store.end(handle, PRODUCER_DIED), now, fx)

    def end_job(self, job: str, now: float, fx: Effects) -> int:
        """Ray job ``job`` ended: its handles end (not the detached ones) as a TTL ends one,
        and their bytes go once no reader, pull or GET may touch them. The agents holding
        copies of them hear it now, not when the bytes go: no new reader can come. Returns
        how many handles ended."""
        ended, freed = self._store.end_job(job)
        for slot_id in ended:
            for node, worker in self.sources.ended(slot_id):
                fx.copy_ends.append((DataHandle(self.worker_id, slot_id), node, worker))
        for item in freed:
            self._bytes_end(item, now, fx)
        return len(ended)

    # --- shutdown --------------------------------------------------------------------

    def begin_drain(self) -> None:
        """From now on the owner answers no descriptor (reason ``draining``)."""
        self._store.begin_drain()

    def demotion_begin(self) -> list[SlotView]:
        """Shutdown's demotion starts: the held slots in registered memory (the pool or a
        caller's region), each now a read in progress so its bytes stay while copied."""
        slots = [
            s for s in self._store.slots()
            if s.total_len and (s.pinned or isinstance(s.location, RegionSlot))
        ]  # fmt: skip
        for slot in slots:
            self.reads.begin(slot.slot_id)
        return slots

    def demote(
        self, slot: SlotView, copy: tuple[Buffer, Holder] | None, now: float, fx: Effects
    ) -> bool:
        """``slot`` was copied into plain buffer ``copy`` (buffer, its ledger holder; None:
        no copy, it stays where it is). The slot now lives there; its registered bytes wait
        under ``demoted:<id>`` until :meth:`release_demoted`, for a GET admitted before the
        gate. Ends the read :meth:`demotion_begin` began. Returns whether the slot moved."""
        moved = False
        if copy is not None:
            buffer, holder = copy
            slot_id, kind, pinned = slot.slot_id, slot.kind, slot.pinned
            old = self._store.relocate(slot_id, buffer, kind="plain", pinned=False)
            if old is None:  # its bytes went meanwhile: the copy is not needed
                self.ledger.give_back(buffer, holder, False, fx)
            else:
                if _is_buffer(old):
                    self.ledger.move(old, Holder("slot", slot_id), Holder("demoted", slot_id))
                self.ledger.move(buffer, holder, Holder("slot", slot_id))
                self._demoted.append(
                    FreedSlot(slot_id, kind, pinned, slot.total_len, old, "demoted")
                )
                moved = True
        self.end_read(slot.slot_id, now, fx)
        return moved

    def release_demoted(self, fx: Effects) -> int:
        """The GETs are drained (or out of time): registered bytes of demoted slots go back.
        Returns how many."""
        demoted, self._demoted = self._demoted, []
        for freed in demoted:
            _move_out(self.ledger, freed, Holder("demoted", freed.slot_id), fx)
        return len(demoted)

    def clear(self, now: float, fx: Effects) -> int:
        """Shutdown (after the reservations and the consumer-side state): end every slot and
        give back every buffer but the quarantined ones (their pool's close unmaps them).
        Returns the slots freed."""
        freed = self._store.clear()
        parked = self.reads.clear()
        self.writes.clear()
        self._pulled_at.clear()
        for item in freed:
            self._bytes_end(item, now, fx)
        for item in parked:
            _move_out(self.ledger, item, Holder("parked", item.slot_id), fx)
        for _, _, item in self._grace:
            _move_out(self.ledger, item, Holder("grace", item.slot_id), fx)
        self._grace.clear()
        self.release_demoted(fx)
        return len(freed)

    # --- where bytes go --------------------------------------------------------------

    def _bytes_end(self, freed: FreedSlot | None, now: float, fx: Effects) -> None:
        """A slot's bytes may go: after the copies out of it, and the pull grace if it was
        abandoned right after a chunk went out."""
        if freed is None:
            return
        slot_id = freed.slot_id
        self.watcher.slot_ended(slot_id)
        for node, worker in self.sources.ended(slot_id):
            fx.copy_ends.append((DataHandle(self.worker_id, slot_id), node, worker))
        buffer = freed.location if _is_buffer(freed.location) else None
        if self.reads.park(freed):
            if buffer is not None:
                self.ledger.move(buffer, Holder("slot", slot_id), Holder("parked", slot_id))
            return
        pulled = self._pulled_at.pop(slot_id, None)
        recent = pulled is not None and now < pulled + self.pull_grace_s
        if buffer is not None and freed.abandoned and recent:
            assert pulled is not None
            self.ledger.move(buffer, Holder("slot", slot_id), Holder("grace", slot_id))
            heapq.heappush(self._grace, (pulled + self.pull_grace_s, slot_id, freed))
            fx.poke = True
            return
        _move_out(self.ledger, freed, Holder("slot", slot_id), fx)

    # --- invariants ------------------------------------------------------------------

    def validate(self) -> None:
        """Check every invariant; tests call it after each step.

        The store's own; then its part of the ledger: rebuilt from slots, parked and graced
        slots and demoted bytes, it must equal what the ledger records for those holders
        (every buffer has one holder, none is lost or held twice). Reads in progress are
        positive.

        Raises:
            AssertionError: an invariant is broken; the message names it.
        """
        self._store.validate()
        expected: Holdings = {}

        def add(location: object, holder: Holder) -> None:
            if not _is_buffer(location):
                return
            key = location.key
            if key in expected:
                raise AssertionError(f"buffer {key} held by {expected[key]} and {holder}")
            expected[key] = holder

        for slot in self._store.slots():
            add(slot.location, Holder("slot", slot.slot_id))
        for freed in self.reads.parked():
            add(freed.location, Holder("parked", freed.slot_id))
        for _, _, freed in self._grace:
            add(freed.location, Holder("grace", freed.slot_id))
        for freed in self._demoted:
            add(freed.location, Holder("demoted", freed.slot_id))
        self.ledger.check(HOLDS, expected)
        self.reads.check()
        self.writes.check(self.reads)


def _move_out(ledger: BufferLedger, freed: FreedSlot, holder: Holder, fx: Effects) -> None:
    """A freed slot's memory leaves ``holder``: a buffer back to its pool, a region's
    anchor released."""
    location = freed.location
    if _is_buffer(location):
        ledger.give_back(location, holder, freed.pinned, fx)
    elif isinstance(location, RegionSlot):
        fx.anchors.append(location.anchor)


def _is_buffer(location: object) -> TypeGuard[Buffer]:
    return (
        location is not None and not isinstance(location, RegionSlot) and hasattr(location, "key")
    )
