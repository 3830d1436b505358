"""How a consumer reaches one owner: the :class:`OwnerLink` interface (calls, notices, pulls) and
its Ray form."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import numpy as np

from ray_velo.agent.clock import Deadline
from ray_velo.errors import OwnerDied, VeloError, WireAuthError
from ray_velo.protocol import (
    AcquireRequest,
    DataHandle,
    PullRequest,
    Rdma,
    Ready,
    decode_acquire_response,
    encode,
)
from ray_velo.protocol.entry import RV_ACQUIRE, RV_PULL, Entry
from ray_velo.protocol.frames import HEADER, decode_answer, encode_request
from ray_velo.wire.auth import WireAuth

__all__ = [
    "Blocking",
    "OwnerLink",
    "RayOwnerLink",
    "WireOwnerLink",
    "acquire",
    "check_chunk",
    "inline",
]

T = TypeVar("T")
#: Bound on opening the TCP link to an owner (then Ray calls are used instead).
_CONNECT_TIMEOUT_S = 2.0
#: Runs a blocking call off the event loop: ``await blocking(fn, *args)``.
Blocking = Callable[..., Awaitable[Any]]


class OwnerLink(Protocol):
    """One owner, as a consumer sees it."""

    node: str

    def call(self, entry: Entry, message: bytes, deadline: Deadline, handle: DataHandle) -> Any:
        """Run the owner's handler ``entry`` and wait for its answer within ``deadline``.

        Raises:
            OwnerDied: the owner (or its node) is gone.
            TransferTimeout: no answer in time.
            VeloError: what the owner raised (HandleNotFound, HandleReleased...).
        """
        ...

    def send(self, entry: Entry, message: bytes) -> None:
        """Run the owner's handler ``entry`` without waiting (lease ends, renewals); never raises."""
        ...

    async def call_async(
        self, entry: Entry, message: bytes, deadline: Deadline, handle: DataHandle
    ) -> Any:
        """:meth:`call`, awaited: the waiting holds no thread."""
        ...

    async def pull(
        self,
        answer: Ready,
        dest: memoryview,
        in_flight: int,
        deadline: Deadline,
        handle: DataHandle,
        blocking: Blocking,
    ) -> None:
        """Pull every chunk of ``answer`` into ``dest``, ``in_flight`` at a time; copies run
        through ``blocking`` (off the event loop)."""
        ...

    def ucx_address(self, deadline: Deadline) -> tuple[int, bytes | None]:
        """(the owner's worker id, its UCX worker address or None without UCX)."""
        ...


async def acquire(link: OwnerLink, request: AcquireRequest, deadline: Deadline) -> Ready | Rdma:
    """``_rv_acquire`` on ``link``, its answer decoded."""
    data = await link.call_async(RV_ACQUIRE, encode(request), deadline, request.handle)
    return decode_acquire_response(data)


async def inline(fn: Callable[..., T], *args: Any) -> T:
    """A :data:`Blocking` that runs ``fn`` right here (no event loop to keep free)."""
    return fn(*args)


def check_chunk(chunk: Any, index: int, answer: Ready, handle: DataHandle) -> int:
    """The offset of chunk ``index`` in the payload, after checking its length."""
    start = index * answer.chunk_size
    expected = min(answer.chunk_size, answer.total_len - start)
    if len(chunk) != expected:
        raise VeloError(
            f"owner of {handle} sent {len(chunk)} bytes for chunk {index}, expected {expected}"
        )
    return start


class RayOwnerLink:
    """An owner agent reached with Ray actor calls."""

    def __init__(self, actor: Any, node: str) -> None:
        self.actor = actor
        self.node = node

    def call(self, entry: Entry, message: bytes, deadline: Deadline, handle: DataHandle) -> Any:
        from ray_velo.agent.calls import wait

        ref = getattr(self.actor, entry.name).remote(message)
        return wait(
            ref,
            deadline.remaining(),
            peer="owner",
            on_timeout=lambda: deadline.timeout_error(handle),
            handle=handle,
            node=self.node,
            cancel=True,
        )

    def send(self, entry: Entry, message: bytes) -> None:
        try:
            getattr(self.actor, entry.name).remote(message)
        except Exception:  # the owner may be gone; the fetch says so elsewhere
            return

    def ucx_address(self, deadline: Deadline) -> tuple[int, bytes | None]:
        from ray_velo.agent.calls import wait

        ref = self.actor.ucx_address.remote()
        worker_id, address = wait(
            ref,
            deadline.remaining(),
            peer="owner",
            on_timeout=lambda: deadline.timeout_error("?"),
            node=self.node,
            cancel=True,
        )
        return int(worker_id), address

    async def call_async(
        self, entry: Entry, message: bytes, deadline: Deadline, handle: DataHandle
    ) -> Any:
        from ray_velo.agent.calls import wait_async

        return await wait_async(
            lambda: getattr(self.actor, entry.name).remote(message),
            deadline.remaining,
            peer="owner",
            on_timeout=lambda: deadline.timeout_error(handle),
            handle=handle,
            node=self.node,
        )

    async def pull(
        self,
        answer: Ready,
        dest: memoryview,
        in_flight: int,
        deadline: Deadline,
        handle: DataHandle,
        blocking: Blocking,
    ) -> None:
        """Chunks land as they complete, in any order; each is copied once into ``dest``
        (off the event loop) and its Ray object dropped at once, so the object store does
        not fill up."""
        target = np.frombuffer(dest, dtype=np.uint8, count=answer.total_len)
        pending: dict[asyncio.Future[Any], int] = {}
        next_index = 0

        async def one(index: int) -> Any:
            message = encode(PullRequest(answer.transfer_id, index))
            return await self.call_async(RV_PULL, message, deadline, handle)

        try:
            while next_index < answer.chunk_count or pending:
                while next_index < answer.chunk_count and len(pending) < in_flight:
                    pending[asyncio.ensure_future(one(next_index))] = next_index
                    next_index += 1
                done, _ = await asyncio.wait(list(pending), return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    index = pending.pop(task)
                    chunk = task.result()
                    start = check_chunk(chunk, index, answer, handle)
                    await blocking(np.copyto, target[start : start + len(chunk)], chunk)
                    del chunk
        finally:
            for task in pending:
                task.cancel()


class WireOwnerLink:
    """An owner agent reached over TCP for its short handlers (:data:`WIRE_METHODS`), and
    with Ray calls for the rest (pulls, synchronous calls) and whenever the TCP connection
    cannot be made (an owner without the wire: an older version, or a closed port).

    One connection, opened on the event loop by the first call and shared by every fetch:
    calls are matched to answers by id. Nothing is sent on it before the owner proved it
    holds the cluster's secret (``auth``); an owner that fails is never called there again
    (Ray calls, which Ray authenticates, from then on). A connection that breaks fails its
    calls with OwnerDied (the agent is gone, or the link is: the fetch retries once on a
    fresh link).
    """

    def __init__(self, ray_link: RayOwnerLink, address: str, auth: WireAuth) -> None:
        self.ray = ray_link
        self.node = ray_link.node
        self.address = address
        self.auth = auth
        self.disabled = False  # the connection failed: Ray calls from now on
        self._loop: asyncio.AbstractEventLoop | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._connecting: asyncio.Lock | None = None
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count(1)
        self._reading: asyncio.Future[None] | None = None

    def call(self, entry: Entry, message: bytes, deadline: Deadline, handle: DataHandle) -> Any:
        """Over the connection when it is open and this is not its loop's thread (an agent
        thread in a GET asking for windows), else a Ray call."""
        loop = self._loop
        if entry.wire is not None and self._writer is not None and loop is not None:
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is not loop and not loop.is_closed():
                call = self.call_async(entry, message, deadline, handle)
                try:
                    future = asyncio.run_coroutine_threadsafe(call, loop)
                except RuntimeError:  # the loop closed meanwhile
                    call.close()
                else:
                    return future.result()
        return self.ray.call(entry, message, deadline, handle)

    def ucx_address(self, deadline: Deadline) -> tuple[int, bytes | None]:
        return self.ray.ucx_address(deadline)

    async def pull(
        self,
        answer: Ready,
        dest: memoryview,
        in_flight: int,
        deadline: Deadline,
        handle: DataHandle,
        blocking: Blocking,
    ) -> None:
        await self.ray.pull(answer, dest, in_flight, deadline, handle, blocking)

    def send(self, entry: Entry, message: bytes) -> None:
        loop, writer = self._loop, self._writer
        if entry.wire is None or loop is None or writer is None or loop.is_closed():
            self.ray.send(entry, message)
            return
        frame = encode_request(entry.name, 0, message)
        try:
            loop.call_soon_threadsafe(self._write_or_ray, writer, frame, entry, message)
        except RuntimeError:  # the loop closed meanwhile
            self.ray.send(entry, message)

    def _write_or_ray(
        self, writer: asyncio.StreamWriter, frame: bytes, entry: Entry, message: bytes
    ) -> None:
        if writer.is_closing():
            self.ray.send(entry, message)
        else:
            writer.write(frame)

    async def call_async(
        self, entry: Entry, message: bytes, deadline: Deadline, handle: DataHandle
    ) -> Any:
        if entry.wire is None or not await self._connected(deadline):
            return await self.ray.call_async(entry, message, deadline, handle)
        assert self._writer is not None
        call_id = next(self._ids)
        answer = asyncio.get_running_loop().create_future()
        self._pending[call_id] = answer
        try:
            self._writer.write(encode_request(entry.name, call_id, message))
            ok, value = await asyncio.wait_for(answer, deadline.remaining())
        except asyncio.TimeoutError:
            raise deadline.timeout_error(handle) from None
        except ConnectionError:
            raise OwnerDied(handle=str(handle), node=self.node) from None
        finally:
            self._pending.pop(call_id, None)
        if not ok:
            raise value
        return value

    async def _connected(self, deadline: Deadline) -> bool:
        """Whether the connection is up (opened now if need be); False: use Ray calls."""
        if self.disabled:
            return False
        if self._writer is not None and not self._writer.is_closing():
            return True
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._writer is not None and not self._writer.is_closing():
                return True
            host, _, port = self.address.rpartition(":")
            left = deadline.remaining()
            try:
                reader, writer = await asyncio.wait_for(
                    self.auth.connect(host, int(port)),
                    min(_CONNECT_TIMEOUT_S, left) if left is not None else _CONNECT_TIMEOUT_S,
                )
            except WireAuthError as exc:  # not an agent of this cluster: never again
                self.auth.refused(exc)
                self.disabled = True
                return False
            except (OSError, asyncio.TimeoutError, ValueError):
                self.disabled = True  # Ray calls say whether the owner is alive
                return False
            self._loop, self._writer = asyncio.get_running_loop(), writer
            self._reading = asyncio.ensure_future(self._read_answers(reader, writer))
            return True

    async def _read_answers(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            while True:
                length, status, call_id = HEADER.unpack(await reader.readexactly(HEADER.size))
                body = await reader.readexactly(length - (HEADER.size - 4))
                answer = self._pending.get(call_id)
                if answer is None or answer.done():
                    continue  # its caller gave up
                try:
                    answer.set_result(decode_answer(status, body))
                except VeloError as exc:  # a malformed answer
                    answer.set_result((False, exc))
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()
            if self._writer is writer:
                self._writer = None
            for answer in list(self._pending.values()):
                if not answer.done():
                    answer.set_exception(ConnectionError("the owner's agent closed the link"))

    def close(self) -> None:
        """Close the connection (its calls fail as OwnerDied)."""
        writer, self._writer = self._writer, None
        loop = self._loop
        if writer is not None and loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(writer.close)
