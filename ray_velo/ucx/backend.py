"""The agent's RDMA registry over UCX: registration, descriptors, endpoints and the GET, on two
workers (docs/architecture.md §10)."""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any

from ray_velo.config import UcxConfig
from ray_velo.errors import DescriptorError, UcxError
from ray_velo.memory.pool import Registration
from ray_velo.protocol.descriptor import BACKEND_UCX, RdmaDescriptor
from ray_velo.protocol.memtype import MemoryType
from ray_velo.ucx.binding import (
    HOST_MEMORY_ONLY,
    Endpoint,
    MemoryRegistration,
    RemoteKey,
    UcxContext,
    UcxWorker,
)
from ray_velo.ucx.binding import get as ucx_get

__all__ = ["UcxRdmaBackend", "UcxRegistrar"]

_log = logging.getLogger(__name__)


class UcxRegistrar:
    """Maps memory with ``ucp_mem_map`` for the pool and regions (the Registrar protocol).

    ``memory_type``: what every range it maps is (host for the shm arenas, CUDA for a GPU
    arena pool's device allocations); UCX is told, not left to detect it.
    """

    def __init__(self, context: UcxContext, memory_type: MemoryType = MemoryType.HOST) -> None:
        self._context = context
        self.memory_type = memory_type

    def register(self, address: int, nbytes: int) -> Registration:
        """Map ``nbytes`` at ``address``; the caller keeps the pages until :meth:`unregister`."""
        return MemoryRegistration.from_address(
            self._context, address, nbytes, keepalive=None, memory_type=self.memory_type
        )

    def unregister(self, registration: Registration) -> None:
        """Unmap; returns only once UCX confirmed it (pages may then be freed)."""
        if not isinstance(registration, MemoryRegistration):
            raise TypeError(f"not a UCX registration: {registration!r}")
        registration.unmap()


class UcxRdmaBackend:
    """Everything UCX an agent needs."""

    backend = "ucx"

    def __init__(self, config: UcxConfig, clock: Callable[[], float]) -> None:
        """``clock``: the agent's; an endpoint's idle time is measured on it."""
        self.config = config
        self._clock = clock
        self.context = UcxContext(dict(config.options))
        try:
            self.worker = UcxWorker(self.context, progress_thread=True, blocking=True)
            self.get_worker = UcxWorker(self.context, progress_thread=True, blocking=True)
        except BaseException:
            self.context.close()  # closes a worker made already
            raise
        self.address: bytes = self.worker.address
        self.registrar = UcxRegistrar(self.context)
        # The memory an owner's key may name: host until this agent has GPU arenas (and so
        # a CUDA-capable UCX); docs/gpu.md.
        self.remote_memory_types: frozenset[MemoryType] = HOST_MEMORY_ONLY
        self._lock = threading.Lock()
        self._peer_addresses: dict[str, bytes] = {}
        self._peer_workers: dict[str, int] = {}
        self._endpoints: dict[str, Endpoint] = {}
        self._last_used: dict[str, float] = {}
        #: (transport, device) of each peer's endpoint lanes, learnt after its first GET.
        self._transports: dict[str, list[tuple[str, str]]] = {}
        self._generation = itertools.count(1)
        self._closed = False
        self.endpoints_reaped = 0

    # --- peers -----------------------------------------------------------------------

    def register_peer(self, node: str, worker_id: int, address: bytes) -> None:
        """Learn a peer agent's worker address; with eager_endpoints, wire up now.

        ``worker_id`` names the peer's incarnation: a restarted agent on the same node has
        a new one, and handles of the old one must not be offered RDMA to the new address.
        """
        with self._lock:
            if self._peer_addresses.get(node) == address:
                self._peer_workers[node] = worker_id
                return
            self._peer_addresses[node] = bytes(address)
            self._peer_workers[node] = worker_id
            stale = self._endpoints.pop(node, None)
            self._transports.pop(node, None)
        if stale is not None:
            stale.close()
        if self.config.eager_endpoints:
            try:
                self._endpoint(node)
            except UcxError:  # a hint only: the first GET wires up lazily instead
                _log.info("eager endpoint to %s failed; wiring up lazily", node, exc_info=True)

    def peer_registered(self, node: str, worker_id: int | None = None) -> bool:
        """Whether UCX is registered for that peer (and that incarnation, if given)."""
        with self._lock:
            if node not in self._peer_addresses:
                return False
            return worker_id is None or self._peer_workers.get(node) == worker_id

    def _endpoint(self, node: str) -> Endpoint:
        with self._lock:
            if self._closed:
                raise UcxError(operation="ucp_ep_create", status=-1, status_text="backend closed")
            endpoint = self._endpoints.get(node)
            if endpoint is not None and not endpoint.closed and endpoint.error_status == 0:
                self._last_used[node] = self._clock()
                return endpoint
            address = self._peer_addresses.get(node)
        if address is None:
            raise UcxError(
                operation="ucp_ep_create", status=-1, status_text=f"peer {node} not registered"
            )
        if endpoint is not None:
            endpoint.close()  # failed: the next use wires up a fresh one
        with self._lock:  # two first GETs to a peer must not both create one
            current = self._endpoints.get(node)
            if current is not None and current is not endpoint and not current.closed:
                return current
            fresh = Endpoint(self.get_worker, address)  # no network I/O: wireup is lazy
            self._endpoints[node] = fresh
            self._last_used[node] = self._clock()
        return fresh

    # --- owner side --------------------------------------------------------------------

    def descriptor(self, registration: Any, address: int, nbytes: int) -> bytes | None:
        """The wire descriptor for ``nbytes`` at ``address`` inside ``registration``, or
        None when the staging is gone (check 8: an unmapped arena or region)."""
        if registration is None or not getattr(registration, "mapped", False):
            return None
        if not registration.contains(address, nbytes):
            return None
        return RdmaDescriptor(
            generation=next(self._generation),
            addr=address,
            length=nbytes,
            rkey=registration.packed_rkey,
            backend=BACKEND_UCX,
        ).encode()

    # --- consumer side -----------------------------------------------------------------

    @staticmethod
    def decode(blob: bytes, expected_len: int) -> RdmaDescriptor:
        """Decode and check a descriptor for this consumer. Raises DescriptorError."""
        descriptor = RdmaDescriptor.decode(blob)
        if descriptor.backend != BACKEND_UCX:
            raise DescriptorError(reason=f"backend {descriptor.backend} is not served here")
        if descriptor.length != expected_len:
            raise DescriptorError(
                reason=f"descriptor length {descriptor.length} != total_len {expected_len}"
            )
        return descriptor

    def get(
        self,
        node: str,
        descriptor: RdmaDescriptor,
        dest_address: int,
        timeout_s: float,
        local_registration: Registration | None = None,
        *,
        start: int = 0,
        stop: int | None = None,
    ) -> None:
        """GET the descriptor's bytes from peer ``node`` into ``dest_address`` (only bytes
        ``[start, stop)`` of it, to the same offsets from ``dest_address``, when given).

        Returns once UCX reports completion. A failed GET has completed too, except a
        timed-out one whose request did not complete even after its endpoint was
        force-closed: that UcxError carries ``destination_unsafe=True``, and the destination
        must never be reused.

        Raises:
            DescriptorError: the packed key fails the pre-parse (never reaches UCX).
            UcxError: the GET failed or timed out.
        """
        endpoint = self._endpoint(node)
        rkey = RemoteKey(endpoint, descriptor.rkey, self.remote_memory_types)
        try:
            stop = descriptor.length if stop is None else stop
            if not 0 <= start <= stop <= descriptor.length:
                raise ValueError(f"range [{start}, {stop}) outside {descriptor.length} bytes")
            ucx_get(
                endpoint,
                dest_address + start,
                stop - start,
                descriptor.addr + start,
                rkey,
                timeout_s,
                # the destination's own registration saves one per GET on InfiniBand
                local_memh=(
                    local_registration
                    if isinstance(local_registration, MemoryRegistration)
                    else None
                ),
            )
            with self._lock:
                self._last_used[node] = self._clock()  # the idle clock restarts
                known = node in self._transports
            if not known:
                self._record_transports(node, endpoint)
        except UcxError:
            if endpoint.error_status != 0 or endpoint.closed:
                with self._lock:
                    if self._endpoints.get(node) is endpoint:
                        del self._endpoints[node]
                endpoint.close()
            raise
        finally:
            rkey.close()

    def _record_transports(self, node: str, endpoint: Endpoint) -> None:
        try:
            lanes = endpoint.transports()
        except UcxError:
            return
        with self._lock:
            self._transports[node] = lanes

    def transports(self) -> dict[str, list[str]]:
        """Per peer node: the ``transport/device`` lanes its endpoint used for a GET
        (``["tcp/veth0"]``); peers no GET went to yet are absent."""
        with self._lock:
            return {
                node: [f"{t}/{d}" for t, d in lanes] for node, lanes in self._transports.items()
            }

    # --- lifetime ----------------------------------------------------------------------

    def endpoint_count(self) -> int:
        with self._lock:
            return len(self._endpoints)

    def reap_idle_endpoints(self, now: float) -> int:
        """Close endpoints unused for ``ep_idle_timeout`` (experimental; off by default)."""
        timeout = self.config.ep_idle_timeout
        if timeout is None:
            return 0
        with self._lock:
            closing = []
            for node, used in list(self._last_used.items()):
                endpoint = self._endpoints.get(node)
                if endpoint is None:
                    del self._last_used[node]
                elif endpoint.in_flight:  # never under an outstanding GET: restart the clock
                    self._last_used[node] = now
                elif now - used >= timeout:
                    closing.append(self._endpoints.pop(node))
                    del self._last_used[node]
        for endpoint in closing:
            endpoint.close()  # the next use wires up a new one; the peer stays registered
        self.endpoints_reaped += len(closing)
        return len(closing)

    def next_reap_due(self, now: float) -> float | None:
        """When the idle-endpoint scan should next run: every half timeout, at least once a
        second, and only while endpoints exist (None otherwise)."""
        timeout = self.config.ep_idle_timeout
        if timeout is None or not self.endpoint_count():
            return None
        return now + min(timeout / 2, 1.0)

    def close(self) -> None:
        """Close endpoints, then the workers and their progress threads, then the context.

        Arenas and regions are unmapped by their owners before this (docs/protocol.md §18);
        the context's close force-unmaps anything left and says so.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            endpoints = list(self._endpoints.values())
            self._endpoints.clear()
        for endpoint in endpoints:
            endpoint.close()
        self.get_worker.close()
        self.worker.close()
        self.context.close()
