"""The public API (DESIGN.md §4): init/shutdown, put/fetch, and the spec's handle API.

Every process (driver, task, actor) talks to the agent of its own node. Staging writes the
payload straight into the agent's shared segment; a fetch on the owner's node is a
read-only, zero-copy view of that segment under a read lease that ends when the view is
garbage-collected; a fetch from another node asks the local agent to bring a copy over
(RDMA GET or chunked pulls) and then reads that copy in place.

Units: sizes in bytes, durations in seconds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
from ray import exceptions as ray_errors

from ray_velo.actors.agent import LocalLease, Reservation
from ray_velo.actors.directory import (
    NAMESPACE,
    agent_name,
    cluster_config_stored,
    ensure_agent,
    ensure_agents,
    load_cluster_config,
    store_cluster_config,
)
from ray_velo.config import VeloConfig
from ray_velo.consumer import clear_ray_frames
from ray_velo.errors import (
    AgentDied,
    ConfigError,
    NotInitialized,
    RegionDeregistered,
    TransferTimeout,
)
from ray_velo.memory.arena import SegmentMap
from ray_velo.payload import as_bytes_view, from_bytes_view
from ray_velo.protocol import (
    DataHandle,
    DetachRequest,
    HandleMetadata,
    MetadataRequest,
    MetadataResponse,
    RefRequest,
    ReleaseRequest,
    TypeHeader,
    decode,
    encode,
)

__all__ = [
    "PinnedBuf",
    "PinnedWriter",
    "RegionGuard",
    "alloc_pinned_writer",
    "alloc_region",
    "detach",
    "fetch",
    "get",
    "get_into",
    "get_pinned",
    "init",
    "is_initialized",
    "metadata",
    "put",
    "ref_handle",
    "register_data",
    "register_data_in_region",
    "register_data_pinned",
    "release",
    "shutdown",
]

_log = logging.getLogger(__name__)

#: Extra seconds a task waits on its local agent beyond the fetch bound, for the agent's own
#: answer (TransferTimeout) to arrive rather than a bare Ray timeout.
_AGENT_SLACK_S = 15.0  # > the binding's 5 s abort grace for a timed-out GET, plus margin


@dataclass
class _Process:
    """This process's view of ray_velo: its node's agent and mapped segments."""

    config: VeloConfig
    node_id: str
    agent: Any
    worker_id: int
    segments: SegmentMap


_state_lock = threading.Lock()
_state: _Process | None = None
_started_ray = False


def _unwrap(exc: BaseException) -> BaseException:
    if isinstance(exc, ray_errors.RayTaskError) and isinstance(exc.cause, BaseException):
        return exc.cause
    return exc


def _call(ref: Any, timeout_s: float | None = None) -> Any:
    """Wait for a call to the local agent; Ray's errors mapped to ours."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray_errors.GetTimeoutError as exc:
        clear_ray_frames(exc)
        raise TransferTimeout(
            handle="?", timeout_s=timeout_s, bound="this node's agent did not answer in time"
        ) from None
    except ray_errors.RayTaskError as exc:
        clear_ray_frames(exc)
        raise _unwrap(exc) from None
    except ray_errors.RayActorError as exc:
        clear_ray_frames(exc)
        _forget_agent()
        raise AgentDied() from exc


def _forget_agent() -> None:
    global _state
    with _state_lock:
        _state = None


def _process() -> _Process:
    """This process's state; inside a Ray worker it is set up on first use."""
    global _state
    state = _state
    if state is not None:
        return state
    if not ray.is_initialized():
        raise NotInitialized()
    with _state_lock:
        if _state is None:
            node_id = ray.get_runtime_context().get_node_id()
            agent, info = _live_agent(node_id)
            _state = _Process(
                config=load_cluster_config(),
                node_id=node_id,
                agent=agent,
                worker_id=info["worker_id"],
                segments=SegmentMap(),
            )
        return _state


def _live_agent(node_id: str, timeout_s: float = 30.0) -> tuple[Any, dict[str, Any]]:
    """This node's agent, answering; a dead one's name takes a moment to free, so retry."""
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


def init(config: VeloConfig | None = None, **ray_init_kwargs: Any) -> None:
    """Start ray_velo: ``ray.init()`` if needed, then one agent on every alive node.

    Without a running Ray, this starts an embedded local cluster (``ray.init(**kwargs)``);
    with one (``ray.init(address=...)`` first, or inside a task) it joins it. Tasks never
    need to call ``init``: they find their node's agent on first use, and a node that joins
    later gets its agent then.

    Raises:
        ConfigError: ``config`` breaks a rule.
    """
    global _started_ray
    if not ray.is_initialized():
        ray.init(**ray_init_kwargs)
        _started_ray = True
    if config is not None or not cluster_config_stored():
        # A second driver's bare init() must not reset the cluster's config to defaults.
        store_cluster_config(config or VeloConfig())
    config = config or load_cluster_config()
    ensure_agents(config)
    _process()


def is_initialized() -> bool:
    return _state is not None


def shutdown(*, stop_ray: bool | None = None) -> None:
    """Stop every agent cleanly (slots freed, segments unlinked, timers stopped).

    ``stop_ray`` defaults to True only when :func:`init` started Ray itself.
    """
    global _started_ray
    if not ray.is_initialized():
        _forget_agent()
        return
    state = _state
    if state is not None:
        state.segments.close_all()
    agents = []
    for node in ray.nodes():  # type: ignore[no-untyped-call]
        try:
            agents.append(ray.get_actor(agent_name(node["NodeID"]), namespace=NAMESPACE))
        except ValueError:
            continue
    try:
        bound = (state.config.rdma.shutdown_timeout if state else None) or 30.0
        ray.get([agent.shutdown.remote() for agent in agents], timeout=bound + 30)
    except ray_errors.RayError:
        _log.warning("ray_velo: an agent did not shut down cleanly", exc_info=True)
    for agent in agents:
        ray.kill(agent)
    _forget_agent()
    if stop_ray if stop_ray is not None else _started_ray:
        ray.shutdown()
        _started_ray = False


# --- staging ---------------------------------------------------------------------------


#: Payloads at least this large are copied by two threads (numpy releases the GIL): measured
#: 256 MiB in 15-17 ms with one thread, 10-12 ms with two, on the 2-core dev machine.
_PARALLEL_COPY_BYTES = 32 << 20


def _copy(dest: np.ndarray[Any, Any], source: np.ndarray[Any, Any]) -> None:
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


def _stage(obj: Any, *, pinned: bool, ttl: float | None, consumers: int = 1) -> DataHandle:
    if ttl is not None and not ttl > 0:
        raise ConfigError(field="ttl", value=ttl, rule="must be None or > 0 seconds")
    header, view = as_bytes_view(obj)
    nbytes = view.nbytes
    try:
        state = _process()
        reservation: Reservation = _call(
            state.agent.stage_reserve.remote(nbytes, pinned, os.getpid())
        )
    except AgentDied:
        # Nothing was staged yet: stage on the node's fresh agent instead.
        state = _process()
        reservation = _call(state.agent.stage_reserve.remote(nbytes, pinned, os.getpid()))
    try:
        if nbytes:
            dest = _segment_view(state, reservation.path, reservation.offset, nbytes)
            _copy(np.frombuffer(dest, dtype=np.uint8), np.frombuffer(view, dtype=np.uint8))
            del dest
        # Not waited for: a call that names the handle before this lands waits for it on the
        # agent, and the put saves a round trip.
        state.agent.stage_commit.remote(reservation.reservation_id, nbytes, header, ttl, consumers)
    except BaseException:
        state.agent.stage_abort.remote(reservation.reservation_id)
        raise
    return reservation.handle


def put(obj: Any, *, pinned: bool = True, ttl: float | None = None) -> DataHandle:
    """Stage ``obj`` on this node's agent and return its handle (refcount 1).

    Args:
        obj: a numpy array (any dtype/shape; non-contiguous is made contiguous), a bytes-like
            object, or a CPU torch tensor.
        pinned: stage in RDMA-registered memory when possible (never fails for lack of it).
        ttl: free the slot this many seconds after staging, whatever its leases.

    Raises:
        UnsupportedPayload: ``obj`` is of another type.
        SharedMemoryTooSmall: the node's shm directory cannot hold the payload.
    """
    return _stage(obj, pinned=pinned, ttl=ttl)


def register_data(data: Any) -> DataHandle:
    """Stage bytes in plain (unregistered) memory. Refcount 1."""
    return _stage(data, pinned=False, ttl=None)


def register_data_pinned(data: Any) -> DataHandle:
    """Copy bytes into registered pool memory; falls back to plain memory, never fails."""
    return _stage(data, pinned=True, ttl=None)


# --- reading ---------------------------------------------------------------------------


def _fetch_bound(timeout: float | None, config: VeloConfig) -> tuple[float | None, str]:
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


def _lease(handle: DataHandle, mode: str, timeout: float | None) -> LocalLease:
    """A local lease on ``handle``'s bytes on this node (bringing them over if remote)."""
    if not isinstance(handle, DataHandle):
        raise TypeError(f"expected a DataHandle, got {type(handle).__name__}")
    try:
        return _lease_once(handle, mode, timeout)
    except AgentDied:
        # This node's agent died (a remote owner's reference is consumed only after a fetch
        # succeeds): ask the node's fresh agent once. A handle the dead agent owned is gone
        # and says so (HandleNotFound).
        return _lease_once(handle, mode, timeout)


def _lease_once(handle: DataHandle, mode: str, timeout: float | None) -> LocalLease:
    state = _process()
    bound, which = _fetch_bound(timeout, state.config)
    if handle.worker_id == state.worker_id:
        return _call(  # type: ignore[no-any-return]
            state.agent.local_acquire.remote(handle, os.getpid(), mode == "release", mode == "hold")
        )
    wait = None if bound is None else bound + _AGENT_SLACK_S
    return _call(  # type: ignore[no-any-return]
        state.agent.fetch_remote.remote(handle, mode, bound, os.getpid(), which), wait
    )


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


def _end_lease(agent: Any, handle: DataHandle, lease_id: int, release: bool) -> None:
    # Interpreter or Ray shutting down: the agent reaps the leases of dead readers.
    with contextlib.suppress(Exception):
        agent.local_end.remote(handle, lease_id, release)


def _segment_view(state: _Process, path: str, offset: int, nbytes: int) -> memoryview:
    """A view into an agent's segment. Segments stay mapped in this process for reuse
    (the agent keeps its arenas warm; a fresh mapping costs a page fault per 4 KiB on first
    touch); the mapping of a segment the agent deleted is dropped on the next new one."""
    if not state.segments.is_mapped(path):
        state.segments.prune_missing()
    return state.segments.view(path, offset, nbytes)


def _view_of(lease: LocalLease) -> memoryview:
    return _segment_view(_process(), lease.path, lease.offset, lease.total_len)


def _leased_array(lease: LocalLease, release: bool) -> np.ndarray[Any, Any]:
    """A read-only uint8 array over the leased bytes; the lease ends when it is collected."""
    state = _process()
    exporter = _LeasedBytes(_view_of(lease))
    finalizer = weakref.finalize(
        exporter, _end_lease, state.agent, lease.handle, lease.lease_id, release
    )
    finalizer.atexit = False
    return np.asarray(exporter)


def fetch(handle: DataHandle, *, release: bool = True, timeout: float | None = None) -> Any:
    """The typed object staged under ``handle``.

    On the owner's node numpy arrays come back as read-only zero-copy views of the shared
    segment; elsewhere the bytes are brought to this node once (a second fetch on the node
    while the first copy is alive reuses it) and viewed there. ``bytes`` come back as
    ``bytes`` (one copy), torch tensors as tensors (one copy).

    Args:
        release: consume this consumer's reference (the owner frees the slot at zero).
        timeout: bound on the fetch in seconds (``staged_fetch_timeout`` bounds it too).

    Raises:
        HandleNotFound: the handle was released, expired, or its owner restarted.
        OwnerDied: the owner's agent or node is gone.
        TransferTimeout: the fetch did not finish within its bound.
        PayloadTooLarge: over this node's ``staged_payload_max``; the staged copy is freed.
    """
    lease = _lease(handle, "release" if release else "detach", timeout)
    local_release = release or lease.handle != handle  # a local copy is always ours to free
    if lease.total_len == 0 or lease.type_header.kind in ("bytes", "torch"):
        try:
            if lease.total_len == 0:
                data: Any = b""
            else:
                data = _view_of(lease)
            return from_bytes_view(lease.type_header, data, copy=lease.type_header.kind == "torch")
        finally:
            _end_lease(_process().agent, lease.handle, lease.lease_id, local_release)
    return from_bytes_view(lease.type_header, _leased_array(lease, local_release))


def _owner_call(handle: DataHandle, method: str, message: Any) -> Any:
    state = _process()
    return _call(state.agent.route.remote(handle, method, encode(message), None))


def metadata(handle: DataHandle) -> HandleMetadata:
    """Size (bytes), refcount and pinned of ``handle``. Takes no lock."""
    answer = decode(MetadataResponse, _owner_call(handle, "_rv_metadata", MetadataRequest(handle)))
    return HandleMetadata(answer.size, answer.refcount, answer.pinned)


def ref_handle(handle: DataHandle) -> int:
    """Add one reference, for one more consumer. Returns the new refcount."""
    return int(_owner_call(handle, "_rv_ref", RefRequest(handle)))


def _release_soon(handle: DataHandle) -> None:
    """Drop one reference on ``handle`` without waiting for the owner's answer (a resolver
    done with a transparent value: an error here would have nobody to tell)."""
    _process().agent.release_quietly.remote(handle)


def detach(handle: DataHandle, lease_id: int) -> None:
    """Drop the read lock of ``get``/``get_pinned``/``get_into``; the handle stays usable."""
    _owner_call(handle, "_rv_detach", DetachRequest(handle, lease_id))


def release(handle: DataHandle, lease_id: int) -> None:
    """Drop the read lock and one reference; the owner frees the slot at zero."""
    _owner_call(handle, "_rv_release", ReleaseRequest(handle, lease_id))


def _held_lease(handle: DataHandle, timeout: float | None) -> tuple[LocalLease, int]:
    """A local lease plus the lease id the caller must detach or release (get semantics)."""
    lease = _lease(handle, "hold", timeout)
    if lease.handle == handle:  # same node: the local lease is the owner's lease
        return lease, lease.lease_id
    return lease, lease.remote_lease_id


def get(handle: DataHandle, *, timeout: float | None = None) -> tuple[memoryview, int]:
    """Take a read lock, move the bytes, return ``(bytes view, lease_id)``.

    The bytes are a private copy; the lease stays held until :func:`detach` or
    :func:`release`.
    """
    lease, lease_id = _held_lease(handle, timeout)
    state = _process()
    try:
        data = bytes(_view_of(lease)) if lease.total_len else b""
    finally:
        if lease.handle != handle:
            _end_lease(state.agent, lease.handle, lease.lease_id, True)
    return memoryview(data), lease_id


class PinnedBuf:
    """Read-only bytes in registered memory on this node, returned by :func:`get_pinned`.

    ``array`` is a uint8 numpy view; ``memoryview(buf)`` works too. The memory stays valid
    while the PinnedBuf (or any view of it) is alive.
    """

    def __init__(self, array: np.ndarray[Any, Any], type_header: TypeHeader) -> None:
        self.array = array
        self.type_header = type_header

    def __len__(self) -> int:
        return int(self.array.nbytes)

    def __buffer__(self, flags: int) -> memoryview:  # Python 3.12+
        return self.array.data

    def memoryview(self) -> memoryview:
        return self.array.data

    def typed(self) -> Any:
        """The staged object rebuilt over these bytes (zero-copy for numpy)."""
        return from_bytes_view(self.type_header, self.array)


def get_pinned(handle: DataHandle, *, timeout: float | None = None) -> tuple[PinnedBuf, int]:
    """Like :func:`get`, but the bytes stay in this node's pool: no copy out."""
    lease, lease_id = _held_lease(handle, timeout)
    # Same node: the owner's lease is the caller's; the view must not end it on collection.
    own_copy = lease.handle != handle
    if lease.total_len == 0:
        array = np.empty(0, dtype=np.uint8)
        if own_copy:
            _end_lease(_process().agent, lease.handle, lease.lease_id, True)
    elif own_copy:
        array = _leased_array(lease, True)
    else:
        # Same node: the caller's lease is the owner's, ended by detach/release; the view
        # holds a lease of its own so the memory outlives it whatever the caller does.
        state = _process()
        own = _call(state.agent.local_acquire.remote(handle, os.getpid(), False))
        array = _leased_array(own, False)
    return PinnedBuf(array, lease.type_header), lease_id


class PinnedWriter:
    """A writable buffer in this node's registered pool, from :func:`alloc_pinned_writer`.

    :func:`get_into` lands fetched bytes in it with no further copy.
    """

    def __init__(self, reservation: Reservation, view: memoryview) -> None:
        self._reservation = reservation
        self.array = np.frombuffer(view, dtype=np.uint8)
        self.nbytes = reservation.nbytes
        agent = _process().agent
        self._finalizer = weakref.finalize(
            self, agent.stage_abort.remote, reservation.reservation_id
        )
        self._finalizer.atexit = False

    def memoryview(self) -> memoryview:
        return self.array.data

    @property
    def reservation_id(self) -> int:
        return self._reservation.reservation_id

    def close(self) -> None:
        """Give the buffer back to the pool; the writer holds nothing afterwards."""
        self.array = np.empty(0, dtype=np.uint8)
        self.nbytes = 0
        self._finalizer()


def alloc_pinned_writer(nbytes: int) -> PinnedWriter:
    """A writable buffer of ``nbytes`` in this node's registered pool."""
    if nbytes <= 0:
        raise ValueError(f"nbytes must be > 0, got {nbytes}")
    state = _process()
    reservation: Reservation = _call(state.agent.stage_reserve.remote(nbytes, True, os.getpid()))
    return PinnedWriter(
        reservation, _segment_view(state, reservation.path, reservation.offset, nbytes)
    )


def get_into(handle: DataHandle, dest: Any, *, timeout: float | None = None) -> int:
    """Move the bytes into ``dest`` (a writable buffer of at least the payload's size, or a
    :class:`PinnedWriter`). Returns the lease id to detach or release.

    Raises:
        ValueError: ``dest`` is smaller than the payload (nothing is written).
    """
    target = dest.array if isinstance(dest, PinnedWriter) else np.frombuffer(dest, dtype=np.uint8)
    if not target.flags.writeable:
        raise ValueError("get_into needs a writable destination")
    state = _process()
    if isinstance(dest, PinnedWriter) and handle.worker_id != state.worker_id:
        # The GET (or the chunks) land in the writer's registered memory: no copy at all.
        bound, which = _fetch_bound(timeout, state.config)
        wait = None if bound is None else bound + _AGENT_SLACK_S
        lease = _call(
            state.agent.fetch_remote.remote(
                handle, "hold", bound, os.getpid(), which, dest.reservation_id
            ),
            wait,
        )
        return int(lease.remote_lease_id)
    lease, lease_id = _held_lease(handle, timeout)
    try:
        if lease.total_len > target.nbytes:
            detach(handle, lease_id)  # nothing was written: give the lease back
            raise ValueError(
                f"destination holds {target.nbytes} bytes, payload of {handle} is "
                f"{lease.total_len} bytes"
            )
        if lease.total_len:
            _copy(target[: lease.total_len], np.frombuffer(_view_of(lease), dtype=np.uint8))
    finally:
        if lease.handle != handle:
            _end_lease(state.agent, lease.handle, lease.lease_id, True)
    return lease_id


# --- caller-owned regions --------------------------------------------------------------


class _RegionSignal:
    """``deregistered()``: resolves once the region's memory is released."""

    def __init__(self, agent: Any, region_id: int) -> None:
        self._agent, self._region_id = agent, region_id

    def wait(self, timeout: float | None = None) -> bool:
        return bool(_call(self._agent.region_deregistered.remote(self._region_id, timeout)))

    def is_set(self) -> bool:
        return self.wait(0.0)


class RegionWatch:
    """Observes a region without owning its release (``RegionGuard.watch()``)."""

    def __init__(self, agent: Any, region_id: int, effective_range: tuple[int, int]) -> None:
        self._signal = _RegionSignal(agent, region_id)
        self.effective_range = effective_range

    def deregistered(self) -> _RegionSignal:
        return self._signal


class RegionGuard:
    """Caller-owned registered memory on this node, from :func:`alloc_region`.

    ``array`` is a writable uint8 view: write the payload there, then stage ranges of it
    with :func:`register_data_in_region` (no copy). Registered memory is remotely readable
    (and, over UCX, writable) by peers holding its key: a trust decision, see the docs.
    ``effective_range`` is what was pinned (whole pages).
    """

    def __init__(self, agent: Any, info: Any, view: memoryview) -> None:
        self._agent = agent
        self.region_id: int = info.region_id
        self.nbytes: int = info.nbytes
        self.effective_range: tuple[int, int] = info.effective_range
        self.array = np.frombuffer(view, dtype=np.uint8)
        self._released = False

    def unregister(self, timeout_s: float = 30.0) -> str:
        """Gate new use, drain in-flight slots (up to ``timeout_s``), unmap.

        Returns ``"drained"`` or ``"drain_timed_out"``; either way the memory is released.
        Slots still staged in the region can no longer be read.
        """
        if self._released:
            raise RegionDeregistered(region=f"#{self.region_id}")
        self._released = True
        self.array = np.empty(0, dtype=np.uint8)
        return str(_call(self._agent.region_unregister.remote(self.region_id, timeout_s)))

    def deregistered(self) -> _RegionSignal:
        return _RegionSignal(self._agent, self.region_id)

    def watch(self) -> RegionWatch:
        return RegionWatch(self._agent, self.region_id, self.effective_range)

    def __del__(self) -> None:
        if not getattr(self, "_released", True):
            _log.warning(
                "ray_velo region #%s dropped without unregister(): deregistering in the background",
                self.region_id,
            )
            with contextlib.suppress(Exception):
                self._agent.region_unregister.remote(
                    self.region_id, _process().config.rdma.drop_dereg_timeout or 30.0
                )


def alloc_region(nbytes: int) -> RegionGuard:
    """``nbytes`` of registered memory that this process owns and writes.

    Raises:
        BudgetExceeded: the pages do not fit ``registered_bytes_budget``.
        SharedMemoryTooSmall: the node's shm directory cannot hold them.
    """
    state = _process()
    info = _call(state.agent.region_alloc.remote(nbytes, os.getpid()))
    view = state.segments.view(info.path, 0, nbytes)
    state.segments.unmap(info.path)  # the mapping goes with the guard's last view
    return RegionGuard(state.agent, info, view)


def register_data_in_region(
    guard: RegionGuard, start: int, stop: int, *, ttl: float | None = None
) -> DataHandle:
    """Stage bytes ``[start, stop)`` of ``guard``'s memory with no copy.

    Raises:
        RegionDeregistered: the region is being (or was) unregistered.
        ValueError: the range is outside the region.
    """
    if not 0 <= start <= stop <= guard.nbytes:
        raise ValueError(f"range [{start}, {stop}) outside region of {guard.nbytes} bytes")
    return _call(  # type: ignore[no-any-return]
        guard._agent.region_stage.remote(guard.region_id, start, stop, TypeHeader(), ttl)
    )
