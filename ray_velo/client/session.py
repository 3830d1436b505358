"""This process's ray_velo session: its node's agent, the segments it mapped, and the staging and
reading primitives the API and transparent staging share. Sizes in bytes, durations in seconds."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import numpy as np
import ray
from ray import exceptions as ray_errors

from ray_velo import _ray
from ray_velo.agent.calls import clear_ray_frames, wait
from ray_velo.client.payload import as_bytes_view, from_bytes_view
from ray_velo.config import VeloConfig, check_lifetime
from ray_velo.errors import AgentDied, ConfigError, NotInitialized, TransferTimeout
from ray_velo.local.channel import AgentChannel, ChannelFull
from ray_velo.local.records import LocalLease, Reservation
from ray_velo.memory.arena import SegmentMap
from ray_velo.protocol import DataHandle, TypeHeader
from ray_velo.protocol.entry import (
    CLAIM_END,
    END_LEASE,
    FETCH_INTO_WRITER,
    FETCH_REMOTE,
    LOCAL_ACQUIRE,
    RELEASE_QUIETLY,
    ROUTE,
    STAGE_ABORT,
    STAGE_COMMIT,
    STAGE_RESERVE,
    STAGE_WRITTEN,
    Entry,
)  # fmt: skip

__all__ = [
    "AGENT_SLACK_S",
    "Session",
    "StagingJob",
    "call",
    "claim_end",
    "commit",
    "current",
    "end_lease",
    "fetch_bound",
    "forget",
    "job_for",
    "lease",
    "leased_array",
    "read",
    "release_soon",
    "reserve",
    "segment_view",
    "stage",
    "stage_streamed",
    "staging_job",
    "staging_terms",
    "view_of",
]

_log = logging.getLogger(__name__)

#: Extra seconds a task waits on its local agent beyond the fetch bound, for the agent's own
#: answer (TransferTimeout) to arrive rather than a bare Ray timeout.
AGENT_SLACK_S = 15.0  # > the binding's 5 s abort grace for a timed-out GET, plus margin


@dataclass
class Session:
    """This process's view of ray_velo: its node's agent and mapped segments."""

    config: VeloConfig
    node_id: str
    agent: Any
    worker_id: int
    segments: SegmentMap
    #: The agent's socket for the calls a caller waits for; None: Ray calls only.
    channel: AgentChannel | None = None

    # --- the agent's entry points a process calls (ray_velo/protocol/entry.py) -----------

    def stage_reserve(self, nbytes: int, pinned: bool, may_map: bool) -> Reservation | None:
        return cast(
            Reservation | None, self._call(STAGE_RESERVE, nbytes, pinned, os.getpid(), may_map)
        )

    def stage_commit(self, reservation_id: int, *terms: Any) -> None:
        self._notify(STAGE_COMMIT, reservation_id, *terms)

    def stage_abort(self, reservation_id: int) -> None:
        self._notify(STAGE_ABORT, reservation_id)

    def stage_written(self, handle: DataHandle, upto: int) -> None:
        self._notify(STAGE_WRITTEN, handle, upto)

    def local_acquire(self, handle: DataHandle, mode: str) -> LocalLease:
        return cast(LocalLease, self._call(LOCAL_ACQUIRE, handle, os.getpid(), mode))

    def end_lease(self, handle: DataHandle, lease_id: int, release: bool) -> None:
        self._notify(END_LEASE, handle, lease_id, release)

    def fetch_remote(
        self, handle: DataHandle, mode: str, bound: float | None, which: str, into: int, *,
        timeout_s: float | None,
    ) -> LocalLease:  # fmt: skip
        args = (handle, mode, bound, os.getpid(), which, into)
        return cast(LocalLease, self._call(FETCH_REMOTE, *args, timeout_s=timeout_s))

    def fetch_into_writer(
        self, handle: DataHandle, bound: float | None, which: str, nbytes: int, mode: str, *,
        timeout_s: float | None,
    ) -> tuple[Reservation, Any]:  # fmt: skip
        args = (handle, bound, os.getpid(), which, nbytes, mode)
        return cast(
            tuple[Reservation, Any], self._call(FETCH_INTO_WRITER, *args, timeout_s=timeout_s)
        )

    def claim_end(self, handle: DataHandle, consume: bool) -> None:
        self._notify(CLAIM_END, handle, consume, os.getpid())

    def release_quietly(self, handle: DataHandle) -> None:
        self._notify(RELEASE_QUIETLY, handle)

    def route(self, handle: DataHandle, handler: Entry, message: bytes) -> Any:
        """Owner ``handler`` on ``handle``'s owner, through this node's agent."""
        return self._call(ROUTE, handle, handler.name, message, None)

    def _call(self, entry: Entry, *args: Any, timeout_s: float | None = None) -> Any:
        """Run ``entry`` on the agent and wait for it, within ``timeout_s``: over the agent's
        socket when it carries the entry and the agent has one, else as a Ray call. Raises
        what the agent raised; AgentDied (the session forgotten) when the agent is gone."""
        if self.channel is not None and entry.socket == "call":
            try:
                return self.channel.call(entry.name, args, timeout_s, lambda: _no_answer(timeout_s))
            except ChannelFull:
                pass  # this process holds as many connections as it may: a Ray call
            except AgentDied:
                forget()
                raise
        return call(getattr(self.agent, entry.name).remote(*args), timeout_s)

    def _notify(self, entry: Entry, *args: Any) -> None:
        """Run ``entry`` on the agent without waiting (a commit, a lease end): over its socket
        when it has one, else as a Ray call. Never raises: nobody is there to tell, and the
        agent reaps what a lost notice leaves (dead readers' leases, uncommitted
        reservations of dead producers)."""
        if self.channel is not None and self.channel.notify(entry.name, args):
            return
        with contextlib.suppress(Exception):
            getattr(self.agent, entry.name).remote(*args)


_lock = threading.Lock()
_session: Session | None = None
T = TypeVar("T")


#: Attempts of a call that meets a dead local agent: one whose session named an agent that
#: died earlier, one more if the node's next agent dies during the call too.
AGENT_ATTEMPTS = 3


def retrying_dead_agent(attempt: Callable[[], T]) -> T:
    """Run ``attempt`` (which calls this node's agent), again on the node's fresh agent when
    the one it reached died (AgentDied), up to :data:`AGENT_ATTEMPTS` times in all."""
    for _ in range(AGENT_ATTEMPTS - 1):
        try:
            return attempt()
        except AgentDied:
            continue
    return attempt()


def call(ref: Any, timeout_s: float | None = None) -> Any:
    """Wait for a call to this node's agent; Ray's errors mapped to ours. A dead agent is
    forgotten (the next call finds the node's new one) and raises AgentDied."""
    try:
        return wait(ref, timeout_s, peer="agent", on_timeout=lambda: _no_answer(timeout_s))
    except AgentDied:
        forget()
        raise


def _no_answer(timeout_s: float | None) -> BaseException:
    return TransferTimeout(
        handle="?", timeout_s=timeout_s, bound="this node's agent did not answer in time"
    )


def forget() -> None:
    """Drop this process's session (its agent died, or ray_velo shut down)."""
    global _session
    with _lock:
        session, _session = _session, None
    _writer.close()  # its payloads' notices go over the session's socket: before it closes
    if session is not None and session.channel is not None:
        session.channel.close()


def current() -> Session:
    """This process's session; inside a Ray worker it is set up on first use.

    Raises:
        NotInitialized: Ray is not initialized in this process.
    """
    global _session
    session = _session
    if session is not None:
        return session
    if not ray.is_initialized():
        raise NotInitialized()
    from ray_velo.actors.directory import load_cluster_config

    with _lock:
        if _session is None:
            node_id = ray.get_runtime_context().get_node_id()
            agent, info = _live_agent(node_id)
            _session = Session(
                config=load_cluster_config(),
                node_id=node_id,
                agent=agent,
                worker_id=info["worker_id"],
                segments=SegmentMap(),
                channel=AgentChannel(info["socket"]) if info.get("socket") else None,
            )
        return _session


def _live_agent(node_id: str, timeout_s: float = 30.0) -> tuple[Any, dict[str, Any]]:
    """This node's agent, answering; a dead one's name takes a moment to free, so retry."""
    from ray_velo.actors.directory import ensure_agent

    deadline = time.monotonic() + timeout_s
    while True:
        agent = ensure_agent(node_id)
        try:
            return agent, ray.get(agent.info.remote(), timeout=timeout_s)
        except ray_errors.RayActorError as exc:
            clear_ray_frames(exc)
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


# --- staging -------------------------------------------------------------------------------

#: Payloads at least this large are copied by two threads (numpy releases the GIL): measured
#: 256 MiB in 15-17 ms with one thread, 10-12 ms with two, on the 2-core dev machine.
_PARALLEL_COPY_BYTES = 32 << 20


def copy_into(dest: np.ndarray[Any, Any], source: np.ndarray[Any, Any]) -> None:
    """``dest[:] = source`` for flat uint8 arrays; large ones in two halves at once."""
    if source.nbytes < _PARALLEL_COPY_BYTES:
        np.copyto(dest, source)
        return
    half = source.nbytes // 2
    helper = threading.Thread(
        target=np.copyto, args=(dest[:half], source[:half]), name="ray_velo-copy"
    )
    helper.start()
    try:
        np.copyto(dest[half:], source[half:])
    finally:
        helper.join()


def staging_job() -> tuple[str, bool]:
    """The Ray job this process stages for (hex; "" outside Ray), and whether a detached
    actor roots its work: Ray keeps a detached actor (and the tasks it starts) past the job
    that created it, so what it stages outlives that job too."""
    try:
        job = ray.get_runtime_context().get_job_id()
    except Exception:  # Ray not initialized (ray_velo.testing): no job to follow
        return "", False
    return job, _ray.in_detached_actor()


def stage(
    obj: Any,
    *,
    pinned: bool,
    ttl: float | None,
    consumers: int = 1,
    follow_producer: bool = False,
    lifetime: str | None = None,
    staged_from: str | None = None,
) -> DataHandle:
    """Stage ``obj`` on this node's agent with ``consumers`` references; its handle (with
    ``follow_producer`` the handle also ends when this process dies). The handle ends with
    this process's Ray job unless ``lifetime`` is ``"detached"``. ``staged_from``: the
    device ``obj``'s bytes were copied from (a transport that stages a CUDA tensor's bytes
    as a host array says ``"cuda"``, so the agent counts the staging); None: ``obj``'s own.

    Returns as soon as the bytes are written: the commit is sent without waiting, and a call
    that names the handle before it lands waits for it on the agent.
    """
    handle = _stage(
        obj, pinned, ttl, consumers, follow_producer, lifetime, may_map=True,
        staged_from=staged_from,
    )  # fmt: skip
    assert handle is not None  # a reservation that may map is never declined
    return handle


#: Payloads at least this large may be staged streamed (:func:`stage_streamed`).
STREAMED_MIN_BYTES = 8 << 20
#: The least a streamed payload's writer copies between two notices to the agent.
_WRITTEN_STEP_MIN = 4 << 20
#: A writer thread with nothing to write for this long ends (and its socket connection).
_WRITER_IDLE_S = 10.0


def stage_streamed(
    obj: Any, *, ttl: float | None, follow_producer: bool, staged_from: str | None = None
) -> DataHandle:
    """:func:`stage` with one reference and registered memory, returning before the bytes
    are written: the commit goes first, and a thread of this process copies ``obj`` into
    the slot, telling the agent how far it got, while readers on other nodes GET the
    windows already written (the agent answers each once its bytes are there; readers on
    this node wait for all of them). The bytes read are ``obj``'s as the thread copies
    them, within milliseconds of this call: a caller must not change ``obj`` meanwhile
    (what Ray asks of a tensor-transport object's source tensor). The agent keeps the
    slot's memory until the thread wrote it all or this process died, whatever ends the
    handle meanwhile. Below :data:`STREAMED_MIN_BYTES`: :func:`stage`."""
    header, view = as_bytes_view(obj)
    if view.nbytes < STREAMED_MIN_BYTES:
        return stage(obj, pinned=True, ttl=ttl, follow_producer=follow_producer,
                     staged_from=staged_from)  # fmt: skip
    if staged_from is not None:
        header = dataclasses.replace(header, device=staged_from)
    job = staging_terms(ttl, None)
    session, reservation = reserve(view.nbytes, True)
    assert reservation is not None  # a reservation that may map is never declined
    commit(session, reservation, header, ttl, 1, follow_producer, job, writing=True)
    dest = segment_view(session, reservation.path, reservation.offset, view.nbytes)
    _writer.write(session, reservation.handle, dest, [(0, view)])
    return reservation.handle


#: The parts of a packed slot (:func:`stage_packed`) start at multiples of this: any dtype's
#: alignment, and a cache line.
PACK_ALIGN = 64


def pack_layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Where each part of sizes ``sizes`` starts in a packed slot, and the slot's size."""
    offsets, end = [], 0
    for size in sizes:
        start = -(-end // PACK_ALIGN) * PACK_ALIGN
        offsets.append(start)
        end = start + size
    return offsets, end


def stage_packed(
    parts: Sequence[np.ndarray[Any, Any]],
    *,
    ttl: float | None,
    follow_producer: bool,
    staged_from: str | None = None,
    consumers: int = 1,
    lifetime: str | None = None,
    streamed: bool = True,
    may_map: bool = True,
) -> tuple[DataHandle, list[int]] | None:
    """Stage flat uint8 ``parts`` (the tensors of one object, the payloads of one call)
    together in one slot with ``consumers`` references: one reservation, one handle, one GET
    for a reader, however many parts. Each starts at a :data:`PACK_ALIGN` boundary, the gaps
    zeroed. ``streamed``, from :data:`STREAMED_MIN_BYTES` in all: the copy is streamed
    (:func:`stage_streamed`'s terms); else written before the commit. Returns the handle and
    each part's offset; None when ``may_map`` is False and no mapped arena fits
    (:func:`stage_transparent`)."""
    offsets, total = pack_layout([part.nbytes for part in parts])
    pieces = list(zip(offsets, parts, strict=True))
    header = TypeHeader("numpy", "|u1", (total,), device=staged_from or "cpu")
    job = staging_terms(ttl, lifetime)
    session, reservation = reserve(total, True, may_map)
    if reservation is None:
        return None
    dest = segment_view(session, reservation.path, reservation.offset, total)
    if streamed and total >= STREAMED_MIN_BYTES:
        commit(session, reservation, header, ttl, consumers, follow_producer, job, writing=True)
        _writer.write(session, reservation.handle, dest, pieces)
        return reservation.handle, offsets
    try:
        into = np.frombuffer(dest, dtype=np.uint8)
        written = 0
        for offset, part in pieces:
            into[written:offset] = 0
            copy_into(into[offset : offset + part.nbytes], part)
            written = offset + part.nbytes
        del into, dest
        commit(session, reservation, header, ttl, consumers, follow_producer, job)
    except BaseException:
        session.stage_abort(reservation.reservation_id)
        raise
    return reservation.handle, offsets


class _BackgroundWriter:
    """The thread that writes streamed payloads (:func:`stage_streamed`) in order, started
    when there is one to write and ended after :data:`_WRITER_IDLE_S` without one, or by
    :meth:`close` (the session's end)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._queue: list[tuple[Session, DataHandle, memoryview, Sequence[tuple[int, Any]]]] = []
        self._thread: threading.Thread | None = None
        self._closing = False

    def write(
        self,
        session: Session,
        handle: DataHandle,
        dest: memoryview,
        pieces: Sequence[tuple[int, Any]],
    ) -> None:
        """Queue ``pieces`` (``(offset, source)``) to be copied into ``dest``."""
        with self._cond:
            self._queue.append((session, handle, dest, pieces))
            self._cond.notify()
            if self._thread is None:
                self._closing = False
                self._thread = threading.Thread(
                    target=self._run, name="ray_velo-writer", daemon=True
                )
                self._thread.start()

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued, then end the thread and join it (within ``timeout_s``)."""
        with self._cond:
            thread, self._closing = self._thread, True
            self._cond.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._queue and not self._closing:
                    self._cond.wait(_WRITER_IDLE_S)
                if not self._queue:
                    self._thread = None
                    return
                session, handle, dest, pieces = self._queue.pop(0)
            try:
                _write_streamed(session, handle, dest, pieces)
            except Exception:  # the agent heard (-1) and ends the handle; the next one goes on
                _log.exception("ray_velo: writing %s into its slot failed", handle)


def _write_streamed(
    session: Session, handle: DataHandle, dest: memoryview, pieces: Sequence[tuple[int, Any]]
) -> None:
    """Copy each ``(offset, source)`` piece into ``dest`` at its offset, in order, zeroing the
    gaps between them (no stale bytes of an earlier payload reach a reader), and tell the
    agent how far ``dest`` is written (``stage_written``) each :data:`_WRITTEN_STEP_MIN`
    or more and at the end; a failure tells it the handle cannot be read (-1)."""
    into = np.frombuffer(dest, dtype=np.uint8)
    step = max(_WRITTEN_STEP_MIN, into.nbytes // 32)
    told = written = 0
    try:
        for offset, source in pieces:
            data = np.frombuffer(source, dtype=np.uint8)
            into[written:offset] = 0
            for at in range(0, data.nbytes, step):
                end = min(data.nbytes, at + step)
                copy_into(into[offset + at : offset + end], data[at:end])
                if offset + end - told >= step:
                    told = offset + end
                    session.stage_written(handle, told)
            written = offset + data.nbytes
        into[written:] = 0
        if told < into.nbytes:
            session.stage_written(handle, into.nbytes)
    except BaseException:
        session.stage_written(handle, -1)
        raise


_writer = _BackgroundWriter()


def stage_transparent(
    obj: Any, *, ttl: float | None, consumers: int, lifetime: str | None = None
) -> DataHandle | None:
    """Stage ``obj`` inside a caller's send (``@ray_velo.transfer``): only into an arena
    the agent has already mapped, never a new mapping or registration (docs/protocol.md
    §12). None when none fits: the payload then travels inside the Ray call, and the agent
    warms an arena up for the next one."""
    return _stage(obj, True, ttl, consumers, False, lifetime, may_map=False)


def _stage(
    obj: Any,
    pinned: bool,
    ttl: float | None,
    consumers: int,
    follow_producer: bool,
    lifetime: str | None,
    *,
    may_map: bool,
    staged_from: str | None = None,
) -> DataHandle | None:
    job = staging_terms(ttl, lifetime)
    header, view = as_bytes_view(obj)
    if staged_from is not None:
        header = dataclasses.replace(header, device=staged_from)
    nbytes = view.nbytes
    session, reservation = reserve(nbytes, pinned, may_map)
    if reservation is None:
        return None
    try:
        if nbytes:
            dest = segment_view(session, reservation.path, reservation.offset, nbytes)
            copy_into(np.frombuffer(dest, dtype=np.uint8), np.frombuffer(view, dtype=np.uint8))
            del dest
        commit(session, reservation, header, ttl, consumers, follow_producer, job)
    except BaseException:
        session.stage_abort(reservation.reservation_id)
        raise
    return reservation.handle


@dataclass(frozen=True)
class StagingJob:
    """The Ray job staged data follows (hex; "" outside Ray), or ``detached`` from it."""

    job: str
    detached: bool


def staging_terms(ttl: float | None, lifetime: str | None) -> StagingJob:
    """Check a staging call's ``ttl`` and ``lifetime``; the job its data will follow.

    Raises:
        ConfigError: ``ttl`` is not None or > 0, or ``lifetime`` is not None or "detached".
    """
    if ttl is not None and not ttl > 0:
        raise ConfigError(field="ttl", value=ttl, rule="must be None or > 0 seconds")
    return job_for(lifetime)


def job_for(lifetime: str | None) -> StagingJob:
    """The job data staged now with ``lifetime`` follows (see :class:`StagingJob`).

    Raises:
        ConfigError: ``lifetime`` is not None or "detached".
    """
    detached = check_lifetime(lifetime)
    job, in_detached_actor = staging_job()
    return StagingJob(job, detached or in_detached_actor)


def reserve(nbytes: int, pinned: bool, may_map: bool = True) -> tuple[Session, Reservation | None]:
    """Reserve ``nbytes`` on this node's agent for this process to write, on the node's
    fresh agent if the one reached died (nothing is staged yet). None: ``may_map`` False
    and no mapped arena fits."""

    def attempt() -> tuple[Session, Reservation | None]:
        session = current()
        return session, session.stage_reserve(nbytes, pinned, may_map)

    return retrying_dead_agent(attempt)


def commit(
    session: Session,
    reservation: Reservation,
    header: TypeHeader,
    ttl: float | None,
    consumers: int,
    follow_producer: bool,
    job: StagingJob,
    writing: bool = False,
) -> None:
    """Turn a written reservation into a slot with ``consumers`` references; not waited for
    (a call that names the handle before the commit lands waits for it on the agent).
    ``writing``: the bytes are written after the commit (:func:`stage_streamed`)."""
    session.stage_commit(
        reservation.reservation_id, reservation.nbytes, header, ttl, consumers, follow_producer,
        job.job, job.detached, writing,
    )  # fmt: skip


# --- reading -------------------------------------------------------------------------------


def fetch_bound(timeout: float | None, config: VeloConfig) -> tuple[float | None, str]:
    """The smaller of the caller's ``timeout`` and ``staged_fetch_timeout``, and its name."""
    bounds = [
        (t, name)
        for t, name in (
            (timeout, "caller timeout"),
            (config.staged_fetch_timeout, "staged_fetch_timeout"),
        )
        if t is not None
    ]
    if not bounds:
        return None, "unbounded"
    return min(bounds)


def _fetch_wait(
    timeout: float | None, config: VeloConfig
) -> tuple[float | None, str, float | None]:
    """A cross-node fetch's bound and which limit set it (:func:`fetch_bound`), and how long
    its caller waits for the agent's answer (the bound plus the agent's slack)."""
    bound, which = fetch_bound(timeout, config)
    return bound, which, None if bound is None else bound + AGENT_SLACK_S


def lease(
    handle: DataHandle, mode: str, timeout: float | None, writer_reservation: int = 0
) -> LocalLease:
    """A local lease on ``handle``'s bytes on this node (brought over if remote).

    ``mode``: ``release``, ``claim``, ``detach`` or ``hold`` (see the agent's readers and
    consumer). ``writer_reservation``: a PinnedWriter the remote bytes land in (``hold``).
    """
    if not isinstance(handle, DataHandle):
        raise TypeError(f"expected a DataHandle, got {type(handle).__name__}")
    # This node's agent died (a remote owner's reference is consumed only after a fetch
    # succeeds, and the owner hands a dead consumer's claim to its successor): ask the node's
    # fresh agent. A handle the dead agent owned is gone and says so (HandleNotFound).
    return retrying_dead_agent(lambda: _lease_once(handle, mode, timeout, writer_reservation))


def _lease_once(
    handle: DataHandle, mode: str, timeout: float | None, writer_reservation: int
) -> LocalLease:
    session = current()
    if handle.worker_id == session.worker_id and not writer_reservation:
        return session.local_acquire(handle, mode)
    bound, which, wait_s = _fetch_wait(timeout, session.config)
    return session.fetch_remote(handle, mode, bound, which, writer_reservation, timeout_s=wait_s)


def fetch_into_writer(
    handle: DataHandle, nbytes: int, timeout: float | None, mode: str = "detach"
) -> tuple[Session, Reservation]:
    """A reservation of ``nbytes`` of this node's registered pool (a PinnedWriter's) holding
    ``handle``'s bytes, fetched from its owner on another node: :func:`reserve` and
    :func:`lease` (``mode``: ``detach``, or ``claim`` ended by :func:`claim_end`) in one
    call to the agent."""

    def attempt() -> tuple[Session, Reservation]:
        session = current()
        bound, which, wait_s = _fetch_wait(timeout, session.config)
        reservation, _ = session.fetch_into_writer(
            handle, bound, which, nbytes, mode, timeout_s=wait_s
        )
        return session, reservation

    return retrying_dead_agent(attempt)


class _LeasedBytes:
    """Exports a leased slot's bytes read-only to numpy; the lease ends when it is collected.

    It is the ``base`` of every array over the bytes (views of views included), so the
    lease outlives every one of them.
    """

    __slots__ = ("__array_interface__", "__weakref__", "_view")

    def __init__(self, view: memoryview) -> None:
        self._view = view
        address = np.frombuffer(view, dtype=np.uint8).ctypes.data if view.nbytes else 0
        self.__array_interface__ = {
            "data": (address, True),
            "shape": (view.nbytes,),
            "typestr": "|u1",
            "version": 3,
        }


def end_lease(session: Session, handle: DataHandle, lease_id: int, release: bool = False) -> None:
    """End a local lease without waiting. Interpreter or Ray shutting down: the agent reaps
    the leases of dead readers."""
    session.end_lease(handle, lease_id, release)


def segment_view(session: Session, path: str, offset: int, nbytes: int) -> memoryview:
    """A view into an agent's segment. Segments stay mapped in this process for reuse
    (the agent keeps its arenas warm; a fresh mapping costs a page fault per 4 KiB on first
    touch); the mapping of a segment the agent deleted is dropped on the next new one."""
    if not session.segments.is_mapped(path):
        session.segments.prune_missing()
    return session.segments.view(path, offset, nbytes)


def view_of(local: LocalLease) -> memoryview:
    return segment_view(current(), local.path, local.offset, local.total_len)


def leased_array(local: LocalLease) -> np.ndarray[Any, Any]:
    """A read-only uint8 array over the leased bytes; the lease ends when it is collected."""
    session = current()
    exporter = _LeasedBytes(view_of(local))
    finalizer = weakref.finalize(exporter, end_lease, session, local.handle, local.lease_id)
    finalizer.atexit = False
    return np.asarray(exporter)


def read(local: LocalLease, device: str | None = None) -> Any:
    """The typed object over a local lease; numpy views end the lease when collected, the
    other kinds (copied out, to a CUDA device for a tensor that goes there) end it at once.
    ``device``: where a torch tensor goes (``payload.fetch_device``)."""
    header = local.type_header
    if local.total_len == 0 or header.kind in ("bytes", "torch"):
        try:
            data: Any = b"" if local.total_len == 0 else view_of(local)
            return from_bytes_view(header, data, copy=header.kind == "torch", device=device)
        finally:
            end_lease(current(), local.handle, local.lease_id)
    return from_bytes_view(header, leased_array(local))


def claim_end(handle: DataHandle, consume: bool) -> None:
    """This process is done with its claim on ``handle`` (a transparent resolution):
    ``consume`` it, or give it back for a retry. Not waited for."""
    with contextlib.suppress(Exception):  # current() itself may fail at interpreter exit
        current().claim_end(handle, consume)


def release_soon(handle: DataHandle) -> None:
    """Drop one reference on ``handle`` without waiting for the owner's answer (an error
    here would have nobody to tell)."""
    current().release_quietly(handle)
