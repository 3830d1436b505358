"""A clock you move by hand, Ray's job table as a set, and an RDMA backend that "GETs" with
``memmove``."""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any

from ray_velo.agent.clock import Clock
from ray_velo.errors import DescriptorError, UcxError
from ray_velo.memory.pool import NoopRegistrar, Registration
from ray_velo.protocol.descriptor import BACKEND_UCX, RdmaDescriptor
from ray_velo.ucx.status import UcsStatus

__all__ = ["FakeClock", "FakeJobs", "FakeRdma"]


class FakeClock(Clock):
    """An agent's clock whose seconds pass only when told to (:meth:`advance`)."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._lock = threading.Lock()
        super().__init__(self._read)

    def _read(self) -> float:
        with self._lock:
            return self._now

    @contextlib.contextmanager
    def passing(self, rate: float = 1.0) -> Iterator[None]:
        """Let time pass while the block runs, ``rate`` seconds for each real one: for a call
        bounded on the agent's clock that the test does not step through (a shutdown with
        leases nobody ends runs to its bound)."""
        stop = threading.Event()

        def run() -> None:
            last = time.monotonic()
            while not stop.wait(0.01):
                now = time.monotonic()
                self.advance((now - last) * rate)
                last = now

        thread = threading.Thread(target=run, name="ray_velo-fake-clock", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def advance(self, seconds: float) -> float:
        """Move time ``seconds`` forward; returns the new time."""
        if seconds < 0:
            raise ValueError(f"time does not go back ({seconds} s)")
        with self._lock:
            self._now += seconds
            return self._now


class FakeJobs:
    """Ray's job table for agents without Ray: jobs are alive until :meth:`end` ends them.

    ``asked`` records each look (the jobs asked about), so a test sees when agents look;
    ``fail`` makes the next N looks fail as an unreachable GCS would.
    """

    def __init__(self) -> None:
        self.ended: set[str] = set()
        self.asked: list[set[str]] = []
        self.fail = 0

    def end(self, job: str) -> None:
        """Job ``job``'s driver is gone: the table says so from now on."""
        self.ended.add(job)

    def dead(self, jobs: Any) -> set[str]:
        self.asked.append(set(jobs))
        if self.fail > 0:
            self.fail -= 1
            raise ConnectionError("the fake GCS is unreachable")
        return set(jobs) & self.ended


class FakeRdma:
    """The agent's RDMA registry without UCX, for agents in one process.

    Registrations are bookkeeping (:class:`~ray_velo.memory.pool.NoopRegistrar`); a
    descriptor names the owner's address; a GET copies from that address in this process.
    Faults, each for the next N GETs: ``fail_gets`` (the transport fails: ``get_failed``),
    ``unsafe_gets`` (it fails and UCX may still write the destination), ``stalled_gets``
    (it runs past the fetch's deadline, moving ``clock`` on by ``stall_s``, and may still
    write the destination: the quarantine case).
    """

    backend = "ucx"

    def __init__(self, clock: FakeClock | None = None, stall_s: float = 3600.0) -> None:
        self.registrar = NoopRegistrar()
        self.address = b"fake-ucx-worker-address"
        self.clock = clock
        self.stall_s = stall_s
        self.fail_gets = 0
        self.unsafe_gets = 0
        self.stalled_gets = 0
        self.gets = 0
        self.endpoints_reaped = 0
        self._peers: dict[str, int] = {}
        self._generation = itertools.count(1)
        self._lock = threading.Lock()

    # --- peers -----------------------------------------------------------------------

    def register_peer(self, node: str, worker_id: int, address: bytes) -> None:
        with self._lock:
            self._peers[node] = worker_id

    def peer_registered(self, node: str, worker_id: int | None = None) -> bool:
        with self._lock:
            known = self._peers.get(node)
        return known is not None and (worker_id is None or known == worker_id)

    # --- owner side --------------------------------------------------------------------

    def descriptor(
        self, registration: Registration | None, address: int, nbytes: int
    ) -> bytes | None:
        if registration is None or nbytes <= 0:
            return None
        start, end = registration.effective_range
        if not (start <= address and address + nbytes <= end):
            return None
        return RdmaDescriptor(
            generation=next(self._generation),
            addr=address,
            length=nbytes,
            rkey=b"fake-rkey",
            backend=BACKEND_UCX,
        ).encode()

    # --- consumer side -----------------------------------------------------------------

    @staticmethod
    def decode(blob: bytes, expected_len: int) -> RdmaDescriptor:
        descriptor = RdmaDescriptor.decode(blob)
        if descriptor.length != expected_len:
            raise DescriptorError(
                reason=f"descriptor length {descriptor.length} != total_len {expected_len}"
            )
        return descriptor

    def _take(self, name: str) -> bool:
        with self._lock:
            left = getattr(self, name)
            if left <= 0:
                return False
            setattr(self, name, left - 1)
            return True

    def get(
        self,
        node: str,
        descriptor: RdmaDescriptor,
        dest_address: int,
        timeout_s: float,
        local_registration: Any = None,
        *,
        start: int = 0,
        stop: int | None = None,
    ) -> None:
        """Copy the descriptor's bytes (``[start, stop)`` of them) to the same offsets from
        ``dest_address``, unless a fault says otherwise."""
        self.gets += 1
        if self._take("fail_gets"):
            raise _failed("injected transport failure", unsafe=False)
        if self._take("unsafe_gets"):
            raise _failed("injected failure; the destination may still be written", unsafe=True)
        if self._take("stalled_gets"):
            if self.clock is not None:
                self.clock.advance(self.stall_s)
            raise _failed("injected stall past the deadline", unsafe=True)
        stop = descriptor.length if stop is None else stop
        ctypes.memmove(dest_address + start, descriptor.addr + start, stop - start)

    # --- what an agent asks of its backend otherwise -----------------------------------

    def endpoint_count(self) -> int:
        return len(self._peers)

    def transports(self) -> dict[str, list[str]]:
        return {node: ["fake/memmove"] for node in self._peers}

    def reap_idle_endpoints(self, now: float) -> int:
        return 0

    def next_reap_due(self, now: float) -> float | None:
        return None

    def close(self) -> None:
        return None


def _failed(why: str, *, unsafe: bool) -> UcxError:
    status = int(UcsStatus.ERR_TIMED_OUT)
    return UcxError(
        operation="ucp_get_nbx", status=status, status_text=why, destination_unsafe=unsafe
    )
