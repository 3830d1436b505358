"""Producers' reservations: memory a process on this node writes before it becomes a slot, and
PinnedWriters (docs/architecture.md §4). Pure: changed under the agent's lock."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from ray_velo.errors import StagingError
from ray_velo.protocol.handle import DataHandle
from ray_velo.protocol.messages import TypeHeader
from ray_velo.state.ledger import Buffer, Effects, Holder, Holdings
from ray_velo.state.owner import OwnerState
from ray_velo.state.store import SlotKind

__all__ = ["Pending", "Reservations"]


@dataclass(slots=True)
class Pending:
    """A producer's reservation between reserve and commit (or a PinnedWriter's buffer)."""

    buffer: Buffer | None
    kind: SlotKind
    pinned: bool
    pid: int
    slot_id: int
    fills: int = 0  # fetches writing into it now (a PinnedWriter destination)
    abort_when_idle: bool = False
    wants_rdma: bool = False  # asked for registered memory (plain: the budget said no)


class Reservations:
    """The reservations of one agent's producers."""

    def __init__(self, owner: OwnerState) -> None:
        self.owner = owner
        self._pending: dict[int, Pending] = {}
        self._ids = itertools.count(1)

    def reserve(
        self,
        buffer: Buffer | None,
        kind: SlotKind,
        pinned: bool,
        pid: int,
        *,
        wants_rdma: bool = False,
    ) -> tuple[int, Pending]:
        """Hold ``buffer`` for a producer (pid) until it commits or aborts. Returns the
        reservation id and record (whose ``slot_id`` the handle will have). ``wants_rdma``:
        the producer asked for registered memory (a plain slot then takes windows)."""
        rid = next(self._ids)
        pending = Pending(buffer, kind, pinned, pid, self.owner.reserve_slot_id())
        pending.wants_rdma = wants_rdma
        if buffer is not None:
            self.owner.ledger.hold(buffer, Holder("reservation", rid))
        self._pending[rid] = pending
        return rid, pending

    def get(self, rid: int) -> Pending | None:
        return self._pending.get(rid)

    def commit(
        self,
        rid: int,
        nbytes: int,
        type_header: TypeHeader,
        ttl: float | None,
        refcount: int,
        now: float,
        fx: Effects,
        *,
        follow_producer: bool = False,
        job: str = "",
        detached: bool = False,
        writing: bool = False,
    ) -> DataHandle:
        """Turn reservation ``rid`` into a slot. Raises StagingError if it is gone; a
        failure to stage gives its buffer back (in ``fx``) before raising. With
        ``follow_producer`` the handle ends when the producing process dies (a Ray Direct
        Transport object, whose normal end is its source process's garbage collection).
        ``job``: the Ray job that staged it; the handle ends with it unless ``detached``.
        ``writing``: its producer commits before writing the bytes, and says how far it got
        (:meth:`~ray_velo.state.owner.OwnerState.written`)."""
        pending = self._pending.pop(rid, None)
        if pending is None:
            raise StagingError(f"reservation {rid} is unknown or was reaped")
        try:
            slot = self.owner.stage(
                pending.buffer, Holder("reservation", rid), nbytes, type_header, now, fx,
                kind=pending.kind, pinned=pending.pinned, ttl=ttl, refcount=refcount,
                slot_id=pending.slot_id, job=job, detached=detached,
                windowable=pending.wants_rdma and not pending.pinned,
                follow_pid=pending.pid if follow_producer else 0,
            )  # fmt: skip
        except Exception as exc:
            self.owner.forget_reserved(pending.slot_id, f"staging it failed: {exc}")
            raise
        if writing and nbytes:
            self.owner.begin_writing(slot.slot_id, pending.pid, nbytes)
        return DataHandle(self.owner.worker_id, slot.slot_id)

    def abort(self, rid: int, why: str, fx: Effects) -> int | None:
        """Give reservation ``rid``'s buffer back (a failed put, a closed PinnedWriter); a
        PinnedWriter that a fetch is filling goes when that fetch ends. Returns the slot id
        that will never be staged (for those waiting on its commit), or None."""
        pending = self._pending.get(rid)
        if pending is None:
            return None
        if pending.fills:
            pending.abort_when_idle = True
            return None
        del self._pending[rid]
        self.owner.forget_reserved(pending.slot_id, why)
        if pending.buffer is not None:
            self.owner.ledger.give_back(
                pending.buffer, Holder("reservation", rid), pending.pinned, fx
            )
        return pending.slot_id

    def fill_begin(self, rid: int) -> Pending:
        """A fetch is about to write into PinnedWriter ``rid``: its buffer stays until the
        fetch ends. Raises StagingError if the writer is gone."""
        pending = self._pending.get(rid)
        if pending is None or pending.buffer is None or pending.abort_when_idle:
            raise StagingError(f"PinnedWriter reservation {rid} is gone")
        pending.fills += 1
        return pending

    def fill_end(self, rid: int, fx: Effects) -> None:
        """A fetch stopped writing into PinnedWriter ``rid``."""
        pending = self._pending.get(rid)
        if pending is None:
            return
        pending.fills -= 1
        if pending.fills == 0 and pending.abort_when_idle:
            self.abort(rid, "its producer aborted staging it", fx)

    def fill_withdraw(self, rid: int) -> None:
        """A timed-out GET may still write PinnedWriter ``rid``: its buffer goes to the
        quarantine and the writer is gone."""
        pending = self._pending.pop(rid, None)
        if pending is None or pending.buffer is None:
            return
        self.owner.forget_reserved(pending.slot_id, "a timed-out GET may still write it")
        self.owner.ledger.quarantine(pending.buffer, pending.pinned, Holder("reservation", rid))

    def pids(self) -> set[int]:
        """The producing processes (the agent watches that they live)."""
        return {pending.pid for pending in self._pending.values()}

    def reap(self, dead: Iterable[int], fx: Effects) -> list[int]:
        """Processes ``dead`` died: their reservations end. Returns the slot ids that will
        never be committed (wake whoever waits for them)."""
        dead = set(dead)
        never: list[int] = []
        for rid, pending in list(self._pending.items()):
            if pending.pid in dead:
                slot_id = self.abort(rid, "its producer died while staging it", fx)
                if slot_id is not None:
                    never.append(slot_id)
        return never

    def clear(self, fx: Effects) -> None:
        """Shutdown: every reservation ends, filled or not (no fetch runs any more)."""
        for rid, pending in list(self._pending.items()):
            pending.fills = 0
            self.abort(rid, "its owner shut down", fx)

    def __len__(self) -> int:
        return len(self._pending)

    def validate(self) -> None:
        """Its part of the ledger equals the reservations' buffers; no negative fills.

        Raises:
            AssertionError: an invariant is broken; the message names it.
        """
        expected: Holdings = {}
        for rid, pending in self._pending.items():
            if pending.fills < 0:
                raise AssertionError(f"reservation {rid} has {pending.fills} fills")
            if pending.buffer is not None:
                expected[pending.buffer.key] = Holder("reservation", rid)
        self.owner.ledger.check(("reservation",), expected)
