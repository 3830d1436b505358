"""Staging a call's payloads, and resolving them on the other side under claims that make
``consumers=N`` exact (docs/transfer.md §3, §4)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Literal, TypeVar

import numpy as np
import ray

from ray_velo.client import session
from ray_velo.client.payload import as_bytes_view, from_bytes_view, is_torch, payload_nbytes
from ray_velo.client.writable import fetched_pinned_writer
from ray_velo.errors import HandleNotFound, HandleReleased
from ray_velo.local.records import LocalLease
from ray_velo.protocol import DataHandle
from ray_velo.staging.tree import PackedPart, StagedValue, TransferOptions, visit, walk

_T = TypeVar("_T")

__all__ = ["Resolution", "discard_tree", "resolve", "resolve_stream", "stage_tree"]


def stage_tree(value: Any, options: TransferOptions, budget_s: float | None) -> Any:
    """``value`` with every payload above the threshold staged and replaced; two or more
    are packed into one slot (one reservation, one handle, one GET for the receiver). If
    staging fails (or the task is interrupted meanwhile), what was staged is released:
    nobody would ever hold its handles."""
    chosen: dict[int, Any] = {}  # by id: a payload the tree names twice is staged once

    def pick(item: Any) -> None:
        if isinstance(item, StagedValue) or id(item) in chosen:
            return
        nbytes = payload_nbytes(item)
        if nbytes is None:
            return
        threshold = options.threshold_bytes
        if threshold is None:
            threshold = session.current().config.threshold_bytes if nbytes > 0 else 0
        if nbytes > threshold:
            chosen[id(item)] = item

    visit(value, pick)
    if not chosen:
        return value
    staged: dict[int, StagedValue] = {}
    try:
        # a tensor goes packed even alone: its receiver fetches the slot into memory of its
        # own that the tensors view (writable, no copy); a slot of its own would be copied out
        if len(chosen) == 1 and not is_torch(next(iter(chosen.values()))):
            staged = _stage_one(chosen, options, budget_s)
        else:
            staged = _stage_packed(chosen, options, budget_s)
        return walk(value, lambda item: staged.get(id(item), item))
    except BaseException:
        with contextlib.suppress(Exception):  # the original error is the one to raise
            discard_tree(list(staged.values()))
        raise


def _stage_one(
    chosen: dict[int, Any], options: TransferOptions, budget_s: float | None
) -> dict[int, StagedValue]:
    [(key, item)] = chosen.items()
    handle = session.stage_transparent(
        item, ttl=options.effective_ttl, consumers=options.consumers, lifetime=options.lifetime
    )
    if handle is None:  # no mapped arena fits: Ray carries it this time (docs/protocol.md §12)
        return {}
    nbytes = payload_nbytes(item) or 0
    return {key: StagedValue(handle, nbytes, options.consumers, budget_s)}


def _stage_packed(
    chosen: dict[int, Any], options: TransferOptions, budget_s: float | None
) -> dict[int, StagedValue]:
    """The chosen payloads in one slot (only into an arena already mapped, as
    :func:`~ray_velo.client.session.stage_transparent`); none staged when none fits."""
    views = {key: as_bytes_view(item) for key, item in chosen.items()}
    parts = [np.frombuffer(view, dtype=np.uint8) for _, view in views.values()]
    packed = session.stage_packed(
        parts,
        ttl=options.effective_ttl,
        follow_producer=False,
        consumers=options.consumers,
        lifetime=options.lifetime,
        streamed=False,
        may_map=False,
    )
    if packed is None:  # no mapped arena fits: Ray carries them this time
        return {}
    handle, offsets = packed
    return {
        key: StagedValue(handle, part.nbytes, options.consumers, budget_s, PackedPart(at, header))
        for (key, (header, _)), part, at in zip(views.items(), parts, offsets, strict=True)
    }


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
        #: the packed slots read so far, by handle: one lease serves all their parts
        self._packs: dict[DataHandle, Any] = {}
        #: the packed slots of this tree fetched into a PinnedWriter, and their sizes
        self._into_writer: dict[DataHandle, int] = {}

    def one(self, staged: StagedValue) -> Any:
        if staged.part is None:
            return session.read(self._acquired(staged, self._lease))
        slot = self._packs.get(staged.handle)
        if slot is None:
            slot = self._packs[staged.handle] = self._slot(staged)
        header, start = staged.part.header, staged.part.offset
        # a tensor over a writer's memory is the callee's own; over a shared slot, a copy
        return from_bytes_view(header, slot[start : start + staged.nbytes].data)

    def _slot(self, staged: StagedValue) -> Any:
        """A packed slot's bytes: in a PinnedWriter of this process where it holds a tensor
        and comes from another node (the GET lands there: no copy, and its tensors are
        writable), else leased in place."""
        nbytes = self._into_writer.get(staged.handle)
        if nbytes is None:
            return session.read(self._acquired(staged, self._lease))
        writer = self._acquired(
            staged, lambda s: fetched_pinned_writer(s.handle, nbytes, s.budget_s, self.mode)
        )
        return writer.array  # its memory stays while a view of it does

    def _lease(self, staged: StagedValue) -> LocalLease:
        return session.lease(staged.handle, self.mode, staged.budget_s)

    def _acquired(self, staged: StagedValue, acquire: Callable[[StagedValue], _T]) -> _T:
        """``acquire(staged)``, its errors in the decorator's terms, its claim noted."""
        try:
            got = acquire(staged)
        except HandleReleased as exc:
            raise _released(staged) from exc
        except HandleNotFound as exc:
            if exc.released:
                raise _released(staged) from exc
            raise
        if self.mode == "claim":
            self.claimed.append(staged.handle)
        return got

    def tree(self, value: Any) -> Any:
        """``value`` with every StagedValue resolved."""
        self._into_writer = self._writer_slots(value)
        try:
            return walk(
                value, lambda item: self.one(item) if isinstance(item, StagedValue) else item
            )
        finally:
            self._packs.clear()  # the values keep what they view; the lease ends with them

    def _writer_slots(self, value: Any) -> dict[DataHandle, int]:
        """The packed slots of ``value`` a claim fetches into a PinnedWriter (from another
        node, holding a tensor), each with its size: where its last part ends."""
        if self.mode != "claim":
            return {}
        ends: dict[DataHandle, int] = {}
        tensors: set[DataHandle] = set()

        def leaf(item: Any) -> None:
            if isinstance(item, StagedValue) and item.part is not None:
                end = item.part.offset + item.nbytes
                ends[item.handle] = max(ends.get(item.handle, 0), end)
                if item.part.header.kind == "torch":
                    tensors.add(item.handle)

        visit(value, leaf)
        if not tensors:  # no session asked for: a call without one stays without
            return {}
        here = session.current().worker_id
        return {h: end for h, end in ends.items() if h in tensors and end and h.worker_id != here}

    def end(self, consume: bool) -> None:
        """The body is done: consume every claim, or give them back (a retry will claim
        again). Not waited for: a handle whose TTL came first is no error here."""
        claimed, self.claimed = self.claimed, []
        for handle in claimed:
            session.claim_end(handle, consume)


def resolve(value: Any, *, timeout: float | None = None) -> Any:
    """A call's result with every staged payload fetched (for the driver or any undecorated
    code); each staged value is consumed. Accepts an ObjectRef, a list or dict of them, or
    an already-fetched value, or lists, tuples and dicts holding any of these at any depth
    (every ObjectRef in it is fetched with one ``ray.get``).

    Raises:
        HandleReleased: a staged value was resolved more times than its ``consumers``.
        TransferTimeout, OwnerDied, PayloadTooLarge: as for :func:`ray_velo.fetch`.
    """
    refs: list[Any] = []
    visit(value, lambda leaf: refs.append(leaf) if isinstance(leaf, ray.ObjectRef) else None)
    if refs:
        got = dict(zip(refs, ray.get(refs, timeout=timeout), strict=True))
        value = walk(value, lambda leaf: got[leaf] if isinstance(leaf, ray.ObjectRef) else leaf)
    return Resolution("release").tree(value)


def discard_tree(value: Any) -> None:
    """Release every staged value in ``value`` unread (a stream that ended early)."""
    from ray_velo import api

    seen: set[DataHandle] = set()  # packed values share a handle and its references

    def leaf(item: Any) -> None:
        if not isinstance(item, StagedValue) or item.handle in seen:
            return
        seen.add(item.handle)
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
