"""A node agent's memory: the registered pool, the plain pool and their budget; it decides where
bytes go, never failing for lack of registered memory (docs/protocol.md §9)."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Any

from ray_velo.agent import nonblocking
from ray_velo.config import RdmaPoolConfig, VeloConfig
from ray_velo.errors import SharedMemoryTooSmall, StagingError
from ray_velo.memory.arena import page_round_up, remove_stale_segments
from ray_velo.memory.pool import ArenaPool, Fallback, Placement, Registrar, RegistrationBudget
from ray_velo.memory.spares import SparePolicy
from ray_velo.state.store import SlotKind

__all__ = ["PLAIN_MAX_ARENA_BYTES", "SPEC_BUDGET_BYTES", "NodeMemory", "default_budget"]

_log = logging.getLogger(__name__)

#: Upper bound on one arena of the plain (unregistered) pool.
PLAIN_MAX_ARENA_BYTES = 1 << 30
#: The protocol's ``registered_bytes_budget`` (docs/protocol.md §20): the least an agent
#: takes by default.
SPEC_BUDGET_BYTES = 1 << 30


def default_budget(memory_bytes: int, shm_bytes: int) -> int:
    """The registered-bytes budget of a node with ``memory_bytes`` of memory and a shm
    directory of ``shm_bytes``: a quarter of its memory (registered memory is memory a
    payload occupies anyway; the rest stays for the tasks), never above half the shm
    directory (staged bytes live there, plain ones too), never below the protocol's 1 GiB."""
    return max(SPEC_BUDGET_BYTES, min(memory_bytes // 4, shm_bytes // 2))


def _node_budget(shm_dir: str) -> int:
    """:func:`default_budget` of this node."""
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    stat = os.statvfs(shm_dir)
    return default_budget(memory, stat.f_blocks * stat.f_frsize)


def _spare_policy(pool_config: RdmaPoolConfig, budget: int) -> SparePolicy:
    """The spare-arena rule of a pool with ``budget`` registered bytes (docs/tuning.md)."""
    spare_max = pool_config.spare_arena_max_bytes
    if spare_max is None:
        spare_max = max(budget // 8, pool_config.dedicated_arena_min)
    return SparePolicy(
        repeat_window_s=pool_config.spare_repeat_window,
        max_bytes=spare_max,
        warm_limit_bytes=pool_config.warm_dedicated_bytes or 0,
    )


class NodeMemory:
    """The pools and budget of one agent.

    Args:
        config: the agent's configuration (pool sizes, budget, shm directory).
        owner_tag: the agent's worker id, named in every arena file.
        registrar: registers arenas with the RDMA backend; None without one (no registered
            pool: everything is plain memory).
        metrics: the agent's metrics (path labels at staging, registration gauges).
    """

    def __init__(
        self, config: VeloConfig, owner_tag: int, registrar: Registrar | None, metrics: Any
    ) -> None:
        self.config = config
        self.metrics = metrics
        os.makedirs(config.shm_dir, exist_ok=True)
        for stale in remove_stale_segments(config.shm_dir):
            _log.warning(
                "removed shared-memory segment %s (%d bytes) of a crashed ray_velo process",
                stale.path,
                stale.nbytes,
            )
        pool_config = config.rdma.pool
        node_budget = _node_budget(config.shm_dir)
        budget = pool_config.registered_bytes_budget
        if budget is None:
            budget = node_budget
        warm = pool_config.warm_dedicated_bytes
        # Plain memory is not registered: a budget set low (so that large payloads move
        # through windows) must not make every large plain arena a fresh, faulting mapping.
        plain_warm = max(budget, node_budget) if warm is None else warm
        pool_config = dataclasses.replace(
            pool_config,
            registered_bytes_budget=budget,
            # None: as much as the budget may register, so what it takes whole stays warm
            warm_dedicated_bytes=budget if warm is None else warm,
        )
        self.budget = RegistrationBudget(budget, on_change=metrics.set_registered)
        self.registrar = registrar
        self.pinned_pool: ArenaPool | None = None
        if registrar is not None:
            self.pinned_pool = ArenaPool(
                pool_config, config.shm_dir, owner_tag, registrar=registrar, budget=self.budget
            )
            self.budget.set_reclaimer(self.pinned_pool.evict_idle)
        self.plain_pool = ArenaPool(
            RdmaPoolConfig(
                initial_arena_bytes=config.plain_arena_bytes,
                max_arena_bytes=max(config.plain_arena_bytes, PLAIN_MAX_ARENA_BYTES),
                dedicated_arena_min=pool_config.dedicated_arena_min,
                registered_bytes_budget=1 << 62,
                arena_reclaim_after=pool_config.arena_reclaim_after,
                retain_arena_bytes=pool_config.retain_arena_bytes,
                warm_dedicated_bytes=plain_warm,
            ),
            config.shm_dir,
            owner_tag,
        )
        self._registrations_seen = 0
        self._seen_lock = threading.Lock()
        self._warm_up_allowed = pool_config.warm_up_after_miss
        self._dedicated_min = pool_config.dedicated_arena_min
        self._spares = _spare_policy(pool_config, budget)
        self._warm_up_wanted: set[tuple[bool, int, bool]] = set()  # (registered, bytes, spare)
        self._warm_up_lock = threading.Lock()
        if self._warm_up_allowed:
            # The first pooled arena, mapped by the timer right after the agent starts, so
            # transparent payloads below dedicated_arena_min stage from the first call.
            self._warm_up_wanted.add((self.pinned_pool is not None, 1, False))

    # --- placing bytes ---------------------------------------------------------------

    def allocate(
        self,
        nbytes: int,
        pinned: bool,
        now: float,
        *,
        rdma_enabled: bool,
        record: bool = True,
    ) -> tuple[Placement, SlotKind, bool]:
        """A placement for ``nbytes`` (>= 1): registered when ``pinned`` and possible, else
        plain. Returns (placement, slot kind, registered).

        ``record``: count a pinned-staging fallback in the path metric (the owner's staging
        point, labels ``kill_switch``, ``budget``, ``pool_exhausted``: docs/protocol.md §9).
        Without a registered pool (no UCX) the data goes to plain memory, counting nothing.
        A dedicated payload whose size repeats may ask the timer for a spare arena
        (:class:`~ray_velo.memory.spares.SparePolicy` says when), as :meth:`allocate_mapped`
        does: a pipeline's next round finds one mapped instead of mapping one inside its put.

        Raises:
            SharedMemoryTooSmall: the shm directory cannot hold the bytes.
            StagingError: plain memory failed for another reason.
        """
        fallback = ""  # why pinned bytes went to plain memory
        if pinned:
            if not rdma_enabled:
                fallback = "kill_switch"
            elif self.pinned_pool is not None:
                got = self._take(self.pinned_pool, nbytes, now)
                self._count_registrations()
                if isinstance(got, Placement):
                    if got.dedicated:
                        self._consider_spare(self.pinned_pool, True, nbytes, now)
                    return got, "dedicated" if got.dedicated else "pooled", True
                fallback = got.reason
        placement = self._plain(nbytes, now)
        if fallback and record:  # counted once placed: a WouldBlock runs this again
            self.metrics.path("chunked", fallback)
        return placement, "plain", False

    def allocate_mapped(
        self, nbytes: int, now: float, *, rdma_enabled: bool
    ) -> tuple[Placement, SlotKind, bool] | None:
        """Transparent staging's placement, inside a caller's send: memory of an arena that
        is already mapped, never a new mapping or registration (docs/protocol.md §12).
        Registered memory when the RDMA path is on, else plain; None when nothing mapped
        fits (the payload then travels inside the Ray call, as if undecorated), after asking
        the timer to warm an arena of that size up (:meth:`warm_up`) so that the next one
        finds it. A dedicated payload whose size repeats may ask for a spare too
        (:class:`~ray_velo.memory.spares.SparePolicy`): on a steady pipeline the next round's
        payload is staged while this one's readers still hold it, and must find another."""
        registered = rdma_enabled and self.pinned_pool is not None
        pool = self.pinned_pool if registered else self.plain_pool
        assert pool is not None
        got = pool.allocate(nbytes, now, may_map=False)
        if isinstance(got, Placement):
            kind: SlotKind = "plain"
            if registered:
                kind = "dedicated" if got.dedicated else "pooled"
            if got.dedicated:
                self._consider_spare(pool, registered, nbytes, now)
            return got, kind, registered
        if nbytes >= self._dedicated_min:
            self._consider_spare(pool, registered, nbytes, now)  # counts as a sighting
        self._want_warm(registered, nbytes)
        return None

    def _consider_spare(self, pool: ArenaPool, registered: bool, nbytes: int, now: float) -> None:
        """A dedicated payload of ``nbytes`` was placed (or missed): ask for a spare arena
        of its size where the spare policy says it pays."""
        with self._warm_up_lock:
            wanted = self._spares.placed(
                nbytes, now, warm_held_bytes=pool.warm_bytes, has_warm=pool.has_warm(nbytes)
            )
        if wanted:
            self._want_warm(registered, nbytes, spare=True)

    def _want_warm(self, registered: bool, nbytes: int, *, spare: bool = False) -> None:
        if self._warm_up_allowed:
            with self._warm_up_lock:
                self._warm_up_wanted.add((registered, nbytes, spare))

    @property
    def warm_up_wanted(self) -> bool:
        """Whether transparent staging missed mapped memory since the last warm-up."""
        return bool(self._warm_up_wanted)

    def warm_up(self, now: float, *, quiet: bool = True) -> bool:
        """Map an arena for each size asked for (a transparent-staging miss, a spare), in
        the registered pool (or plain when the RDMA path is off), then give it back to its
        pool at once: a pooled arena stays mapped, a dedicated one stays warm
        (``warm_dedicated_bytes``). Runs on the agent's timer, never inside a send; bounded
        by ``registered_bytes_budget`` like every registration; a spare never pushes a warm
        arena out to make room. ``quiet``: no transfer of this node is in flight; when it
        is False, dedicated sizes wait (mapping one takes a core for up to a second).
        Returns whether some wait, for the timer to come back."""
        with self._warm_up_lock:
            wanted = sorted(self._warm_up_wanted)
            later = set() if quiet else {w for w in wanted if w[1] >= self._dedicated_min}
            self._warm_up_wanted = set(later)
        for registered, nbytes, spare in wanted:
            pool = self.pinned_pool if registered else self.plain_pool
            if pool is None or (registered, nbytes, spare) in later or pool.has_warm(nbytes):
                continue
            if spare and registered and page_round_up(nbytes) > self.budget.available_bytes:
                continue  # it would push warm arenas out: a spare never does
            got = pool.allocate(nbytes, now)
            if isinstance(got, Placement):
                pool.free(got, now)
        self._count_registrations()
        return bool(later)

    @staticmethod
    def _take(pool: ArenaPool, nbytes: int, now: float) -> Placement | Fallback:
        """``pool.allocate``; on the agent's event loop only from mapped arenas (a mapping
        may take long): raises WouldBlock where it would map one."""
        if not nonblocking.active():
            return pool.allocate(nbytes, now)
        got = pool.allocate(nbytes, now, may_map=False)
        if isinstance(got, Fallback):
            nonblocking.check(f"mapping an arena for {nbytes} bytes")
        return got

    def _plain(self, nbytes: int, now: float) -> Placement:
        got = self._take(self.plain_pool, nbytes, now)
        if isinstance(got, Fallback):
            if isinstance(got.error, SharedMemoryTooSmall):
                raise got.error
            raise StagingError(
                f"cannot stage {nbytes} bytes in plain memory in {self.config.shm_dir}: "
                f"{got.detail or got.reason}"
            )
        return got

    def allocate_registered(self, nbytes: int, now: float) -> Placement | None:
        """A registered destination for a GET, or None (the consumer's ``pool_exhausted``)."""
        if self.pinned_pool is None:
            return None
        got = self.pinned_pool.allocate(nbytes, now)
        self._count_registrations()
        return got if isinstance(got, Placement) else None

    def allocate_plain(self, nbytes: int, now: float) -> Placement:
        """A plain destination (chunks, copies). Raises as :meth:`allocate`."""
        return self._plain(nbytes, now)

    def kind_of(self, placement: Placement, registered: bool) -> SlotKind:
        if placement.dedicated:
            return "dedicated"
        return "pooled" if registered else "plain"

    def free(self, placement: Any, registered: bool, now: float) -> None:
        """Give ``placement`` back to the pool it came from."""
        pool = self.pinned_pool if registered else self.plain_pool
        if pool is not None:
            pool.free(placement, now)

    # --- upkeep ----------------------------------------------------------------------

    def _count_registrations(self) -> None:
        """Count the arena registrations the pool made since the last look (none without
        a registered pool)."""
        if self.pinned_pool is None:
            return
        total = self.pinned_pool.registrations_total.get("arena", 0)
        with self._seen_lock:
            new = total - self._registrations_seen
            self._registrations_seen = max(total, self._registrations_seen)
        for _ in range(new):
            self.metrics.registration("arena", self.budget.registered_bytes)

    def reclaim(self, now: float) -> list[float]:
        """Unmap what reclamation allows; the next times it has something to do."""
        due = []
        for pool in (self.pinned_pool, self.plain_pool):
            if pool is None:
                continue
            pool.reclaim(now)
            when = pool.next_reclaim_deadline(now)
            if when is not None:
                due.append(when)
        return due

    @property
    def pinned_used_bytes(self) -> int:
        return 0 if self.pinned_pool is None else self.pinned_pool.used_bytes

    @property
    def plain_used_bytes(self) -> int:
        return self.plain_pool.used_bytes

    def close_registered(self, *, unmap: bool = True) -> None:
        """Unregister, unmap and unlink the registered pool's arenas (shutdown, before UCX
        goes; the plain pool stays for the pulls still draining). ``unmap=False``: a GET
        into them may still run, so only their files go (:meth:`ArenaPool.abandon`)."""
        if self.pinned_pool is None:
            return
        if unmap:
            self.pinned_pool.close()
        else:
            self.pinned_pool.abandon()

    def close(self) -> None:
        """Unregister, unmap and unlink every arena (quarantined memory included)."""
        if self.pinned_pool is not None:
            self.pinned_pool.close()
        self.plain_pool.close()
