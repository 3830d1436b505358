"""Same-node producers: reserve a range of a shared segment, write it, commit it
(docs/architecture.md §7)."""

from __future__ import annotations

from ray_velo.agent.core import AgentCore
from ray_velo.local.records import Reservation
from ray_velo.protocol import DataHandle, TypeHeader
from ray_velo.protocol.path import DEVICE_STAGING_REASONS

__all__ = ["ProducerService"]


class ProducerService:
    """``stage_reserve`` / ``stage_commit`` / ``stage_written`` / ``stage_abort`` of one
    agent."""

    def __init__(self, core: AgentCore) -> None:
        self.core = core

    def reserve(
        self, nbytes: int, pinned: bool, pid: int, may_map: bool = True
    ) -> Reservation | None:
        """Reserve ``nbytes`` for process ``pid`` to write into; commit or abort it next.

        ``may_map`` False is transparent staging inside a caller's send: only memory of an
        arena already mapped, and None (nothing reserved) when none fits.

        Raises:
            SharedMemoryTooSmall: the shm directory cannot hold the bytes.
            AgentShuttingDown: the agent is shutting down.
        """
        core = self.core
        core.check_open()
        placement = None
        kind, registered = "empty", False
        if nbytes:  # outside the lock: mapping a new arena must not stall other calls
            if may_map:
                placement, kind, registered = core.memory.allocate(
                    nbytes, pinned, core.clock(), rdma_enabled=core.rdma_enabled
                )
            else:
                mapped = core.memory.allocate_mapped(
                    nbytes, core.clock(), rdma_enabled=core.rdma_enabled
                )
                if mapped is None:
                    core.metrics.transparent_declined()
                    core.poke()  # the timer maps an arena for the next payload
                    return None
                placement, kind, registered = mapped
            if core.memory.warm_up_wanted:
                core.poke()  # a spare arena of this size, for the next payload
        with core.changing() as fx:
            if core.closed:
                if placement is not None:
                    fx.free.append((placement, registered))
                core.check_open()
            rid, pending = core.reservations.reserve(
                placement,
                kind,  # type: ignore[arg-type]
                registered,
                pid,
                wants_rdma=pinned,
            )
            core.commits.expect(pending.slot_id)
        handle = core.handle(pending.slot_id)
        if placement is None:
            return Reservation(rid, "", 0, 0, False, handle)
        return Reservation(
            rid, placement.arena.path, placement.offset_bytes, nbytes, placement.dedicated, handle
        )

    def commit(
        self,
        reservation_id: int,
        nbytes: int,
        type_header: TypeHeader,
        ttl: float | None,
        refcount: int,
        follow_producer: bool = False,
        job: str = "",
        detached: bool = False,
        writing: bool = False,
    ) -> DataHandle:
        """Turn a written reservation into a slot; returns its handle (with
        ``follow_producer`` it ends when the producing process dies; it ends with Ray job
        ``job`` unless ``detached``). ``writing``: the producer writes the bytes after this
        commit and says how far it got (``stage_written``); readers wait for them.

        Raises:
            StagingError: the reservation is unknown (aborted, its producer died) or the
                agent is shutting down.
        """
        core = self.core
        pending = None
        try:
            with core.changing() as fx:
                core.check_open()
                pending = core.reservations.get(reservation_id)
                handle = core.reservations.commit(
                    reservation_id, nbytes, type_header, ttl, refcount, core.clock(), fx,
                    follow_producer=follow_producer, job=job, detached=detached,
                    writing=writing,
                )  # fmt: skip
        finally:
            if pending is not None:
                core.commits.landed(pending.slot_id)
        if type_header.device != "cpu":
            # This agent has no GPU arena pool (yet): the producer copied the tensor to host
            # memory, and the consumer copies it back to its device.
            core.metrics.device_staged(DEVICE_STAGING_REASONS[0])
        return DataHandle(handle.worker_id, handle.slot_id, core.node_id)

    def written(self, handle: DataHandle, upto: int) -> None:
        """The producer of ``handle`` (committed ``writing``) wrote its bytes ``[0, upto)``;
        ``upto`` < 0: it failed to, and the handle ends. Its notices may overtake the commit
        (another connection of the producer's): waits for the commit first."""
        core = self.core
        core.commits.wait(handle)
        with core.changing() as fx:
            core.state.written(handle.slot_id, upto, core.clock(), fx)

    def abort(self, reservation_id: int, why: str = "its producer aborted staging it") -> None:
        """Give a reservation's memory back (a failed put, a closed PinnedWriter)."""
        with self.core.changing() as fx:
            slot_id = self.core.reservations.abort(reservation_id, why, fx)
        if slot_id is not None:
            self.core.commits.landed(slot_id)
