"""Everything an agent knows about its slots and its memory, as one plain object.

Theory of operation. :class:`OwnerState` holds the slot table (:class:`~ray_velo.store.SlotStore`)
and what the agent keeps beside it: producers' reservations, the read gate (copies out of a
slot in progress), the pull grace, the quarantine, the destinations of fetches in flight, the
node-local copies of other nodes' payloads and the claims its local processes hold. It does no
I/O, starts no thread and reads no clock: every call takes ``now`` where time matters and adds
what the caller must do to an :class:`Effects` (give these buffers back to their pool, release
those region anchors, look at the timers again). The agent calls it under one short lock and
performs the effects outside it.

**The buffer ledger.** Every pool buffer the agent has handed out is in ``holders``, under
exactly one holder, and moves between holders only through this class:

    reservation:<rid>   a producer writes it (rv.put, a SendBuffer, or a PinnedWriter,
                        which a fetch may fill); the process's side: ray_velo/writable.py
    slot:<id>           a staged slot's bytes
    fetch:<id>          the destination of a fetch (or a region copy) in progress
    relayed:<id>        a failed fetch's bytes, waiting for the other nodes reading them
    parked:<id>         a freed slot's bytes, waiting for a copy out of them to end
    grace:<id>          a freed slot's bytes, waiting out the pull grace
    demoted:<id>        shutdown moved the slot to plain memory; its registered bytes wait
                        for the GETs admitted before the gate
    quarantine          memory a timed-out GET may still write: never given back

A buffer leaves the ledger only to go back to its pool (``Effects.free``), once. A second
give-back, or a move from the wrong holder, raises: that is a double free caught before it
happens. ``validate()`` rebuilds the ledger from the other tables and compares.
"""

from __future__ import annotations

import itertools
import secrets
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from ray_velo.errors import HandleNotFound, LeaseNotFound, ProtocolError, StagingError
from ray_velo.owner.relays import CopySources, Relay
from ray_velo.protocol.handle import DataHandle
from ray_velo.protocol.ids import ID_KEY_BYTES, IdSequence
from ray_velo.protocol.messages import TypeHeader
from ray_velo.store import FreedSlot, Lease, Slot, SlotKind, SlotStore, SweepResult

__all__ = [
    "PULL_GRACE_S",
    "Buffer",
    "Effects",
    "OwnerState",
    "Pending",
    "PullPlan",
    "Reaped",
    "RegionSlot",
]

#: How long a slot's bytes stay out of the pool after its last chunk was handed out as a view
#: (Ray serializes a returned view after the method returns: milliseconds for 16 MiB).
PULL_GRACE_S = 1.0
#: A node-local copy whose last reader is gone ends with this reason.
COPY_UNUSED = "its node-local copy has no reader left"
#: A node-local copy kept for its owner ends with this reason once the owner says so.
COPY_ENDED = "its owner ended the handle"
#: A copy kept for its owner ends anyway once it had no reader for this long: the owner's
#: word that the handle ended may never come (its agent died, the notice was lost).
KEPT_IDLE_S = 60.0
COPY_IDLE = f"its node-local copy had no reader for {KEPT_IDLE_S:.0f} s"
PRODUCER_DIED = "the process that staged it died"

ReadMode = Literal["release", "detach", "hold", "claim"]


class Buffer(Protocol):
    """A range of a pool's memory (``memory.pool.Placement`` in the agent)."""

    @property
    def key(self) -> tuple[str, int]: ...

    @property
    def nbytes(self) -> int: ...


@dataclass(frozen=True, slots=True)
class RegionSlot:
    """A slot staged in a caller's region: no copy; an in-flight anchor held while it lives."""

    region: Any
    anchor: Any
    offset: int


@dataclass(slots=True)
class Pending:
    """A producer's reservation between reserve and commit (or a PinnedWriter's buffer)."""

    buffer: Buffer | None
    kind: SlotKind
    pinned: bool
    pid: int
    slot_id: int
    fills: int = 0  # fetches writing into it now (a PinnedWriter destination)
    abort_when_idle: bool = False
    wants_rdma: bool = False  # asked for registered memory (plain: the budget said no)


@dataclass(slots=True)
class Effects:
    """What the caller performs, outside the lock, after a call.

    ``free``: (buffer, pinned) pairs to give back to the pinned or plain pool, in order.
    ``anchors``: region in-flight anchors to release. ``poke``: a deadline may have moved:
    let the timer look again. ``copy_ends``: (handle, node, worker) of copies on other nodes
    whose agents must hear that the handle ended. ``windows``: window sets of ended RDMA
    leases (``ray_velo.memory.windows``), closed before anything in ``free`` goes back.
    """

    free: list[tuple[Buffer, bool]] = field(default_factory=list)
    windows: list[Any] = field(default_factory=list)
    anchors: list[Any] = field(default_factory=list)
    poke: bool = False
    copy_ends: list[tuple[DataHandle, str, int]] = field(default_factory=list)


@dataclass(slots=True)
class Reaped:
    """What the death of processes leaves the caller to do: give back ``unclaim`` (one
    entry per claim) to the handles' owners, and wake whoever waits for the commit of
    ``never_committed`` slots."""

    unclaim: list[DataHandle] = field(default_factory=list)
    never_committed: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class PullPlan:
    """One chunk to serve: ``[start, start + length)`` of ``slot``'s bytes.

    ``view``: a pool slot: hand out a view (the grace protects it). Otherwise a region slot:
    copy under its copy gate, then :meth:`OwnerState.end_read`.
    """

    slot: Slot
    start: int
    length: int
    view: bool


class OwnerState:
    """One agent's slots and buffers (see the module docstring). Not thread-safe: the agent
    holds one lock around every call."""

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
        key = secrets.token_bytes(ID_KEY_BYTES) if id_key is None else id_key
        self.store = SlotStore(worker_id, node=node, id_key=key)
        self.node = node
        self.pull_grace_s = pull_grace_s
        self.holders: dict[tuple[str, int], str] = {}
        self.quarantined: list[tuple[Buffer, bool]] = []
        self._reservations: dict[int, Pending] = {}
        self._reservation_ids = itertools.count(1)
        self._reading: Counter[int] = Counter()
        self._parked: dict[int, list[FreedSlot]] = {}
        self._pulled_at: dict[int, float] = {}
        self._grace: list[tuple[float, FreedSlot]] = []
        self._fetches: dict[int, tuple[Buffer, bool]] = {}
        self._fetch_ids = itertools.count(1)
        self._copies: dict[DataHandle, int] = {}  # remote handle -> local copy slot id
        self._copy_of: dict[int, DataHandle] = {}
        self._claims: dict[int, Counter[DataHandle]] = {}  # pid -> claims it holds
        self._followed: dict[int, set[DataHandle]] = {}  # pid -> handles that end with it
        self._demoted: list[FreedSlot] = []  # registered bytes of slots shutdown demoted
        #: As owner: the copies of our handles on other nodes (see ray_velo.owner.relays).
        self.sources = CopySources()
        #: As a copy's node: the copies other nodes may read, by remote handle.
        self._relays: dict[DataHandle, Relay] = {}
        self._relay_fids: dict[int, DataHandle] = {}
        self._relayed: dict[int, tuple[Buffer, bool]] = {}
        # Relay lease ids reach other nodes' agents: as unguessable as the store's lease ids.
        self._relay_leases = IdSequence(key, b"relay")
        #: Copies the owner counts: kept past their last reader until it says the handle ended.
        self._kept: set[DataHandle] = set()
        self._kept_idle: dict[DataHandle, float] = {}  # kept copy -> when it ends unread

    # --- the ledger ------------------------------------------------------------------

    def _hold(self, buffer: Buffer, holder: str) -> None:
        key = buffer.key
        if key in self.holders:
            raise AssertionError(f"buffer {key} handed to {holder}, already {self.holders[key]}")
        self.holders[key] = holder

    def _move(self, buffer: Buffer, source: str, target: str) -> None:
        current = self.holders.get(buffer.key)
        if current != source:
            raise AssertionError(f"buffer {buffer.key} moved from {source}, held by {current}")
        self.holders[buffer.key] = target

    def _give_back(self, buffer: Buffer, source: str, pinned: bool, fx: Effects) -> None:
        current = self.holders.get(buffer.key)
        if current != source:
            raise AssertionError(
                f"buffer {buffer.key} given back by {source}, held by {current} (double free?)"
            )
        del self.holders[buffer.key]
        fx.free.append((buffer, pinned))

    def holder_of(self, buffer: Buffer) -> str | None:
        """Who holds ``buffer`` now (None: its pool)."""
        return self.holders.get(buffer.key)

    # --- producers -------------------------------------------------------------------

    def reserve(
        self,
        buffer: Buffer | None,
        kind: SlotKind,
        pinned: bool,
        pid: int,
        *,
        wants_rdma: bool = False,
    ) -> tuple[int, Pending]:
        """Hold ``buffer`` for a producer (pid) until it commits or aborts. Returns the
        reservation id and record (whose ``slot_id`` the handle will have). ``wants_rdma``:
        the producer asked for registered memory (a plain slot then takes windows)."""
        rid = next(self._reservation_ids)
        pending = Pending(buffer, kind, pinned, pid, self.store.reserve_slot_id())
        pending.wants_rdma = wants_rdma
        if buffer is not None:
            self._hold(buffer, f"reservation:{rid}")
        self._reservations[rid] = pending
        return rid, pending

    def reservation(self, rid: int) -> Pending | None:
        return self._reservations.get(rid)

    def commit(
        self,
        rid: int,
        nbytes: int,
        type_header: TypeHeader,
        ttl: float | None,
        refcount: int,
        now: float,
        fx: Effects,
        *,
        follow_producer: bool = False,
        job: str = "",
        detached: bool = False,
    ) -> DataHandle:
        """Turn reservation ``rid`` into a slot. Raises StagingError if it is gone; a
        failure to stage gives its buffer back (in ``fx``) before raising. With
        ``follow_producer`` the handle ends when the producing process dies (a Ray Direct
        Transport object, whose normal end is its source process's garbage collection).
        ``job``: the Ray job that staged it; the handle ends with it unless ``detached``."""
        pending = self._reservations.pop(rid, None)
        if pending is None:
            raise StagingError(f"reservation {rid} is unknown or was reaped")
        # A job not watched yet: the timer starts watching it (see OwnerState.end_job).
        new_job = bool(job) and not detached and not self.store.follows(job)
        try:
            handle = self.store.stage(
                nbytes,
                type_header,
                pending.buffer,
                kind=pending.kind,
                pinned=pending.pinned,
                now=now,
                ttl=ttl,
                refcount=refcount,
                slot_id=pending.slot_id,
                job=job,
                detached=detached,
            )
        except Exception as exc:
            self.store.forget_reserved(pending.slot_id, f"staging it failed: {exc}")
            if pending.buffer is not None:
                self._give_back(pending.buffer, f"reservation:{rid}", pending.pinned, fx)
            raise
        if pending.buffer is not None:
            self._move(pending.buffer, f"reservation:{rid}", f"slot:{pending.slot_id}")
            self.store.slot(handle).windowable = pending.wants_rdma and not pending.pinned
        fx.poke = fx.poke or ttl is not None or new_job
        if follow_producer and pending.pid:
            self._follow(pending.pid, handle)
        return handle

    def _follow(self, pid: int, handle: DataHandle) -> None:
        followed = self._followed.setdefault(pid, set())
        followed.add(handle)
        if len(followed) >= 64 and len(followed) & (len(followed) - 1) == 0:
            # A long-lived producer: forget its handles that already ended (amortised).
            followed.intersection_update({h for h in followed if self.store.is_live(h)})

    def abort(self, rid: int, why: str, fx: Effects) -> int | None:
        """Give reservation ``rid``'s buffer back (a failed put, a closed PinnedWriter); a
        PinnedWriter that a fetch is filling goes when that fetch ends. Returns the slot id
        that will never be staged (for those waiting on its commit), or None."""
        pending = self._reservations.get(rid)
        if pending is None:
            return None
        if pending.fills:
            pending.abort_when_idle = True
            return None
        del self._reservations[rid]
        self.store.forget_reserved(pending.slot_id, why)
        if pending.buffer is not None:
            self._give_back(pending.buffer, f"reservation:{rid}", pending.pinned, fx)
        return pending.slot_id

    def fill_begin(self, rid: int) -> Pending:
        """A fetch is about to write into PinnedWriter ``rid``: its buffer stays until the
        fetch ends. Raises StagingError if the writer is gone."""
        pending = self._reservations.get(rid)
        if pending is None or pending.buffer is None or pending.abort_when_idle:
            raise StagingError(f"PinnedWriter reservation {rid} is gone")
        pending.fills += 1
        return pending

    def fill_end(self, rid: int, fx: Effects) -> None:
        """A fetch stopped writing into PinnedWriter ``rid``."""
        pending = self._reservations.get(rid)
        if pending is None:
            return
        pending.fills -= 1
        if pending.fills == 0 and pending.abort_when_idle:
            self.abort(rid, "its producer aborted staging it", fx)

    def fill_withdraw(self, rid: int) -> None:
        """A timed-out GET may still write PinnedWriter ``rid``: its buffer goes to the
        quarantine and the writer is gone."""
        pending = self._reservations.pop(rid, None)
        if pending is None or pending.buffer is None:
            return
        self.store.forget_reserved(pending.slot_id, "a timed-out GET may still write it")
        self._move(pending.buffer, f"reservation:{rid}", "quarantine")
        self.quarantined.append((pending.buffer, pending.pinned))

    # --- fetch destinations ----------------------------------------------------------

    def fetch_take(self, buffer: Buffer, pinned: bool) -> int:
        """A fetch (or a region copy) now owns ``buffer``. Returns its fetch id."""
        fid = next(self._fetch_ids)
        self._hold(buffer, f"fetch:{fid}")
        self._fetches[fid] = (buffer, pinned)
        return fid

    def fetch_give_back(self, fid: int, fx: Effects) -> None:
        """The fetch failed or moved elsewhere: its buffer goes back to its pool, once no
        other node reads the copy it was filling."""
        buffer, pinned = self._fetches.pop(fid)
        relay = self._relay_failed(fid)
        if relay is not None and relay.readers:
            self._move(buffer, f"fetch:{fid}", f"relayed:{fid}")
            self._relayed[fid] = (buffer, pinned)
            return
        self._give_back(buffer, f"fetch:{fid}", pinned, fx)

    def fetch_abandon(self, fid: int, fx: Effects) -> None:
        """The fetch's work failed: its buffer goes back as with :meth:`fetch_give_back`,
        if the fetch still owns it (it may have become a slot or a demoted slot's already)."""
        if fid in self._fetches:
            self.fetch_give_back(fid, fx)

    def fetch_quarantine(self, fid: int) -> None:
        """A timed-out GET may still write the fetch's buffer: it never goes back (other
        nodes reading the bytes that had landed may go on: those stay as they were)."""
        buffer, pinned = self._fetches.pop(fid)
        self._relay_failed(fid)
        self._move(buffer, f"fetch:{fid}", "quarantine")
        self.quarantined.append((buffer, pinned))

    def fetch_stage(
        self,
        fid: int,
        total_len: int,
        type_header: TypeHeader,
        kind: SlotKind,
        now: float,
        *,
        copy_of: DataHandle | None = None,
    ) -> Slot:
        """The fetch's buffer becomes a local slot (refcount 1). ``copy_of``: it is the
        node-local copy of that remote handle, found again by :meth:`copy_for`."""
        buffer, pinned = self._fetches.pop(fid)
        handle = self.store.stage(total_len, type_header, buffer, kind=kind, pinned=pinned, now=now)
        self._move(buffer, f"fetch:{fid}", f"slot:{handle.slot_id}")
        remote = self._relay_fids.pop(fid, None)
        if remote is not None:  # the copy's readers now read a slot: reads in progress
            relay = self._relays[remote]
            relay.fid, relay.slot_id, relay.landed = None, handle.slot_id, total_len
            for _ in relay.readers:
                self.begin_read(handle.slot_id)
        if copy_of is not None:
            # A copy that two fetches made at once: the newest serves later fetches; every
            # copy still ends with its own last reader.
            self._copies[copy_of] = handle.slot_id
            self._copy_of[handle.slot_id] = copy_of
        return self.store.held(handle)

    def stage_empty(self, type_header: TypeHeader, now: float) -> Slot:
        """A local slot of zero bytes (a fetched empty payload)."""
        handle = self.store.stage(0, type_header, None, kind="empty", pinned=False, now=now)
        return self.store.held(handle)

    # --- node-local copies -----------------------------------------------------------

    def copy_for(self, remote: DataHandle) -> Slot | None:
        """The live node-local copy of ``remote``, if any."""
        slot_id = self._copies.get(remote)
        if slot_id is None:
            return None
        try:
            return self.store.slot(DataHandle(self.store.worker_id, slot_id))
        except HandleNotFound:
            return None

    def copy_ended(self, remote: DataHandle, now: float, fx: Effects) -> None:
        """``remote``'s owner says the handle ended: its copy here goes with its last
        reader (now, if it has none), and a copy still filling is not kept."""
        self._kept.discard(remote)
        self._kept_idle.pop(remote, None)
        copy = self.copy_for(remote)
        if copy is not None and not copy.leases:
            local = DataHandle(self.store.worker_id, copy.slot_id)
            self._bytes_end(self.store.end(local, COPY_ENDED), now, fx)

    # --- copies other nodes read as they fill (relays) -------------------------------

    def relay_open(self, remote: DataHandle, fid: int, total_len: int) -> bool:
        """Fetch ``fid`` fills a copy of ``remote`` that its owner counts: other nodes may
        read it as it fills, and it stays until the owner says the handle ended. False (not
        relayed, not kept) while an older copy of it still has readers."""
        old = self._relays.get(remote)
        if old is not None and (not old.failed or old.readers):
            return False
        self._relays[remote] = Relay(remote, total_len, fid)
        self._relay_fids[fid] = remote
        self._kept.add(remote)
        return True

    def relay_landed(self, remote: DataHandle, landed: int) -> None:
        """Bytes ``[0, landed)`` of the copy being filled are final."""
        relay = self._relays.get(remote)
        if relay is not None and not relay.failed and relay.fid is not None:
            relay.landed = max(relay.landed, landed)

    def relay(self, remote: DataHandle) -> Relay | None:
        return self._relays.get(remote)

    def relay_buffer(self, relay: Relay) -> Any:
        """Where ``relay``'s bytes are: the filling fetch's buffer, then the copy's slot."""
        if relay.slot_id is not None:
            return self.store.held(DataHandle(self.store.worker_id, relay.slot_id)).location
        if relay.fid in self._fetches:
            return self._fetches[relay.fid][0]
        return self._relayed[relay.fid][0] if relay.fid in self._relayed else None

    def relay_join(self, remote: DataHandle, now: float, timeout: float) -> tuple[int, Relay]:
        """A relay lease on the copy of ``remote``: its bytes stay until the lease ends.

        Raises:
            HandleNotFound: no copy of it here (or it failed).
        """
        relay = self._relays.get(remote)
        if relay is None or relay.failed:
            raise HandleNotFound(handle=str(remote), node=self.node, reason="no copy of it here")
        lease_id = next(self._relay_leases)
        relay.readers[lease_id] = now + timeout
        if relay.slot_id is not None:
            self.begin_read(relay.slot_id)
        return lease_id, relay

    def relay_renew(self, remote: DataHandle, lease_id: int, now: float, timeout: float) -> Relay:
        """Push relay lease ``lease_id`` on; the copy (check ``failed``).

        Raises:
            LeaseNotFound: the lease ended (or expired).
        """
        relay = self._relays.get(remote)
        if relay is None or lease_id not in relay.readers:
            raise LeaseNotFound(handle=str(remote), lease_id=lease_id)
        relay.readers[lease_id] = now + timeout
        return relay

    def relay_leave(self, remote: DataHandle, lease_id: int, now: float, fx: Effects) -> None:
        """Relay lease ``lease_id`` ends (unknown: already ended, nothing to do)."""
        relay = self._relays.get(remote)
        if relay is None or relay.readers.pop(lease_id, None) is None:
            return
        if relay.slot_id is not None:
            self.end_read(relay.slot_id, now, fx)
        elif relay.fid in self._relayed and not relay.readers:
            fid = relay.fid
            buffer, pinned = self._relayed.pop(fid)
            self._give_back(buffer, f"relayed:{fid}", pinned, fx)
        self._relay_drop(relay)

    def _relay_failed(self, fid: int) -> Relay | None:
        """Fetch ``fid`` failed: the copy it filled gets no more bytes."""
        remote = self._relay_fids.get(fid)
        if remote is None:
            return None
        relay = self._relays[remote]
        relay.failed = True
        self._kept.discard(remote)
        self._relay_drop(relay)
        return relay

    def _relay_drop(self, relay: Relay) -> None:
        if relay.failed and not relay.readers and self._relays.get(relay.remote) is relay:
            del self._relays[relay.remote]
            if relay.fid is not None:
                self._relay_fids.pop(relay.fid, None)

    def _kept_expire(self, now: float, fx: Effects) -> None:
        for remote, due in list(self._kept_idle.items()):
            if due > now:
                continue
            del self._kept_idle[remote]
            copy = self.copy_for(remote)
            if copy is not None and not copy.leases:  # read again meanwhile: not idle
                local = DataHandle(self.store.worker_id, copy.slot_id)
                self._bytes_end(self.store.end(local, COPY_IDLE), now, fx)

    def _relays_expire(self, now: float, fx: Effects) -> None:
        for relay in list(self._relays.values()):
            for lease_id, due in list(relay.readers.items()):
                if due <= now:
                    self.relay_leave(relay.remote, lease_id, now, fx)

    # --- readers (local leases) ------------------------------------------------------

    def local_acquire(
        self, handle: DataHandle, pid: int, mode: ReadMode, now: float
    ) -> tuple[Slot, Lease]:
        """A local lease for process ``pid`` reading ``handle`` in place.

        ``release``: the reader consumes a reference now (a claimed one: refused with
        HandleReleased when all are claimed), so the handle may end while the view lives.
        ``claim``: the reader claims one, consumed or given back later (:meth:`claim_end`).
        ``detach`` / ``hold``: no reference changes hands.
        """
        claim = mode in ("release", "claim")
        lease = self.store.acquire(handle, now, kind="local", holder_pid=pid, claim=claim)
        slot = self.store.held(handle)
        if mode == "release":
            self.store.release(handle, 0, claim=True)  # the lease keeps the bytes
        elif mode == "claim":
            self.claim_held(pid, handle)
        return slot, lease

    def lease_end(
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
        ``claim``: a claimed one); a detach with ``claim`` gives a claim back. On a node-local
        copy, the last reader's end ends the copy."""
        end = self.store.release if release else self.store.detach
        freed = end(handle, lease_id, claim=claim)
        self._bytes_end(freed, now, fx)
        if freed is None and lease_id:
            self._copy_unread(handle.slot_id, now, fx)

    def _copy_unread(self, slot_id: int, now: float, fx: Effects) -> None:
        """A reader of slot ``slot_id`` just ended: if it is a live node-local copy with no
        reader left, it ends now, unless its owner counts it: then it stays until the owner
        says the handle ended, or until it sat unread for KEPT_IDLE_S."""
        remote = self._copy_of.get(slot_id)
        if remote is None:
            return
        handle = DataHandle(self.store.worker_id, slot_id)
        slot = self.store.held(handle)  # a copy in the index is held
        if slot.ended is not None or slot.leases:
            return
        if remote not in self._kept:
            self._bytes_end(self.store.end(handle, COPY_UNUSED), now, fx)
        else:
            self._kept_idle[remote] = now + KEPT_IDLE_S
            fx.poke = True

    # --- claims held by local processes ----------------------------------------------

    def claim_held(self, pid: int, handle: DataHandle) -> None:
        """Process ``pid`` holds a claim on ``handle`` (whatever node owns it)."""
        self._claims.setdefault(pid, Counter())[handle] += 1

    def claim_end(self, pid: int, handle: DataHandle) -> bool:
        """Process ``pid`` consumed or gave back a claim on ``handle``; False if it held
        none (ended already, e.g. by its death)."""
        held = self._claims.get(pid)
        if not held or held[handle] <= 0:
            return False
        held[handle] -= 1
        if held[handle] == 0:
            del held[handle]
        if not held:
            del self._claims[pid]
        return True

    def claim_pids(self) -> set[int]:
        return set(self._claims)

    # --- owner handlers --------------------------------------------------------------

    def pull(self, transfer_id: int, index: int, chunk_size: int, now: float) -> PullPlan:
        """Chunk ``index`` of chunked transfer ``transfer_id`` (renews its lease). A region
        slot's chunk is a read in progress until :meth:`end_read`.

        Raises:
            LeaseNotFound: the transfer's lease is gone.
            ProtocolError: ``index`` is outside the payload.
        """
        slot = self.store.pull(transfer_id, now)
        start = index * chunk_size
        if index < 0 or start >= max(slot.total_len, 1):
            raise ProtocolError(
                f"chunk {index} is outside transfer {transfer_id} "
                f"({slot.total_len} bytes in chunks of {chunk_size})"
            )
        length = min(chunk_size, slot.total_len - start)
        if isinstance(slot.location, RegionSlot) or slot.location is None:
            self._reading[slot.slot_id] += 1
            return PullPlan(slot, start, length, view=False)
        self._pulled_at[slot.slot_id] = now
        return PullPlan(slot, start, length, view=True)

    def supersede(self, node: str, worker: int, now: float, fx: Effects) -> int:
        """A consumer agent's new incarnation on ``node`` acquires: end the old one's
        leases (see :meth:`SlotStore.supersede`). Returns the RDMA leases ended."""
        freed, rdma = self.store.supersede(node, worker)
        self.sources.superseded(node, worker)
        for item in freed:
            self._bytes_end(item, now, fx)
        return rdma

    def begin_read(self, slot_id: int) -> None:
        """A copy out of slot ``slot_id`` starts: its bytes stay until :meth:`end_read`."""
        self._reading[slot_id] += 1

    def end_read(self, slot_id: int, now: float, fx: Effects) -> None:
        """A copy out of slot ``slot_id`` ended: bytes freed meanwhile may go now."""
        self._reading[slot_id] -= 1
        if self._reading[slot_id] > 0:
            return
        del self._reading[slot_id]
        for freed in self._parked.pop(slot_id, []):
            self._move_out(freed, f"parked:{slot_id}", now, fx)

    # --- timers and liveness ---------------------------------------------------------

    def sweep(self, now: float, fx: Effects) -> SweepResult:
        """Expire TTLs and deadlines, and end the pull graces that are due."""
        result = self.store.sweep(now)
        for freed in result.freed:
            self._bytes_end(freed, now, fx)
        self._relays_expire(now, fx)
        self._kept_expire(now, fx)
        due = [(d, f) for d, f in self._grace if d <= now]
        self._grace = [(d, f) for d, f in self._grace if d > now]
        for _, freed in due:
            self._move_out(freed, f"grace:{freed.slot_id}", now, fx)
        return result

    def next_due(self) -> float | None:
        """The earliest deadline, TTL or grace end, or None."""
        due = [d for d, _ in self._grace]
        due += [d for relay in self._relays.values() for d in relay.readers.values()]
        due += list(self._kept_idle.values())
        store_due = self.store.next_deadline()
        if store_due is not None:
            due.append(store_due)
        return min(due, default=None)

    def watched_pids(self) -> set[int]:
        """Processes whose death the agent must notice: local readers, producers, claimers."""
        pids = self.store.holder_pids() | {p.pid for p in self._reservations.values()}
        return (pids | set(self._claims) | set(self._followed)) - {0}

    def reap(self, dead: Iterable[int], now: float, fx: Effects) -> Reaped:
        """Processes ``dead`` died: end their local leases, abort their reservations, drop
        their claims (see :class:`Reaped` for what the caller does next)."""
        dead = set(dead)
        read = self.store.read_by(dead) & set(self._copy_of)
        for freed in self.store.reap_holders(dead):
            self._bytes_end(freed, now, fx)
        for copy_id in read:  # a copy's reader died: as if its lease had ended
            self._copy_unread(copy_id, now, fx)
        reaped = Reaped()
        for rid, pending in list(self._reservations.items()):
            if pending.pid in dead:
                slot_id = self.abort(rid, "its producer died while staging it", fx)
                if slot_id is not None:
                    reaped.never_committed.append(slot_id)
        for pid in dead & set(self._claims):
            for handle, count in self._claims.pop(pid).items():
                reaped.unclaim += [handle] * count
        for pid in dead & set(self._followed):
            for handle in self._followed.pop(pid):
                if self.store.is_live(handle):
                    self._bytes_end(self.store.end(handle, PRODUCER_DIED), now, fx)
        return reaped

    @property
    def reservations(self) -> int:
        return len(self._reservations)

    @property
    def copies(self) -> int:
        return len(self._copies)

    @property
    def relay_readers(self) -> int:
        """Relay leases other nodes hold on this node's copies."""
        return sum(len(relay.readers) for relay in self._relays.values())

    @property
    def quarantined_bytes(self) -> int:
        return sum(buffer.nbytes for buffer, _ in self.quarantined)

    # --- ends ------------------------------------------------------------------------

    def followed_jobs(self) -> set[str]:
        """The Ray jobs whose end ends some live handle here (the agent watches them)."""
        return self.store.followed_jobs()

    def end_job(self, job: str, now: float, fx: Effects) -> int:
        """Ray job ``job`` ended: its handles end (not the detached ones) as a TTL ends one,
        and their bytes go once no reader, pull or GET may touch them. The agents holding
        copies of them hear it now, not when the bytes go: no new reader can come. Returns
        how many handles ended."""
        ended, freed = self.store.end_job(job)
        for slot_id in ended:
            for node, worker in self.sources.ended(slot_id):
                fx.copy_ends.append((DataHandle(self.store.worker_id, slot_id), node, worker))
        for item in freed:
            self._bytes_end(item, now, fx)
        return len(ended)

    def evict(self, handle: DataHandle, why: str, now: float, fx: Effects) -> None:
        """End ``handle`` and every lease on it now (its memory went away)."""
        self._bytes_end(self.store.evict(handle, why), now, fx)

    # --- shutdown --------------------------------------------------------------------

    def demotion_begin(self) -> list[Slot]:
        """Shutdown's demotion starts: the held slots in registered memory (the pool or a
        caller's region), each now a read in progress so its bytes stay while copied."""
        slots = [
            s for s in self.store.slots()
            if s.total_len and (s.pinned or isinstance(s.location, RegionSlot))
        ]  # fmt: skip
        for slot in slots:
            self.begin_read(slot.slot_id)
        return slots

    def demote(self, slot: Slot, fid: int | None, now: float, fx: Effects) -> bool:
        """``slot`` was copied into fetch ``fid``'s plain buffer (None: no copy, it stays
        where it is). The slot now lives there; its registered bytes wait under
        ``demoted:<id>`` until :meth:`release_demoted`, for a GET admitted before the gate.
        Ends the read :meth:`demotion_begin` began. Returns whether the slot moved."""
        moved = False
        if fid is not None:
            slot_id, kind, pinned = slot.slot_id, slot.kind, slot.pinned
            buffer, _ = self._fetches[fid]
            old = self.store.relocate(slot_id, buffer, kind="plain", pinned=False)
            if old is None:  # its bytes went meanwhile: the copy is not needed
                self.fetch_give_back(fid, fx)
            else:
                if _is_buffer(old):
                    self._move(old, f"slot:{slot_id}", f"demoted:{slot_id}")
                del self._fetches[fid]
                self._move(buffer, f"fetch:{fid}", f"slot:{slot_id}")
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
            self._move_out(freed, f"demoted:{freed.slot_id}", 0.0, fx)
        return len(demoted)

    def clear(self, now: float, fx: Effects) -> int:
        """Shutdown: end every slot and give back every buffer but the quarantined ones
        (their pool's close unmaps them). Returns the slots freed."""
        freed = self.store.clear()
        self._reading.clear()
        self._pulled_at.clear()
        for item in freed:
            self._bytes_end(item, now, fx)
        for slot_id, parked in list(self._parked.items()):
            for item in parked:
                self._move_out(item, f"parked:{slot_id}", now, fx)
        self._parked.clear()
        for _, item in self._grace:
            self._move_out(item, f"grace:{item.slot_id}", now, fx)
        self._grace.clear()
        for rid, pending in list(self._reservations.items()):
            pending.fills = 0
            self.abort(rid, "its owner shut down", fx)
        for relay in self._relays.values():
            relay.readers.clear()  # every read ends with the agent
        for fid in list(self._fetches):
            self.fetch_give_back(fid, fx)
        for fid, (buffer, pinned) in list(self._relayed.items()):
            self._give_back(buffer, f"relayed:{fid}", pinned, fx)
        self._relayed.clear()
        self._relays.clear()
        self._relay_fids.clear()
        self._kept.clear()
        self._kept_idle.clear()
        self._claims.clear()
        self.release_demoted(fx)
        return len(freed)

    def _bytes_end(self, freed: FreedSlot | None, now: float, fx: Effects) -> None:
        """A slot's bytes may go: after the copies out of it, and the pull grace if it was
        abandoned right after a chunk went out."""
        if freed is None:
            return
        slot_id = freed.slot_id
        remote = self._copy_of.pop(slot_id, None)
        if remote is not None and self._copies.get(remote) == slot_id:
            del self._copies[remote]
            self._kept.discard(remote)
            self._kept_idle.pop(remote, None)
        relay = self._relays.get(remote) if remote is not None else None
        if relay is not None and relay.slot_id == slot_id:
            relay.failed = True  # its readers' reads in progress keep the bytes (parked)
            self._relay_drop(relay)
        for node, worker in self.sources.ended(slot_id):
            fx.copy_ends.append((DataHandle(self.store.worker_id, slot_id), node, worker))
        buffer = freed.location if _is_buffer(freed.location) else None
        if self._reading[slot_id] > 0:
            if buffer is not None:
                self._move(buffer, f"slot:{slot_id}", f"parked:{slot_id}")
            self._parked.setdefault(slot_id, []).append(freed)
            return
        self._reading.pop(slot_id, None)
        pulled = self._pulled_at.pop(slot_id, None)
        recent = pulled is not None and now < pulled + self.pull_grace_s
        if buffer is not None and freed.abandoned and recent:
            assert pulled is not None
            self._move(buffer, f"slot:{slot_id}", f"grace:{slot_id}")
            self._grace.append((pulled + self.pull_grace_s, freed))
            fx.poke = True
            return
        self._move_out(freed, f"slot:{slot_id}", now, fx)

    def _move_out(self, freed: FreedSlot, holder: str, now: float, fx: Effects) -> None:
        location = freed.location
        if _is_buffer(location):
            self._give_back(location, holder, freed.pinned, fx)
        elif isinstance(location, RegionSlot):
            fx.anchors.append(location.anchor)

    # --- invariants ------------------------------------------------------------------

    def validate(self) -> None:
        """Check every invariant; tests call it after each step.

        The store's own; then the ledger: rebuilt from slots, reservations, fetches, parked
        and graced slots and the quarantine, it must equal ``holders`` exactly (every buffer
        has one holder, none is lost or held twice). Reads in progress are positive; a
        node-local copy is a held slot.

        Raises:
            AssertionError: an invariant is broken; the message names it.
        """
        self.store.validate()
        expected: dict[tuple[str, int], str] = {}

        def add(location: Any, holder: str) -> None:
            if not _is_buffer(location):
                return
            key = location.key
            if key in expected:
                raise AssertionError(f"buffer {key} held by {expected[key]} and {holder}")
            expected[key] = holder

        for slot in self.store.slots():
            add(slot.location, f"slot:{slot.slot_id}")
        for rid, pending in self._reservations.items():
            add(pending.buffer, f"reservation:{rid}")
            if pending.fills < 0:
                raise AssertionError(f"reservation {rid} has {pending.fills} fills")
        for fid, (buffer, _) in self._fetches.items():
            add(buffer, f"fetch:{fid}")
        for slot_id, parked in self._parked.items():
            for freed in parked:
                add(freed.location, f"parked:{slot_id}")
        for _, freed in self._grace:
            add(freed.location, f"grace:{freed.slot_id}")
        for freed in self._demoted:
            add(freed.location, f"demoted:{freed.slot_id}")
        for fid, (buffer, _) in self._relayed.items():
            add(buffer, f"relayed:{fid}")
        for buffer, _ in self.quarantined:
            add(buffer, "quarantine")
        if expected != self.holders:
            missing = {k: v for k, v in expected.items() if self.holders.get(k) != v}
            extra = {k: v for k, v in self.holders.items() if expected.get(k) != v}
            raise AssertionError(f"ledger disagrees: expected {missing}, recorded {extra}")
        for slot_id, count in self._reading.items():
            if count <= 0:
                raise AssertionError(f"slot {slot_id} has {count} reads in progress")
        for remote, slot_id in self._copies.items():
            if self._copy_of.get(slot_id) != remote:
                raise AssertionError(f"copy index of {remote} disagrees")


def _is_buffer(location: Any) -> bool:
    return (
        location is not None and not isinstance(location, RegionSlot) and hasattr(location, "key")
    )
