"""The owner's short handlers served over TCP to other nodes' agents (frames:
:mod:`ray_velo.protocol.frames`).

Each request runs as its own task, so a slow one (waiting for a commit, on a thread) never
holds up the others on the connection; answers go back in the order they finish, matched by
call id. The listening address is published in Ray's KV under the agent's worker id, which a
consumer reads once per owner: an owner without it (an older version, or the wire turned
off) is called with Ray calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ray_velo.protocol.frames import (
    HEADER,
    MAX_FRAME_BYTES,
    decode_request,
    encode_answer,
    encode_error,
)

__all__ = ["WIRE_DISABLE_ENV", "WireServer"]

#: Set to 1 in an agent's environment to serve no TCP wire (peers use Ray calls).
WIRE_DISABLE_ENV = "VELO_PEER_WIRE_DISABLE"

_log = logging.getLogger(__name__)


class WireServer:
    """Listens on ``host`` (an ephemeral port); runs ``dispatch(method, message)``."""

    def __init__(self, host: str, dispatch: Callable[[str, bytes], Awaitable[Any]]) -> None:
        self.host = host
        self.port = 0
        self._dispatch = dispatch
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.calls = 0  # requests served, for ray-velo status and the tests

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
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
        finally:
            self._writers.discard(writer)
            writer.close()

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
