"""What every role of a node agent shares: its state under one lock, its memory, its metrics, and
the effects performed after the lock (docs/architecture.md §4)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ray_velo.agent import nonblocking
from ray_velo.agent.backend import RdmaBackend
from ray_velo.agent.clock import Clock
from ray_velo.agent.node_memory import NodeMemory
from ray_velo.config import VeloConfig
from ray_velo.errors import AgentShuttingDown, StagingError, UcxError
from ray_velo.memory.pool import Placement
from ray_velo.metrics import AgentMetrics
from ray_velo.protocol import DataHandle
from ray_velo.state.agent import AgentStates
from ray_velo.state.consumer import ConsumerState
from ray_velo.state.ledger import Effects
from ray_velo.state.owner import OwnerState
from ray_velo.state.reservations import Reservations

__all__ = ["COMMIT_WAIT_S", "AgentCore", "CommitGate"]

#: How long a call naming a handle waits for its producer's commit to land (s).
COMMIT_WAIT_S = 30.0


class CommitGate:
    """Slots whose producer's commit is on its way: calls naming them wait for it."""

    def __init__(self, worker_id: int) -> None:
        self._worker_id = worker_id
        self._lock = threading.Lock()
        self._events: dict[int, threading.Event] = {}

    def expect(self, slot_id: int) -> None:
        with self._lock:
            self._events[slot_id] = threading.Event()

    def landed(self, slot_id: int) -> None:
        """The commit of ``slot_id`` landed (or never will: the reservation ended)."""
        with self._lock:
            event = self._events.pop(slot_id, None)
        if event is not None:
            event.set()

    def wait(self, handle: DataHandle, timeout_s: float = COMMIT_WAIT_S) -> None:
        """Wait for ``handle``'s commit if it is still on its way.

        Raises:
            StagingError: it did not land within ``timeout_s``.
        """
        if handle.worker_id != self._worker_id:
            return
        with self._lock:
            event = self._events.get(handle.slot_id)
        if event is None or event.is_set():
            return
        nonblocking.check(f"waiting for the commit of {handle}")
        if not event.wait(timeout_s):
            raise StagingError(
                f"handle {handle} is still being staged after {timeout_s} s: its producer "
                "did not commit it"
            )

    def release_all(self) -> None:
        with self._lock:
            events, self._events = list(self._events.values()), {}
        for event in events:
            event.set()


@dataclass
class AgentCore:
    """The agent's shared parts."""

    config: VeloConfig
    node_id: str
    worker_id: int
    state: OwnerState
    memory: NodeMemory
    metrics: AgentMetrics
    rdma: RdmaBackend | None  # UCX (ray_velo.ucx.backend.UcxRdmaBackend), a fake, or none
    rdma_enabled: bool
    clock: Clock
    poke: Callable[[], None] = lambda: None
    lock: threading.RLock = field(default_factory=threading.RLock)
    commits: CommitGate = field(init=False)
    #: ``state`` with the reservations and consumer-side state over its ledger.
    states: AgentStates = field(init=False)
    reservations: Reservations = field(init=False)
    consumer_state: ConsumerState = field(init=False)
    closed: bool = False
    #: Notified after every change (shutdown's drain waits on it).
    changed: threading.Condition = field(init=False)
    #: Tells other nodes' agents that handles whose copies they hold ended (the agent's
    #: peers do it; ``ray_velo.testing`` has no other node): [(handle, node, worker)].
    tell_copy_ends: Callable[[list[tuple[DataHandle, str, int]]], None] = lambda ends: None
    #: This agent serves its copies to other nodes (it has a TCP wire they can reach).
    serves_copies: bool = False
    #: This agent sends payload bytes over its wire's bulk port (the wire path's check W1).
    serves_wire: bool = False

    def __post_init__(self) -> None:
        self.commits = CommitGate(self.worker_id)
        self.states = AgentStates.over(self.state)
        self.reservations, self.consumer_state = self.states.reservations, self.states.consumer
        self.changed = threading.Condition(self.lock)

    @contextlib.contextmanager
    def changing(self) -> Iterator[Effects]:
        """Hold the state lock for a change; perform its effects after releasing it."""
        fx = Effects()
        try:
            with self.lock:
                try:
                    yield fx
                finally:
                    fx.windows += self.state.take_ended_windows()
                    self.changed.notify_all()
        finally:
            self.perform(fx)

    @contextlib.contextmanager
    def plain_copy_buffer(self, nbytes: int) -> Iterator[tuple[int, Placement]]:
        """A plain buffer for a copy (a region slot's, a demotion), owned in the ledger by a
        fetch id from the moment it is taken: yields ``(fid, placement)``. If the block raises,
        the buffer goes back unless the block handed it on already (the ledger says which:
        no local flag decides)."""
        placement = self.memory.allocate_plain(nbytes, self.clock())
        with self.lock:
            fid = self.consumer_state.fetch_take(placement, False)
        try:
            yield fid, placement
        except BaseException:
            with self.changing() as fx:
                if self.consumer_state.fetch_buffer(fid) is not None:
                    self.consumer_state.fetch_give_back(fid, fx)
            raise

    def wait_written(
        self, handle: DataHandle, upto: int | None = None, timeout_s: float = COMMIT_WAIT_S
    ) -> None:
        """Wait until bytes ``[0, upto)`` (None: all) of our ``handle`` are written: a slot
        committed before its producer wrote them (streamed staging) is read no sooner.

        Raises:
            StagingError: they were not written within ``timeout_s``.
        """
        if handle.worker_id != self.worker_id:
            return

        def written() -> bool:
            return self.state.writes.through(handle.slot_id, upto)

        with self.lock:
            if written():
                return
        nonblocking.check(f"waiting for the bytes of {handle} to be written")
        if not self.wait_until(written, self.clock() + timeout_s):
            raise StagingError(
                f"handle {handle}: its producer did not write its bytes within {timeout_s} s"
            )

    def wait_until(self, ready: Callable[[], bool], until: float) -> bool:
        """Wait (under the lock) until ``ready()`` or ``until`` on the agent's clock; says
        which."""
        return self.clock.wait(self.changed, ready, until)

    def perform(self, fx: Effects) -> None:
        """Give buffers back, release anchors, poke the timer (outside the lock). Giving a
        dedicated arena back may unmap it, and an anchor's release may deregister a region:
        on the event loop those go to a thread (:func:`~ray_velo.agent.nonblocking.defer`)."""
        now = self.clock()
        if fx.windows:
            self._perform_after_windows(fx, now)
            return
        slow = []
        for buffer, registered in fx.free:
            if getattr(buffer, "dedicated", False):
                slow.append((buffer, registered))
            else:
                self.memory.free(buffer, registered, now)
        if slow or fx.anchors:
            anchors = list(fx.anchors)

            def slow_effects() -> None:
                for buffer, registered in slow:
                    self.memory.free(buffer, registered, now)
                for anchor in anchors:
                    anchor.release()

            nonblocking.defer(slow_effects)
        if fx.copy_ends:
            ends, tell = list(fx.copy_ends), self.tell_copy_ends
            nonblocking.defer(lambda: tell(ends))
        if fx.poke:
            self.poke()

    def _perform_after_windows(self, fx: Effects, now: float) -> None:
        """:meth:`perform` when leases with windows ended: unregistering may block, and
        nothing may go back to its pool before the windows over it are unregistered (a GET
        could still read it through them), so it all runs in that order, off the loop."""
        windows, frees, anchors = list(fx.windows), list(fx.free), list(fx.anchors)

        def in_order() -> None:
            for window_set in windows:
                window_set.close()
            for buffer, registered in frees:
                self.memory.free(buffer, registered, now)
            for anchor in anchors:
                anchor.release()

        nonblocking.defer(in_order)
        rest = Effects(copy_ends=fx.copy_ends, poke=fx.poke)
        self.perform(rest)

    def ucx(self) -> RdmaBackend:
        """The RDMA backend, for a step only the RDMA path takes.

        Raises:
            UcxError: the agent has none (UCX is off, or closed at shutdown).
        """
        if self.rdma is None:
            raise UcxError(operation="rdma", status=-1, status_text="this agent has no UCX")
        return self.rdma

    def check_open(self) -> None:
        """Raises AgentShuttingDown once the agent is shutting down."""
        if self.closed:
            raise AgentShuttingDown(node=self.node_id)

    def handle(self, slot_id: int) -> DataHandle:
        """This agent's handle for ``slot_id`` (with the node hint)."""
        return DataHandle(self.worker_id, slot_id, self.node_id)
