"""The rendezvous agent: one per Ray node, the composition root of its roles; it owns the timer
and the shutdown order (docs/architecture.md §2, §4, §8)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import math
import os
import secrets
from collections.abc import Callable
from typing import Any, cast

from ray_velo import metrics
from ray_velo.actors.faults import (
    FaultPlan,
    FaultyRdma,
    FaultyReader,
    SlowPulls,
    StalledSends,
    fault_injection_off,
)
from ray_velo.actors.jobs import JobTable, JobWatch
from ray_velo.actors.ticker import Ticker
from ray_velo.agent.clock import Clock
from ray_velo.agent.core import AgentCore
from ray_velo.agent.node_memory import NodeMemory
from ray_velo.config import VeloConfig
from ray_velo.consumer.bulk import BulkReader, RangeReader
from ray_velo.consumer.links import Blocking, inline
from ray_velo.consumer.peers import PeerDirectory, Peers
from ray_velo.consumer.service import ConsumerService
from ray_velo.errors import UcxError, VeloError
from ray_velo.local.producers import ProducerService
from ray_velo.local.readers import ReaderService
from ray_velo.local.records import LocalLease, Reservation
from ray_velo.local.regions import RegionService
from ray_velo.memory.arena import SEGMENT_PREFIX, pid_alive, remove_stale_segments
from ray_velo.owner.sender import WireSender
from ray_velo.owner.service import OwnerService
from ray_velo.protocol import DataHandle, kill_switch_engaged
from ray_velo.protocol.entry import Entry
from ray_velo.state.fetch import Mode
from ray_velo.state.owner import OwnerState, RegionSlot
from ray_velo.ucx.backend import UcxRdmaBackend, agent_transports
from ray_velo.ucx.loader import ucx_available
from ray_velo.ucx.policy import UCX_TCP_ENV
from ray_velo.ucx.status import UcsStatus
from ray_velo.wire.auth import WireAuth
from ray_velo.wire.bulk import BulkServer

__all__ = ["LocalLease", "RendezvousAgent", "Reservation"]

_log = logging.getLogger(__name__)

#: How often the agent checks that the processes it serves are still alive, while any are.
LIVENESS_INTERVAL_S = 1.0
#: How often the timer looks again for a quiet moment to map the arenas it was asked for
#: while a transfer was in flight.
WARM_UP_RETRY_S = 0.05
_START_UCX: Any = object()  # the default of RendezvousAgent(rdma=...): start UCX if it loads


def _start_rdma(config: VeloConfig, clock: Clock) -> tuple[UcxRdmaBackend | None, str]:
    """The agent's UCX backend, or None (logged) when UCX is off or cannot load, with why.
    UCX leaves TCP out unless the operator opted in (``VELO_UCX_TCP=1``), which is logged as
    the risk it is (docs/deployment.md §8)."""
    if not config.rdma.ucx.enabled:
        return None, "UCX is off in the configuration (rdma.ucx.enabled=False)"
    tcp, choice = agent_transports(config.rdma.ucx)
    if choice.note:
        _log.warning("ray_velo: %s", choice.note)
    if not choice.start:
        return None, f"UCX not started: {choice.note}"
    available, why = ucx_available()
    if not available:
        _log.warning("ray_velo: UCX unavailable (%s); no UCX GET on this node", why)
        return None, f"UCX unavailable: {why}"
    try:
        backend = UcxRdmaBackend(config.rdma.ucx, clock)
    except UcxError as exc:
        if exc.fields.get("status") == int(UcsStatus.ERR_UNREACHABLE):  # a TCP-only host
            _log.info("ray_velo: %s", exc.fields.get("status_text"))
            return None, f"UCX not started: {exc.fields.get('status_text')}"
        _log.warning("ray_velo: UCX failed to start; no UCX GET on this node", exc_info=True)
        return None, f"UCX failed to start: {exc}"
    except VeloError as exc:
        _log.warning("ray_velo: UCX failed to start; no UCX GET on this node", exc_info=True)
        return None, f"UCX failed to start: {exc}"
    if tcp:
        _log.warning(
            "ray_velo: UCX may use TCP on this node (%s=1): UCX over TCP authenticates no "
            "one, so any process that reaches this node's UCX ports can read this agent's "
            "memory, Ray's token included. Use it only on a network you trust",
            UCX_TCP_ENV,
        )
    return backend, ""


def _warn_cleartext_payloads(tcp: bool, environ: Any = os.environ) -> bool:
    """Under Ray's TLS, say once that UCX's TCP transport (when the operator allowed it)
    moves payload bytes in clear (as Ray's own NIXL transport does). Returns whether it did."""
    if not tcp or environ.get("RAY_USE_TLS", "0").lower() not in ("1", "true"):
        return False
    _log.warning(
        "ray_velo: Ray runs with TLS, but a UCX GET over UCX's tcp transport (%s=1) moves "
        "payload bytes in clear (as Ray's NIXL transport does). Without it, payloads cross "
        "hosts over the agents' wire, under TLS",
        UCX_TCP_ENV,
    )
    return True


def process_stats(shm_dir: str) -> dict[str, int]:
    """This process's open files, threads, resident memory (all, and anonymous: the heap)
    and the shared-memory segments it created, for the soak's growth checks (Linux /proc)."""
    stats = {"fds": 0, "threads": 0, "rss_bytes": 0, "rss_anon_bytes": 0}
    try:
        stats["fds"] = len(os.listdir("/proc/self/fd"))
        stats["threads"] = len(os.listdir("/proc/self/task"))
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "RssAnon"):
                    name = "rss_bytes" if key == "VmRSS" else "rss_anon_bytes"
                    stats[name] = int(value.split()[0]) * 1024
    except OSError:  # not Linux: what could be read
        pass
    prefix = f"{SEGMENT_PREFIX}{os.getpid()}-"
    stats["segments"] = stats["segment_bytes"] = 0
    for entry in os.scandir(shm_dir):
        if entry.name.startswith(prefix):
            with contextlib.suppress(FileNotFoundError):  # unlinked meanwhile
                stats["segment_bytes"] += entry.stat().st_size
                stats["segments"] += 1
    return stats


def _detached_slots(slots: Any, now: float) -> list[dict[str, Any]]:
    """The live slots staged ``lifetime="detached"`` (they outlive their job): slot id,
    bytes, the job that staged it, references, and seconds left of its TTL (None: none)."""
    return [
        {"slot": s.slot_id, "bytes": s.total_len, "job": s.job, "refcount": s.refcount,
         "ttl_left_s": None if s.ttl_deadline is None else round(s.ttl_deadline - now, 3)}
        for s in slots if s.detached and s.ended is None
    ]  # fmt: skip


def _ray_worker_id() -> str:
    """This process's Ray worker id (the WorkerId label of its exported metrics), or ""."""
    try:
        import ray

        return str(ray.get_runtime_context().get_worker_id()) if ray.is_initialized() else ""
    except Exception:  # outside Ray (ray_velo.testing)
        return ""


def _find_agent(node_id: str) -> Any:
    from ray_velo.actors.directory import find_agent

    return find_agent(node_id)


def _node_of_worker(worker_id: int) -> str | None:
    from ray_velo.actors.directory import node_of_worker

    return node_of_worker(worker_id)


def _wire_address(worker_id: int) -> str | None:
    from ray_velo.actors.directory import wire_address_of

    return wire_address_of(worker_id)


def _bulk_address(worker_id: int) -> str | None:
    from ray_velo.actors.directory import bulk_address_of

    return bulk_address_of(worker_id)


def _agent_rdma(
    config: VeloConfig, rdma: Any, rdma_enabled: bool, faults: FaultPlan | None, clock: Clock
) -> tuple[Any, str]:
    """The agent's RDMA backend (UCX started here unless one was given; a fault test's
    wrapped in its plan) and why there is none ("" when there is)."""
    unavailable = "" if rdma is not None else "no RDMA backend given"
    if rdma is _START_UCX:
        rdma, unavailable = _start_rdma(config, clock)
        if rdma is not None and rdma_enabled:
            _warn_cleartext_payloads(rdma.tcp)
    if faults is not None and rdma is not None:
        rdma = FaultyRdma(rdma, faults)
    return rdma, unavailable


class RendezvousAgent:
    """Owner and node-local consumer of staged payloads."""

    def __init__(
        self,
        config: VeloConfig,
        node_id: str,
        *,
        worker_id: int | None = None,
        rdma: Any = _START_UCX,
        peers: Peers | None = None,
        clock: Clock | None = None,
        timer: bool = True,
        jobs: JobTable | None = None,
        wire_auth: WireAuth | None = None,
        bulk_host: str | None = None,
        faults: FaultPlan | None = None,
    ) -> None:
        """An agent for ``node_id``. ``jobs``: Ray's job table, for staged data to follow
        its job (None: no handle ends with its job). ``wire_auth``: credentials for other
        agents' TCP wire (None: Ray calls only; with them it reads other agents' bulk
        ports). ``bulk_host``: the address its own bulk port listens on, where it sends
        payload bytes to other nodes' agents (None, or no ``wire_auth``: it sends none:
        they read by chunks or UCX). ``faults``: the plan of a fault test's
        agent, whose wrappers go around its RDMA backend and owner handlers now (None:
        none, and :meth:`inject_fault` is refused). The other keyword arguments are for
        ``ray_velo.testing``: an RDMA backend in place of UCX (None: none), a peer directory,
        a clock, and no timer thread (the test calls :meth:`tick`)."""
        worker_id = worker_id if worker_id is not None else secrets.randbits(64) | 1
        clock = clock if clock is not None else Clock()  # the agent's one clock, passed down
        rdma_enabled = config.rdma.rendezvous.enabled and not kill_switch_engaged(os.environ)
        agent_metrics = metrics.AgentMetrics(node_id)
        rdma, self.rdma_unavailable = _agent_rdma(config, rdma, rdma_enabled, faults, clock)
        registrar = None if rdma is None else rdma.registrar
        memory = NodeMemory(config, worker_id, registrar, agent_metrics)
        core = AgentCore(
            config, node_id, worker_id, OwnerState(worker_id, node_id), memory,
            agent_metrics, rdma, rdma_enabled, clock=clock,
        )  # fmt: skip
        self.core = core
        self.config, self.node_id, self.worker_id = config, node_id, worker_id
        owner = OwnerService(core)
        self._faults = faults
        # the owner's handlers as the actor serves them (a fault test's agent: wrapped)
        self.owner = owner if faults is None else cast(OwnerService, SlowPulls(owner, faults))
        self.producers = ProducerService(core)
        self.readers = ReaderService(core)
        self.regions = RegionService(core)
        self.peers = PeerDirectory(
            rdma, _find_agent, _node_of_worker, node_id, _wire_address, wire_auth, _bulk_address
        )
        self.bulk_reader: RangeReader | None = None
        if wire_auth is not None:
            reader = BulkReader(wire_auth, streams=config.wire_streams, stall_s=config.wire_stall_s)
            self.bulk_reader = reader if faults is None else FaultyReader(reader, faults)
        self.consumer = ConsumerService(
            core, peers or self.peers, owner, self.serve, self.bulk_reader
        )
        self.sender = WireSender(core)
        self.bulk: BulkServer | None = None
        if wire_auth is not None and bulk_host is not None:
            opener = (
                self.sender.open if faults is None else StalledSends(self.sender.open, faults).open
            )
            self.bulk = BulkServer(bulk_host, wire_auth, opener, send_stall_s=config.wire_stall_s)
            core.serves_wire = True
        if peers is None:
            core.tell_copy_ends = self.peers.tell_copy_ends
        self.jobs = None if jobs is None else JobWatch(jobs)
        self._gauges_due = -math.inf
        self._refresh_gauges(clock())  # every gauge set from the start
        self._ticker: Ticker | None = None
        if timer:
            self._ticker = Ticker(self.tick, name=f"ray_velo-agent-{worker_id:016x}", clock=clock)
            core.poke = self._ticker.poke
            if memory.warm_up_wanted:
                core.poke()  # map the first arena now, outside any caller's send

    # --- introspection ---------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        """Identity and counters (for the API's routing and for ``ray-velo status``)."""
        core = self.core
        rdma = core.rdma
        with core.lock:
            counts = core.state.counts()
            slots = [
                {"slot": s.slot_id, "kind": s.kind, "bytes": s.total_len, "refcount": s.refcount,
                 "leases": len(s.leases), "ended": s.ended, "job": s.job, "detached": s.detached}
                for s in itertools.islice(core.state.slots(), 32)
            ]  # fmt: skip
            return {
                "worker_id": core.worker_id,
                "node_id": core.node_id,
                "pid": os.getpid(),
                "shm_dir": core.config.shm_dir,
                "rdma": rdma is not None,
                "rdma_enabled": core.rdma_enabled,
                "live_slots": counts.live_slots,
                "live_handles": counts.live_handles,
                "live_leases": counts.live_leases,
                "staged_bytes": counts.staged_bytes,
                "pinned_used_bytes": core.memory.pinned_used_bytes,
                "plain_used_bytes": core.memory.plain_used_bytes,
                "registered_bytes": core.memory.budget.registered_bytes,
                "budget_bytes": core.memory.budget.budget_bytes,
                "quarantined_bytes": counts.quarantined_bytes,
                "reservations": len(core.reservations),
                "counters": dataclasses.asdict(counts.counters),
                "slots": slots,
                "jobs_followed": sorted(core.state.followed_jobs()),
                "job_watch": {} if self.jobs is None else self.jobs.counters(),
                "copies": core.consumer_state.copies,
                "relay_readers": core.consumer_state.relay_readers,
                "relay_renewals": self.consumer.relays.renewals,
                "copy_sources": counts.copy_sources,
                "windowed_leases": self.owner.windowed_leases,
                "windows_registered": self.owner.windows_registered,
                "windowed_gets": self.consumer.driver.windowed_gets,
                "fetches_in_flight": self.consumer.inflight,
                "ucx_endpoints": 0 if rdma is None else rdma.endpoint_count(),
                "ucx_endpoints_reaped": 0 if rdma is None else rdma.endpoints_reaped,
                "ucx_transports": {} if rdma is None else rdma.transports(),
                "peers": self.peers.nodes,
                "metrics": core.metrics.snapshot(),
            }

    def status(self) -> dict[str, Any]:
        """The operator's summary (``ray-velo status --json``): identity, the transport,
        memory, slots and leases, the jobs followed and the detached slots (they outlive
        their job), and the path counters."""
        core = self.core
        with core.lock:
            counts = core.state.counts()
            status: dict[str, Any] = {
                "node_id": core.node_id,
                "worker_id": f"{core.worker_id:016x}",
                "pid": os.getpid(),
                "transport": self._transport(),
                "registered_bytes": core.memory.budget.registered_bytes,
                "budget_bytes": core.memory.budget.budget_bytes,
                "live_slots": counts.live_slots,
                "live_leases": counts.live_leases,
                "staged_bytes": counts.staged_bytes,
                "fetches_in_flight": self.consumer.inflight,
                "draining": counts.draining,
                "jobs_followed": len(core.state.followed_jobs()),
                "detached": _detached_slots(core.state.slots(), core.clock()),
            }
        status["ray_worker_id"] = _ray_worker_id()
        status["process"] = process_stats(core.config.shm_dir)
        snapshot = core.metrics.snapshot()
        status["paths"] = snapshot["velo_rendezvous_rdma_path_total"]
        status["bytes_moved"] = snapshot["velo_bytes_moved_total"]
        status["leases_reaped"] = snapshot["velo_rendezvous_rdma_leases_reaped_total"]
        # decorated payloads that rode inside their Ray call, by why (the only reason: no
        # mapped arena fit inside the send; the timer then warms one for the next)
        status["transparent_inline"] = {
            "no_mapped_arena": snapshot["velo_transparent_inline_total"]
        }
        return status

    def _transport(self) -> str:
        """The UCX transports used to each peer so far, or why there is no RDMA path."""
        core = self.core
        if core.rdma is None:
            return f"none: {self.rdma_unavailable or 'UCX closed'}"
        if not core.rdma_enabled:
            return "none: the kill switch is on (VELO_RDMA_RENDEZVOUS_DISABLE or config)"
        used = sorted({t for ts in core.rdma.transports().values() for t in ts})
        return "ucx: " + (", ".join(used) if used else "no endpoint yet")

    def fetch_into_writer(
        self,
        handle: DataHandle,
        timeout_s: float | None,
        pid: int,
        bound: str,
        nbytes: int,
        mode: Mode = "detach",
    ) -> tuple[Reservation, LocalLease]:
        """:meth:`fetch_into_writer_async` from synchronous code."""
        return asyncio.run(
            self.fetch_into_writer_async(
                handle, timeout_s, pid, bound, nbytes, inline, inline, mode
            )
        )

    async def fetch_into_writer_async(
        self,
        handle: DataHandle,
        timeout_s: float | None,
        pid: int,
        bound: str,
        nbytes: int,
        blocking: Blocking,
        quick: Blocking,
        mode: Mode = "detach",
    ) -> tuple[Reservation, LocalLease]:
        """A PinnedWriter of ``nbytes`` for ``pid`` (``stage_reserve``) with ``handle``'s bytes
        fetched into it (``fetch_remote``, mode ``detach``, or ``claim`` for a decorated
        callee's resolution): one socket call where a tensor transport's receive made two.
        A failed fetch gives the reservation back; the caller owns it (and aborts it as any
        PinnedWriter's) once this returns. ``quick`` runs the reservation's steps (on the
        actor: on its loop unless one may block)."""
        reservation = await quick(self.producers.reserve, nbytes, True, pid)
        assert reservation is not None  # a reservation that may map is never declined
        try:
            lease = await self.consumer.fetch_async(
                handle, mode, timeout_s, pid, bound, blocking, reservation.reservation_id
            )
        except BaseException:
            await quick(
                self.producers.abort, reservation.reservation_id, "the fetch into it failed"
            )
            raise
        return reservation, lease

    def cleanup(self) -> list[tuple[str, int]]:
        """Remove the segments of dead processes in this node's shm directory (never a live
        process's); returns (path, bytes) of each."""
        return [(s.path, s.nbytes) for s in remove_stale_segments(self.core.config.shm_dir)]

    def ping(self) -> int:
        return self.worker_id

    def inject_fault(self, name: str, value: float) -> None:
        """For the fault tests: arm fault ``name`` (:mod:`ray_velo.actors.faults`; 0 disarms
        it) in an agent built with faults.

        Raises:
            ConfigError: this agent was built without faults (every production agent).
            ValueError: an unknown fault, or an RDMA fault on an agent without RDMA.
        """
        if self._faults is None:
            raise fault_injection_off()
        self._faults.arm(
            name,
            value,
            with_rdma=self.core.rdma is not None,
            with_reads=self.bulk_reader is not None,
        )

    # --- entry points --------------------------------------------------------------

    def serve(self, entry: Entry) -> Callable[..., Any]:
        """The method that serves ``entry`` here (:meth:`Entry.served_by`)."""
        return entry.served_by(self)

    def ucx_address(self) -> tuple[int, bytes | None]:
        """(worker id, UCX worker address or None without UCX), for peers to wire up."""
        rdma = self.core.rdma
        return self.worker_id, None if rdma is None else rdma.address

    # --- the timer -------------------------------------------------------------------

    def tick(self, now: float) -> float | None:
        """Sweep deadlines, reap what dead processes left, reclaim arenas; say when next."""
        core = self.core
        if core.closed:
            return None
        with core.changing() as fx:
            states = core.states
            core.metrics.leases_reaped(states.sweep(now, fx))
            watched = states.watched_pids() | self.regions.pids()
            dead = {pid for pid in watched if not pid_alive(pid)}
            reaped = states.reap(dead, now, fx) if dead else None
            counts = states.owner.counts()
            core.metrics.set_slots(counts.live_slots, counts.staged_bytes)
            quiet = states.transfers_in_flight() == 0
            due = [states.next_due(), self._refresh_gauges(now)]
            if watched - dead:
                due.append(now + LIVENESS_INTERVAL_S)
        if reaped is not None:
            for slot_id in reaped.never_committed:
                core.commits.landed(slot_id)
            self.consumer.return_claims(reaped.unclaim)
            self.regions.reap(dead)
        due.append(self._end_jobs(now))
        # outside every caller's send (docs/protocol.md §12), and a large arena only while no
        # transfer of this node is in flight (it would take a core from it)
        if core.memory.warm_up_wanted and core.memory.warm_up(now, quiet=quiet):
            due.append(now + WARM_UP_RETRY_S)
        due += core.memory.reclaim(now)
        if core.rdma is not None:
            core.rdma.reap_idle_endpoints(now)
            due.append(core.rdma.next_reap_due(now))
        return min((d for d in due if d is not None), default=None)

    def _end_jobs(self, now: float) -> float | None:
        """While a live handle here follows a Ray job, look at Ray's job table once a period
        and end the handles of the jobs that ended (actors/jobs.py). Says when next."""
        watch, core = self.jobs, self.core
        if watch is None:
            return None
        with core.lock:
            jobs = core.state.followed_jobs()
        if not jobs:
            return None  # an idle agent asks nothing
        if now < watch.due_at:
            return watch.due_at
        dead = watch.look(jobs, now)  # outside the lock: a GCS call
        if dead:
            with core.changing() as fx:
                ended = sum(core.state.end_job(job, core.clock(), fx) for job in dead)
            _log.info("ray_velo: jobs %s ended; %d staged handles of theirs ended", dead, ended)
        return watch.due_at

    def _refresh_gauges(self, now: float) -> float:
        """Re-set every gauge when due (Ray drops a gauge nobody sets); says when next."""
        if now < self._gauges_due:
            return self._gauges_due
        core = self.core
        memory = core.memory
        with core.lock:
            counts = core.state.counts()
            live_slots, staged = counts.live_slots, counts.staged_bytes
        registered_arenas = 0 if memory.pinned_pool is None else memory.pinned_pool.arenas
        core.metrics.refresh(
            metrics.Gauges(
                registered_bytes=memory.budget.registered_bytes,
                live_regions=registered_arenas + self.regions.live,
                live_slots=live_slots,
                staged_bytes=staged,
                registered_arenas=registered_arenas,
                plain_arenas=memory.plain_pool.arenas,
                budget_bytes=memory.budget.budget_bytes,
            )
        )
        self._gauges_due = now + metrics.GAUGE_REFRESH_S
        return self._gauges_due

    # --- shutdown --------------------------------------------------------------------

    def shutdown(self, timeout_s: float | None = None) -> dict[str, int]:
        """The protocol's shutdown order (docs/protocol.md §18), under one bound (``timeout_s``, else the config's
        ``shutdown_timeout``, else 30 s):

        1. gate: no new reservation, region or fetch; acquires answer chunked (``draining``);
        2. stop the reaper (the timer); the drains pass over leases whose deadline passed;
        3. demote: copy every registered slot to plain memory, so a chunked pull admitted
           before the gate still finishes;
        4. drain the GETs: this agent's own fetches, the RDMA and wire leases on its memory
           (GETs of it, and its sends over the wire), and the reads of what fetches brought
           during the drain; then close the bulk port (a send still running stops there);
        5. deregister regions, then arenas (before UCX: pages outlive registrations);
        6. drain the chunked pulls still running (the messenger half, remaining time);
        7. free every slot, unmap the plain pool, tear UCX down.

        A drain that runs out of time is logged and the steps after it run anyway: a GET
        still in flight then fails at the consumer. Returns what each step did.
        """
        core = self.core
        bound = timeout_s if timeout_s is not None else core.config.rdma.shutdown_timeout
        deadline = core.clock() + (bound if bound is not None else 30.0)
        with core.lock:
            if core.closed:
                return {"slots": 0}
            core.state.begin_drain()
            core.closed = True
            counts = core.state.counts()
            report = {
                "fetches_at_gate": self.consumer.inflight,
                "gets_at_gate": counts.rdma_leases,
                "reads_at_gate": counts.wire_leases,
                "pulls_at_gate": counts.chunked_leases,
            }
        if self._ticker is not None:
            self._ticker.stop()
        report["demoted"] = self._demote()
        report["gets_drained"] = int(self._drain_gets(deadline))
        if self.bulk is not None:  # a send still running stops here, before its bytes go
            self.sender.close()
            self.bulk.close()
        with core.changing() as fx:
            core.state.release_demoted(fx)
        self.regions.close()
        # A fetch of ours still running may be inside a GET into the registered pool:
        # never unmap under it (the files go; the pages go with the process).
        core.memory.close_registered(unmap=self.consumer.inflight == 0)
        state = core.state
        report["pulls_drained"] = int(
            core.wait_until(lambda: state.counts(core.clock()).chunked_leases == 0, deadline)
        )
        if not report["pulls_drained"]:
            _log.warning(
                "ray_velo: %d chunked pulls still running at the shutdown bound; ending them",
                state.counts().chunked_leases,
            )
        with core.changing() as fx:
            report["slots"] = core.states.clear(core.clock(), fx)
        core.commits.release_all()
        self.peers.close()
        if self.bulk_reader is not None:
            self.bulk_reader.close()
        core.memory.close()
        if core.rdma is not None:  # after every unmap: endpoints and worker go last
            core.rdma.close()
            core.rdma = None
        self.consumer.driver.renewals.close()  # no GET runs after UCX closed
        return report

    def _demote(self) -> int:
        """Step 3: copy each registered slot into plain memory (outside the lock; the read
        gate keeps its bytes meanwhile). A slot plain memory cannot hold stays registered
        until step 5; its pulls then fail. Returns the slots moved."""
        core = self.core
        with core.lock:
            slots = core.state.demotion_begin()
        moved = 0
        for slot in slots:
            fid = self._copy_for_demotion(slot)
            with core.changing() as fx:
                if fid is None:
                    moved += core.state.demote(slot, None, core.clock(), fx)
                else:
                    moved += core.consumer_state.fetch_demote(fid, slot, core.clock(), fx)
        return moved

    def _copy_for_demotion(self, slot: Any) -> int | None:
        """Copy ``slot`` into a plain buffer a fetch id owns; that id, or None when it could
        not (one slot's copy must not stop the shutdown: it stays where it is)."""
        try:
            with self.core.plain_copy_buffer(slot.total_len) as (fid, placement):
                source = slot.location
                if isinstance(source, RegionSlot):
                    source.region.copy_into(source.offset, placement.view()[: slot.total_len])
                else:
                    placement.view()[: slot.total_len] = source.view()[: slot.total_len]
            return fid
        except Exception:
            _log.warning("ray_velo: could not demote slot %d", slot.slot_id, exc_info=True)
            return None

    def _drain_gets(self, deadline: float) -> bool:
        """Step 4: this agent's fetches end, the RDMA leases on its memory end, and so do
        the reads of fetches that finished during the drain (their reader maps the copy,
        which may sit in registered memory, after the fetch returns)."""
        state = self.core.state
        fetches = self.consumer.wait_idle(deadline)
        clock = self.core.clock

        def drained() -> bool:
            counts = state.counts(clock())
            return counts.rdma_leases == 0 and counts.wire_leases == 0 and counts.late_reads == 0

        leases = self.core.wait_until(drained, deadline)
        if not (fetches and leases):
            counts = state.counts()
            _log.warning(
                "ray_velo: at the shutdown bound %d fetches, %d RDMA leases, %d wire leases "
                "and %d reads were still live; unmapping anyway (their GETs and reads fail at "
                "the consumer)",
                self.consumer.inflight,
                counts.rdma_leases,
                counts.wire_leases,
                counts.late_reads,
            )
        return fetches and leases
