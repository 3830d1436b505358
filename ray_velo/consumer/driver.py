"""Performs a :class:`~ray_velo.state.fetch.FetchMachine`'s instructions: the calls, the GET
with its lease renewal, the pulls, and the ledger moves. The machine decides; this only does."""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ray_velo.agent.clock import Clock, Deadline
from ray_velo.agent.core import AgentCore
from ray_velo.consumer.bulk import RangeReader, WireSource
from ray_velo.consumer.links import Blocking, OwnerLink, acquire
from ray_velo.consumer.peers import Peers
from ray_velo.consumer.relay import (
    OwnRelayLink,
    RelayLink,
    RelayServer,
    copy_gone_notice,
    read_relay,
)
from ray_velo.consumer.windows import WindowFeed, written_range
from ray_velo.errors import (
    AgentShuttingDown,
    DescriptorError,
    UcxError,
    VeloError,
    WireReadError,
)
from ray_velo.local.records import LocalLease, lease_of
from ray_velo.memory.pool import Placement, Registration
from ray_velo.memory.windows import WindowSet
from ray_velo.protocol import (
    AcquireRequest,
    DataHandle,
    DetachRequest,
    LeaseRenewRequest,
    Rdma,
    ReadRequest,
    Ready,
    ReleaseRequest,
    WindowRequest,
    encode,
)
from ray_velo.protocol.descriptor import RdmaDescriptor
from ray_velo.protocol.entry import RV_COPY, RV_DETACH, RV_LEASE_RENEW, RV_RELEASE, RV_WINDOW
from ray_velo.state.fetch import (
    Acquire,
    Allocate,
    Allocated,
    Answered,
    CheckDescriptor,
    Count,
    Decoded,
    DecodeFailed,
    Done,
    EndLease,
    Event,
    Fail,
    Failed,
    FetchFacts,
    FetchMachine,
    Get,
    GetExpired,
    GetFailed,
    GetOk,
    GiveBack,
    Instruction,
    Mode,
    Pull,
    Pulled,
    Quarantine,
    Stage,
    WithdrawWriter,
)
from ray_velo.state.owner import ReadMode
from ray_velo.state.relays import RELAY_MIN_BYTES, RELAY_PIECE_BYTES, Relay
from ray_velo.state.store import SlotView

__all__ = ["RENEW_FLOOR_S", "FetchDriver", "LeaseRenewals"]

#: Where a range is read from: a UCX descriptor (a GET), a lease on an agent's bulk port
#: (the agent sends it over the wire), or this agent's own copy (a memory copy).
Source = RdmaDescriptor | WireSource | Placement
#: GETs bytes ``[start, stop)`` of a payload from a node: (node, source, start, stop,
#: timeout_s).
GetRange = Callable[[str, Source, int, int, float], None]

_log = logging.getLogger(__name__)

#: The longest a receive into a PinnedWriter waits for other nodes reading its copy (they lag
#: a piece behind: 0.13 s at 1 Gbit/s) before it sends them to the owner for the rest.
LENT_READERS_WAIT_S = 30.0
#: Floor of the consumer's RDMA lease renewal period (docs/protocol.md §11: 5 ms).
RENEW_FLOOR_S = 0.005


class LeaseRenewals:
    """Renews the RDMA leases of the GETs in flight, each every lease_timeout / 2 (at least
    5 ms), on one thread for the whole agent (started on first use, ended by :meth:`close`):
    a thread per GET cost more than a short GET itself.

    Renewals are fire-and-forget: a lost one is harmless, the next is half a deadline away.
    A lease_timeout_ms of 0 means the owner set no deadline: nothing to renew.
    """

    def __init__(self, node: str, clock: Clock) -> None:
        """``clock``: the agent's (``ray_velo.testing.FakeClock`` in tests, which then
        :meth:`wake` the thread after moving it)."""
        self._node = node  # whose agent renews (for the error after close)
        self._clock = clock
        self._cond = threading.Condition(threading.Lock())
        self._due: dict[int, tuple[float, float, OwnerLink, bytes]] = {}  # (due, period, ...)
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._closed = False

    @contextlib.contextmanager
    def renewing(
        self, link: OwnerLink, handle: DataHandle, lease_id: int, lease_timeout_ms: int
    ) -> Iterator[None]:
        """Keep the lease renewed while the body (the GET) runs."""
        if lease_timeout_ms <= 0:
            yield
            return
        period = max(lease_timeout_ms / 2000, RENEW_FLOOR_S)
        message = encode(LeaseRenewRequest(handle, lease_id))
        key = next(self._ids)
        with self._cond:
            if self._closed:
                raise AgentShuttingDown(node=self._node)
            self._due[key] = (self._clock() + period, period, link, message)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="ray_velo-lease-renewals", daemon=True
                )
                self._thread.start()
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self._due.pop(key, None)

    def wake(self) -> None:
        """Look at the due renewals again (a test moved its fake clock)."""
        with self._cond:
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                now = self._clock()
                sends = []
                for key, (due, period, link, message) in list(self._due.items()):
                    if due <= now:
                        sends.append((link, message))
                        self._due[key] = (now + period, period, link, message)
                if sends:
                    self._cond.release()  # never send under the lock
                    try:
                        for link, message in sends:
                            link.send(RV_LEASE_RENEW, message)
                    finally:
                        self._cond.acquire()
                    continue
                wait = min((d for d, *_ in self._due.values()), default=now + 60.0) - now
                self._cond.wait(max(wait, 0.0))

    def close(self) -> None:
        """End the thread (the agent shuts down; no GET runs any more)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(5.0)


@dataclass(slots=True)
class _Destination:
    buffer: Placement | None = None  # the fetch's own, or the PinnedWriter's
    fid: int | None = None  # the ledger entry when the fetch owns it
    registered: bool = False
    #: A plain destination's windows (depth 1, charged at allocation): closed as soon as the
    #: GET returns, before the buffer may be staged or given back.
    windows: WindowSet | None = None


class _Run:
    """One fetch being performed."""

    def __init__(
        self,
        driver: FetchDriver,
        link: OwnerLink,
        machine: FetchMachine,
        deadline: Deadline,
        pid: int,
        writer_rid: int,
        writer_buffer: Placement | None,
    ) -> None:
        self.driver = driver
        self.core = driver.core
        self.link = link
        self.machine = machine
        self.handle = machine.handle
        self.deadline = deadline
        self.pid = pid
        self.writer_rid = writer_rid
        self.dest = _Destination(writer_buffer, None, writer_buffer is not None)
        self.local: tuple[SlotView, int] | None = None  # (local slot, reader's lease id)

    async def request(self, instruction: Acquire | Pull, blocking: Blocking) -> Event:
        """Perform a call to the owner, awaited on the event loop (the other requests run in
        :meth:`FetchDriver._advance`, on an agent thread); what it raised becomes a Failed
        event."""
        try:
            if isinstance(instruction, Acquire):
                return await self._acquire(instruction)
            await self.link.pull(
                instruction.answer,
                self._buffer().view(),
                self.core.config.pulls_in_flight,
                self.deadline,
                self.handle,
                blocking,
            )
            return Pulled()
        except Exception as exc:
            return Failed(exc)

    def request_blocking(self, instruction: Instruction) -> Event:
        """Perform a request that needs no event loop: decode, allocate, GET."""
        if isinstance(instruction, CheckDescriptor):
            try:
                return Decoded(
                    self.core.ucx().decode(
                        instruction.answer.descriptor, instruction.answer.total_len
                    )
                )
            except DescriptorError as exc:
                return DecodeFailed(str(exc))
        if isinstance(instruction, Allocate):
            return self._allocate(instruction)
        if isinstance(instruction, Get):
            return self._get(instruction)
        raise AssertionError(f"not a request: {instruction!r}")

    def _buffer(self) -> Placement:
        """The destination's buffer (a step that needs one runs only once it exists)."""
        if self.dest.buffer is None:
            raise AssertionError(f"the fetch of {self.handle} has no destination yet")
        return self.dest.buffer

    async def _acquire(self, instruction: Acquire) -> Event:
        budget = self.deadline.budget_ms()
        request = AcquireRequest(
            self.handle,
            rdma=instruction.offer,
            lease_ms=budget if instruction.chunked_deadline else 0,
            budget_ms=budget,
            claim=instruction.claim,
            consumer_node=self.core.node_id,
            consumer_worker=self.core.worker_id,
            # a copy other nodes can read (and, but in a PinnedWriter, later fetches here
            # find): not the get family's own
            copies=self.core.serves_copies and self.machine.mode != "hold",
        )
        return Answered(await acquire(self.link, request, self.deadline))

    def _allocate(self, instruction: Allocate) -> Event:
        core = self.core
        core.check_open()
        now = core.clock()
        if instruction.registered:
            placement = core.memory.allocate_registered(instruction.nbytes, now)
            if placement is None:
                return Allocated(False)
        else:
            placement = core.memory.allocate_plain(instruction.nbytes, now)
        windows = None
        if instruction.windows:
            windows = self._open_windows(placement)
            if windows is None:
                core.memory.free(placement, False, now)
                return Allocated(False)
        with core.lock:
            fid = core.consumer_state.fetch_take(placement, instruction.registered)
        self.dest = _Destination(placement, fid, instruction.registered, windows)
        return Allocated(True)

    def _open_windows(self, placement: Placement) -> WindowSet | None:
        """Windows of a plain destination, one registered at a time, charged now (None:
        the budget cannot take one)."""
        memory = self.core.memory
        if memory.registrar is None:
            return None
        window_bytes = self.core.config.rdma.pool.window_bytes
        windows = WindowSet(
            memory.registrar, memory.budget, placement.address, placement.nbytes, window_bytes,
            depth=1,
        )  # fmt: skip
        return windows if windows.open() else None

    def _get(self, instruction: Get) -> Event:
        core, answer = self.core, instruction.answer
        renewing = self.driver.renewals.renewing(
            self.link, self.handle, answer.lease_id, answer.lease_timeout_ms
        )
        started = core.clock()
        try:
            remaining = self.deadline.remaining()
            timeout = remaining if remaining is not None else max(60.0, answer.total_len / 50e6)
            if timeout <= 0:
                return GetExpired(self.deadline.timeout_error(self.handle))
            with renewing:
                self._move_bytes(instruction, timeout)
        except (UcxError, WireReadError) as exc:
            what = "read over the wire" if answer.wire else "GET"
            _log.warning(
                "ray_velo: %s of %s from node %s failed: %s", what, self.handle, self.link.node, exc
            )
            unsafe = bool(exc.fields.get("destination_unsafe"))
            self._end_windows(unsafe)
            if self.deadline.expired():
                return GetExpired(self.deadline.timeout_error(self.handle), unsafe)
            return GetFailed(unsafe)
        finally:  # whatever ended the GET, it returned
            self._end_windows(False)
        if not answer.wire:  # the RDMA GET's histogram; a read's time is in the fetch's
            core.metrics.get_completed(core.clock() - started)
        if core.config.rdma.ucx.ep_idle_timeout is not None:
            core.poke()  # arm the idle-endpoint scan
        return GetOk()

    def _end_windows(self, unsafe: bool) -> None:
        """Close the destination's windows once its GET returned; a GET that may still write
        them leaves them registered until the agent's UCX goes (their charge stays)."""
        windows, self.dest.windows = self.dest.windows, None
        if windows is None:
            return
        if unsafe:
            self.driver.abandoned_windows.extend(windows.abandon())
        else:
            windows.close()

    def _move_bytes(self, instruction: Get, timeout: float) -> None:
        """GET the payload: from the copy the owner pointed at as far as it serves, the
        rest from the owner. A copy the owner counts is opened to other nodes first, and
        filled in pieces they may read as each lands."""
        core, answer = self.core, instruction.answer
        until = core.clock() + timeout
        relayed = False
        # A copy nobody else can claim a reference for is neither kept nor relayed.
        wanted = answer.announce and answer.unclaimed != 0
        if wanted and self.dest.windows is not None:  # plain: no other node can GET it
            self.link.send(RV_COPY, copy_gone_notice(self.handle, core.node_id, core.worker_id))
            wanted = False
        lent: Relay | None = None
        if wanted and self.dest.fid is not None and self.machine.mode != "hold":
            with core.lock:
                relayed = core.consumer_state.relay_open(
                    self.handle, self.dest.fid, answer.total_len
                )
        elif wanted and self.writer_rid and self.machine.mode != "hold":
            with core.lock:
                lent = core.consumer_state.relay_open_lent(
                    self.handle, self._buffer(), answer.total_len
                )
            relayed = lent is not None
            own = (answer.relay_node, answer.relay_worker) == (core.node_id, core.worker_id)
            if not relayed and not own:  # an older copy here still has readers: nobody
                # reads this one (the copy it reads, another receiver's here, still serves)
                self.link.send(RV_COPY, copy_gone_notice(self.handle, core.node_id, core.worker_id))
        pieces = relayed and answer.total_len >= RELAY_MIN_BYTES

        def get_range(node: str, source: Source, start: int, stop: int, timeout_s: float) -> None:
            self._get_range(node, source, start, stop, timeout_s, pieces)

        try:
            start = 0
            if answer.relay_node:
                start = self._read_copy(answer, until, get_range)
            if answer.window_bytes and answer.descriptor:
                self._get_written(answer, start, until, pieces)
            elif answer.window_bytes:
                self._get_windows(answer, start, until, pieces)
            else:
                source = instruction.descriptor
                if answer.wire:
                    address = self.driver.peers.bulk(self.handle.worker_id)
                    if address is None:
                        raise WireReadError(
                            handle=str(self.handle),
                            peer=self.link.node,
                            start=start,
                            stop=answer.total_len,
                            got=0,
                            reason="the owner has no bulk port now",
                        )
                    source = WireSource(address, self.handle, answer.lease_id)
                get_range(self.link.node, source, start, answer.total_len, core.clock.left(until))
        except BaseException:
            if relayed and lent is None:  # the owner must not point anyone else at it
                self.link.send(RV_COPY, copy_gone_notice(self.handle, core.node_id, core.worker_id))
            raise
        finally:
            if lent is not None:
                self._close_lent(lent)

    def _close_lent(self, relay: Relay) -> None:
        """The GET into a PinnedWriter returned: the owner points nobody else at its copy,
        and the readers already on it finish before the writer, and so the bytes, become
        its process's to write. Readers renew their relay lease with each piece, so the
        wait ends with the last one; past :data:`LENT_READERS_WAIT_S` they are sent to the
        owner for the rest, once a GET of theirs in flight has had its time."""
        core, state = self.core, self.core.consumer_state
        with core.lock:
            state.relay_seal(relay)
        self.link.send(RV_COPY, copy_gone_notice(self.handle, core.node_id, core.worker_id))
        done = core.wait_until(
            lambda: not state.relay_reading(relay, core.clock()),
            core.clock() + LENT_READERS_WAIT_S,
        )
        with core.lock:
            state.relay_close_lent(relay)  # a reader's next renewal: go to the owner
        if not done:
            _log.warning(
                "ray_velo: other nodes still read the copy of %s after %.0f s; they read the "
                "rest from its owner",
                self.handle,
                LENT_READERS_WAIT_S,
            )
            # a reader's GET ends within half its relay lease (read_relay's bound)
            time.sleep(core.config.rdma.rendezvous.lease_timeout / 2)

    def _read_copy(self, answer: Rdma, until: float, get_range: GetRange) -> int:
        """Bytes read from the copy on ``answer.relay_node`` (see :func:`read_relay`); a copy
        that could not serve them all is reported gone to the owner."""
        node, worker = answer.relay_node, answer.relay_worker
        peers = self.driver.peers
        link: RelayLink | OwnRelayLink | None
        bulk: str | None = None
        if (node, worker) == (self.core.node_id, self.core.worker_id):
            link, get_range = OwnRelayLink(self.driver.relays), self._copy_range
        elif answer.wire:  # that agent sends its copy's bytes over its bulk port
            bulk = peers.bulk(worker)
            link = peers.relay(node, worker) if bulk is not None else None
        else:
            if not peers.registered(node, worker):  # its UCX address, over a Ray call, once
                with contextlib.suppress(VeloError):
                    peers.learn(peers.link(DataHandle(worker, 0, node)), worker, self.deadline)
            link = peers.relay(node, worker) if peers.registered(node, worker) else None
        if link is None:
            return 0
        buffer = self.dest.buffer
        done = read_relay(self.core, link, (self.handle, node), buffer, until, get_range, bulk)
        if done < answer.total_len:
            self.link.send(RV_COPY, copy_gone_notice(self.handle, node, worker))
        if done:
            self.core.metrics.relayed()
        return done

    def _copy_range(
        self, node: str, source: Source, start: int, stop: int, timeout_s: float
    ) -> None:
        """Copy bytes ``[start, stop)`` of this agent's own copy (``source``, its buffer in
        this process; the relay lease keeps it) into the destination: another receiver on
        this node brought them over the link."""
        assert isinstance(source, Placement)
        ctypes.memmove(self._buffer().address + start, source.address + start, stop - start)

    def _get_windows(self, answer: Rdma, start: int, until: float, pieces: bool) -> None:
        """GET bytes ``[start, total_len)`` of a plain slot window by window, asking for the
        next window's descriptor while the current one moves (:class:`WindowFeed`)."""
        size, total, clock = answer.window_bytes, answer.total_len, self.core.clock
        first, count = start // size, -(-total // size)
        self.driver.windowed_gets += 1
        feed = WindowFeed(
            self.link, self.handle, answer.lease_id, self.core.ucx(), size, total, clock
        )
        with feed:
            feed.ask(first, -1, until)
            for index in range(first, count):
                descriptor = feed.take(index, until)
                if index + 1 < count:  # the next one registers while this one moves
                    feed.ask(index + 1, index - 1, until)
                base = index * size
                self._get_range(
                    self.link.node, descriptor, max(start, base), min(total, base + size),
                    clock.left(until), pieces, base=base,
                )  # fmt: skip
        if self.machine.mode == "hold":  # the lease stays: its windows need not
            done = WindowRequest(self.handle, answer.lease_id, -1, count - 1)
            self.link.send(RV_WINDOW, encode(done))

    def _get_written(self, answer: Rdma, start: int, until: float, pieces: bool) -> None:
        """GET bytes ``[start, total_len)`` of a slot its producer is still writing, all
        that is written at each step (:func:`written_range`)."""
        size, total, clock = answer.window_bytes, answer.total_len, self.core.clock
        at = start
        while at < total:
            index = at // size
            descriptor, upto = written_range(
                self.link, self.handle, answer.lease_id, self.core.ucx(), size, total, index,
                clock.left(until), clock,
            )  # fmt: skip
            self._get_range(
                self.link.node, descriptor, at, upto, clock.left(until), pieces, base=index * size
            )
            at = upto

    def _get_range(
        self,
        node: str,
        descriptor: Source,
        start: int,
        stop: int,
        timeout_s: float,
        pieces: bool,
        base: int = 0,
    ) -> None:
        """GET bytes ``[start, stop)`` of the payload from ``node`` (``descriptor`` starts
        at byte ``base``), or read them over the wire; in pieces that other nodes may read
        as each lands when ``pieces``."""
        core = self.core
        until = core.clock() + timeout_s
        step = RELAY_PIECE_BYTES if pieces else max(stop - start, 1)
        for at in range(start, stop, step):
            end = min(stop, at + step)
            self._get_into(node, descriptor, base, at, end, until)
            if pieces:
                with core.changing():  # wakes the relays waiting for these bytes
                    core.consumer_state.relay_landed(self.handle, end)

    def _get_into(
        self, node: str, descriptor: Source, base: int, start: int, stop: int, until: float
    ) -> None:
        """One GET of payload bytes ``[start, stop)`` into the destination, through its
        windows when it is plain (each registered for the time its bytes move; one the GET
        may still write stays registered: :meth:`_end_windows`); or, from a bulk port, one
        read straight into the destination (it is over once it returns: nothing can write
        the destination after)."""
        if isinstance(descriptor, WireSource):
            self._read_into(descriptor, start, stop, until)
            return
        assert isinstance(descriptor, RdmaDescriptor)
        rdma, buffer, windows = self.core.ucx(), self._buffer(), self.dest.windows
        dest = buffer.address + base
        if windows is None:
            rdma.get(
                node, descriptor, dest, self.core.clock.left(until), buffer.registration,
                start=start - base, stop=stop - base,
            )  # fmt: skip
            return
        at = start
        while at < stop:
            index = at // windows.window_bytes
            end = min(stop, windows.bounds(index)[1])
            registration, _, _ = windows.window(index)
            rdma.get(
                node, descriptor, dest, self.core.clock.left(until), registration,
                start=at - base, stop=end - base,
            )  # fmt: skip
            windows.done_through(index)
            at = end

    def _read_into(self, source: WireSource, start: int, stop: int, until: float) -> None:
        """Bytes ``[start, stop)`` of the payload from ``source``'s bulk port into the
        destination.

        Raises:
            WireReadError: the read failed, the sender's refusal included (its lease ended,
                a range it lacks).
        """
        reader = self.driver.bulk
        assert reader is not None  # the wire is offered, and answered, only with a reader
        request = ReadRequest(source.handle, source.lease_id, start, stop, source.copy)
        view = self._buffer().view()
        try:
            reader.read(source.address, request, view[start:stop], self.core.clock.left(until))
        except WireReadError:
            raise
        except VeloError as exc:
            raise WireReadError(
                handle=str(self.handle),
                peer=source.address,
                start=start,
                stop=stop,
                got=0,
                reason=f"refused: {exc}",
            ) from exc
        finally:
            del view

    def act(self, instruction: Instruction) -> None:
        """Perform an instruction that expects no result."""
        core = self.core
        if isinstance(instruction, Count):
            core.metrics.path(instruction.path, instruction.reason)
        elif isinstance(instruction, EndLease):
            cls = ReleaseRequest if instruction.release else DetachRequest
            entry = RV_RELEASE if instruction.release else RV_DETACH
            message = cls(self.handle, instruction.lease_id, claim=instruction.claim)
            self.link.send(entry, encode(message))
        elif isinstance(instruction, GiveBack):
            fid, self.dest = self.dest.fid, _Destination()
            assert fid is not None
            with core.changing() as fx:
                core.consumer_state.fetch_give_back(fid, fx)
        elif isinstance(instruction, Quarantine):
            fid, buffer = self.dest.fid, self._buffer()
            assert fid is not None
            with core.lock:
                core.consumer_state.fetch_quarantine(fid)
            self.dest = _Destination()
            _log.error(
                "ray_velo: a timed-out GET may still write %d bytes at %s; they stay out of "
                "every pool until this agent shuts down",
                buffer.nbytes,
                buffer.key,
            )
        elif isinstance(instruction, WithdrawWriter):
            with core.lock:
                core.reservations.fill_withdraw(self.writer_rid)
            self.dest = _Destination()
        elif isinstance(instruction, Stage):
            self._stage(instruction.answer)
        else:
            raise AssertionError(f"unknown instruction {instruction!r}")

    def _stage(self, answer: Ready | Rdma) -> None:
        core = self.core
        fid = self.dest.fid
        assert fid is not None
        indexed = self.machine.mode != "hold"
        with core.changing() as fx:
            now = core.clock()
            kind = core.memory.kind_of(self._buffer(), self.dest.registered)
            slot = core.consumer_state.fetch_stage(
                fid, answer.total_len, answer.type_header, kind, now, fx,
                copy_of=self.handle if indexed else None,
            )  # fmt: skip
            self.local = (slot, self._lease_local(slot, indexed, now))
        self.dest = _Destination()

    def _lease_local(self, slot: SlotView, indexed: bool, now: float) -> int:
        # core.lock held. A copy no other fetch can find ends with its reader's lease.
        mode: ReadMode = "detach" if indexed else "release"
        _, lease = self.core.state.local_acquire(
            self.core.handle(slot.slot_id), self.pid, mode, now
        )
        return lease.lease_id

    def done(self, outcome: Done) -> LocalLease:
        core, answer = self.core, outcome.answer
        if self.writer_rid:
            buffer = self._buffer()
            lease = LocalLease(
                DataHandle(core.worker_id, 0, core.node_id), 0, buffer.arena.path,
                buffer.offset_bytes, answer.total_len, answer.type_header, buffer.dedicated,
                outcome.kept_lease,
            )  # fmt: skip
        else:
            if self.local is None:  # an empty payload: nothing moved, nothing allocated
                with core.changing() as fx:
                    now = core.clock()
                    slot = core.state.stage(
                        None, None, 0, answer.type_header, now, fx, kind="empty", pinned=False
                    )
                    self.local = (slot, self._lease_local(slot, False, now))
            slot, lease_id = self.local
            lease = lease_of(core.worker_id, core.node_id, slot, lease_id, outcome.kept_lease)
        if outcome.claimed:
            with core.lock:
                core.consumer_state.claim_held(self.pid, self.handle)
        core.poke()  # a reader to watch
        return lease


class FetchDriver:
    """Runs fetches for the processes of this node."""

    def __init__(
        self, core: AgentCore, peers: Peers, relays: RelayServer, bulk: RangeReader | None = None
    ) -> None:
        """``bulk``: this agent's reader of other agents' bulk ports (None: it reads no
        wire: UCX GETs or chunks only)."""
        self.core = core
        self.peers = peers
        self.relays = relays
        self.bulk = bulk
        self.renewals = LeaseRenewals(core.node_id, core.clock)
        #: GETs of plain slots, window by window (``ray-velo status``; the tests' sign).
        self.windowed_gets = 0
        #: Window registrations a timed-out GET may still write: kept until UCX goes.
        self.abandoned_windows: list[Registration] = []

    async def run(
        self,
        link: OwnerLink,
        handle: DataHandle,
        mode: Mode,
        deadline: Deadline,
        pid: int,
        blocking: Blocking,
        writer_rid: int = 0,
        writer_buffer: Placement | None = None,
    ) -> LocalLease:
        """Fetch ``handle`` from ``link``'s owner; a lease on the local result for ``pid``.
        Waiting on the owner holds no thread; blocking work goes through ``blocking``.

        Raises:
            HandleNotFound, HandleReleased, OwnerDied, TransferTimeout, PayloadTooLarge,
            ProtocolError, SharedMemoryTooSmall: as the fetch met them; every lease and buffer
            was dealt with first.
        """
        core = self.core
        started = core.clock()
        facts = FetchFacts(
            has_registry=core.rdma is not None,
            rdma_enabled=core.rdma_enabled,
            peer_registered=self.peers.registered(link.node, handle.worker_id),
            payload_max=core.config.staged_payload_max,
            writer_bytes=None if writer_buffer is None else writer_buffer.nbytes,
            windows=core.rdma is not None and core.memory.registrar is not None,
            wire=self.bulk is not None and self.peers.bulk(handle.worker_id) is not None,
        )
        machine = FetchMachine(handle, link.node, mode, facts)
        run = _Run(self, link, machine, deadline, pid, writer_rid, writer_buffer)
        pending = machine.start()
        while True:
            # One hop to an agent thread does every step that needs no event loop; only the
            # owner calls (acquire, pulls) come back here, where waiting holds no thread.
            step: LocalLease | Acquire | Pull
            if len(pending) == 1 and isinstance(pending[0], (Acquire, Pull)):
                step = pending[0]  # nothing to do before the call: no hop
            else:
                step = await blocking(self._advance, run, machine, pending, started)
            if isinstance(step, LocalLease):
                return step
            pending = machine.on(await run.request(step, blocking))

    def _advance(
        self, run: _Run, machine: FetchMachine, pending: list[Instruction], started: float
    ) -> LocalLease | Acquire | Pull:
        """Perform the machine's instructions that need no event loop (on an agent thread),
        feeding their events back to it, until the fetch is done (its lease), failed (its
        error is raised) or needs a call to the owner (that request, always the last of its
        list)."""
        while True:
            event: Event | None = None
            for index, instruction in enumerate(pending):
                if isinstance(instruction, Done):
                    return self._finish(run, instruction, started)
                if isinstance(instruction, Fail):
                    raise instruction.error
                if isinstance(instruction, (Acquire, Pull)):
                    assert index == len(pending) - 1, f"a request before the end of {pending}"
                    return instruction
                if isinstance(instruction, (CheckDescriptor, Allocate, Get)):
                    try:
                        event = run.request_blocking(instruction)
                    except Exception as exc:
                        event = Failed(exc)
                else:
                    run.act(instruction)
            assert event is not None, f"no request among {pending}"
            pending = machine.on(event)

    def _finish(self, run: _Run, outcome: Done, started: float) -> LocalLease:
        lease = run.done(outcome)
        if outcome.path == "chunked":
            self.peers.learn(run.link, run.handle.worker_id, run.deadline)
        self.core.metrics.fetched(
            outcome.path, outcome.answer.total_len, self.core.clock() - started
        )
        return lease
