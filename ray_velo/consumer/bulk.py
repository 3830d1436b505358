"""The consumer's end of the bulk reads on the agents' wire: ranges of a leased payload
received straight into their destination (docs/architecture.md §13).

Connections are authenticated once (the owner proves the cluster's secret before anything
is sent; TLS under ``RAY_USE_TLS=1``) and kept per owner for the next read. A range of at
least ``stripe_min_bytes`` is split over ``streams`` connections read at once, for a link
one TCP stream does not fill. Every wait is bounded twice: by the fetch's own bound and by
:data:`READ_STALL_S` without a byte (a sender that stopped, a half-open link).
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from ray_velo.errors import ProtocolError, VeloError, WireReadError
from ray_velo.protocol.bulk import HEADER, decode_sending, encode_read
from ray_velo.protocol.frames import MAX_FRAME_BYTES
from ray_velo.protocol.handle import DataHandle
from ray_velo.protocol.messages import ReadRequest
from ray_velo.wire.auth import WireAuth, keep_alive
from ray_velo.wire.bulk import abort
from ray_velo.wire.io import receive_exactly

__all__ = ["READ_STALL_S", "STRIPE_ALIGN", "BulkReader", "RangeReader", "WireSource", "stripes"]

#: A read that receives no byte for this long fails (and the fetch falls back to chunks).
READ_STALL_S = 10.0
#: Stripes start at multiples of this (whole pages of the destination).
STRIPE_ALIGN = 1 << 20
#: Idle connections kept per owner.
_IDLE_PER_ADDRESS = 8


@dataclass(frozen=True, slots=True)
class WireSource:
    """Where the wire path reads a payload from: the agent at ``address`` (its bulk port)
    sends ``handle``'s bytes under ``lease_id`` (a wire lease on its slot; with ``copy``, a
    relay lease on its copy of another owner's payload). What a descriptor is to a GET."""

    address: str
    handle: DataHandle
    lease_id: int
    copy: bool = False


class RangeReader(Protocol):
    """What a fetch reads bulk ranges with (:class:`BulkReader`, or a fault test's wrapper)."""

    @property
    def reads(self) -> int:
        """Reads done."""
        ...

    def read(
        self, address: str, request: ReadRequest, dest: memoryview, timeout_s: float
    ) -> None: ...

    def close(self) -> None: ...


def stripes(start: int, stop: int, count: int) -> list[tuple[int, int]]:
    """``[start, stop)`` cut into at most ``count`` ranges of about equal size, each cut at a
    multiple of :data:`STRIPE_ALIGN` from ``start``."""
    total = stop - start
    count = max(1, min(count, total // STRIPE_ALIGN))
    size = -(-total // count // STRIPE_ALIGN) * STRIPE_ALIGN
    return [(at, min(stop, at + size)) for at in range(start, stop, size)]


class BulkReader:
    """Reads leased ranges from other agents' bulk ports, for one agent's fetches (called
    from its threads; thread-safe)."""

    def __init__(
        self,
        auth: WireAuth,
        *,
        streams: int = 1,
        stripe_min_bytes: int = 64 << 20,
        stall_s: float = READ_STALL_S,
    ) -> None:
        self.auth = auth
        self.streams = streams
        self.stripe_min_bytes = stripe_min_bytes
        self.stall_s = stall_s
        self._lock = threading.Lock()
        self._idle: dict[str, list[socket.socket]] = {}
        self._ids = itertools.count(1)
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        #: Reads done and bytes received (``ray-velo status``, the tests).
        self.reads = 0
        self.bytes_read = 0

    def read(self, address: str, request: ReadRequest, dest: memoryview, timeout_s: float) -> None:
        """Receive bytes ``[request.start, request.stop)`` from the agent at ``address`` into
        ``dest`` (exactly that many bytes), within ``timeout_s``.

        Raises:
            WireReadError: the connection failed, stalled or ended early; ``dest`` may hold
                some of the bytes, none of them vouched for.
            WireAuthError: the agent there failed the handshake.
            VeloError: the owner refused the read (LeaseNotFound: the lease ended...).
        """
        nbytes = request.stop - request.start
        if len(dest) != nbytes:
            raise ValueError(f"a {len(dest)}-byte destination for {nbytes} bytes")
        until = time.monotonic() + timeout_s
        if self.streams <= 1 or nbytes < self.stripe_min_bytes:
            self._read_one(address, request, dest, until)
            return
        ranges = stripes(request.start, request.stop, self.streams)
        pool = self._executor()
        futures: list[Future[None]] = []
        for start, stop in ranges[1:]:
            part = _part(request, start, stop)
            view = dest[start - request.start : stop - request.start]
            futures.append(pool.submit(self._read_one, address, part, view, until))
        first = ranges[0]
        try:
            self._read_one(address, _part(request, *first), dest[: first[1] - first[0]], until)
        finally:
            errors = [f.exception() for f in futures]  # waits: no stripe outlives the read
        for error in errors:
            if error is not None:
                raise error

    def _read_one(self, address: str, request: ReadRequest, dest: memoryview, until: float) -> None:
        """One range on one connection; a kept connection the owner closed meanwhile (it
        idles them out) is replaced once, before any byte of the answer came."""
        for fresh in (False, True):
            sock, reused = self._take(address, request, until, fresh)
            try:
                self._exchange(sock, request, dest, until)
            except VeloError:
                self._give(address, sock)  # the owner answered: the connection is sound
                raise
            except (OSError, ProtocolError, _Short) as exc:
                abort(sock)
                # a kept connection the owner closed fails at once, before any answer
                if reused and not fresh and isinstance(exc, (ConnectionError, BrokenPipeError)):
                    continue
                got = exc.got if isinstance(exc, _Short) else 0
                raise WireReadError(
                    handle=str(request.handle),
                    peer=address,
                    start=request.start,
                    stop=request.stop,
                    got=got,
                    reason=_why(exc),
                ) from exc
            self._give(address, sock)
            with self._lock:
                self.reads += 1
                self.bytes_read += len(dest)
            return

    def _exchange(
        self, sock: socket.socket, request: ReadRequest, dest: memoryview, until: float
    ) -> None:
        """Send the request and receive the answer into ``dest`` (a failure before the
        answer's header arrived raises as OSError, after it as _Short)."""
        sock.settimeout(self._wait(until))
        sock.sendall(encode_read(next(self._ids), request))
        length, status, _ = HEADER.unpack(self._receive(sock, HEADER.size, until))
        if not HEADER.size - 4 <= length <= MAX_FRAME_BYTES:
            raise ProtocolError(f"a bulk answer frame of {length} bytes")
        body = self._receive(sock, length - (HEADER.size - 4), until)
        nbytes = decode_sending(length, status, body)
        if nbytes != len(dest):
            raise ProtocolError(f"the owner announced {nbytes} bytes for a {len(dest)}-byte read")
        got = 0
        try:
            while got < nbytes:
                sock.settimeout(self._wait(until))
                n = sock.recv_into(dest[got:], nbytes - got)
                if n == 0:
                    raise ConnectionResetError("the sender closed the connection")
                got += n
        except OSError as exc:
            raise _Short(str(exc) or type(exc).__name__, got) from exc

    def _wait(self, until: float) -> float:
        left = until - time.monotonic()
        if left <= 0:
            raise TimeoutError("the fetch's bound ran out")
        return min(left, self.stall_s)

    def _receive(self, sock: socket.socket, size: int, until: float) -> bytes:
        sock.settimeout(self._wait(until))
        return receive_exactly(sock, size)

    # --- connections -------------------------------------------------------------------

    def _take(
        self, address: str, request: ReadRequest, until: float, fresh: bool
    ) -> tuple[socket.socket, bool]:
        """A connection to ``address`` and whether it was kept from an earlier read."""
        if not fresh:
            with self._lock:
                idle = self._idle.get(address)
                if idle:
                    return idle.pop(), True
        try:
            sock = self.auth.connect_blocking(address, max(0.001, until - time.monotonic()))
        except OSError as exc:
            raise WireReadError(
                handle=str(request.handle),
                peer=address,
                start=request.start,
                stop=request.stop,
                got=0,
                reason=f"no connection: {exc}",
            ) from exc
        keep_alive(sock)
        return sock, False

    def _give(self, address: str, sock: socket.socket) -> None:
        with self._lock:
            idle = self._idle.setdefault(address, [])
            if not self._closed and len(idle) < _IDLE_PER_ADDRESS:
                idle.append(sock)
                return
        sock.close()

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=max(1, self.streams - 1) * 8,
                    thread_name_prefix="ray_velo-bulk-read",
                )
            return self._pool

    def forget(self, address: str) -> None:
        """Close the kept connections to ``address`` (its agent is gone)."""
        with self._lock:
            idle = self._idle.pop(address, [])
        for sock in idle:
            sock.close()

    def close(self) -> None:
        """Close every kept connection and the stripes' threads (the agent shuts down)."""
        with self._lock:
            self._closed = True
            idle = [s for socks in self._idle.values() for s in socks]
            self._idle.clear()
            pool, self._pool = self._pool, None
        for sock in idle:
            with contextlib.suppress(OSError):
                sock.close()
        if pool is not None:
            pool.shutdown(wait=True)


class _Short(Exception):
    """The answer's bytes stopped coming after ``got`` of them."""

    def __init__(self, why: str, got: int) -> None:
        super().__init__(why)
        self.got = got


def _part(request: ReadRequest, start: int, stop: int) -> ReadRequest:
    return ReadRequest(request.handle, request.lease_id, start, stop, request.copy)


def _why(exc: BaseException) -> str:
    if isinstance(exc, _Short):
        cause = exc.__cause__
        if isinstance(cause, (TimeoutError, socket.timeout)):
            return "the bytes stopped coming: " + _why(cause)
        return f"the bytes stopped coming ({exc.args[0]})"
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return str(exc) if str(exc) != "timed out" else "no byte within the read's bound"
    return str(exc) or type(exc).__name__
