"""How a consumer reaches one owner: the :class:`OwnerLink` interface and its Ray form.

The fetch driver talks to an owner only through an :class:`OwnerLink`: a synchronous call
bounded by the fetch's deadline, a fire-and-forget send (lease ends, renewals), and the
chunked pulls. :class:`RayOwnerLink` carries them as Ray actor calls to the owner's agent;
``ray_velo.testing`` carries them to an owner in the same process.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import numpy as np

from ray_velo.consumer.deadline import Deadline
from ray_velo.errors import VeloError
from ray_velo.protocol import (
    AcquireRequest,
    DataHandle,
    PullRequest,
    Rdma,
    Ready,
    decode_acquire_response,
    encode,
)

__all__ = ["Blocking", "OwnerLink", "RayOwnerLink", "acquire", "check_chunk", "inline"]

T = TypeVar("T")
#: Runs a blocking call off the event loop: ``await blocking(fn, *args)``.
Blocking = Callable[..., Awaitable[Any]]


class OwnerLink(Protocol):
    """One owner, as a consumer sees it."""

    node: str

    def call(self, method: str, message: bytes, deadline: Deadline, handle: DataHandle) -> Any:
        """Run handler ``method`` on the owner and wait for its answer within ``deadline``.

        Raises:
            OwnerDied: the owner (or its node) is gone.
            TransferTimeout: no answer in time.
            VeloError: what the owner raised (HandleNotFound, HandleReleased...).
        """
        ...

    def send(self, method: str, message: bytes) -> None:
        """Run handler ``method`` without waiting (lease ends, renewals); never raises."""
        ...

    async def call_async(
        self, method: str, message: bytes, deadline: Deadline, handle: DataHandle
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
    data = await link.call_async("_rv_acquire", encode(request), deadline, request.handle)
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

    def call(self, method: str, message: bytes, deadline: Deadline, handle: DataHandle) -> Any:
        from ray_velo.calls import wait

        ref = getattr(self.actor, method).remote(message)
        return wait(
            ref,
            deadline.remaining(),
            peer="owner",
            on_timeout=lambda: deadline.timeout_error(handle),
            handle=handle,
            node=self.node,
            cancel=True,
        )

    def send(self, method: str, message: bytes) -> None:
        try:
            getattr(self.actor, method).remote(message)
        except Exception:  # the owner may be gone; the fetch says so elsewhere
            return

    def ucx_address(self, deadline: Deadline) -> tuple[int, bytes | None]:
        from ray_velo.calls import wait

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
        self, method: str, message: bytes, deadline: Deadline, handle: DataHandle
    ) -> Any:
        from ray_velo.calls import wait_async

        return await wait_async(
            lambda: getattr(self.actor, method).remote(message),
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
            return await self.call_async("_rv_pull", message, deadline, handle)

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
