"""Two real agents in one process, an owner and a consumer, joined by in-process links."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
from pathlib import Path
from typing import Any

import numpy as np

from ray_velo.actors.agent import RendezvousAgent
from ray_velo.actors.faults import FaultPlan
from ray_velo.agent.clock import Deadline
from ray_velo.client.payload import as_bytes_view
from ray_velo.config import (
    RdmaConfig,
    RdmaPoolConfig,
    RdmaRendezvousConfig,
    VeloConfig,
    check_lifetime,
)
from ray_velo.consumer.links import Blocking, OwnerLink, check_chunk
from ray_velo.errors import HandleNotFound, OwnerDied, VeloError
from ray_velo.local.records import LocalLease
from ray_velo.memory.arena import SegmentMap
from ray_velo.protocol import (
    AcquireRequest,
    CopyNotice,
    DataHandle,
    PullRequest,
    RdmaOffer,
    Ready,
    decode,
    encode,
)
from ray_velo.protocol.entry import RV_ACQUIRE, Entry
from ray_velo.protocol.handshake import SECRET_BYTES
from ray_velo.testing.fakes import FakeClock, FakeJobs, FakeRdma
from ray_velo.wire.auth import WireAuth

__all__ = ["AgentPair", "InProcessLink", "InProcessPeers"]

MiB = 1 << 20


class InProcessLink:
    """An :class:`~ray_velo.consumer.links.OwnerLink` that calls an agent's handlers in
    this process. ``dead`` makes every call fail as a dead owner's would; ``offer_anyway``
    N makes the next N acquires without an RDMA offer reach the owner with one, so it
    answers RDMA to a consumer that offered none (a broken owner, as the consumer sees it)."""

    def __init__(self, agent: RendezvousAgent) -> None:
        self.agent = agent
        self.node = agent.node_id
        self.dead = False
        self.offer_anyway = 0
        self.sent: list[str] = []  # the fire-and-forget calls, by handler name

    def _check(self, handle: object) -> None:
        if self.dead:
            raise OwnerDied(handle=str(handle), node=self.node)

    def call(self, entry: Entry, message: bytes, deadline: Deadline, handle: DataHandle) -> Any:
        self._check(handle)
        if entry is RV_ACQUIRE and self.offer_anyway > 0:
            request = decode(AcquireRequest, message)
            if request.rdma is None:
                self.offer_anyway -= 1
                message = encode(dataclasses.replace(request, rdma=RdmaOffer(("ucx",))))
        return self.agent.serve(entry)(message)

    def send(self, entry: Entry, message: bytes) -> None:
        self.sent.append(entry.name)
        if not self.dead:
            with contextlib.suppress(VeloError):
                self.agent.serve(entry)(message)

    async def call_async(
        self, entry: Entry, message: bytes, deadline: Deadline, handle: DataHandle
    ) -> Any:
        return self.call(entry, message, deadline, handle)

    async def pull(
        self,
        answer: Ready,
        dest: memoryview,
        in_flight: int,
        deadline: Deadline,
        handle: DataHandle,
        blocking: Blocking,
    ) -> None:
        target = np.frombuffer(dest, dtype=np.uint8, count=answer.total_len)
        for index in range(answer.chunk_count):
            self._check(handle)
            if deadline.expired():
                raise deadline.timeout_error(handle)
            chunk = self.agent.owner._rv_pull(encode(PullRequest(answer.transfer_id, index)))
            start = check_chunk(chunk, index, answer, handle)
            np.copyto(target[start : start + len(chunk)], chunk)

    def ucx_address(self, deadline: Deadline) -> tuple[int, bytes | None]:
        self._check("?")
        rdma = self.agent.core.rdma
        return self.agent.worker_id, None if rdma is None else rdma.address


class InProcessPeers:
    """A consumer's directory holding one in-process owner (``bulk``: its bulk port, when
    it has one)."""

    def __init__(
        self, consumer_rdma: FakeRdma | None, link: InProcessLink, bulk: str | None = None
    ) -> None:
        self.rdma = consumer_rdma
        self.owner_link = link
        self.bulk_address = bulk

    def link(self, handle: DataHandle) -> OwnerLink:
        if handle.worker_id != self.owner_link.agent.worker_id:
            raise HandleNotFound(handle=str(handle), reason="no live agent issued this handle")
        return self.owner_link

    def cached(self, handle: DataHandle) -> OwnerLink | None:
        try:
            return self.link(handle)
        except HandleNotFound:
            return None

    def forget(self, link: Any) -> bool:
        return False

    def registered(self, node: str, worker_id: int) -> bool:
        return self.rdma is not None and self.rdma.peer_registered(node, worker_id)

    def learn(self, link: Any, worker_id: int, deadline: Deadline) -> None:
        if self.rdma is None:
            return
        peer, address = link.ucx_address(deadline)
        if address:
            self.rdma.register_peer(link.node, peer, address)

    def relay(self, node: str, worker_id: int) -> None:
        return None  # one owner, one consumer: no other node's copy to read

    def bulk(self, worker_id: int) -> str | None:
        return self.bulk_address if worker_id == self.owner_link.agent.worker_id else None


class AgentPair:
    """An owner agent ("node-a") and a consumer agent ("node-b") in this process.

    Args:
        shm_dir: where both agents' segments go (a test's temporary directory).
        config: the agents' configuration (default: small arenas and chunks, 2 s leases).
        rdma: False gives both agents no RDMA backend (the chunked path only).
        registered: whether the consumer already knows the owner's UCX address (False: the
            cold start, whose first fetch is chunked).
        consumer_config: the consumer's own configuration (default: ``config``).
        wire: the owner sends its bytes over a real bulk port on 127.0.0.1 (both agents hold
            one cluster's secret, ``auth``): the wire path, as between hosts on a TCP network.
    """

    def __init__(
        self,
        shm_dir: str | os.PathLike[str],
        config: VeloConfig | None = None,
        *,
        rdma: bool = True,
        registered: bool = True,
        consumer_config: VeloConfig | None = None,
        wire: bool = False,
    ) -> None:
        Path(shm_dir).mkdir(parents=True, exist_ok=True)
        self.config = (config or default_config()).replace(shm_dir=os.fspath(shm_dir))
        self.consumer_config = (consumer_config or self.config).replace(shm_dir=os.fspath(shm_dir))
        self.clock = FakeClock(1000.0)
        self.owner_rdma = FakeRdma(self.clock) if rdma else None
        self.consumer_rdma = FakeRdma(self.clock) if rdma else None
        self.jobs = FakeJobs()
        self.auth = WireAuth(secrets.token_bytes(SECRET_BYTES)) if wire else None
        self.owner = RendezvousAgent(
            self.config,
            "node-a",
            rdma=self.owner_rdma,
            clock=self.clock,
            timer=False,
            jobs=self.jobs,
            wire_auth=self.auth,
            bulk_host="127.0.0.1" if wire else None,
            faults=FaultPlan(),
        )
        self.link = InProcessLink(self.owner)
        bulk = None if self.owner.bulk is None else self.owner.bulk.address
        self.peers = InProcessPeers(self.consumer_rdma, self.link, bulk)
        self.consumer = RendezvousAgent(
            self.consumer_config,
            "node-b",
            rdma=self.consumer_rdma,
            peers=self.peers,
            clock=self.clock,
            timer=False,
            jobs=self.jobs,
            wire_auth=self.auth,
            faults=FaultPlan(),
        )
        self.owner.core.tell_copy_ends = self._tell_copy_ends
        if registered and self.consumer_rdma is not None and self.owner_rdma is not None:
            self.consumer_rdma.register_peer(
                "node-a", self.owner.worker_id, self.owner_rdma.address
            )
        self.segments = SegmentMap()
        self.pid = os.getpid()

    # --- producing and consuming -----------------------------------------------------

    def put(
        self,
        data: Any,
        *,
        pinned: bool = True,
        ttl: float | None = None,
        consumers: int = 1,
        on: str = "owner",
        transparent: bool = False,
        job: str = "",
        lifetime: str | None = None,
    ) -> DataHandle:
        """Stage ``data`` on the owner (or the consumer) as ``rv.put`` does.

        ``transparent``: as ``@ray_velo.transfer`` does, only into an arena already mapped;
        LookupError when none fits (the decorator then leaves the payload in the Ray call).
        ``job``: the Ray job staging it (end it with ``pair.jobs.end(job)``); ``lifetime``
        as in ``rv.put``.
        """
        detached = check_lifetime(lifetime)
        agent = self.owner if on == "owner" else self.consumer
        header, view = as_bytes_view(data)
        reservation = agent.producers.reserve(view.nbytes, pinned, self.pid, not transparent)
        if reservation is None:
            raise LookupError("no mapped arena fits a transparent payload: it travels inline")
        if view.nbytes:
            dest = self.segments.view(reservation.path, reservation.offset, view.nbytes)
            np.frombuffer(dest, dtype=np.uint8)[:] = np.frombuffer(view, dtype=np.uint8)
            del dest
        return agent.producers.commit(
            reservation.reservation_id, view.nbytes, header, ttl, consumers, False, job, detached
        )

    def lease(
        self, handle: DataHandle, mode: str = "release", timeout: float | None = None
    ) -> LocalLease:
        """The consumer's lease on the fetched bytes (the caller ends it with :meth:`end`)."""
        bound = "caller timeout" if timeout is not None else "unbounded"
        return self.consumer.consumer.fetch(handle, mode, timeout, self.pid, bound)  # type: ignore[arg-type]

    def read(self, lease: LocalLease) -> bytes:
        if not lease.total_len:
            return b""
        return bytes(self.segments.view(lease.path, lease.offset, lease.total_len))

    def end(self, lease: LocalLease) -> None:
        """End a consumer lease as a collected view does."""
        self.consumer.readers.end_lease(lease.handle, lease.lease_id, False)

    def fetch(
        self, handle: DataHandle, mode: str = "release", timeout: float | None = None
    ) -> bytes:
        """Fetch ``handle`` on the consumer, read it, end the lease: the bytes."""
        lease = self.lease(handle, mode, timeout)
        try:
            return self.read(lease)
        finally:
            self.end(lease)

    def _tell_copy_ends(self, ends: list[tuple[DataHandle, str, int]]) -> None:
        """The owner's word that handles ended, to the consumer holding copies of them (the
        agents' peers send it over the wire)."""
        for handle, node, worker in ends:
            if worker == self.consumer.worker_id:
                self.consumer.consumer.copy_notice(encode(CopyNotice(handle, node, worker)))

    # --- time and state --------------------------------------------------------------

    def tick(self, seconds: float = 0.0) -> None:
        """Move the clock ``seconds`` on and run both agents' timers."""
        now = self.clock.advance(seconds)
        self.owner.tick(now)
        self.consumer.tick(now)

    def validate(self) -> None:
        """Both agents' state objects check every invariant (the buffer ledger included)."""
        for agent in (self.owner, self.consumer):
            with agent.core.lock:
                agent.core.states.validate()

    def paths(self, agent: RendezvousAgent) -> dict[str, int]:
        return dict(agent.core.metrics.snapshot()["velo_rendezvous_rdma_path_total"])

    def owner_paths(self) -> dict[str, int]:
        return self.paths(self.owner)

    def consumer_paths(self) -> dict[str, int]:
        return self.paths(self.consumer)

    def close(self) -> None:
        self.segments.close_all()
        for agent in (self.consumer, self.owner):
            agent.shutdown()

    def __enter__(self) -> AgentPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def default_config() -> VeloConfig:
    """Small sizes for fast tests: 1 MiB chunks, 4 MiB first arenas, 2 s RDMA leases."""
    return VeloConfig(
        chunk_size=1 * MiB,
        plain_arena_bytes=4 * MiB,
        rdma=RdmaConfig(
            rendezvous=RdmaRendezvousConfig(lease_timeout=2.0),
            pool=RdmaPoolConfig(
                initial_arena_bytes=4 * MiB,
                max_arena_bytes=64 * MiB,
                dedicated_arena_min=16 * MiB,
                registered_bytes_budget=256 * MiB,
                warm_dedicated_bytes=64 * MiB,
            ),
        ),
    )
