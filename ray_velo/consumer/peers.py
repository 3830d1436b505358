"""The owners a consumer knows: how to reach each one, and whether UCX is wired to it (the
consumer's third offer fact, docs/protocol.md §8)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

from ray_velo.agent.clock import Deadline
from ray_velo.consumer.links import OwnerLink, RayOwnerLink, WireOwnerLink
from ray_velo.consumer.relay import RelayLink, copy_gone_notice
from ray_velo.errors import HandleNotFound, OwnerDied, VeloError
from ray_velo.protocol import DataHandle
from ray_velo.protocol.entry import RV_COPY
from ray_velo.wire.auth import WireAuth

__all__ = ["PeerDirectory", "Peers"]


class Peers(Protocol):
    """What the consumer needs of a directory (Ray's, or ``ray_velo.testing``'s)."""

    def link(self, handle: DataHandle) -> OwnerLink:
        """The owner of ``handle``. Raises OwnerDied or HandleNotFound."""
        ...

    def cached(self, handle: DataHandle) -> OwnerLink | None:
        """The owner of ``handle`` if it is known already (never blocks), else None."""
        ...

    def forget(self, link: OwnerLink) -> bool:
        """Drop a dead owner's link; True if a fresh lookup may find a new incarnation on
        that node (the link was this directory's: cached, or already dropped by a fetch
        beside this one)."""
        ...

    def registered(self, node: str, worker_id: int) -> bool:
        """Whether UCX is registered for that owner incarnation."""
        ...

    def learn(self, link: OwnerLink, worker_id: int, deadline: Deadline) -> None:
        """Learn an owner's UCX address after a first chunked transfer (never raises)."""
        ...

    def relay(self, node: str, worker_id: int) -> RelayLink | None:
        """A connection to the agent ``worker_id`` on ``node`` that serves a copy; None
        when it cannot be reached that way (read the owner's bytes)."""
        ...

    def bulk(self, worker_id: int) -> str | None:
        """``host:port`` where the agent ``worker_id`` sends payload bytes over the wire (its
        bulk port), or None: it has none (an older version, the wire off)."""
        ...


#: Bulk ports remembered per agent incarnation (each lookup is a call to Ray's KV).
_BULK_REMEMBERED = 4096


class PeerDirectory:
    """Ray's directory of owner agents."""

    def __init__(
        self,
        rdma: Any,
        find_agent: Callable[[str], Any],
        node_of_worker: Callable[[int], str | None],
        own_node: str,
        wire_address: Callable[[int], str | None] = lambda worker_id: None,
        wire_auth: WireAuth | None = None,
        bulk_address: Callable[[int], str | None] = lambda worker_id: None,
    ) -> None:
        """``wire_auth``: this agent's credentials for other agents' TCP wire (None: it
        reaches them with Ray calls only); ``wire_address`` and ``bulk_address``: where an
        agent incarnation serves its wire and its bulk port (Ray's KV)."""
        self._rdma = rdma
        self._find_agent = find_agent
        self._node_of_worker = node_of_worker
        self._wire_address = wire_address if wire_auth is not None else lambda worker_id: None
        self._wire_auth = wire_auth
        self._bulk_address = bulk_address if wire_auth is not None else lambda worker_id: None
        self._bulk: dict[int, str | None] = {}
        self._own_node = own_node
        self._lock = threading.Lock()
        self._links: dict[str, RayOwnerLink | WireOwnerLink] = {}
        self._no_ucx: set[tuple[str, int]] = set()  # (node, worker id) without UCX

    def cached(self, handle: DataHandle) -> RayOwnerLink | WireOwnerLink | None:
        if not handle.owner_node:
            return None  # a lookup in Ray's KV first
        with self._lock:
            return self._links.get(handle.owner_node)

    def link(self, handle: DataHandle) -> RayOwnerLink | WireOwnerLink:
        node = handle.owner_node or self._node_of_worker(handle.worker_id)
        if node is None:
            raise HandleNotFound(handle=str(handle), reason="no live agent issued this handle")
        with self._lock:
            link = self._links.get(node)
        if link is not None:
            return link
        try:
            actor = self._find_agent(node)
        except ValueError as exc:
            raise OwnerDied(handle=str(handle), node=node) from exc
        ray_link = RayOwnerLink(actor, node)
        address = self._wire_address(handle.worker_id)
        # An owner that serves its short handlers over TCP is called there.
        found: RayOwnerLink | WireOwnerLink = ray_link
        if address and self._wire_auth is not None:
            found = WireOwnerLink(ray_link, address, self._wire_auth)
        with self._lock:
            return self._links.setdefault(node, found)

    def forget(self, link: OwnerLink) -> bool:
        with self._lock:
            cached = self._links.get(link.node) is link
            if cached:
                del self._links[link.node]
        if cached and isinstance(link, WireOwnerLink):
            link.close()
        # Every link this directory hands out was cached: one no longer cached was dropped
        # by a fetch that met the same dead owner first, and a fresh lookup may find the
        # node's new agent all the same (answering False made that fetch fail OwnerDied).
        return isinstance(link, RayOwnerLink | WireOwnerLink)

    def close(self) -> None:
        """Close every TCP link to an owner (the agent shuts down)."""
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            if isinstance(link, WireOwnerLink):
                link.close()

    @property
    def nodes(self) -> list[str]:
        with self._lock:
            return sorted(self._links)

    def registered(self, node: str, worker_id: int) -> bool:
        return self._rdma is not None and bool(self._rdma.peer_registered(node, worker_id))

    def register(self, addresses: dict[str, tuple[int, bytes | None]]) -> int:
        """Learn peer agents' worker addresses: node id -> (worker id, address)."""
        if self._rdma is None:
            return 0
        count = 0
        for node, (worker_id, address) in addresses.items():
            if node != self._own_node and address:
                self._rdma.register_peer(node, worker_id, address)
                count += 1
        return count

    def relay(self, node: str, worker_id: int) -> RelayLink | None:
        if node == self._own_node:
            return None
        address = self._wire_address(worker_id)
        if not address or self._wire_auth is None:
            return None
        return RelayLink(address, self._wire_auth)

    def bulk(self, worker_id: int) -> str | None:
        with self._lock:
            if worker_id in self._bulk:
                return self._bulk[worker_id]
        address = self._bulk_address(worker_id)  # outside the lock: a call to Ray's KV
        with self._lock:
            if len(self._bulk) >= _BULK_REMEMBERED:
                self._bulk.pop(next(iter(self._bulk)))
            self._bulk[worker_id] = address
        return address

    def tell_copy_ends(self, ends: list[tuple[DataHandle, str, int]]) -> None:
        """Tell each copy's agent that its handle ended (see ``AgentCore.tell_copy_ends``),
        at that agent incarnation's own wire: a link cached by node may reach an older
        incarnation (or a newer one, which holds none of these copies). An agent that cannot
        be reached is gone, and its copies with it."""
        by_agent: dict[tuple[str, int], list[DataHandle]] = {}
        for handle, node, worker in ends:
            by_agent.setdefault((node, worker), []).append(handle)
        for (node, worker), handles in by_agent.items():
            address = self._wire_address(worker)
            if not address or self._wire_auth is None:
                continue  # an agent without the wire never says it keeps copies
            link = RelayLink(address, self._wire_auth)
            try:
                for handle in handles:
                    link.notify(RV_COPY, copy_gone_notice(handle, node, worker), 2.0)
            except (OSError, VeloError):  # gone, or not an agent of this cluster
                pass
            finally:
                link.close()

    def learn(self, link: OwnerLink, worker_id: int, deadline: Deadline) -> None:
        if self._rdma is None or self._rdma.peer_registered(link.node, worker_id):
            return
        with self._lock:
            if (link.node, worker_id) in self._no_ucx:
                return
        try:
            peer_worker, address = link.ucx_address(deadline)
        except VeloError:
            return
        if address:
            self._rdma.register_peer(link.node, peer_worker, address)
        else:
            with self._lock:
                self._no_ucx.add((link.node, peer_worker))
