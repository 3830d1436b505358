"""The node's fast lane: a process's calls and notices to its own agent over a Unix socket
(docs/architecture.md §7, docs/tuning.md "The control plane")."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import re
import socket
import struct
import tempfile
import threading
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from ray_velo.errors import AgentDied, VeloError
from ray_velo.memory.arena import pid_alive
from ray_velo.protocol.entry import CHANNEL_CALLS, CHANNEL_NOTICES, ORDERED_NOTICES

__all__ = [
    "CHANNEL_METHODS",
    "DISABLE_ENV",
    "MAX_CONNECTIONS",
    "NOTICE_METHODS",
    "AgentChannel",
    "ChannelFull",
    "ChannelServer",
    "peer_uid",
    "remove_stale_sockets",
    "socket_path",
]

#: The agent calls that travel over the socket: the ones a producer or reader waits for;
#: the calls nobody waits for, sent over the socket too (a Ray call's submission costs the
#: sender about as much as a socket round trip, and a commit is on the producer's path); and
#: of those the short changes of the agent's state, run in order with the calls of their
#: connection (a put's commit lands before the same thread's next fetch of it; the others may
#: wait on a peer, and run beside them: ORDERED_NOTICES). Declared in ray_velo.protocol.entry.
CHANNEL_METHODS = CHANNEL_CALLS
NOTICE_METHODS = CHANNEL_NOTICES
#: Connections one process holds to its agent at most (one per thread that calls it): the
#: threads beyond make Ray calls (at most about that many threads call at once, usually).
MAX_CONNECTIONS = 64
#: Set to 1 in an agent's environment to serve no socket (every call is a Ray call).
DISABLE_ENV = "VELO_LOCAL_SOCKET_DISABLE"
_log = logging.getLogger(__name__)
_HEADER = struct.Struct("!I")
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_MAX_FRAME = 64 << 20  # a sane bound on one message (they are a few hundred bytes)
_CLOSE_WAIT_S = 2.0  # bound on the connections' tasks ending at close
_NOTICE_SEND_S = 5.0  # bound on sending a notice (a few hundred bytes to a live agent)
_PATH_MAX = 100  # sun_path holds 108 bytes on Linux
_SOCKET_RE = re.compile(r"^ray_velo_agent-(\d+)-[0-9a-f]{16}\.sock$")


def socket_path(directory: str, pid: int, tag: int) -> str:
    """Where agent ``tag`` (pid ``pid``) listens: its shm directory, or the temporary
    directory when that path would not fit a socket address."""
    name = f"ray_velo_agent-{pid}-{tag:016x}.sock"
    path = os.path.join(directory, name)
    if len(path.encode()) > _PATH_MAX:
        path = os.path.join(tempfile.gettempdir(), name)
    return path


def remove_stale_sockets(directory: str) -> list[str]:
    """Remove the socket files of dead agents (a crashed agent leaves its file behind)."""
    removed = []
    for folder in {directory, tempfile.gettempdir()}:
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(folder):
                match = _SOCKET_RE.match(entry.name)
                if match and not pid_alive(int(match.group(1))):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
                        removed.append(entry.path)
    return removed


def _frame(value: Any) -> bytes:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def peer_uid(sock: socket.socket) -> int | None:
    """The user id of the process at the other end of a Unix socket (None: not known)."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return None
    _pid, uid, _gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, option, _PEERCRED.size))
    return int(uid)


class ChannelServer:
    """The agent's side: serves :data:`CHANNEL_METHODS` through ``dispatch`` on its loop, to
    processes of this agent's own user only; ``on_refusal()`` counts any other."""

    def __init__(
        self,
        path: str,
        dispatch: Callable[[str, tuple[Any, ...]], Awaitable[Any]],
        on_refusal: Callable[[], None] = lambda: None,
    ):
        self.path = path
        self._dispatch = dispatch
        self._on_refusal = on_refusal
        self._warned_uids: set[int] = set()
        self._server: asyncio.AbstractServer | None = None
        self._busy: set[asyncio.StreamWriter] = set()  # a call in progress
        self._notices: set[asyncio.Future[Any]] = set()
        #: Each open connection and the task serving it.
        self._serving: dict[asyncio.StreamWriter, asyncio.Task[Any]] = {}
        self.calls = 0  # answered, for ray-velo status and the tests

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        old_mask = os.umask(0o177)  # 0600 from the start, no window
        try:
            self._server = await asyncio.start_unix_server(self._serve, self.path)
        finally:
            os.umask(old_mask)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._own_user(writer):
            writer.close()
            return
        serving = asyncio.current_task()
        assert serving is not None  # asyncio runs each connection as a task
        self._serving[writer] = serving
        try:
            while True:
                (length,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
                if length > _MAX_FRAME:
                    return
                frame = await reader.readexactly(length)
                try:
                    method, args, reply = pickle.loads(frame)
                except Exception:  # not a frame of ours: drop the connection, keep serving
                    _log.warning("ray_velo: a malformed frame on the agent's socket; closed")
                    return
                if not reply:  # a notice: its outcome is not sent
                    task = self._notice(method, args)
                    if task is not None and method in ORDERED_NOTICES:
                        await asyncio.wait([task])
                    continue
                self._busy.add(writer)
                try:
                    answer = await self._answer(method, args)
                finally:
                    self._busy.discard(writer)
                if writer.is_closing():
                    return  # closed under the call: it was answered with the closing error
                writer.write(answer)
                self.calls += 1
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return  # the process closed its end (or died)
        finally:
            self._serving.pop(writer, None)
            writer.close()

    def _own_user(self, writer: asyncio.StreamWriter) -> bool:
        """Whether the connecting process runs as this agent's user (else counted, and its
        uid logged once)."""
        sock = writer.get_extra_info("socket")
        try:
            uid = -1 if sock is None else peer_uid(sock)
        except OSError:  # the kernel cannot say who it is: not served
            uid = -1
        if uid is None:  # no SO_PEERCRED (not Linux): the file's mode alone guards it
            return True
        if uid == os.geteuid():
            return True
        self._on_refusal()
        if uid not in self._warned_uids and len(self._warned_uids) < 1024:
            self._warned_uids.add(uid)
            _log.warning(
                "ray_velo: a process of uid %d connected to the agent's socket %s; closed "
                "unread (only uid %d, the agent's own, is served)", uid, self.path, os.geteuid(),
            )  # fmt: skip
        return False

    def _notice(self, method: str, args: tuple[Any, ...]) -> asyncio.Future[Any] | None:
        if method not in NOTICE_METHODS:
            _log.warning("ray_velo: %r is not a notice; dropped", method)
            return None
        task = asyncio.ensure_future(self._dispatch(method, args))
        self._notices.add(task)
        task.add_done_callback(self._notice_done)
        return task

    def _notice_done(self, task: asyncio.Future[Any]) -> None:
        self._notices.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # nobody waits for a notice: what it met (a lease already reaped...) is logged
            _log.debug("ray_velo: a notice failed: %r", task.exception())
        self.calls += 1

    async def _answer(self, method: str, args: tuple[Any, ...]) -> bytes:
        try:
            if method not in CHANNEL_METHODS:
                raise ValueError(f"{method!r} is not served over the agent's socket")
            return _frame((True, await self._dispatch(method, args)))
        except Exception as exc:
            try:
                return _frame((False, exc))
            except Exception:  # an error that does not pickle: say what it was
                return _frame((False, VeloError(f"this node's agent failed: {exc!r}")))

    async def close(self, error: BaseException) -> None:
        """Stop listening, answer every call still in progress with ``error`` (the agent
        shut down under it: the caller must not retry on this agent), close every
        connection, remove the socket file."""
        if self._server is not None:
            self._server.close()
            self._server = None
        idle = []
        for writer, serving in list(self._serving.items()):
            if writer in self._busy:  # its call ends on its own; its answer is not written
                writer.write(_frame((False, error)))
            else:
                idle.append(serving)
            writer.close()
        if idle:  # each ends as soon as it sees its connection closed
            await asyncio.wait(idle, timeout=_CLOSE_WAIT_S)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class ChannelFull(Exception):
    """This process holds :data:`MAX_CONNECTIONS` connections already: the calling thread
    makes a Ray call instead (nothing was sent). Never reaches a user."""


class _Connection:
    """A thread's connection, in its thread-local storage: when the thread ends and this is
    collected, the socket is closed and the process's slot given back."""

    def __init__(self, sock: socket.socket, sockets: dict[int, socket.socket]) -> None:
        self.sock = sock
        weakref.finalize(self, _close, sock, sockets)


def _close(sock: socket.socket, sockets: dict[int, socket.socket]) -> None:
    sockets.pop(id(sock), None)
    with contextlib.suppress(OSError):
        sock.close()


class AgentChannel:
    """A process's side: one connection per thread to its agent's socket (at most
    ``max_connections`` of them at once)."""

    def __init__(self, path: str, max_connections: int = 0) -> None:
        """``max_connections``: at most this many at once (0: :data:`MAX_CONNECTIONS`)."""
        self.path = path
        self.max_connections = max_connections or MAX_CONNECTIONS
        self._local = threading.local()
        self._lock = threading.Lock()
        self._sockets: dict[int, socket.socket] = {}  # id -> each live thread's connection
        self._pid = os.getpid()

    def call(
        self, method: str, args: tuple[Any, ...], timeout_s: float | None,
        on_timeout: Callable[[], BaseException],
    ) -> Any:  # fmt: skip
        """Run ``method(*args)`` on the agent; what it raised is raised here.

        Raises:
            AgentDied: the agent is gone (the socket refused, reset or closed).
            ChannelFull: this thread has no connection and the process may open no more.
            what ``on_timeout()`` builds: no answer within ``timeout_s`` seconds.
        """
        sock = self._socket()
        self._local.busy = True
        try:
            sock.settimeout(timeout_s)
            sock.sendall(_frame((method, args, True)))
            (length,) = _HEADER.unpack(_receive(sock, _HEADER.size))
            ok, value = pickle.loads(_receive(sock, length))
        except TimeoutError:
            self._drop(sock)  # its answer may still come: never read it as another's
            raise on_timeout() from None
        except (OSError, EOFError) as exc:
            self._drop(sock)
            raise AgentDied() from exc
        finally:
            self._local.busy = False
        if not ok:
            try:
                raise value
            finally:
                value = None  # no cycle through this frame keeps the caller's frames alive
        return value

    def notify(self, method: str, args: tuple[Any, ...]) -> bool:
        """Send ``method(*args)`` without waiting (:data:`NOTICE_METHODS`). False when it
        could not be sent here (the agent is gone, or this thread is inside a call on its
        connection: a finalizer run by the garbage collector mid-call); the caller then
        sends it as a Ray call. Never raises."""
        if getattr(self._local, "busy", False):
            return False
        self._local.busy = True
        try:
            sock = self._socket()
            sock.settimeout(_NOTICE_SEND_S)
            sock.sendall(_frame((method, args, False)))
            return True
        except Exception:  # AgentDied, ChannelFull, OSError: the Ray call says the rest
            connection: _Connection | None = getattr(self._local, "connection", None)
            if connection is not None:
                self._drop(connection.sock)
            return False
        finally:
            self._local.busy = False

    def _socket(self) -> socket.socket:
        if os.getpid() != self._pid:  # a forked child: its parent's connections are not its own
            self._local = threading.local()
            self._sockets = {}
            self._pid = os.getpid()
        connection: _Connection | None = getattr(self._local, "connection", None)
        if connection is not None:
            return connection.sock
        with self._lock:
            if len(self._sockets) >= self.max_connections:
                raise ChannelFull()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sockets[id(sock)] = sock
        try:
            sock.connect(self.path)
        except OSError as exc:
            _close(sock, self._sockets)
            raise AgentDied() from exc
        self._local.connection = _Connection(sock, self._sockets)
        return sock

    @property
    def connections(self) -> int:
        """Connections open now (one per thread that called, until it ends)."""
        return len(self._sockets)

    def _drop(self, sock: socket.socket) -> None:
        self._local.connection = None
        _close(sock, self._sockets)

    def close(self) -> None:
        """Close every thread's connection (the session ends)."""
        with self._lock:
            sockets, self._sockets = list(self._sockets.values()), {}
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()


def _receive(sock: socket.socket, nbytes: int) -> bytes:
    chunks, left = [], nbytes
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("the agent closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
