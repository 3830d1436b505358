"""The owner's short handlers served over TCP to other nodes' agents, each connection
authenticated first (docs/architecture.md §13)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from ray_velo.errors import WireAuthError
from ray_velo.protocol.frames import (
    HEADER,
    MAX_FRAME_BYTES,
    decode_request,
    encode_answer,
    encode_error,
)
from ray_velo.wire.auth import HANDSHAKE_TIMEOUT_S, WireAuth, peer_address

__all__ = ["MAX_PENDING_HANDSHAKES", "WIRE_DISABLE_ENV", "WireServer"]

#: Set to 1 in an agent's environment to serve no TCP wire (peers use Ray calls).
WIRE_DISABLE_ENV = "VELO_PEER_WIRE_DISABLE"
#: Handshakes in progress at once; a new connection beyond it drops the oldest.
MAX_PENDING_HANDSHAKES = 64

_log = logging.getLogger(__name__)


class WireServer:
    """Listens on ``host`` (an ephemeral port); authenticates each peer with ``auth``, then
    runs ``dispatch(method, message)`` for its frames."""

    def __init__(
        self,
        host: str,
        dispatch: Callable[[str, bytes], Awaitable[Any]],
        auth: WireAuth,
        *,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        max_pending: int = MAX_PENDING_HANDSHAKES,
    ) -> None:
        self.host = host
        self.port = 0
        self.auth = auth
        self._dispatch = dispatch
        self._handshake_timeout_s = handshake_timeout_s
        self._max_pending = max_pending
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        #: Connections still in their handshake, oldest first, with the task serving each.
        self._pending: OrderedDict[asyncio.StreamWriter, asyncio.Task[Any]] = OrderedDict()
        self.calls = 0  # requests served, for ray-velo status and the tests
        self.peers = 0  # connections that passed the handshake

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        tls = self.auth.tls is not None

        def connection() -> asyncio.StreamReaderProtocol:
            return _Connection(asyncio.StreamReader(loop=loop), self.serve_connection, hold=tls)

        self._server = await loop.create_server(connection, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def serve_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """One connection, handshake first (the listener's callback; tests call it on
        in-memory streams)."""
        self._writers.add(writer)
        try:
            if not await self._authenticated(reader, writer):
                return
            self.peers += 1
            await self._frames(reader, writer)
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _authenticated(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Whether the peer passed the handshake (a failure is counted and the caller closes
        the connection)."""
        task = asyncio.current_task()
        assert task is not None  # asyncio runs each connection as a task
        if len(self._pending) >= self._max_pending:
            oldest, waiting = self._pending.popitem(last=False)
            self.auth.refused(WireAuthError(reason="dropped", peer=peer_address(oldest)))
            waiting.cancel()
        self._pending[writer] = task
        try:
            await asyncio.wait_for(self.auth.accept(reader, writer), self._handshake_timeout_s)
            return True
        except asyncio.TimeoutError:
            self.auth.refused(WireAuthError(reason="silent", peer=peer_address(writer)))
        except WireAuthError as exc:
            self.auth.refused(exc)
        except asyncio.CancelledError:
            if self._pending.get(writer) is task:  # not dropped for a newer one: closing
                raise
            if hasattr(task, "uncancel"):  # dropped (and counted): this task ends normally
                task.uncancel()
        finally:
            if self._pending.get(writer) is task:
                del self._pending[writer]
        return False

    async def _frames(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                length, kind, call_id = HEADER.unpack(await reader.readexactly(HEADER.size))
                body_len = length - (HEADER.size - 4)
                if not 0 <= body_len <= MAX_FRAME_BYTES:
                    _log.warning("ray_velo: a peer sent a %d-byte frame; closing it", length)
                    return
                body = await reader.readexactly(body_len)
                task = asyncio.ensure_future(self._one(writer, kind, call_id, body))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except (asyncio.IncompleteReadError, ConnectionError):
            return  # the peer closed (or died)

    async def _one(
        self, writer: asyncio.StreamWriter, kind: int, call_id: int, body: bytes
    ) -> None:
        self.calls += 1
        try:
            answer = encode_answer(call_id, await self._dispatch(decode_request(kind, body), body))
        except Exception as exc:
            answer = encode_error(call_id, exc)
        if call_id and not writer.is_closing():
            writer.write(answer)

    @property
    def pending_handshakes(self) -> int:
        return len(self._pending)

    async def close(self) -> None:
        """Stop listening and close every connection."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._tasks, return_exceptions=True)


class _Connection(asyncio.StreamReaderProtocol):
    """A connection as ``asyncio.start_server`` makes it, but with ``hold`` read nothing
    until the TLS upgrade: a consumer's first TLS bytes that a plain stream read first would
    be lost to the TLS layer, and its handshake would hang."""

    def __init__(self, reader: asyncio.StreamReader, serve: Any, *, hold: bool) -> None:
        super().__init__(reader, serve)
        self._hold = hold

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self._hold and isinstance(transport, asyncio.ReadTransport):
            transport.pause_reading()  # resumed by the TLS upgrade (loop.start_tls)
        super().connection_made(transport)
