"""The consumer side of a fetch (DESIGN.md's transfer.py; renamed so that the module does not
shadow the public ``ray_velo.transfer`` decorator): calls to an owner under one deadline, and chunked pulls.

Every call to an owner goes through :func:`call_owner`, which bounds it by the fetch's
deadline and maps Ray's errors to ours once, here: a dead owner actor or node is
:class:`OwnerDied`, a timeout is :class:`TransferTimeout`, and an error the owner raised
(``HandleNotFound``, ``LeaseNotFound``...) comes back as itself, not wrapped.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
from ray import exceptions as ray_errors

from ray_velo.errors import OwnerDied, TransferTimeout, VeloError
from ray_velo.protocol import DataHandle, PullRequest, encode

__all__ = ["Deadline", "call_owner", "clear_ray_frames", "map_ray_error", "pull_chunks"]


def clear_ray_frames(exc: BaseException) -> None:
    """Drop the locals of the finished frames in a Ray error's traceback.

    ``ray.get`` frames keep the error itself in their locals, a cycle that keeps every
    caller frame alive (through ``f_back``) until the cyclic GC runs: a caller's zero-copy
    view, and with it a read lease, would outlive the caller. Clearing the finished frames
    breaks the cycle at once.
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]


@dataclass(frozen=True, slots=True)
class Deadline:
    """A fetch's bound: ``at`` (monotonic seconds) or None, and which bound it is."""

    at: float | None
    timeout_s: float | None
    bound: str

    @classmethod
    def start(cls, timeout_s: float | None, bound: str = "fetch timeout") -> Deadline:
        at = None if timeout_s is None else time.monotonic() + timeout_s
        return cls(at, timeout_s, bound)

    def remaining(self) -> float | None:
        return None if self.at is None else max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at

    def budget_ms(self) -> int:
        """What is left, rounded up to whole ms, for the wire (0 = unbounded)."""
        left = self.remaining()
        return 0 if left is None else max(1, int(np.ceil(left * 1000)))

    def timeout_error(self, handle: DataHandle) -> TransferTimeout:
        return TransferTimeout(handle=str(handle), timeout_s=self.timeout_s, bound=self.bound)


def map_ray_error(exc: BaseException, handle: DataHandle, node: str) -> BaseException:
    """Our error for a Ray error met while talking to ``handle``'s owner on ``node``."""
    if isinstance(exc, ray_errors.RayTaskError):
        cause = exc.cause
        if isinstance(cause, VeloError):
            return cause
        return VeloError(f"owner of handle {handle} on node {node} failed: {cause!r}")
    if isinstance(exc, (ray_errors.RayActorError, ray_errors.NodeDiedError)):
        return OwnerDied(handle=str(handle), node=node)
    if isinstance(exc, (ray_errors.ObjectLostError, ray_errors.OwnerDiedError)):
        return OwnerDied(handle=str(handle), node=node)
    return exc


def call_owner(ref: Any, deadline: Deadline, handle: DataHandle, node: str) -> Any:
    """``ray.get(ref)`` within the deadline, with Ray's errors mapped to ours."""
    try:
        return ray.get(ref, timeout=deadline.remaining())
    except ray_errors.GetTimeoutError as exc:
        clear_ray_frames(exc)
        ray.cancel(ref)
        raise deadline.timeout_error(handle) from exc
    except ray_errors.RayError as exc:
        clear_ray_frames(exc)
        mapped = map_ray_error(exc, handle, node)
        if mapped is exc:
            raise
        raise mapped from exc


def pull_chunks(
    owner: Any,
    handle: DataHandle,
    node: str,
    transfer_id: int,
    chunk_size: int,
    chunk_count: int,
    total_len: int,
    dest: memoryview,
    in_flight: int,
    deadline: Deadline,
) -> None:
    """Pull ``chunk_count`` chunks into ``dest``, keeping ``in_flight`` pulls outstanding.

    Chunks land as they complete, in any order; each is copied once into ``dest`` and its
    Ray object dropped at once so the object store does not fill up.
    """
    target = np.frombuffer(dest, dtype=np.uint8, count=total_len) if total_len else None
    pending: dict[Any, int] = {}
    next_index = 0
    try:
        while next_index < chunk_count or pending:
            while next_index < chunk_count and len(pending) < in_flight:
                ref = owner._rv_pull.remote(encode(PullRequest(transfer_id, next_index)))
                pending[ref] = next_index
                next_index += 1
            done, _ = ray.wait(list(pending), num_returns=1, timeout=deadline.remaining())
            if not done:
                raise deadline.timeout_error(handle)
            for ref in done:
                index = pending.pop(ref)
                chunk = call_owner(ref, deadline, handle, node)
                start = index * chunk_size
                expected = min(chunk_size, total_len - start)
                if len(chunk) != expected or target is None:
                    raise VeloError(
                        f"owner of {handle} sent {len(chunk)} bytes for chunk {index}, "
                        f"expected {expected}"
                    )
                np.copyto(target[start : start + expected], chunk)
                del chunk
    finally:
        for ref in pending:
            ray.cancel(ref)
