"""The seam between an agent and its RDMA transport: :class:`RdmaBackend`, which UCX, the fake and
the faulty backend implement, held to it by type checking (in :mod:`ray_velo.testing`, the
layer that sees all three) (docs/architecture.md §2)."""

from __future__ import annotations

from typing import Protocol

from ray_velo.memory.pool import Registrar, Registration
from ray_velo.protocol.descriptor import RdmaDescriptor

__all__ = ["RdmaBackend"]


class RdmaBackend(Protocol):
    """An agent's RDMA transport. Thread-safe."""

    @property
    def registrar(self) -> Registrar:
        """Registers memory ranges for GETs by peers (and into this agent's memory)."""
        ...

    @property
    def address(self) -> bytes:
        """This agent's worker address, for peers to create endpoints to it."""
        ...

    @property
    def endpoints_reaped(self) -> int:
        """Idle endpoints closed so far."""
        ...

    def register_peer(self, node: str, worker_id: int, address: bytes) -> None:
        """Learn the worker address of agent ``worker_id`` on ``node``."""
        ...

    def peer_registered(self, node: str, worker_id: int | None = None) -> bool:
        """Whether ``node``'s agent (that incarnation, when given) is known."""
        ...

    def descriptor(
        self, registration: Registration | None, address: int, nbytes: int
    ) -> bytes | None:
        """The descriptor of ``nbytes`` at ``address`` inside ``registration``, or None when
        that memory is no longer registered (the owner's eighth check)."""
        ...

    def decode(self, blob: bytes, expected_len: int) -> RdmaDescriptor:
        """A peer's descriptor, checked for this consumer. Raises DescriptorError."""
        ...

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
        """GET bytes ``[start, stop)`` of ``descriptor`` from ``node`` to the same offsets
        from ``dest_address``. Raises UcxError (``destination_unsafe`` when the destination
        may still be written)."""
        ...

    def endpoint_count(self) -> int: ...

    def transports(self) -> dict[str, list[str]]:
        """The UCX transports each peer's endpoint uses."""
        ...

    def reap_idle_endpoints(self, now: float) -> int: ...

    def next_reap_due(self, now: float) -> float | None: ...

    def close(self) -> None: ...
