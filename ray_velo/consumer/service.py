"""The agent as consumer for its node's processes: fetches from other nodes (single flight),
node-local copies, claims, and routing the handle API to owners (docs/architecture.md §6)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from ray_velo.agent import nonblocking
from ray_velo.agent.clock import Deadline
from ray_velo.agent.core import AgentCore
from ray_velo.consumer.bulk import RangeReader
from ray_velo.consumer.driver import FetchDriver
from ray_velo.consumer.links import Blocking, OwnerLink, acquire, inline
from ray_velo.consumer.peers import Peers
from ray_velo.consumer.relay import RelayServer
from ray_velo.errors import HandleNotFound, LeaseNotFound, OwnerDied, StagingError
from ray_velo.local.records import LocalLease, lease_of
from ray_velo.memory.pool import Placement
from ray_velo.owner.service import OwnerService
from ray_velo.protocol import (
    AcquireRequest,
    CopyNotice,
    DataHandle,
    DetachRequest,
    ReleaseRequest,
    decode,
    encode,
)
from ray_velo.protocol.entry import BY_NAME, RV_DETACH, RV_RELEASE, Entry
from ray_velo.state.fetch import Mode

__all__ = ["ConsumerService"]

_MODES = ("release", "detach", "hold", "claim")


class ConsumerService:
    """Fetches, copies, claims and routing of one agent."""

    def __init__(
        self,
        core: AgentCore,
        peers: Peers,
        owner: OwnerService,
        serve: Callable[[Entry], Any],
        bulk: RangeReader | None = None,
    ) -> None:
        """``bulk``: the reader of other agents' bulk ports (None: this agent reads no
        wire)."""
        self.core = core
        self.peers = peers
        self.owner = owner
        #: The agent's resolver of entry points (its own owner's handlers, for its own handles).
        self.serve = serve
        #: Serves this node's copies to other nodes' agents (``_rv_relay``), and to this
        #: node's other receivers.
        self.relays = RelayServer(
            core, lambda handle: handle in self._flights or handle in self._into_writers
        )
        self.driver = FetchDriver(core, peers, self.relays, bulk)
        #: Transfers in flight by handle (on the event loop): a second fetch of one waits
        #: for it and reads its node-local copy, so the bytes cross the link once.
        self._flights: dict[DataHandle, asyncio.Future[None]] = {}
        #: Fetches into PinnedWriters in flight by handle (their copies relay as they fill).
        self._into_writers: Counter[DataHandle] = Counter()
        self._inflight = 0
        self._inflight_cond = threading.Condition(threading.Lock())

    # --- fetches ---------------------------------------------------------------------

    def fetch(
        self,
        handle: DataHandle,
        mode: Mode,
        timeout_s: float | None,
        pid: int,
        bound: str,
        writer_rid: int = 0,
    ) -> LocalLease:
        """:meth:`fetch_async` from synchronous code (no event loop to keep free)."""
        return asyncio.run(
            self.fetch_async(handle, mode, timeout_s, pid, bound, inline, writer_rid)
        )

    async def fetch_async(
        self,
        handle: DataHandle,
        mode: Mode,
        timeout_s: float | None,
        pid: int,
        bound: str,
        blocking: Blocking,
        writer_rid: int = 0,
    ) -> LocalLease:
        """Bring ``handle``'s bytes to this node and lease them to ``pid``. Waiting on the
        owner holds no thread (a stalled owner cannot starve fetches from healthy ones);
        blocking work (mapping, the GET, copies) goes through ``blocking``.

        ``mode``: ``release`` (consume one reference), ``claim`` (a transparent resolution:
        claim one, consumed or given back with :meth:`claim_end`), ``detach`` (the handle
        stays usable) or ``hold`` (the get family: the owner's lease stays the caller's).
        ``writer_rid`` (with ``hold``, ``detach`` to end the owner's lease at once, or
        ``claim``): a PinnedWriter's reservation that the GET (or the chunks) land in
        directly; no local slot is made.
        """
        if mode not in _MODES:
            raise ValueError(f"unknown fetch mode {mode!r}")
        if writer_rid and mode == "release":
            raise ValueError("a PinnedWriter destination needs mode 'hold', 'detach' or 'claim'")
        with self._inflight_cond:
            self.core.check_open()
            self._inflight += 1
        try:
            deadline = self.core.clock.deadline(timeout_s, bound)
            if writer_rid:
                return await self._into_writer(handle, mode, deadline, pid, writer_rid, blocking)
            return await self._fetch(handle, mode, deadline, pid, blocking)
        finally:
            with self._inflight_cond:
                self._inflight -= 1
                self._inflight_cond.notify_all()

    async def _fetch(
        self, handle: DataHandle, mode: Mode, deadline: Deadline, pid: int, blocking: Blocking
    ) -> LocalLease:
        link = await self._link(handle, blocking)
        if mode == "hold":  # the get family keeps the owner's lease: always its own transfer
            return await self._transfer(link, handle, mode, deadline, pid, blocking)
        while True:
            cached = await self._from_copy(link, handle, mode, deadline, pid)
            if cached is not None:
                return cached
            flight = self._flights.get(handle)
            if flight is None or flight.get_loop() is not asyncio.get_running_loop():
                break
            # Single flight: another fetch on this node is bringing these bytes over; wait for
            # it, then read its node-local copy (asking the owner first, as for any copy).
            try:
                await asyncio.wait_for(asyncio.shield(flight), deadline.remaining())
            except asyncio.TimeoutError:
                raise deadline.timeout_error(handle) from None
        flight = asyncio.get_running_loop().create_future()
        self._flights[handle] = flight
        try:
            return await self._transfer(link, handle, mode, deadline, pid, blocking)
        finally:
            del self._flights[handle]
            flight.set_result(None)  # the waiters look for the copy (or fetch themselves)

    async def _transfer(
        self,
        link: OwnerLink,
        handle: DataHandle,
        mode: Mode,
        deadline: Deadline,
        pid: int,
        blocking: Blocking,
    ) -> LocalLease:
        try:
            return await self.driver.run(link, handle, mode, deadline, pid, blocking)
        except OwnerDied:
            if not self.peers.forget(link):
                raise
        # The cached link was to a dead incarnation; a new agent may serve the node now (it
        # answers HandleNotFound for the old one's handles).
        link = await self._link(handle, blocking)
        return await self.driver.run(link, handle, mode, deadline, pid, blocking)

    async def _link(self, handle: DataHandle, blocking: Blocking) -> OwnerLink:
        """The owner's link: a known one at once, a lookup (Ray calls) off the loop."""
        link = self.peers.cached(handle)
        if link is None:
            link = await blocking(self.peers.link, handle)
        return link

    async def _into_writer(
        self,
        handle: DataHandle,
        mode: Mode,
        deadline: Deadline,
        pid: int,
        writer_rid: int,
        blocking: Blocking,
    ) -> LocalLease:
        core = self.core
        with core.lock:
            pending = core.reservations.fill_begin(writer_rid)  # its buffer stays until we end
        self._into_writers[handle] += 1
        try:
            buffer = pending.buffer
            if not isinstance(buffer, Placement):  # fill_begin takes none without memory
                raise StagingError(f"PinnedWriter reservation {writer_rid} has no memory")
            link = await self._link(handle, blocking)
            return await self.driver.run(
                link, handle, mode, deadline, pid, blocking, writer_rid, buffer
            )
        finally:
            self._into_writers[handle] -= 1
            if not self._into_writers[handle]:
                del self._into_writers[handle]
            with core.changing() as fx:
                core.reservations.fill_end(writer_rid, fx)

    async def _from_copy(
        self, link: OwnerLink, handle: DataHandle, mode: Mode, deadline: Deadline, pid: int
    ) -> LocalLease | None:
        """Serve from a live node-local copy, once the owner agreed (docs/architecture.md
        §6). The reader's lease on the copy is taken first, so the copy cannot go
        between the owner's word and the lease."""
        core = self.core
        with core.lock:
            copy = core.consumer_state.copy_for(handle)
            if copy is None:
                return None
            local = core.handle(copy.slot_id)
            _, lease = core.state.local_acquire(local, pid, "detach", core.clock())
        request = AcquireRequest(
            handle,
            lease_ms=deadline.budget_ms(),
            claim=mode in ("release", "claim"),
            consumer_node=core.node_id,
            consumer_worker=core.worker_id,
        )
        try:
            answer = await acquire(link, request, deadline)
        except BaseException as exc:
            with core.changing() as fx:
                core.state.end_lease(local, lease.lease_id, False, core.clock(), fx)
                if isinstance(exc, HandleNotFound):  # its owner will never say so now
                    core.consumer_state.copy_ended(handle, core.clock(), fx)
            raise
        if mode == "release":
            link.send(RV_RELEASE, encode(ReleaseRequest(handle, answer.lease_id, claim=True)))
        else:
            link.send(RV_DETACH, encode(DetachRequest(handle, answer.lease_id)))
        with core.changing() as fx:
            if mode == "claim":
                core.consumer_state.claim_held(pid, handle)
            if answer.unclaimed == 0:  # the last consumer: the copy goes with its last reader
                core.consumer_state.copy_ended(handle, core.clock(), fx)
        core.metrics.fetched("cache", copy.total_len, 0.0)
        core.poke()
        return lease_of(core.worker_id, core.node_id, copy, lease.lease_id)

    def wait_idle(self, until: float) -> bool:
        """Wait until no fetch runs (shutdown); False if some still did at ``until`` on the
        agent's clock."""
        return self.core.clock.wait(self._inflight_cond, lambda: self._inflight == 0, until)

    @property
    def inflight(self) -> int:
        return self._inflight

    # --- copies ----------------------------------------------------------------------

    def copy_notice(self, data: bytes) -> None:
        """``_rv_copy``: about one of our handles, a copy of it elsewhere is gone; about
        another owner's, that owner ended it (our copy goes with its last reader)."""
        notice = decode(CopyNotice, data)
        core = self.core
        if notice.handle.worker_id == core.worker_id:
            self.owner.copy_gone(notice)
            return
        with core.changing() as fx:
            core.consumer_state.copy_ended(notice.handle, core.clock(), fx)

    # --- claims ----------------------------------------------------------------------

    def claim_end(self, handle: DataHandle, consume: bool, pid: int) -> None:
        """Process ``pid`` is done with its claim on ``handle``: ``consume`` it (the body
        succeeded) or give it back (Ray retries the task). Not waited for by the caller; a
        handle gone meanwhile (its TTL) is no error here."""
        with self.core.lock:
            held = self.core.consumer_state.claim_end(pid, handle)
        if held:
            self._end_claim(handle, consume)

    def return_claims(self, handles: list[DataHandle]) -> None:
        """Give back the claims of processes that died (Ray retries system failures)."""
        for handle in handles:
            self._end_claim(handle, consume=False)

    def _end_claim(self, handle: DataHandle, consume: bool) -> None:
        entry = RV_RELEASE if consume else RV_DETACH
        cls = ReleaseRequest if consume else DetachRequest
        message = encode(cls(handle, 0, claim=True))
        if handle.worker_id == self.core.worker_id:
            with contextlib.suppress(HandleNotFound, LeaseNotFound):
                self.serve(entry)(message)
            return
        with contextlib.suppress(HandleNotFound, OwnerDied):
            self.peers.link(handle).send(entry, message)

    # --- routing ---------------------------------------------------------------------

    def route(self, handle: DataHandle, method: str, data: bytes, timeout_s: float | None) -> Any:
        """The ``route`` entry: a process's call of the owner's handler named ``method``."""
        entry = BY_NAME.get(method)
        if entry is None or not entry.owner:
            raise ValueError(f"unknown handler {method!r}")
        return self.to_owner(handle, entry, data, timeout_s)

    def to_owner(
        self, handle: DataHandle, entry: Entry, data: bytes, timeout_s: float | None
    ) -> Any:
        """Run the owner's handler ``entry`` on ``handle``'s owner (this agent or a peer)."""
        if handle.worker_id == self.core.worker_id:
            return self.serve(entry)(data)
        nonblocking.check(f"calling {entry.name} on another node's owner")
        for attempt in range(2):
            link = self.peers.link(handle)
            try:
                return link.call(entry, data, self.core.clock.deadline(timeout_s), handle)
            except OwnerDied:
                if attempt or not self.peers.forget(link):
                    raise
        raise AssertionError("unreachable")

    def release_quietly(self, handle: DataHandle) -> None:
        """Drop one reference on ``handle`` for a caller that does not wait for the answer;
        a handle already gone (its TTL came first) is not an error here."""
        with contextlib.suppress(HandleNotFound, OwnerDied, StagingError):
            self.to_owner(handle, RV_RELEASE, encode(ReleaseRequest(handle, 0)), None)
