"""The owner's bulk port: payload bytes sent to other nodes' agents over authenticated TCP
connections, one thread per connection (docs/architecture.md §13, docs/deployment.md §8).

Why threads and a port of its own: a send moves up to gigabytes with blocking ``send`` calls
that release the GIL (the kernel copies straight out of the arena's shared memory), and
under TLS the ``ssl`` module encrypts on the same thread; none of it may run on the agent's
event loop, which answers the short handlers. Every connection proves the cluster's secret
first (:meth:`WireAuth.accept_blocking`, TLS with Ray's certificates under
``RAY_USE_TLS=1``); a peer that does not is closed with nothing read past its handshake.

Bounds: at most :data:`MAX_PENDING_HANDSHAKES` handshakes wait at once (a new connection
beyond them drops the oldest, as on the control wire), at most :data:`MAX_CONNECTIONS`
authenticated connections live (a consumer keeps a few per owner), a connection idle for
:data:`IDLE_S` is closed, and a send that moves no byte for :data:`SEND_STALL_S` (a reader
that stopped reading) is aborted: its thread and the bytes it held go back.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Protocol

from ray_velo.errors import ProtocolError, VeloError, WireAuthError
from ray_velo.protocol.bulk import (
    HEADER,
    decode_read,
    encode_error,
    encode_sending,
)
from ray_velo.protocol.frames import MAX_FRAME_BYTES
from ray_velo.protocol.messages import ReadRequest
from ray_velo.wire.auth import HANDSHAKE_TIMEOUT_S, WireAuth, keep_alive
from ray_velo.wire.io import receive_exactly

__all__ = [
    "IDLE_S",
    "MAX_CONNECTIONS",
    "MAX_PENDING_HANDSHAKES",
    "SEND_STALL_S",
    "BulkServer",
    "Send",
    "abort",
]

#: Handshakes in progress at once; a new connection beyond it drops the oldest.
MAX_PENDING_HANDSHAKES = 64
#: Authenticated connections at once; one beyond is closed (its consumer reads by chunks).
MAX_CONNECTIONS = 256
#: A connection with no request for this long is closed (its consumer opens a new one).
IDLE_S = 120.0
#: A send that moves no byte for this long is aborted (its reader stopped reading).
SEND_STALL_S = 10.0

_log = logging.getLogger(__name__)


class Send(Protocol):
    """One read being served: its pieces, each checked just before it goes (the lease still
    holds), and ``close`` once done or abandoned (the bytes it held may go)."""

    def pieces(self) -> Iterator[memoryview]:
        """The range's bytes, in order. Raises a VeloError to stop mid-range."""
        ...

    def close(self) -> None: ...


#: Opens the send a request asks for (raises a VeloError to refuse it: the consumer gets it).
Opener = Callable[[ReadRequest], Send]


def abort(sock: socket.socket) -> None:
    """Close ``sock`` with a reset: unsent bytes are dropped, so the reader sees the range
    end early (never a byte queued after a lease ended)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class BulkServer:
    """Listens on ``host`` (``port`` 0: an ephemeral one); serves the reads of each
    authenticated connection with ``open_send``."""

    def __init__(
        self,
        host: str,
        auth: WireAuth,
        open_send: Opener,
        *,
        port: int = 0,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        max_pending: int = MAX_PENDING_HANDSHAKES,
        max_connections: int = MAX_CONNECTIONS,
        idle_s: float = IDLE_S,
        send_stall_s: float = SEND_STALL_S,
    ) -> None:
        self.host = host
        self.auth = auth
        self._open_send = open_send
        self._handshake_timeout_s = handshake_timeout_s
        self._max_pending = max_pending
        self._max_connections = max_connections
        self._idle_s = idle_s
        self._send_stall_s = send_stall_s
        self._lock = threading.Lock()
        self._pending: OrderedDict[socket.socket, None] = OrderedDict()
        self._serving: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._closed = False
        self._listener = socket.create_server((host, port), backlog=128)
        self.port: int = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(
            target=self._accept_loop, name=f"ray_velo-bulk-{self.port}", daemon=True
        )
        #: Reads served, bytes sent, sends stopped mid-range, connections refused for the
        #: connection bound (``ray-velo status``, the tests).
        self.reads = 0
        self.bytes_sent = 0
        self.aborted = 0
        self.refused = 0
        self._acceptor.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._serving)

    # --- accepting -------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    abort(sock)
                    return
                if len(self._pending) >= self._max_pending:
                    oldest, _ = self._pending.popitem(last=False)
                    self.auth.refused(WireAuthError(reason="dropped", peer=_peer(oldest)))
                    with contextlib.suppress(OSError):
                        oldest.shutdown(socket.SHUT_RDWR)  # its thread's read fails
                self._pending[sock] = None
                thread = threading.Thread(
                    target=self._connection, args=(sock,), name="ray_velo-bulk-send", daemon=True
                )
                self._threads.add(thread)
                thread.start()  # under the lock: close() joins only threads that started

    def _connection(self, raw: socket.socket) -> None:
        sock: socket.socket | None = None
        try:
            sock = self._authenticated(raw)
            if sock is not None:
                self._serve(sock)
        finally:
            with self._lock:
                self._pending.pop(raw, None)
                if sock is not None:
                    self._serving.discard(sock)
                self._threads.discard(threading.current_thread())
            for each in {raw, sock} - {None}:
                with contextlib.suppress(OSError):
                    each.close()  # type: ignore[union-attr]

    def _authenticated(self, raw: socket.socket) -> socket.socket | None:
        """The connection once its peer proved the secret (None: refused and counted)."""
        try:
            sock = self.auth.accept_blocking(raw, self._handshake_timeout_s)
        except WireAuthError as exc:
            with self._lock:
                dropped = raw not in self._pending  # dropped for a newer one: counted then
            if not dropped and not self._closed:
                self.auth.refused(exc)
            return None
        with self._lock:
            self._pending.pop(raw, None)
            if self._closed or len(self._serving) >= self._max_connections:
                self.refused += not self._closed
                return None
            self._serving.add(sock)
        keep_alive(sock)
        return sock

    # --- serving ---------------------------------------------------------------------

    def _serve(self, sock: socket.socket) -> None:
        """Reads, one after another, until the peer closes, idles out, or breaks a rule."""
        while not self._closed:
            sock.settimeout(self._idle_s)
            try:
                length, kind, call_id = HEADER.unpack(receive_exactly(sock, HEADER.size))
                if not HEADER.size - 4 <= length <= MAX_FRAME_BYTES:
                    _log.warning("ray_velo: a bulk peer sent a %d-byte frame; closing", length)
                    return
                body = receive_exactly(sock, length - (HEADER.size - 4))
                request = decode_read(length, kind, body)
            except (OSError, ConnectionError, ProtocolError):
                return  # closed, idle, or not speaking the protocol: nothing more to say
            sock.settimeout(self._send_stall_s)
            if not self._one(sock, call_id, request):
                abort(sock)
                return

    def _one(self, sock: socket.socket, call_id: int, request: ReadRequest) -> bool:
        """Serve one read; False when the connection must be reset (stopped mid-range)."""
        try:
            send = self._open_send(request)
        except VeloError as exc:
            try:
                sock.sendall(encode_error(call_id, exc))
            except OSError:
                return False
            return True
        sent = 0
        try:
            sock.sendall(encode_sending(call_id, request.stop - request.start))
            for piece in send.pieces():
                sock.sendall(piece)
                sent += len(piece)
        except (OSError, VeloError) as exc:
            with self._lock:
                self.aborted += 1
                self.bytes_sent += sent
            if not self._closed:
                _log.info(
                    "ray_velo: bulk read of %s stopped after %d bytes: %s",
                    request.handle,
                    sent,
                    exc,
                )
            return False
        finally:
            send.close()
        with self._lock:
            self.reads += 1
            self.bytes_sent += sent
        return True

    # --- closing ---------------------------------------------------------------------

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop listening, reset every connection (sends in progress stop mid-range), and
        wait for their threads."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            socks = [*self._pending, *self._serving]
            threads = list(self._threads)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._acceptor.join(timeout_s)
        for thread in threads:
            thread.join(timeout_s)


def _peer(sock: socket.socket) -> str:
    try:
        name = sock.getpeername()
    except OSError:
        return "?"
    return f"{name[0]}:{name[1]}"
