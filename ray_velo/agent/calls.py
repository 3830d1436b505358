"""Waiting on Ray calls: one bound per wait, and the one map from Ray's errors to ours
(docs/architecture.md §9)."""

from __future__ import annotations

import asyncio
import contextlib
import traceback
from collections.abc import Callable
from typing import Any, Literal

import ray
from ray import exceptions as ray_errors

from ray_velo.errors import AgentDied, OwnerDied, OwnerUnreachable, VeloError

__all__ = ["Peer", "clear_ray_frames", "map_ray_error", "wait", "wait_async"]

Peer = Literal["agent", "owner"]


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


def map_ray_error(
    exc: BaseException, *, peer: Peer, handle: object = None, node: str | None = None
) -> BaseException:
    """Our error for a Ray error met while calling ``peer`` (about ``handle`` on ``node``)."""
    if isinstance(exc, ray_errors.RayTaskError):
        cause = exc.cause
        if isinstance(cause, VeloError):
            return cause
        whom = "this node's agent" if peer == "agent" else f"owner of {handle} on node {node}"
        return VeloError(f"{whom} failed: {cause!r}")
    if isinstance(exc, ray_errors.ActorUnavailableError):  # a RayActorError, but not death
        if peer == "agent":
            return AgentDied()
        return OwnerUnreachable(handle=str(handle), node=node)
    dead = (
        ray_errors.RayActorError,
        ray_errors.NodeDiedError,
        ray_errors.ObjectLostError,
        ray_errors.OwnerDiedError,
    )
    if isinstance(exc, dead):
        if peer == "agent":
            return AgentDied()
        return OwnerDied(handle=str(handle), node=node)
    return exc


def wait(
    ref: Any,
    timeout_s: float | None,
    *,
    peer: Peer,
    on_timeout: Callable[[], BaseException],
    handle: object = None,
    node: str | None = None,
    cancel: bool = False,
) -> Any:
    """``ray.get(ref)`` within ``timeout_s`` seconds (None: unbounded), Ray's errors mapped.

    ``cancel``: cancel the call when the wait runs out (an owner call nobody waits for any
    more must not keep a slot of the owner's threads).
    """
    cause: BaseException | None = None
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray_errors.GetTimeoutError as exc:
        clear_ray_frames(exc)
        if cancel:
            ray.cancel(ref)
        error: BaseException | None = on_timeout()
    except ray_errors.RayError as exc:
        clear_ray_frames(exc)
        error = map_ray_error(exc, peer=peer, handle=handle, node=node)
        if error is exc:
            raise
        if not isinstance(exc, ray_errors.RayTaskError):
            cause = exc
    # Raised outside the except clause, and the locals dropped on the way out: no cycle
    # (error -> traceback -> this frame -> error, or error -> context -> Ray's error ->
    # cause -> error) keeps the caller's frames, and a view (its lease) in them, alive.
    try:
        raise error from cause  # type: ignore[misc]
    finally:
        error = cause = None


async def wait_async(
    submit: Callable[[], Any],
    remaining: Callable[[], float | None],
    *,
    peer: Peer,
    on_timeout: Callable[[], BaseException],
    handle: object = None,
    node: str | None = None,
) -> Any:
    """Await the call ``submit()`` makes, within what ``remaining()`` says is left, Ray's
    errors mapped as :func:`wait` does, without holding a thread while it waits.

    A callee Ray reports *unavailable* (stalled or restarting, not dead) is called again,
    every 0.5 s, until the bound runs out (then ``on_timeout()``), so a stalled owner ends
    the fetch with the caller's timeout and a dead one with OwnerDied.
    """
    while True:
        ref = submit()
        left = remaining()
        try:
            return await asyncio.wait_for(asyncio.wrap_future(ref.future()), left)
        except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            with contextlib.suppress(Exception):
                ray.cancel(ref)
            error: BaseException | None = on_timeout()
            cause: BaseException | None = None
        except ray_errors.ActorUnavailableError as exc:
            clear_ray_frames(exc)
            left = remaining()
            if left is None or left > 0:
                await asyncio.sleep(0.5 if left is None else min(0.5, left))
                continue
            error, cause = on_timeout(), None
        except ray_errors.RayError as exc:
            clear_ray_frames(exc)
            error = map_ray_error(exc, peer=peer, handle=handle, node=node)
            if error is exc:
                raise
            cause = None if isinstance(exc, ray_errors.RayTaskError) else exc
        try:
            raise error from cause  # type: ignore[misc]
        finally:
            error = cause = None
