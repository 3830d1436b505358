"""Faults for ray_velo's fault tests, wrapped around an agent's real parts (its RDMA backend,
its reader of other agents' bulk ports, its sends, its handlers) when the agent is built,
never inside them, and only in an agent built with a
:class:`FaultPlan` (``VeloConfig(fault_injection=True)``, or ``ray_velo.testing``'s
``AgentPair``); its ``inject_fault`` entry arms them (docs/architecture.md §12)."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from ray_velo.consumer.bulk import RangeReader
from ray_velo.errors import ConfigError, UcxError, WireReadError
from ray_velo.memory.pool import Registrar, Registration
from ray_velo.protocol.descriptor import RdmaDescriptor
from ray_velo.protocol.messages import ReadRequest
from ray_velo.wire.bulk import Opener, Send

if TYPE_CHECKING:
    from collections.abc import Iterator

    from ray_velo.agent.backend import RdmaBackend
    from ray_velo.owner.service import OwnerService

__all__ = [
    "FAULTS",
    "FaultPlan",
    "FaultyRdma",
    "FaultyReader",
    "SlowPulls",
    "StalledSends",
    "fault_injection_off",
]

#: Every fault a plan knows (docs/architecture.md §12 says what each does).
FAULTS = (
    "corrupt_descriptors",
    "stall_before_get_s",
    "fail_gets",
    "copy_piece_pause_s",
    "slow_pulls_s",
    "stall_sends_s",
)
#: The faults that act on an agent's GETs or reads (its RDMA backend, its bulk reader).
GET_FAULTS = frozenset({"stall_before_get_s", "fail_gets", "copy_piece_pause_s"})
#: The faults only an RDMA backend has.
RDMA_FAULTS = frozenset({"corrupt_descriptors"})


def fault_injection_off() -> ConfigError:
    """What ``inject_fault`` raises in an agent built without faults (every production one)."""
    return ConfigError(
        field="fault_injection",
        value=False,
        rule="this agent was built without faults: they are for ray_velo's own fault tests "
        "(VeloConfig(fault_injection=True) before the agents start, or ray_velo.testing)",
    )


class FaultPlan:
    """The armed faults of one agent: counts (``take``) and durations (``seconds``); none
    armed, the wrappers pass everything through."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = {}

    def arm(self, name: str, value: float, *, with_rdma: bool, with_reads: bool = False) -> None:
        """Arm fault ``name`` (a count or seconds; 0 disarms it). ``with_reads``: the agent
        reads other agents' bulk ports (the GET faults act on those reads too).

        Raises:
            ValueError: an unknown fault, or one for a part the agent does not have.
        """
        if name not in FAULTS:
            raise ValueError(f"unknown fault {name!r} (known: {', '.join(FAULTS)})")
        if name in RDMA_FAULTS and not with_rdma:
            raise ValueError(f"fault {name!r} needs an agent with RDMA")
        if name in GET_FAULTS and not (with_rdma or with_reads):
            raise ValueError(f"fault {name!r} needs an agent with RDMA or the wire")
        with self._lock:
            self._values[name] = value

    def take(self, name: str) -> bool:
        """Consume one count of ``name`` (False when none is armed)."""
        with self._lock:
            left = self._values.get(name, 0)
            if left <= 0:
                return False
            self._values[name] = left - 1
            return True

    def seconds(self, name: str) -> float:
        with self._lock:
            return self._values.get(name, 0.0)


class FaultyRdma:
    """An :class:`~ray_velo.agent.backend.RdmaBackend` that passes every call to ``inner`` but
    where the plan says otherwise (docs/architecture.md §12)."""

    def __init__(self, inner: RdmaBackend, plan: FaultPlan) -> None:
        self.inner = inner
        self.plan = plan

    @property
    def registrar(self) -> Registrar:
        return self.inner.registrar

    @property
    def address(self) -> bytes:
        return self.inner.address

    @property
    def endpoints_reaped(self) -> int:
        return self.inner.endpoints_reaped

    def register_peer(self, node: str, worker_id: int, address: bytes) -> None:
        self.inner.register_peer(node, worker_id, address)

    def peer_registered(self, node: str, worker_id: int | None = None) -> bool:
        return self.inner.peer_registered(node, worker_id)

    def descriptor(
        self, registration: Registration | None, address: int, nbytes: int
    ) -> bytes | None:
        blob = self.inner.descriptor(registration, address, nbytes)
        if blob and self.plan.take("corrupt_descriptors"):
            blob += b"\x00"  # a trailing byte: decode must refuse it
        return blob

    def decode(self, blob: bytes, expected_len: int) -> RdmaDescriptor:
        return self.inner.decode(blob, expected_len)

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
        stall = self.plan.seconds("stall_before_get_s")
        if stall > 0 and start == 0:  # once per fetch: its first GET
            time.sleep(stall)
        pause = self.plan.seconds("copy_piece_pause_s")
        if pause > 0 and start > 0:  # the pieces before this one landed (and were told)
            time.sleep(pause)
        if self.plan.take("fail_gets"):
            raise UcxError(operation="ucp_get_nbx", status=-3, status_text="injected failure")
        self.inner.get(
            node, descriptor, dest_address, timeout_s, local_registration, start=start, stop=stop
        )

    def endpoint_count(self) -> int:
        return self.inner.endpoint_count()

    def transports(self) -> dict[str, list[str]]:
        return self.inner.transports()

    def reap_idle_endpoints(self, now: float) -> int:
        return self.inner.reap_idle_endpoints(now)

    def next_reap_due(self, now: float) -> float | None:
        return self.inner.next_reap_due(now)

    def close(self) -> None:
        self.inner.close()


class FaultyReader:
    """A :class:`~ray_velo.consumer.bulk.RangeReader` with the GET faults: a fetch's first
    read stalls ``stall_before_get_s``, a copy's later pieces land ``copy_piece_pause_s``
    later, and the next ``fail_gets`` reads fail as a broken connection's would."""

    def __init__(self, inner: RangeReader, plan: FaultPlan) -> None:
        self.inner = inner
        self.plan = plan

    def read(self, address: str, request: ReadRequest, dest: memoryview, timeout_s: float) -> None:
        stall = self.plan.seconds("stall_before_get_s")
        if stall > 0 and request.start == 0:  # once per fetch: its first read
            time.sleep(stall)
        pause = self.plan.seconds("copy_piece_pause_s")
        if pause > 0 and request.start > 0:
            time.sleep(pause)
        if self.plan.take("fail_gets"):
            raise WireReadError(
                handle=str(request.handle),
                peer=address,
                start=request.start,
                stop=request.stop,
                got=0,
                reason="injected failure",
            )
        self.inner.read(address, request, dest, timeout_s)

    @property
    def reads(self) -> int:
        return self.inner.reads

    def close(self) -> None:
        self.inner.close()


class StalledSends:
    """The owner's sends over the wire, each stopping ``stall_sends_s`` after its first
    piece: a sender that stalls mid-range, as its reader sees it."""

    def __init__(self, inner: Opener, plan: FaultPlan) -> None:
        self.inner = inner
        self.plan = plan

    def open(self, request: ReadRequest) -> Send:
        return _StalledSend(self.inner(request), self.plan)


class _StalledSend:
    def __init__(self, inner: Send, plan: FaultPlan) -> None:
        self.inner = inner
        self.plan = plan

    def pieces(self) -> Iterator[memoryview]:
        for index, piece in enumerate(self.inner.pieces()):
            stall = self.plan.seconds("stall_sends_s")
            if index == 1 and stall > 0:
                time.sleep(stall)
            yield piece

    def close(self) -> None:
        self.inner.close()


class SlowPulls:
    """The owner's handlers, each chunk (``_rv_pull``) answered ``slow_pulls_s`` later."""

    def __init__(self, inner: OwnerService, plan: FaultPlan) -> None:
        self.inner = inner
        self.plan = plan

    def _rv_pull(self, data: bytes) -> Any:
        slow = self.plan.seconds("slow_pulls_s")
        if slow > 0:
            time.sleep(slow)
        return self.inner._rv_pull(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
