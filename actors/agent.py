"""The rendezvous agent: one per Ray node, owner of everything staged there.

As **owner** it holds the slot store and the arena pools of its node and answers the seven
``_rv_*`` handlers. As **consumer** it fetches, for the processes of its node, payloads owned
by other nodes' agents: it acquires, pulls chunks with several calls in flight (or GETs,
on the RDMA path) into a local slot, and hands the local processes a lease on that slot,
which they read in place. Local processes stage by reserving a granule range, writing into
the shared segment themselves and committing.

The class is plain Python; :mod:`ray_velo.actors` wraps it with ``ray.remote`` as a threaded
actor, so a long pull never blocks an acquire. All state changes happen under one lock;
the copies, GETs and arena mappings run outside it. Memory never goes back to a pool while
something may still read or write it: a region chunk copied out counts as a read of its slot;
a pool chunk returned as a view (Ray serializes it after the method returns) keeps a slot
that a deadline freed out of the pool for PULL_GRACE_S, a timing bound rather than a count;
a PinnedWriter being fetched into is held until the fetch ends; and memory a timed-out GET
may still write is quarantined until shutdown. Shutdown waits for fetches in flight.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import secrets
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from ray_velo import metrics
from ray_velo.actors.ticker import Ticker
from ray_velo.config import RdmaPoolConfig, VeloConfig
from ray_velo.consumer import Deadline, call_owner, pull_chunks
from ray_velo.errors import (
    DescriptorError,
    HandleNotFound,
    LeaseNotFound,
    OwnerDied,
    PayloadTooLarge,
    ProtocolError,
    RegionDeregistered,
    StagingError,
    UcxError,
    VeloError,
)
from ray_velo.memory.arena import ShmArena, remove_stale_segments
from ray_velo.memory.pool import (
    ArenaPool,
    Fallback,
    NoopRegistrar,
    Placement,
    Registrar,
    RegistrationBudget,
)
from ray_velo.memory.region import DrainTimedOut, InFlight, Region
from ray_velo.protocol import (
    AcquireRequest,
    DataHandle,
    DetachRequest,
    LeaseRenewRequest,
    MetadataRequest,
    MetadataResponse,
    OwnerFacts,
    PullRequest,
    Rdma,
    Ready,
    RefRequest,
    ReleaseRequest,
    TypeHeader,
    build_offer,
    decide_path,
    decode,
    decode_acquire_response,
    encode,
    kill_switch_engaged,
)
from ray_velo.store import FreedSlot, Slot, SlotKind, SlotStore
from ray_velo.ucx.backend import UcxRdmaBackend
from ray_velo.ucx.loader import ucx_available

__all__ = ["LocalLease", "RendezvousAgent", "Reservation"]

_log = logging.getLogger(__name__)

#: How often the agent checks that local readers are still alive, while any exist (s).
LIVENESS_INTERVAL_S = 1.0
#: How long a call naming a handle waits for its producer's commit to land (s).
COMMIT_WAIT_S = 30.0
#: How long a pulled slot's memory stays out of the pool after its last chunk pull: Ray
#: serializes a returned chunk view after the method returns (milliseconds for 16 MiB).
PULL_GRACE_S = 1.0
_EMPTY: SlotKind = "empty"
#: Floor of the consumer's RDMA lease renewal period (spec: 5 ms).
RENEW_FLOOR_S = 0.005
#: Upper bound on one ``plain`` arena of the unregistered pool (bytes).
_PLAIN_MAX_ARENA = 1 << 30


@dataclass(frozen=True, slots=True)
class Reservation:
    """Where a local producer writes a payload before committing it, and the handle the
    slot will have once committed."""

    reservation_id: int
    path: str
    offset: int
    nbytes: int
    dedicated: bool
    handle: DataHandle


@dataclass(frozen=True, slots=True)
class LocalLease:
    """A lease a local process holds on a slot of its own node's agent, read in place.

    ``handle`` is the slot the lease is on (a local copy for a cross-node fetch);
    ``remote_lease_id`` is the owner's lease still held for ``get``-style reads (0: none).
    """

    handle: DataHandle
    lease_id: int
    path: str
    offset: int
    total_len: int
    type_header: TypeHeader
    dedicated: bool
    remote_lease_id: int = 0


@dataclass(frozen=True, slots=True)
class RegionInfo:
    """A caller-owned region as its process sees it: a segment to map and write."""

    region_id: int
    path: str
    nbytes: int
    effective_range: tuple[int, int]


@dataclass(slots=True)
class _OwnedRegion:
    arena: ShmArena
    region: Region
    pid: int


@dataclass(frozen=True, slots=True)
class _RegionSlot:
    """A slot staged in a caller's region: no copy, an in-flight anchor held while it lives."""

    region: Region
    anchor: InFlight
    offset: int


_HANDLERS = frozenset(
    {
        "_rv_metadata",
        "_rv_acquire",
        "_rv_pull",
        "_rv_ref",
        "_rv_detach",
        "_rv_release",
        "_rv_lease_renew",
    }
)


@dataclass(frozen=True, slots=True)
class _Pending:
    """A reservation between ``stage_reserve`` and ``stage_commit``."""

    placement: Placement | None
    kind: SlotKind
    pinned: bool
    pid: int
    slot_id: int


class _LeaseRenewal:
    """Renews an RDMA lease every lease_timeout / 2 (at least 5 ms) while a GET runs.

    Renewals are fire-and-forget: a lost one is harmless, the next is half a deadline away.
    A lease_timeout_ms of 0 means the owner set no deadline: no ticker at all.
    """

    def __init__(self, owner: Any, handle: DataHandle, lease_id: int, lease_timeout_ms: int):
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if lease_timeout_ms <= 0:
            return
        period = max(lease_timeout_ms / 2000, RENEW_FLOOR_S)
        message = encode(LeaseRenewRequest(handle, lease_id))

        def run() -> None:
            while not self._stop.wait(period):
                try:
                    owner._rv_lease_renew.remote(message)
                except Exception:  # the owner may be gone; the GET will say so
                    return

        self._thread = threading.Thread(target=run, name="ray_velo-lease-renewal", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)


def _start_rdma(config: VeloConfig) -> UcxRdmaBackend | None:
    """The agent's UCX backend, or None (logged) when UCX is off or cannot load."""
    if not config.rdma.ucx.enabled:
        return None
    available, why = ucx_available()
    if not available:
        _log.warning("ray_velo: UCX unavailable (%s); this node serves the chunked path only", why)
        return None
    try:
        return UcxRdmaBackend(config.rdma.ucx)
    except VeloError:
        _log.warning("ray_velo: UCX failed to start; chunked path only", exc_info=True)
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RendezvousAgent:
    """Owner and node-local consumer of staged payloads (see the module docstring)."""

    def __init__(self, config: VeloConfig, node_id: str, *, worker_id: int | None = None) -> None:
        self.config = config
        self.node_id = node_id
        self.worker_id = worker_id if worker_id is not None else secrets.randbits(64) | 1
        self.rdma_enabled = config.rdma.rendezvous.enabled and not kill_switch_engaged(os.environ)
        self._lock = threading.RLock()
        self.store = SlotStore(self.worker_id, node=node_id)
        os.makedirs(config.shm_dir, exist_ok=True)
        for path in remove_stale_segments(config.shm_dir):
            _log.warning("removed shared-memory segment %s of a crashed ray_velo agent", path)
        self.budget = RegistrationBudget(config.rdma.pool.registered_bytes_budget)
        self._noop_registrar = NoopRegistrar()
        #: The RDMA registry (UCX), or None: the chunked path only (reason not_configured).
        self.rdma: UcxRdmaBackend | None = _start_rdma(config)
        self.pinned_pool = ArenaPool(
            config.rdma.pool,
            config.shm_dir,
            self.worker_id,
            registrar=self._registrar(),
            budget=self.budget,
            prefault=False,
        )
        self.plain_pool = ArenaPool(
            RdmaPoolConfig(
                initial_arena_bytes=config.plain_arena_bytes,
                max_arena_bytes=max(config.plain_arena_bytes, _PLAIN_MAX_ARENA),
                dedicated_arena_min=config.rdma.pool.dedicated_arena_min,
                registered_bytes_budget=1 << 62,
                arena_reclaim_after=config.rdma.pool.arena_reclaim_after,
                retain_arena_bytes=config.rdma.pool.retain_arena_bytes,
            ),
            config.shm_dir,
            self.worker_id,
            registrar=None,
            budget=None,
            prefault=False,
        )
        self._reservations: dict[int, _Pending] = {}
        self._reservation_seq = 0
        self._reading: Counter[int] = Counter()  # slot id -> copies in progress
        self._deferred: dict[int, list[FreedSlot]] = {}
        self._copies: dict[DataHandle, DataHandle] = {}  # remote handle -> local copy
        self._copy_of: dict[int, DataHandle] = {}  # local slot id -> remote handle
        self._peers: dict[str, Any] = {}
        self._regions: dict[int, _OwnedRegion] = {}
        self._committing: dict[int, threading.Event] = {}  # slot id -> its commit landed
        self._writers_busy: Counter[int] = Counter()  # reservation id -> fetches writing it
        self._abort_when_idle: set[int] = set()
        self._no_ucx_peers: set[tuple[str, int]] = set()  # (node, worker id) without UCX
        self._arena_registrations_seen = 0
        self._pulled_at: dict[int, float] = {}  # slot id -> last chunk pull (monotonic s)
        self._grace: list[tuple[float, FreedSlot]] = []  # frees waiting out PULL_GRACE_S
        #: Fault injection for the fault tests only (see inject_fault); empty in production.
        self._faults: dict[str, float] = {}
        #: Memory a timed-out GET may still write: out of every pool until shutdown.
        self._quarantined: list[tuple[Placement, bool]] = []
        self._inflight = 0  # fetches from other nodes running now
        self._inflight_cond = threading.Condition(threading.Lock())
        self._closed = False
        self.metrics = metrics.AgentMetrics(node_id)
        self._ticker = Ticker(self._tick, name=f"ray_velo-agent-{self.worker_id:016x}")

    # --- introspection ---------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        """Identity and counters (for the API's routing and for ``ray-velo status``)."""
        with self._lock:
            return {
                "worker_id": self.worker_id,
                "node_id": self.node_id,
                "pid": os.getpid(),
                "shm_dir": self.config.shm_dir,
                "rdma": self.rdma is not None,
                "rdma_enabled": self.rdma_enabled,
                "live_slots": self.store.live_slots,
                "live_leases": self.store.live_leases,
                "staged_bytes": self.store.staged_bytes,
                "pinned_used_bytes": self.pinned_pool.used_bytes,
                "plain_used_bytes": self.plain_pool.used_bytes,
                "registered_bytes": self.budget.registered_bytes,
                "reservations": len(self._reservations),
                "counters": _counters(self.store),
                "slots": [
                    {
                        "slot": slot.slot_id,
                        "kind": slot.kind,
                        "bytes": slot.total_len,
                        "refcount": slot.refcount,
                        "leases": len(slot.leases),
                    }
                    for slot in list(self.store.slots())[:32]
                ],
                "copies": len(self._copies),
                "ucx_endpoints": 0 if self.rdma is None else self.rdma.endpoint_count(),
                "ucx_endpoints_reaped": 0 if self.rdma is None else self.rdma.endpoints_reaped,
                "ucx_transports": {} if self.rdma is None else self.rdma.transports(),
                "peers": sorted(self._peers),
                "metrics": self.metrics.snapshot(),
            }

    def ping(self) -> int:
        return self.worker_id

    def inject_fault(self, name: str, value: float) -> None:
        """Test hook: ``corrupt_descriptors`` (the next N RDMA answers carry a corrupt
        descriptor) or ``stall_before_get_s`` (the consumer holds its RDMA lease this long
        before its GET, renewing it, as a slow GET would)."""
        if name not in ("corrupt_descriptors", "stall_before_get_s"):
            raise ValueError(f"unknown fault {name!r}")
        with self._lock:
            self._faults[name] = value

    # --- memory ----------------------------------------------------------------------

    def _allocate(
        self, nbytes: int, pinned: bool, now: float, *, record: bool = True
    ) -> tuple[Placement, SlotKind, bool]:
        """A placement for ``nbytes``: pinned pool when asked and possible, else plain.

        Never fails for lack of registered memory (spec: register_data_pinned never fails);
        a plain-memory failure (the shm directory is full) raises StagingError. ``record``:
        count a pinned-staging fallback in the path metric (the owner's staging point; a
        consumer's destination records its own reason instead). Thread-safe without the
        agent lock (the pools lock themselves), so a mapping never stalls other calls.
        """
        if pinned:
            if not self.rdma_enabled:
                if record:
                    self.metrics.path("chunked", "kill_switch")
            elif self.rdma is not None:
                got = self.pinned_pool.allocate(nbytes, now)
                self._sync_registrations()
                if isinstance(got, Placement):
                    return got, "dedicated" if got.dedicated else "pooled", True
                assert isinstance(got, Fallback)
                if record:
                    self.metrics.path("chunked", got.reason)
            # No UCX transport: the data goes to plain memory (spec), counting nothing.
        got = self.plain_pool.allocate(nbytes, now)
        if isinstance(got, Fallback):
            raise StagingError(
                f"cannot stage {nbytes} bytes in plain memory on node {self.node_id}: "
                f"{got.reason} (is {self.config.shm_dir} full?)"
            )
        return got, "dedicated" if got.dedicated else "plain", False

    def _sync_registrations(self) -> None:
        """Export arena registrations the pool made since the last look (off the hot path:
        a registration is an arena mapping, not a transfer)."""
        total = self.pinned_pool.registrations_total.get("arena", 0)
        with self._lock:
            new = total - self._arena_registrations_seen
            self._arena_registrations_seen = max(total, self._arena_registrations_seen)
        for _ in range(new):
            self.metrics.registration("arena", self.budget.registered_bytes)
        self.metrics.set_registered(self.budget.registered_bytes)

    def _release_memory(self, freed: FreedSlot, now: float, *, abandoned: bool = False) -> None:
        """Return a freed slot's memory to its pool, unless a copy still reads it.

        ``abandoned``: freed by a deadline (TTL, an expired lease), not by its consumers. A
        chunk pulled in the last PULL_GRACE_S may then still be read by Ray serializing it
        (a view of the arena); the memory waits out the grace on the ticker. A consumer's
        own release comes after it received every chunk, so needs no grace.
        """
        if self._reading[freed.slot_id] > 0:
            self._deferred.setdefault(freed.slot_id, []).append(freed)
            return
        pulled = self._pulled_at.pop(freed.slot_id, None)
        if abandoned and pulled is not None and now < pulled + PULL_GRACE_S:
            self._grace.append((pulled + PULL_GRACE_S, freed))
            self._ticker.poke()
            return
        remote = self._copy_of.pop(freed.slot_id, None)
        if remote is not None and self._copies.get(remote) == DataHandle(
            self.worker_id, freed.slot_id
        ):
            del self._copies[remote]
        if isinstance(freed.location, Placement):
            self._free_placement(freed.location, freed.pinned, now)
        elif isinstance(freed.location, _RegionSlot):
            freed.location.anchor.release()

    def _release_all(
        self, freed: list[FreedSlot] | FreedSlot | None, now: float, *, abandoned: bool = False
    ) -> None:
        if freed is None:
            return
        for item in freed if isinstance(freed, list) else [freed]:
            self._release_memory(item, now, abandoned=abandoned)

    def _begin_read(self, slot_id: int) -> None:
        self._reading[slot_id] += 1

    def _end_read(self, slot_id: int, now: float) -> None:
        with self._lock:
            self._reading[slot_id] -= 1
            if self._reading[slot_id] <= 0:
                del self._reading[slot_id]
                for freed in self._deferred.pop(slot_id, []):
                    self._release_memory(freed, now)

    # --- local producers -------------------------------------------------------------

    def stage_reserve(self, nbytes: int, pinned: bool, pid: int) -> Reservation:
        """Reserve ``nbytes`` for a local producer to write into; commit or abort it next."""
        self._check_open()
        placement: Placement | None = None
        kind, is_pinned = _EMPTY, False
        if nbytes:  # outside the agent lock: mapping a new arena must not stall other calls
            placement, kind, is_pinned = self._allocate(nbytes, pinned, time.monotonic())
        with self._lock:
            if self._closed:
                if placement is not None:
                    self._free_placement(placement, is_pinned, time.monotonic())
                self._check_open()
            self._reservation_seq += 1
            rid = self._reservation_seq
            slot_id = self.store.reserve_slot_id()
            self._reservations[rid] = _Pending(placement, kind, is_pinned, pid, slot_id)
            self._committing[slot_id] = threading.Event()
            handle = DataHandle(self.worker_id, slot_id, self.node_id)
            if placement is None:
                return Reservation(rid, "", 0, 0, False, handle)
            return Reservation(
                rid,
                placement.arena.path,
                placement.offset_bytes,
                nbytes,
                placement.dedicated,
                handle,
            )

    def stage_commit(
        self,
        reservation_id: int,
        nbytes: int,
        type_header: TypeHeader,
        ttl: float | None,
        refcount: int,
    ) -> DataHandle:
        """Turn a written reservation into a slot; returns its handle.

        Producers send this without waiting for the answer: a call that names the handle
        before the commit lands waits for it (see _await_commit).
        """
        now = time.monotonic()
        with self._lock:
            self._check_open()
            pending = self._reservations.pop(reservation_id, None)
            if pending is None:
                raise StagingError(f"reservation {reservation_id} is unknown or was reaped")
            try:
                handle = self.store.stage(
                    nbytes,
                    type_header,
                    pending.placement,
                    kind=pending.kind,
                    pinned=pending.pinned,
                    now=now,
                    ttl=ttl,
                    refcount=refcount,
                    slot_id=pending.slot_id,
                )
            except Exception as exc:
                self._end_commit(pending.slot_id, f"staging it failed: {exc}")
                if pending.placement is not None:
                    self._free_placement(pending.placement, pending.pinned, now)
                raise
            self._end_commit(pending.slot_id)
            self._ticker.poke()
            return DataHandle(handle.worker_id, handle.slot_id, self.node_id)

    def _end_commit(self, slot_id: int, why: str | None = None) -> None:
        """The reservation of ``slot_id`` is committed (or, with ``why``, never will be)."""
        if why is not None:
            self.store.forget_reserved(slot_id, why)
        event = self._committing.pop(slot_id, None)
        if event is not None:
            event.set()

    def _await_commit(self, handle: DataHandle) -> None:
        """A call naming a slot whose producer's commit is still on its way waits for it."""
        if handle.worker_id != self.worker_id:
            return
        event = self._committing.get(handle.slot_id)
        if event is not None and not event.wait(COMMIT_WAIT_S):
            raise StagingError(
                f"handle {handle} is still being staged after {COMMIT_WAIT_S} s: its "
                "producer did not commit it"
            )

    def stage_abort(self, reservation_id: int) -> None:
        """Give a reservation's memory back (a failed put, a closed PinnedWriter)."""
        with self._lock:
            self._abort_reservation(reservation_id, "its producer aborted staging it")

    def _abort_reservation(self, reservation_id: int, why: str) -> None:
        # _lock held. A PinnedWriter a fetch still writes into is freed when it is done.
        if self._writers_busy[reservation_id] > 0:
            self._abort_when_idle.add(reservation_id)
            return
        self._writers_busy.pop(reservation_id, None)
        pending = self._reservations.pop(reservation_id, None)
        if pending is not None:
            self._end_commit(pending.slot_id, why)
            if pending.placement is not None:
                self._free_placement(pending.placement, pending.pinned, time.monotonic())

    def _free_placement(self, placement: Placement, pinned: bool, now: float) -> None:
        (self.pinned_pool if pinned else self.plain_pool).free(placement, now)

    # --- local readers ---------------------------------------------------------------

    def local_acquire(
        self, handle: DataHandle, pid: int, release: bool = False, hold: bool = False
    ) -> LocalLease:
        """A lease for a process of this node reading an owned slot in place.

        A slot in a caller's region is never handed out in place (its owner may write it at
        any time): the reader gets a lease on a copy taken under the region's copy gate, and
        ``release`` says whether the reader consumed its reference on the region slot. With
        ``hold`` (the get family) the lease on the region slot stays the caller's, to detach
        or release later; its id comes back as ``remote_lease_id``.
        """
        self._await_commit(handle)
        now = time.monotonic()
        with self._lock:
            slot = self.store.slot(handle)
            lease = self.store.acquire(handle, now, kind="local", holder_pid=pid)
            self._ticker.poke()
            if not isinstance(slot.location, _RegionSlot) or slot.total_len == 0:
                return self._local_lease(slot, lease.lease_id)
            region_slot: _RegionSlot = slot.location
        placement: Placement | None = None
        try:
            placement, kind, _ = self._allocate(slot.total_len, False, now)
            region_slot.region.copy_into(region_slot.offset, placement.view()[: slot.total_len])
            with self._lock:
                # the copy stands in for the region slot: the reader's lease moves onto it
                if not hold:
                    end = self.store.release if release else self.store.detach
                    self._release_all(end(handle, lease.lease_id), now)
                copy = self.store.stage(
                    slot.total_len, slot.type_header, placement, kind=kind, pinned=False, now=now
                )
                placement = None  # the copy slot owns it now
                copy_slot = self.store.slot(copy)
                copy_lease = self.store.acquire(copy, now, kind="local", holder_pid=pid)
                return self._local_lease(
                    copy_slot, copy_lease.lease_id, lease.lease_id if hold else 0
                )
        except BaseException:
            with self._lock:
                if placement is not None:
                    self._free_placement(placement, False, time.monotonic())
                with contextlib.suppress(HandleNotFound, LeaseNotFound):  # a TTL came first
                    self._release_all(self.store.detach(handle, lease.lease_id), time.monotonic())
            raise

    def _local_lease(self, slot: Slot, lease_id: int, remote_lease_id: int = 0) -> LocalLease:
        placement = slot.location
        handle = DataHandle(self.worker_id, slot.slot_id, self.node_id)
        if not isinstance(placement, Placement):
            return LocalLease(
                handle, lease_id, "", 0, slot.total_len, slot.type_header, False, remote_lease_id
            )
        return LocalLease(
            handle,
            lease_id,
            placement.arena.path,
            placement.offset_bytes,
            slot.total_len,
            slot.type_header,
            placement.dedicated,
            remote_lease_id,
        )

    def local_end(self, handle: DataHandle, lease_id: int, release: bool) -> None:
        """End a local lease: ``release`` also drops the reference the reader consumed."""
        now = time.monotonic()
        with self._lock:
            try:
                if release:
                    freed = self.store.release(handle, lease_id)
                else:
                    freed = self.store.detach(handle, lease_id)
            except HandleNotFound:
                return  # TTL or shutdown freed it first: nothing left to end
            self._release_all(freed, now)

    # --- the seven handlers (owner side) ---------------------------------------------

    def _rv_metadata(self, data: bytes) -> bytes:
        request = decode(MetadataRequest, data)
        self._await_commit(request.handle)
        with self._lock:
            meta = self.store.metadata(request.handle)
        return encode(MetadataResponse(meta.size, meta.refcount, meta.pinned))

    def _rv_acquire(self, data: bytes) -> bytes:
        request = decode(AcquireRequest, data)
        self._await_commit(request.handle)
        now = time.monotonic()
        with self._lock:
            slot = self.store.slot(request.handle)
            rendezvous = self.config.rdma.rendezvous
            facts = OwnerFacts(
                offer=request.rdma,
                has_registry=self.rdma is not None,
                rdma_enabled=self.rdma_enabled,
                slot_pinned=slot.pinned,
                total_len=slot.total_len,
                rdma_min_bytes=rendezvous.rdma_min_bytes,
                draining=self.store.draining,
            )
            decision = decide_path(facts, lambda: self._descriptor(slot))
            self.metrics.path(decision.path, decision.reason)
            descriptor = decision.descriptor
            if descriptor and self._faults.get("corrupt_descriptors", 0) > 0:
                self._faults["corrupt_descriptors"] -= 1
                descriptor = descriptor + b"\x00"  # a trailing byte: decode must refuse it
            if decision.path == "rdma":
                lease = self.store.acquire(
                    request.handle, now, kind="rdma", timeout=rendezvous.lease_timeout
                )
                self._ticker.poke()
                return encode(
                    Rdma(
                        lease.lease_id,
                        descriptor,
                        rendezvous.lease_timeout_ms,
                        slot.total_len,
                        slot.type_header,
                    )
                )
            timeout = request.lease_ms / 1000 if request.lease_ms > 0 else None
            lease = self.store.acquire(
                request.handle,
                now,
                kind="local" if request.holder_pid else "chunked",
                timeout=timeout,
                holder_pid=request.holder_pid,
            )
            if timeout is not None or request.holder_pid:
                self._ticker.poke()
            chunk = self.config.chunk_size
            return encode(
                Ready(
                    lease.lease_id,
                    lease.lease_id,
                    chunk,
                    math.ceil(slot.total_len / chunk),
                    slot.total_len,
                    slot.type_header,
                )
            )

    def _descriptor(self, slot: Slot) -> bytes | None:
        """Check 8: the staging still exists (registered) and the descriptor encodes."""
        if self.rdma is None:
            return None
        location = slot.location
        if isinstance(location, Placement):
            return self.rdma.descriptor(location.registration, location.address, slot.total_len)
        if isinstance(location, _RegionSlot):
            region = location.region
            if region.state.name != "REGISTERED":
                return None
            return self.rdma.descriptor(
                region.registration, region.address + location.offset, slot.total_len
            )
        return None

    def _rv_pull(self, data: bytes) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """One chunk.

        A pool slot's chunk is returned as a view of the arena: Ray copies it into its
        object store while serializing the return value, after this method returns, so
        the slot's memory stays out of the pool for PULL_GRACE_S after its last pull (see
        _release_memory). A region's chunk is copied here, under the region's copy gate.
        """
        request = decode(PullRequest, data)
        now = time.monotonic()
        with self._lock:
            slot = self.store.pull(request.transfer_id, now)
            chunk = self.config.chunk_size
            start = request.index * chunk
            if request.index < 0 or start >= max(slot.total_len, 1):
                raise VeloError(
                    f"chunk {request.index} is outside transfer {request.transfer_id} "
                    f"({slot.total_len} bytes in chunks of {chunk})"
                )
            length = min(chunk, slot.total_len - start)
            placement = slot.location
            if isinstance(placement, Placement):
                self._pulled_at[slot.slot_id] = now
                return np.frombuffer(placement.view(), dtype=np.uint8, count=length, offset=start)
            self._begin_read(slot.slot_id)
        try:
            out = np.empty(length, dtype=np.uint8)
            if length and isinstance(placement, _RegionSlot):
                # never a view into caller memory: copy under the region's gate
                placement.region.copy_into(placement.offset + start, out.data)
            elif length:
                assert isinstance(placement, Placement)
                source = np.frombuffer(placement.view(), dtype=np.uint8, count=length, offset=start)
                np.copyto(out, source)
            return out
        finally:
            self._end_read(slot.slot_id, time.monotonic())

    def _rv_ref(self, data: bytes) -> int:
        request = decode(RefRequest, data)
        self._await_commit(request.handle)
        with self._lock:
            return self.store.ref(request.handle)

    def _rv_detach(self, data: bytes) -> None:
        self._end_owner_lease(decode(DetachRequest, data), release=False)

    def _rv_release(self, data: bytes) -> None:
        self._end_owner_lease(decode(ReleaseRequest, data), release=True)

    def _end_owner_lease(self, request: DetachRequest | ReleaseRequest, release: bool) -> None:
        """Detach (lock only) or release (lock and one reference); free the slot at zero."""
        self._await_commit(request.handle)
        end = self.store.release if release else self.store.detach
        with self._lock:
            self._release_all(end(request.handle, request.lease_id), time.monotonic())

    def _rv_lease_renew(self, data: bytes) -> None:
        request = decode(LeaseRenewRequest, data)
        with self._lock:
            self.store.renew(request.handle, request.lease_id, time.monotonic())

    # --- caller-owned regions --------------------------------------------------------

    def region_alloc(self, nbytes: int, pid: int) -> RegionInfo:
        """Registered memory a local process owns and writes (spec: register_external_memory).

        Raises:
            BudgetExceeded: the region's pages do not fit ``registered_bytes_budget``.
            SharedMemoryTooSmall: the shm directory cannot hold it.
        """
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes}")
        with self._lock:
            self._check_open()
            arena = ShmArena(self.config.shm_dir, nbytes, self.worker_id)
            try:
                region = Region(
                    arena.address,
                    nbytes,
                    self._registrar(),
                    self.budget,
                    on_released=arena.close,
                )
            except BaseException:
                arena.close()
                raise
            self._regions[region.region_id] = _OwnedRegion(arena, region, pid)
            self.metrics.registration("external", self.budget.registered_bytes)
            self._publish_registered()
            self._ticker.poke()
            return RegionInfo(region.region_id, arena.path, nbytes, region.effective_range)

    def _registrar(self) -> Registrar:
        return self.rdma.registrar if self.rdma is not None else self._noop_registrar

    def _publish_registered(self) -> None:
        live = sum(1 for r in self._regions.values() if r.region.state.name == "REGISTERED")
        self.metrics.set_registered(self.budget.registered_bytes, live)

    def region_stage(
        self, region_id: int, start: int, stop: int, type_header: TypeHeader, ttl: float | None
    ) -> DataHandle:
        """Stage ``[start, stop)`` of a region (relative to its pointer) with no copy."""
        with self._lock:
            self._check_open()
            owned = self._regions.get(region_id)
            if owned is None:
                raise RegionDeregistered(region=f"#{region_id}")
            owned.region.check_range(start, stop - start)
            anchor = owned.region.enter()  # the in-flight guard first, then the state
            try:
                handle = self.store.stage(
                    stop - start,
                    type_header,
                    _RegionSlot(owned.region, anchor, start),
                    kind="region",
                    pinned=self.rdma is not None,
                    now=time.monotonic(),
                    ttl=ttl,
                )
            except BaseException:
                anchor.release()
                raise
            if ttl is not None:
                self._ticker.poke()
            return DataHandle(handle.worker_id, handle.slot_id, self.node_id)

    def region_unregister(self, region_id: int, timeout_s: float) -> str:
        """Gate, drain anchors up to ``timeout_s``, unmap. Returns drained / drain_timed_out."""
        with self._lock:
            owned = self._regions.get(region_id)
        if owned is None:
            raise RegionDeregistered(region=f"#{region_id}")
        result = owned.region.deregister(timeout_s)
        with self._lock:
            self._regions.pop(region_id, None)
            now = time.monotonic()
            for slot in [s for s in self.store.slots() if isinstance(s.location, _RegionSlot)]:
                if slot.location.region is owned.region:
                    handle = DataHandle(self.worker_id, slot.slot_id)
                    self._release_all(self.store.evict(handle, "its region was unregistered"), now)
            self._publish_registered()
        return "drain_timed_out" if isinstance(result, DrainTimedOut) else "drained"

    def region_deregistered(self, region_id: int, timeout_s: float | None) -> bool:
        """Wait up to ``timeout_s`` for the region's release signal; True once released."""
        with self._lock:
            owned = self._regions.get(region_id)
        return True if owned is None else owned.region.signal.wait(timeout_s)

    # --- routing to owners (consumer side) -------------------------------------------

    def _owner_node(self, handle: DataHandle) -> str:
        if handle.owner_node:
            return handle.owner_node
        from ray_velo.actors.directory import node_of_worker

        node = node_of_worker(handle.worker_id)
        if node is None:
            raise HandleNotFound(handle=str(handle), reason="no live agent issued this handle")
        return node

    def _owner(self, handle: DataHandle) -> tuple[Any, str]:
        """The owner agent's actor handle and node id. Raises OwnerDied if it is gone."""
        node = self._owner_node(handle)
        with self._lock:
            actor = self._peers.get(node)
        if actor is None:
            from ray_velo.actors.directory import find_agent

            try:
                actor = find_agent(node)
            except ValueError as exc:
                raise OwnerDied(handle=str(handle), node=node) from exc
            with self._lock:
                self._peers[node] = actor
        return actor, node

    def route(self, handle: DataHandle, method: str, data: bytes, timeout_s: float | None) -> Any:
        """Run one of the seven handlers on ``handle``'s owner (this agent or a peer)."""
        if method not in _HANDLERS:
            raise ValueError(f"unknown handler {method!r}")
        if handle.worker_id == self.worker_id:
            return getattr(self, method)(data)
        for attempt in range(2):
            actor, node = self._owner(handle)
            try:
                return call_owner(
                    getattr(actor, method).remote(data), Deadline.start(timeout_s), handle, node
                )
            except OwnerDied:
                if not self._forget_owner(node, actor) or attempt:
                    raise
        raise AssertionError("unreachable")

    def ucx_address(self) -> tuple[int, bytes | None]:
        """(worker id, UCX worker address or None without UCX), for peers to wire up."""
        return self.worker_id, None if self.rdma is None else self.rdma.address

    def register_peers(self, addresses: dict[str, tuple[int, bytes | None]]) -> int:
        """Learn peer agents' worker addresses: node id -> (worker id, address)."""
        if self.rdma is None:
            return 0
        count = 0
        for node, (worker_id, address) in addresses.items():
            if node != self.node_id and address:
                self.rdma.register_peer(node, worker_id, address)
                count += 1
        return count

    def _learn_peer(self, actor: Any, node: str, worker_id: int, deadline: Deadline) -> None:
        """Cold start: after a first (chunked) fetch from an unknown owner, register it so
        later fetches offer RDMA."""
        if self.rdma is None or self.rdma.peer_registered(node, worker_id):
            return
        if (node, worker_id) in self._no_ucx_peers:
            return
        try:
            peer_worker, address = call_owner(
                actor.ucx_address.remote(), deadline, DataHandle(worker_id, 0), node
            )
        except VeloError:
            return
        if address:
            self.rdma.register_peer(node, peer_worker, address)
        else:
            with self._lock:
                self._no_ucx_peers.add((node, peer_worker))

    def release_quietly(self, handle: DataHandle) -> None:
        """Drop one reference on ``handle`` for a caller that does not wait for the answer;
        a handle already gone (its TTL came first) is not an error here."""
        with contextlib.suppress(HandleNotFound, OwnerDied):
            self.route(handle, "_rv_release", encode(ReleaseRequest(handle, 0)), None)

    # --- fetching from other nodes (consumer side) -----------------------------------

    def fetch_remote(
        self,
        handle: DataHandle,
        mode: str,
        timeout_s: float | None,
        pid: int,
        bound: str,
        into_reservation: int = 0,
    ) -> LocalLease:
        """Bring ``handle``'s bytes to this node and lease the local copy to ``pid``.

        ``mode``: ``release`` (fetch: consume one reference on the owner), ``detach`` (fetch
        without release: the handle stays usable), or ``hold`` (get: keep the owner's lease;
        the caller detaches or releases it later). ``into_reservation`` (with ``hold``): a
        PinnedWriter's reservation that the GET (or the chunks) land in directly; no local
        slot is made and the answer's lease id is 0.
        """
        if mode not in ("release", "detach", "hold"):
            raise ValueError(f"unknown fetch mode {mode!r}")
        into: _Pending | None = None
        if into_reservation:
            if mode != "hold":
                raise ValueError("a PinnedWriter destination needs mode='hold'")
            with self._lock:
                into = self._reservations.get(into_reservation)
                if into is not None:
                    self._writers_busy[into_reservation] += 1  # its memory stays until done
            if into is None or into.placement is None:
                raise StagingError(f"PinnedWriter reservation {into_reservation} is gone")
            try:
                return self._fetch_remote(handle, mode, timeout_s, pid, bound, into)
            finally:
                self._writer_done(into_reservation)
        return self._fetch_remote(handle, mode, timeout_s, pid, bound, None)

    def _writer_done(self, reservation_id: int) -> None:
        with self._lock:
            self._writers_busy[reservation_id] -= 1
            if self._writers_busy[reservation_id] > 0:
                return
            del self._writers_busy[reservation_id]
            if reservation_id in self._abort_when_idle:
                self._abort_when_idle.discard(reservation_id)
                self._abort_reservation(reservation_id, "its producer aborted staging it")

    def _fetch_remote(
        self,
        handle: DataHandle,
        mode: str,
        timeout_s: float | None,
        pid: int,
        bound: str,
        into: _Pending | None,
    ) -> LocalLease:
        with self._inflight_cond:
            self._check_open()
            self._inflight += 1
        try:
            return self._fetch_counted(handle, mode, timeout_s, pid, bound, into)
        finally:
            with self._inflight_cond:
                self._inflight -= 1
                self._inflight_cond.notify_all()

    def _fetch_counted(
        self,
        handle: DataHandle,
        mode: str,
        timeout_s: float | None,
        pid: int,
        bound: str,
        into: _Pending | None,
    ) -> LocalLease:
        deadline = Deadline.start(timeout_s, bound)
        started = time.monotonic()
        actor, node = self._owner(handle)
        if mode != "hold":
            cached = self._lease_cached_copy(handle, pid)
            if cached is not None:
                if mode == "release":  # the owner is known: this send cannot fail here
                    actor._rv_release.remote(encode(ReleaseRequest(handle, 0)))
                return cached
        try:
            return self._fetch_from_owner(actor, node, handle, mode, deadline, pid, started, into)
        except OwnerDied:
            if not self._forget_owner(node, actor):
                raise
        # The cached actor handle was of a dead incarnation; a new agent may serve the node
        # now (it answers HandleNotFound for the old one's handles).
        actor, node = self._owner(handle)
        return self._fetch_from_owner(actor, node, handle, mode, deadline, pid, started, into)

    def _forget_owner(self, node: str, actor: Any) -> bool:
        """Drop a dead owner's cached actor handle. True if it was cached (a retry with a
        fresh lookup may find the node's new agent). Its UCX registration stays: it names
        the dead incarnation's worker id, so no handle of a new one is offered to it."""
        with self._lock:
            cached = self._peers.get(node) is actor
            if cached:
                del self._peers[node]
        return cached

    def _lease_cached_copy(self, handle: DataHandle, pid: int) -> LocalLease | None:
        with self._lock:
            local = self._copies.get(handle)
            if local is None:
                return None
            try:
                self.store.ref(local)
            except HandleNotFound:
                del self._copies[handle]
                return None
            slot = self.store.slot(local)
            lease = self.store.acquire(local, time.monotonic(), kind="local", holder_pid=pid)
            self._ticker.poke()
            self.metrics.fetched("cache", slot.total_len, 0.0)
            return self._local_lease(slot, lease.lease_id)

    def _fetch_from_owner(
        self,
        actor: Any,
        node: str,
        handle: DataHandle,
        mode: str,
        deadline: Deadline,
        pid: int,
        started: float,
        into: _Pending | None = None,
    ) -> LocalLease:
        offer = build_offer(
            self.rdma is not None,
            self.rdma_enabled,
            self.rdma is not None and self.rdma.peer_registered(node, handle.worker_id),
        )
        if offer.reason is not None:
            self.metrics.path("chunked", offer.reason)
        # A public get holds its lease past the last pull: no chunked deadline (spec).
        lease_ms = 0 if mode == "hold" else deadline.budget_ms()
        request = AcquireRequest(
            handle, rdma=offer.offer, lease_ms=lease_ms, budget_ms=deadline.budget_ms()
        )
        answer = decode_acquire_response(
            call_owner(actor._rv_acquire.remote(encode(request)), deadline, handle, node)
        )
        lease_to_end: int | None = answer.lease_id  # the owner's lease this fetch must end

        def end_lease(release: bool) -> None:
            nonlocal lease_to_end
            if lease_to_end is not None:
                message = (ReleaseRequest if release else DetachRequest)(handle, lease_to_end)
                getattr(actor, "_rv_release" if release else "_rv_detach").remote(encode(message))
                lease_to_end = None

        limit = self.config.staged_payload_max
        if limit is not None and answer.total_len > limit:
            # Refuse before allocating. A consuming fetch releases, so the owner frees its
            # staged copy (transparent handles are single-use); the others only detach.
            end_lease(release=mode == "release")
            raise PayloadTooLarge(
                handle=str(handle), size_bytes=answer.total_len, limit_bytes=limit
            )
        placement: Placement | None = None
        kind: SlotKind = _EMPTY
        pinned = False
        try:
            self._check_open()
            if into is not None:
                assert into.placement is not None
                if answer.total_len > into.placement.nbytes:
                    raise ValueError(
                        f"PinnedWriter holds {into.placement.nbytes} bytes, payload of "
                        f"{handle} is {answer.total_len} bytes"
                    )
                placement, kind, pinned = into.placement, into.kind, into.pinned
            elif answer.total_len:
                # Registered memory only where a GET will land in it.
                placement, kind, pinned = self._allocate(
                    answer.total_len, isinstance(answer, Rdma), time.monotonic(), record=False
                )
        except BaseException:
            end_lease(release=False)
            raise
        path = "chunked"
        try:
            if isinstance(answer, Rdma):
                if request.rdma is None:
                    raise ProtocolError(
                        f"owner on node {node} answered RDMA to an acquire with no offer"
                    )
                reason, unsafe = self._rdma_get(
                    actor, node, handle, answer, placement, pinned, deadline
                )
                if unsafe:
                    # UCX may still write this memory: it never goes back to a pool.
                    self._quarantine(placement, pinned)
                    placement = None
                    if into is not None:
                        raise StagingError(
                            f"a timed-out GET of {handle} may still write the PinnedWriter; "
                            "it was withdrawn, allocate a new one"
                        )
                if reason is None:
                    path = "rdma"
                else:
                    # Fallback, exactly once: detach, acquire with no offer, pull chunks.
                    self.metrics.path("chunked", reason)
                    end_lease(release=False)
                    retry = AcquireRequest(
                        handle, rdma=None, lease_ms=lease_ms, budget_ms=deadline.budget_ms()
                    )
                    answer = decode_acquire_response(
                        call_owner(actor._rv_acquire.remote(encode(retry)), deadline, handle, node)
                    )
                    lease_to_end = answer.lease_id
                    if isinstance(answer, Rdma):
                        raise ProtocolError(
                            f"owner on node {node} answered RDMA again to the fallback acquire, "
                            "which carried no offer; refusing to retry"
                        )
                    if placement is None and answer.total_len:
                        placement, kind, pinned = self._allocate(
                            answer.total_len, False, time.monotonic(), record=False
                        )
            if isinstance(answer, Ready) and placement is not None:
                pull_chunks(
                    actor,
                    handle,
                    node,
                    answer.transfer_id,
                    answer.chunk_size,
                    answer.chunk_count,
                    answer.total_len,
                    placement.view(),
                    self.config.pulls_in_flight,
                    deadline,
                )
        except BaseException:
            if placement is not None and into is None:  # a writer's memory is the writer's
                with self._lock:
                    self._free_placement(placement, pinned, time.monotonic())
            if not isinstance(sys.exc_info()[1], OwnerDied):
                end_lease(release=False)
            raise
        if path == "chunked":
            self._learn_peer(actor, node, handle.worker_id, deadline)
        if mode == "release":
            end_lease(release=True)
        elif mode == "detach":
            end_lease(release=False)
        now = time.monotonic()
        if into is not None and placement is not None:
            self.metrics.fetched(path, answer.total_len, now - started)
            return LocalLease(
                DataHandle(self.worker_id, 0, self.node_id),
                0,
                placement.arena.path,
                placement.offset_bytes,
                answer.total_len,
                answer.type_header,
                placement.dedicated,
                answer.lease_id,
            )
        with self._lock:
            local = self.store.stage(
                answer.total_len, answer.type_header, placement, kind=kind, pinned=pinned, now=now
            )
            slot = self.store.slot(local)
            lease = self.store.acquire(local, now, kind="local", holder_pid=pid)
            if mode != "hold":
                self._copies[handle] = local
                self._copy_of[local.slot_id] = handle
            self._ticker.poke()
        self.metrics.fetched(path, answer.total_len, now - started)
        return self._local_lease(slot, lease.lease_id, answer.lease_id if mode == "hold" else 0)

    def _quarantine(self, placement: Placement | None, pinned: bool) -> None:
        """Keep memory a GET may still write out of every pool until shutdown (logged)."""
        if placement is None:
            return
        _log.error(
            "ray_velo: a timed-out GET may still write %d bytes at %s+%d; keeping them out "
            "of the pool until this agent shuts down",
            placement.nbytes,
            placement.arena.path,
            placement.offset_bytes,
        )
        with self._lock:
            self._quarantined.append((placement, pinned))

    def _rdma_get(
        self,
        actor: Any,
        node: str,
        handle: DataHandle,
        answer: Rdma,
        placement: Placement | None,
        pinned: bool,
        deadline: Deadline,
    ) -> tuple[str | None, bool]:
        """GET an RDMA answer into ``placement``.

        Returns (None on success, else the consumer's fallback reason: decode_error,
        pool_exhausted, get_failed; and whether UCX may still write the destination).
        """
        assert self.rdma is not None
        try:
            descriptor = self.rdma.decode(answer.descriptor, answer.total_len)
        except DescriptorError:
            return "decode_error", False
        if placement is None or not pinned:
            return "pool_exhausted", False
        renewal = _LeaseRenewal(actor, handle, answer.lease_id, answer.lease_timeout_ms)
        started = time.monotonic()
        try:
            remaining = deadline.remaining()
            timeout = remaining if remaining is not None else max(60.0, answer.total_len / 50e6)
            if timeout <= 0:
                raise deadline.timeout_error(handle)
            stall = self._faults.get("stall_before_get_s", 0.0)
            if stall:
                time.sleep(stall)
            self.rdma.get(node, descriptor, placement.address, timeout, placement.registration)
        except DescriptorError:
            return "decode_error", False
        except UcxError as exc:
            _log.warning("ray_velo: GET of %s from node %s failed", handle, node, exc_info=True)
            unsafe = bool(exc.fields.get("destination_unsafe"))
            if deadline.expired():
                if unsafe:
                    self._quarantine(placement, pinned)
                    raise deadline.timeout_error(handle) from None
                raise deadline.timeout_error(handle) from None
            return "get_failed", unsafe
        finally:
            renewal.stop()
        elapsed = time.monotonic() - started
        if self.config.rdma.ucx.ep_idle_timeout is not None:
            self._ticker.poke()  # arm the idle-endpoint scan
        self.metrics.get_completed(elapsed)
        self.metrics.path("rdma", "ok")
        return None, False

    # --- timers ----------------------------------------------------------------------

    def _tick(self, now: float) -> float | None:
        """Sweep deadlines, reap dead local readers, reclaim arenas; say when to run next."""
        dead_regions: list[int] = []
        with self._lock:
            if self._closed:
                return None
            result = self.store.sweep(now)
            self._release_all(result.freed, now, abandoned=True)
            due_frees = [freed for due, freed in self._grace if due <= now]
            self._grace = [(due, freed) for due, freed in self._grace if due > now]
            self._release_all(due_frees, now)
            self.metrics.leases_reaped(result.rdma_leases_reaped)
            pids = self.store.holder_pids() | {p.pid for p in self._reservations.values()}
            pids |= {owned.pid for owned in self._regions.values()}
            dead = {pid for pid in pids if pid and not _pid_alive(pid)}
            if dead:
                self._release_all(self.store.reap_holders(dead), now)
                for rid, pending in list(self._reservations.items()):
                    if pending.pid in dead:
                        self._abort_reservation(rid, "its producer died while staging it")
                dead_regions = [r for r, o in self._regions.items() if o.pid in dead]
            if self.pinned_pool.reclaim(now):
                self._sync_registrations()
            self.plain_pool.reclaim(now)
            self.metrics.set_slots(self.store.live_slots, self.store.staged_bytes)
            due = [
                min((d for d, _ in self._grace), default=None),
                self.store.next_deadline(),
                self.pinned_pool.next_reclaim_deadline(now),
                self.plain_pool.next_reclaim_deadline(now),
            ]
            if self.store.holder_pids() or self._reservations:
                due.append(now + LIVENESS_INTERVAL_S)
            if self.rdma is not None:
                self.rdma.reap_idle_endpoints(now)
                due.append(self.rdma.next_reap_due(now))
            if self._regions:
                due.append(now + LIVENESS_INTERVAL_S)
        for region_id in dead_regions:  # their owner process died: nobody will unregister
            _log.warning("ray_velo: region #%d's process died; unregistering it", region_id)
            with contextlib.suppress(RegionDeregistered):
                self.region_unregister(region_id, 0.0)
        return min((d for d in due if d is not None), default=None)

    # --- shutdown --------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StagingError(f"the ray_velo agent on node {self.node_id} is shutting down")

    def shutdown(self) -> dict[str, int]:
        """Drain and release everything: timers, slots, arenas. Returns what was freed."""
        with self._lock:
            if self._closed:
                return {"slots": 0}
            self.store.begin_drain()
            self._closed = True
        self._ticker.stop()
        # Fetches in flight finish (or fail) before their memory and UCX go away.
        bound = self.config.rdma.shutdown_timeout or 30.0
        with self._inflight_cond:
            if not self._inflight_cond.wait_for(lambda: self._inflight == 0, bound):
                _log.warning(
                    "ray_velo: %d fetches still running after %.0f s; shutting down anyway",
                    self._inflight,
                    bound,
                )
        with self._lock:
            now = time.monotonic()
            freed = self.store.clear()
            self._reading.clear()
            self._pulled_at.clear()
            self._release_all(freed + [f for _, f in self._grace], now)
            self._grace.clear()
            for pending in self._reservations.values():
                self._end_commit(pending.slot_id, "its owner shut down")
                if pending.placement is not None:
                    self._free_placement(pending.placement, pending.pinned, now)
            self._reservations.clear()
            for owned in list(self._regions.values()):
                # RegionDeregistered: already deregistering on another thread
                with contextlib.suppress(RegionDeregistered):
                    owned.region.deregister(0.0)
            self._regions.clear()
            self.pinned_pool.close()
            self.plain_pool.close()
            if self.rdma is not None:  # after every unmap: endpoints and worker go last
                self.rdma.close()
                self.rdma = None
            self._quarantined.clear()  # the pools are closed: their arenas are gone
        return {"slots": len(freed)}


def _counters(store: SlotStore) -> dict[str, int]:
    return dataclasses.asdict(store.counters)
