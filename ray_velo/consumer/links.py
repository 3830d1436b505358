"""How a consumer reaches one owner: the :class:`OwnerLink` interface and its Ray form.

The fetch driver talks to an owner only through an :class:`OwnerLink`: a synchronous call
bounded by the fetch's deadline, a fire-and-forget send (lease ends, renewals), and the
chunked pulls. :class:`RayOwnerLink` carries them as Ray actor calls to the owner's agent;
``ray_velo.testing`` carries them to an owner in the same process.
"""

from __future__ import annotations

from typing import Any, Protocol

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

__all__ = ["OwnerLink", "RayOwnerLink", "check_chunk"]


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

    def pull(
        self,
        answer: Ready,
        dest: memoryview,
        in_flight: int,
        deadline: Deadline,
        handle: DataHandle,
    ) -> None:
        """Pull every chunk of ``answer`` into ``dest``, ``in_flight`` at a time."""
        ...

    def ucx_address(self, deadline: Deadline) -> tuple[int, bytes | None]:
        """(the owner's worker id, its UCX worker address or None without UCX)."""
        ...


def acquire(link: OwnerLink, request: AcquireRequest, deadline: Deadline) -> Ready | Rdma:
    """``_rv_acquire`` on ``link``, its answer decoded."""
    data = link.call("_rv_acquire", encode(request), deadline, request.handle)
    return decode_acquire_response(data)


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

    def pull(
        self,
        answer: Ready,
        dest: memoryview,
        in_flight: int,
        deadline: Deadline,
        handle: DataHandle,
    ) -> None:
        """Chunks land as they complete, in any order; each is copied once into ``dest``
        and its Ray object dropped at once, so the object store does not fill up."""
        import ray

        from ray_velo.calls import wait

        target = np.frombuffer(dest, dtype=np.uint8, count=answer.total_len)
        pending: dict[Any, int] = {}
        next_index = 0
        try:
            while next_index < answer.chunk_count or pending:
                while next_index < answer.chunk_count and len(pending) < in_flight:
                    message = encode(PullRequest(answer.transfer_id, next_index))
                    pending[self.actor._rv_pull.remote(message)] = next_index
                    next_index += 1
                done, _ = ray.wait(list(pending), num_returns=1, timeout=deadline.remaining())
                if not done:
                    raise deadline.timeout_error(handle)
                for ref in done:
                    index = pending.pop(ref)
                    chunk = wait(
                        ref,
                        deadline.remaining(),
                        peer="owner",
                        on_timeout=lambda: deadline.timeout_error(handle),
                        handle=handle,
                        node=self.node,
                    )
                    start = check_chunk(chunk, index, answer, handle)
                    np.copyto(target[start : start + len(chunk)], chunk)
                    del chunk
        finally:
            for ref in pending:
                ray.cancel(ref)
