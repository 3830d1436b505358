"""The agent's RDMA registry over UCX: registration, descriptors, endpoints and the GET, on two
workers (docs/architecture.md §10)."""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Callable, Mapping
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
    quiet_log,
)
from ray_velo.ucx.binding import get as ucx_get
from ray_velo.ucx.policy import TransportChoice, choose_transports, ucx_tcp_allowed
from ray_velo.ucx.status import UcsStatus

__all__ = ["UcxRdmaBackend", "UcxRegistrar", "agent_transports"]

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


def agent_transports(
    config: UcxConfig, environ: Mapping[str, str] = os.environ
) -> tuple[bool, TransportChoice]:
    """(whether UCX may use TCP, the transports an agent's UCX context gets) from the
    config and the environment (:mod:`ray_velo.ucx.policy`)."""
    tcp = ucx_tcp_allowed(config.tcp, environ)
    requested = dict(config.options).get("TLS", environ.get("UCX_TLS"))
    return tcp, choose_transports(requested, tcp)


class UcxRdmaBackend:
    """Everything UCX an agent needs.

    Its context uses every transport the operator's ``UCX_TLS`` names but ``tcp``, unless
    TCP is allowed (:func:`agent_transports`); a peer no transport reaches (another host on
    a TCP network) is not registered, so a consumer offers it no UCX GET.
    """

    backend = "ucx"

    def __init__(
        self,
        config: UcxConfig,
        clock: Callable[[], float],
        environ: Mapping[str, str] = os.environ,
    ) -> None:
        """``clock``: the agent's; an endpoint's idle time is measured on it. ``environ``:
        where ``VELO_UCX_TCP`` and ``UCX_TLS`` are read, once.

        Raises:
            UcxError: UCX does not start, or no transport is left once TCP is taken out.
        """
        self.config = config
        self._clock = clock
        self.tcp, choice = agent_transports(config, environ)
        if not choice.start:
            raise UcxError(
                operation="ucp_init", status=int(UcsStatus.ERR_UNSUPPORTED), status_text=choice.note
            )
        options = dict(config.options)
        if choice.tls is not None:
            options["TLS"] = choice.tls
        self.context = UcxContext(options)
        try:
            self.worker = UcxWorker(self.context, progress_thread=True, blocking=True)
            self.get_worker = UcxWorker(self.context, progress_thread=True, blocking=True)
        except BaseException:
            self.context.close()  # closes a worker made already
            raise
        self.address: bytes = self.worker.address
        try:
            self._check_reach()
        except BaseException:
            self.get_worker.close()
            self.worker.close()
            self.context.close()
            raise
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
        #: Peers none of our transports reaches (another host, with TCP off): not registered.
        self._unreachable: set[str] = set()
        self._generation = itertools.count(1)
        self._closed = False
        self.endpoints_reaped = 0

    def _check_reach(self) -> None:
        """Raise UcxError (unreachable) when no transport of ours reaches another worker.

        An endpoint needs a lane for UCX's wireup messages that detects a dead peer (we ask
        for ``UCP_ERR_HANDLING_MODE_PEER``): ``tcp`` or an InfiniBand transport, never shared
        memory. With TCP left out on a host without RDMA NICs nothing is left, not even for a
        peer on the same host: this agent then runs without UCX rather than hold arenas
        registered for nothing. The probe is an endpoint from one of our workers to the
        other (no network I/O)."""
        try:
            with quiet_log():  # UCX would log the expected refusal as an ERROR
                probe = Endpoint(self.get_worker, self.address)
        except UcxError as exc:
            if exc.fields.get("status") != int(UcsStatus.ERR_UNREACHABLE):
                raise
            raise UcxError(
                operation="ucp_ep_create",
                status=int(UcsStatus.ERR_UNREACHABLE),
                status_text=(
                    "no UCX transport ray_velo may use reaches another process here (TCP is "
                    "off and there is no RDMA NIC); payloads between nodes move over the "
                    "agents' wire"
                ),
            ) from exc
        probe.close()

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
            self._unreachable.discard(node)
            stale = self._endpoints.pop(node, None)
            self._transports.pop(node, None)
        if stale is not None:
            stale.close()
        if self.config.eager_endpoints or not self.tcp:
            # Without TCP a peer on another host may be out of every transport's reach:
            # ucp_ep_create says so at once (no network I/O), and such a peer is offered no
            # GET (its bytes come over the wire).
            try:
                self._endpoint(node)
            except UcxError as exc:
                if exc.fields.get("status") == int(UcsStatus.ERR_UNREACHABLE):
                    with self._lock:
                        self._unreachable.add(node)
                    _log.info("ray_velo: no UCX transport reaches node %s: %s", node, exc)
                else:  # a hint only: the first GET wires up lazily instead
                    _log.info("eager endpoint to %s failed; wiring up lazily", node, exc_info=True)

    def peer_registered(self, node: str, worker_id: int | None = None) -> bool:
        """Whether UCX is registered for that peer (and that incarnation, if given)."""
        with self._lock:
            if node not in self._peer_addresses or node in self._unreachable:
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
