"""Caller-owned registered regions served to the node's processes: allocate, stage with no copy,
unregister (docs/protocol.md §10, docs/architecture.md §14)."""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass

from ray_velo.agent.core import AgentCore
from ray_velo.errors import RegionDeregistered
from ray_velo.local.records import RegionInfo
from ray_velo.memory.arena import ShmArena
from ray_velo.memory.pool import NoopRegistrar
from ray_velo.memory.region import DrainTimedOut, Region
from ray_velo.protocol import DataHandle, TypeHeader
from ray_velo.state.owner import RegionSlot

__all__ = ["RegionService"]

_log = logging.getLogger(__name__)


@dataclass(slots=True)
class _OwnedRegion:
    arena: ShmArena
    region: Region
    pid: int


class RegionService:
    """``region_*`` calls of one agent."""

    def __init__(self, core: AgentCore) -> None:
        self.core = core
        self._lock = threading.Lock()
        self._regions: dict[int, _OwnedRegion] = {}
        self._noop = NoopRegistrar()

    def alloc(self, nbytes: int, pid: int) -> RegionInfo:
        """Registered memory process ``pid`` owns and writes.

        Raises:
            BudgetExceeded: the pages do not fit ``registered_bytes_budget`` even after idle
                warm memory was evicted.
            SharedMemoryTooSmall: the shm directory cannot hold it.
        """
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes}")
        core = self.core
        core.check_open()
        arena = ShmArena(core.config.shm_dir, nbytes, core.worker_id)
        try:
            region = Region(
                arena.address,
                nbytes,
                core.memory.registrar or self._noop,
                core.memory.budget,
                on_released=arena.close,
            )
        except BaseException:
            arena.close()
            raise
        with self._lock:
            self._regions[region.region_id] = _OwnedRegion(arena, region, pid)
        core.metrics.registration("external", core.memory.budget.registered_bytes)
        self._publish()
        core.poke()  # a process to watch
        return RegionInfo(region.region_id, arena.path, nbytes, region.effective_range)

    def _publish(self) -> None:
        with self._lock:
            live = sum(1 for r in self._regions.values() if r.region.state.name == "REGISTERED")
        self.core.metrics.set_registered(self.core.memory.budget.registered_bytes, live)

    def stage(
        self, region_id: int, start: int, stop: int, type_header: TypeHeader, ttl: float | None,
        job: str = "", detached: bool = False,
    ) -> DataHandle:  # fmt: skip
        """Stage ``[start, stop)`` of a region (relative to its pointer) with no copy; the
        handle ends with Ray job ``job`` unless ``detached``."""
        core = self.core
        with self._lock:
            owned = self._regions.get(region_id)
        if owned is None:
            raise RegionDeregistered(region=f"#{region_id}")
        owned.region.check_range(start, stop - start)
        anchor = owned.region.enter()  # the in-flight guard first, then the state
        try:
            with core.changing() as fx:
                core.check_open()
                slot = core.state.stage(
                    RegionSlot(owned.region, anchor, start), None, stop - start, type_header,
                    core.clock(), fx, kind="region", pinned=core.rdma is not None, ttl=ttl,
                    job=job, detached=detached,
                )  # fmt: skip
        except BaseException:
            anchor.release()
            raise
        return core.handle(slot.slot_id)

    def unregister(self, region_id: int, timeout_s: float) -> str:
        """Gate, drain anchors up to ``timeout_s``, unmap; end the slots left in it.
        Returns ``drained`` or ``drain_timed_out``."""
        core = self.core
        with self._lock:
            owned = self._regions.get(region_id)
        if owned is None:
            raise RegionDeregistered(region=f"#{region_id}")
        result = owned.region.deregister(timeout_s)
        with self._lock:
            self._regions.pop(region_id, None)
        with core.changing() as fx:
            state, now = core.state, core.clock()
            for slot in list(state.slots()):
                location = slot.location
                if isinstance(location, RegionSlot) and location.region is owned.region:
                    state.evict(core.handle(slot.slot_id), "its region was unregistered", now, fx)
        self._publish()
        return "drain_timed_out" if isinstance(result, DrainTimedOut) else "drained"

    def deregistered(self, region_id: int, timeout_s: float | None) -> bool:
        """Wait up to ``timeout_s`` for the region's release signal; True once released."""
        with self._lock:
            owned = self._regions.get(region_id)
        return True if owned is None else owned.region.signal.wait(timeout_s)

    def pids(self) -> set[int]:
        """The processes that own regions (the agent watches them)."""
        with self._lock:
            return {owned.pid for owned in self._regions.values()}

    def reap(self, dead: set[int]) -> None:
        """Unregister the regions of processes that died: nobody else will."""
        with self._lock:
            ids = [rid for rid, owned in self._regions.items() if owned.pid in dead]
        for region_id in ids:
            _log.warning("ray_velo: region #%d's process died; unregistering it", region_id)
            with contextlib.suppress(RegionDeregistered):
                self.unregister(region_id, 0.0)

    def close(self) -> None:
        """Deregister every region (shutdown; the drain is not waited for)."""
        with self._lock:
            owned_all, self._regions = list(self._regions.values()), {}
        for owned in owned_all:
            with contextlib.suppress(RegionDeregistered):  # already going on another thread
                owned.region.deregister(0.0)

    @property
    def live(self) -> int:
        with self._lock:
            return len(self._regions)
