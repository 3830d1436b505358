"""Staging a call's payloads, and resolving them on the other side under claims that make
``consumers=N`` exact (docs/transfer.md §3, §4)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal

import ray

from ray_velo import session
from ray_velo.errors import HandleNotFound, HandleReleased
from ray_velo.payload import payload_nbytes
from ray_velo.protocol import DataHandle
from ray_velo.staging.tree import StagedValue, TransferOptions, visit, walk
from ray_velo.store import RELEASED_BY_CONSUMERS

__all__ = ["Resolution", "discard_tree", "resolve", "resolve_stream", "stage_tree"]


def stage_tree(value: Any, options: TransferOptions, budget_s: float | None) -> Any:
    """``value`` with every payload above the threshold staged and replaced. If staging
    one fails (or the task is interrupted meanwhile), those already staged are released:
    nobody would ever hold their handles."""
    staged: list[StagedValue] = []

    def leaf(item: Any) -> Any:
        if isinstance(item, StagedValue):
            return item
        nbytes = payload_nbytes(item)
        if nbytes is None:
            return item
        threshold = options.threshold_bytes
        if threshold is None:
            threshold = session.current().config.threshold_bytes if nbytes > 0 else 0
        if nbytes <= threshold:
            return item
        handle = session.stage_transparent(
            item, ttl=options.effective_ttl, consumers=options.consumers, lifetime=options.lifetime
        )
        if handle is None:  # no mapped arena fits: Ray carries it this time (docs/protocol.md §12)
            return item
        staged.append(StagedValue(handle, nbytes, options.consumers, budget_s))
        return staged[-1]

    try:
        return walk(value, leaf)
    except BaseException:
        with contextlib.suppress(Exception):  # the original error is the one to raise
            discard_tree(staged)
        raise


def _released(staged: StagedValue) -> HandleReleased:
    return HandleReleased(
        handle=str(staged.handle),
        allowed=staged.consumers,
        option=f"consumers=N (it was staged with consumers={staged.consumers})",
    )


class Resolution:
    """The StagedValues of one call, fetched; and the claims held on them until :meth:`end`.

    ``mode``: ``claim`` (a decorated callee: consumed or given back at the end) or
    ``release`` (consumed at once).
    """

    def __init__(self, mode: Literal["claim", "release"]) -> None:
        self.mode = mode
        self.claimed: list[DataHandle] = []

    def one(self, staged: StagedValue) -> Any:
        try:
            local = session.lease(staged.handle, self.mode, staged.budget_s)
        except HandleReleased as exc:
            raise _released(staged) from exc
        except HandleNotFound as exc:
            if exc.fields.get("reason") == RELEASED_BY_CONSUMERS:
                raise _released(staged) from exc
            raise
        if self.mode == "claim":
            self.claimed.append(staged.handle)
        return session.read(local)

    def tree(self, value: Any) -> Any:
        """``value`` with every StagedValue resolved."""
        return walk(value, lambda item: self.one(item) if isinstance(item, StagedValue) else item)

    def end(self, consume: bool) -> None:
        """The body is done: consume every claim, or give them back (a retry will claim
        again). Not waited for: a handle whose TTL came first is no error here."""
        claimed, self.claimed = self.claimed, []
        for handle in claimed:
            session.claim_end(handle, consume)


def _get_refs(value: Any, timeout: float | None) -> Any:
    """``value`` with every ObjectRef in it (at any depth of lists, tuples and dicts)
    replaced by its value, all fetched with one ``ray.get``."""
    refs: list[Any] = []
    visit(value, lambda leaf: refs.append(leaf) if isinstance(leaf, ray.ObjectRef) else None)
    if not refs:
        return value
    got = dict(zip(refs, ray.get(refs, timeout=timeout), strict=True))
    return walk(value, lambda leaf: got[leaf] if isinstance(leaf, ray.ObjectRef) else leaf)


def resolve(value: Any, *, timeout: float | None = None) -> Any:
    """A call's result with every staged payload fetched (for the driver or any undecorated
    code); each staged value is consumed. Accepts an ObjectRef, a list or dict of them, or
    an already-fetched value, or lists, tuples and dicts holding any of these at any depth
    (every ObjectRef in it is fetched with one ``ray.get``).

    Raises:
        HandleReleased: a staged value was resolved more times than its ``consumers``.
        TransferTimeout, OwnerDied, PayloadTooLarge: as for :func:`ray_velo.fetch`.
    """
    return Resolution("release").tree(_get_refs(value, timeout))


def discard_tree(value: Any) -> None:
    """Release every staged value in ``value`` unread (a stream that ended early)."""
    from ray_velo import api

    def leaf(item: Any) -> None:
        if not isinstance(item, StagedValue):
            return
        for _ in range(item.consumers):
            try:
                api.release(item.handle, 0)
            except HandleNotFound:
                break

    visit(value, leaf)


def resolve_stream(refs: Any, *, timeout: float | None = None) -> Iterator[Any]:
    """Iterate a streaming generator's ObjectRefs, each item resolved as it arrives.

    If an item fails (over this node's ``staged_payload_max``, timed out, owner gone), the
    stream ends with that error: the producer is cancelled and the items it already staged
    are released unread, so nothing stays behind. Other streams are not affected.
    """
    try:
        for ref in refs:
            yield resolve(ref, timeout=timeout)
    except BaseException:
        ray.cancel(refs)
        with contextlib.suppress(Exception):  # the cancelled producer ends with its own error
            for ref in refs:
                discard_tree(ray.get(ref, timeout=30))
        raise
