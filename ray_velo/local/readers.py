"""Same-node readers: a process of the owner's node reads a slot in place under a local lease
(docs/architecture.md §7)."""

from __future__ import annotations

import contextlib

from ray_velo.agent import nonblocking
from ray_velo.agent.core import AgentCore
from ray_velo.errors import HandleNotFound, LeaseNotFound
from ray_velo.local.records import LocalLease, lease_of
from ray_velo.protocol import DataHandle
from ray_velo.state.owner import ReadMode, RegionSlot
from ray_velo.state.store import SlotView

__all__ = ["ReaderService"]


class ReaderService:
    """``local_acquire`` / ``end_lease`` of one agent."""

    def __init__(self, core: AgentCore) -> None:
        self.core = core

    def acquire(self, handle: DataHandle, pid: int, mode: ReadMode) -> LocalLease:
        """A lease for process ``pid`` reading an owned slot in place.

        ``mode`` (see :meth:`~ray_velo.state.owner.OwnerState.local_acquire`): ``release``
        consumes a reference now, ``claim`` claims one, ``detach`` and ``hold`` take none; with
        ``hold`` (the get family) the lease is the caller's to detach or release, and on a
        region slot its id comes back as ``remote_lease_id``.

        Raises:
            HandleNotFound: the handle ended (released, TTL, its owner restarted).
            HandleReleased: a consuming read found every reference claimed.
        """
        core = self.core
        core.commits.wait(handle)
        core.wait_written(handle)
        with core.changing() as fx:
            if nonblocking.active() and self._in_region(handle):
                nonblocking.check(f"copying {handle} out of its region")
            slot, lease = core.state.local_acquire(handle, pid, mode, core.clock())
            if mode == "claim":  # consumed or given back later (claim_end)
                core.consumer_state.claim_held(pid, handle)
            fx.poke = True  # a holder to watch
            if not isinstance(slot.location, RegionSlot) or slot.total_len == 0:
                return lease_of(core.worker_id, core.node_id, slot, lease.lease_id)
        return self._copy_of_region(handle, slot, lease.lease_id, pid, mode)

    def _in_region(self, handle: DataHandle) -> bool:
        # core.lock held. A live slot in a caller's region with bytes to copy.
        try:
            slot = self.core.state.slot(handle)
        except HandleNotFound:
            return False  # local_acquire says why
        return isinstance(slot.location, RegionSlot) and slot.total_len > 0

    def _copy_of_region(
        self, handle: DataHandle, slot: SlotView, lease_id: int, pid: int, mode: ReadMode
    ) -> LocalLease:
        """Copy a region slot under its copy gate into plain memory; the reader leases the
        copy, and its lease on the region slot ends (unless ``hold`` keeps it)."""
        core = self.core
        region_slot = slot.location
        if not isinstance(region_slot, RegionSlot):
            raise AssertionError(f"slot {slot.slot_id} is not in a region")
        total_len = slot.total_len
        try:
            with core.plain_copy_buffer(total_len) as (fid, placement):
                region_slot.region.copy_into(region_slot.offset, placement.view()[:total_len])
                with core.changing() as fx:
                    now = core.clock()
                    copy = core.consumer_state.fetch_stage(
                        fid, total_len, slot.type_header, "plain", now, fx
                    )
                    # the copy is the reader's only: it ends with the reader's lease
                    _, copy_lease = core.state.local_acquire(
                        core.handle(copy.slot_id), pid, "release", now
                    )
                    if mode != "hold":
                        core.state.end_lease(handle, lease_id, False, now, fx)
                    return lease_of(
                        core.worker_id,
                        core.node_id,
                        copy,
                        copy_lease.lease_id,
                        lease_id if mode == "hold" else 0,
                    )
        except BaseException:
            with core.changing() as fx, contextlib.suppress(HandleNotFound, LeaseNotFound):
                core.state.end_lease(handle, lease_id, False, core.clock(), fx)  # a TTL came first?
            raise

    def end_lease(self, handle: DataHandle, lease_id: int, release: bool) -> None:
        """End a local lease: ``release`` also drops one reference. A slot already gone
        (shutdown) has nothing left to end."""
        core = self.core
        with core.changing() as fx:
            try:
                core.state.end_lease(handle, lease_id, release, core.clock(), fx)
            except (HandleNotFound, LeaseNotFound):
                return
