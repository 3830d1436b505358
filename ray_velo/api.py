"""The public API: init/shutdown, put/fetch, and the protocol's handle API (docs/api.md,
docs/protocol.md §3). Sizes in bytes, durations in seconds."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

import numpy as np
import ray
from ray import exceptions as ray_errors

from ray_velo import _ray
from ray_velo.actors.directory import (
    NAMESPACE,
    agent_name,
    cluster_config_stored,
    ensure_agents,
    load_cluster_config,
    store_cluster_config,
)
from ray_velo.client import session
from ray_velo.client.payload import check_fetch_device, from_bytes_view
from ray_velo.client.writable import PinnedWriter, SendBuffer, alloc_pinned_writer, empty
from ray_velo.config import VeloConfig
from ray_velo.errors import RegionDeregistered
from ray_velo.local.records import LocalLease
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
from ray_velo.protocol.entry import RV_DETACH, RV_METADATA, RV_REF, RV_RELEASE, Entry

__all__ = [
    "PinnedBuf",
    "PinnedWriter",
    "RegionGuard",
    "SendBuffer",
    "alloc_pinned_writer",
    "alloc_region",
    "detach",
    "empty",
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
    "runtime_env",
    "shutdown",
    "worker_setup",
]

_log = logging.getLogger(__name__)

_started_ray = False


def init(config: VeloConfig | None = None, **ray_init_kwargs: Any) -> None:
    """Start ray_velo: ``ray.init()`` if needed, then one agent on every alive node, and
    register the ``"VELO"`` / ``"VELO_NUMPY"`` tensor transports with Ray (call it before
    creating the actors that use them).

    Without a running Ray, this starts an embedded local cluster (``ray.init(**kwargs)``,
    its runtime env given :func:`runtime_env`'s setup hook so that every worker of the job
    knows the transports); with one (``ray.init(address=...)`` first, or inside a task) it
    joins it, and says in a warning when that job's workers lack the hook. Tasks never need
    to call ``init``: they find their node's agent on first use, and a node that joins
    later gets its agent then.

    Raises:
        ConfigError: ``config`` breaks a rule.
        ValueError: ``runtime_env`` has a setup hook of its own (call :func:`worker_setup`
            from it, and pass the env through :func:`runtime_env` to say so).
    """
    global _started_ray
    if not ray.is_initialized():
        ray_init_kwargs["runtime_env"] = runtime_env(ray_init_kwargs.get("runtime_env"))
        ray.init(**ray_init_kwargs)
        _started_ray = True
    else:
        _warn_without_setup_hook()
    if config is not None or not cluster_config_stored():
        # A second driver's bare init() must not reset the cluster's config to defaults.
        store_cluster_config(config or VeloConfig())
    config = config or load_cluster_config()
    ensure_agents(config)
    session.current()
    # Before the caller creates actors: Ray hands the registrations to actors created later.
    if _ray.has_tensor_transport():
        from ray_velo.rdt import register_transports

        register_transports()
    else:
        _log.info(
            "ray_velo: no VELO tensor transport on Ray %s (it needs Ray >= %s); put, fetch "
            "and @ray_velo.transfer work as on any Ray",
            _ray.version_text(),
            _ray.version_text(_ray.RDT_MIN_VERSION),
        )


def runtime_env(env: dict[str, Any] | None = None, *, own_hook: bool = False) -> dict[str, Any]:
    """A Ray runtime env (``env``'s entries, if given) whose every worker process registers
    the ``VELO`` tensor transports before it runs user code, for a ``ray.init`` that comes
    before :func:`init`: ``ray.init(runtime_env=rv.runtime_env())``. On a Ray without tensor
    transports, ``env`` unchanged.

    Args:
        env: the job's runtime env otherwise.
        own_hook: ``env``'s ``worker_process_setup_hook`` calls :func:`worker_setup` itself
            (Ray takes one hook a job): keep it.

    Raises:
        ValueError: ``env`` has a setup hook of its own and ``own_hook`` is False.
    """
    merged = dict(env or {})
    if not _ray.has_tensor_transport() or own_hook:
        return merged
    from ray_velo.rdt import WORKER_SETUP_HOOK

    hook = merged.get("worker_process_setup_hook")
    if hook not in (None, WORKER_SETUP_HOOK):
        raise ValueError(
            f"the runtime env has a worker_process_setup_hook of its own ({hook!r}) and Ray "
            "takes one: call ray_velo.worker_setup() from it, and pass own_hook=True"
        )
    merged["worker_process_setup_hook"] = WORKER_SETUP_HOOK
    return merged


def worker_setup() -> None:
    """Register the tensor transports in this process, as every worker of a job started with
    :func:`runtime_env` does before it runs user code; for a setup hook of the job's own.
    Nothing on a Ray without tensor transports."""
    if _ray.has_tensor_transport():
        from ray_velo.rdt import worker_setup as register_here

        register_here()


def _warn_without_setup_hook() -> None:
    """A driver whose own ray.init came first, without ray_velo's setup hook: say what
    fails and the one line that fixes it."""
    if not _ray.has_tensor_transport() or _ray.is_worker_process():
        return
    from ray_velo.rdt import WORKER_SETUP_HOOK

    hook = _ray.job_setup_hook()
    if hook is not None:  # ours, or the job's own (which may call worker_setup)
        _log.debug(
            "ray_velo: the job's worker setup hook is %s (ours: %s)", hook, WORKER_SETUP_HOOK
        )
    else:
        _log.warning(
            "ray_velo: this job's workers do not register the VELO tensor transports at "
            'start: ray.put(..., _tensor_transport="VELO") in an actor, or an RDT call '
            'submitted by an actor that did not create its actors, fails with "Invalid '
            'tensor transport: VELO". Start Ray with '
            "ray.init(runtime_env=ray_velo.runtime_env()) (or call "
            "ray_velo.worker_setup() from your own worker_process_setup_hook)."
        )


def is_initialized() -> bool:
    return session._session is not None


def shutdown(*, stop_ray: bool | None = None) -> dict[str, dict[str, int]]:
    """Stop every agent in the protocol's shutdown order (docs/protocol.md §18): transfers admitted
    before it finish, within each agent's ``shutdown_timeout``; slots freed, segments
    unlinked, timers stopped. Returns each node's report (what its drain found and did).

    ``stop_ray`` defaults to True only when :func:`init` started Ray itself.
    """
    global _started_ray
    if not ray.is_initialized():
        session.forget()
        return {}
    state = session._session
    if state is not None:
        state.segments.close_all()
    agents = {}
    for node in ray.nodes():  # type: ignore[no-untyped-call]
        try:
            agents[node["NodeID"]] = ray.get_actor(agent_name(node["NodeID"]), namespace=NAMESPACE)
        except ValueError:
            continue
    reports: dict[str, dict[str, int]] = {}
    bound = (state.config.rdma.shutdown_timeout if state else None) or 30.0
    pending: dict[str, Any] = {node: agent.shutdown.remote() for node, agent in agents.items()}
    deadline = time.monotonic() + bound + 30  # all agents drain at once, under one bound
    for node, ref in pending.items():
        try:
            report = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            reports[node] = dict(report)
        except ray_errors.RayError:
            _log.warning("ray_velo: the agent on node %s did not shut down cleanly", node)
    for agent in agents.values():
        ray.kill(agent)
    session.forget()
    if stop_ray if stop_ray is not None else _started_ray:
        ray.shutdown()
        _started_ray = False
    return reports


# --- staging ---------------------------------------------------------------------------


def put(
    obj: Any, *, pinned: bool = True, ttl: float | None = None, lifetime: str | None = None
) -> DataHandle:
    """Stage ``obj`` on this node's agent and return its handle (refcount 1).

    The handle ends with the Ray job that staged it (this driver's, or the job of the task
    or actor calling put): when that job ends, every agent frees its data within seconds
    (docs/deployment.md, "Staged data follows its job"), and a later fetch raises
    ``HandleNotFound`` saying its job ended.

    Args:
        obj: a numpy array (any dtype/shape; non-contiguous is made contiguous), a bytes-like
            object, or a torch tensor on the CPU or a CUDA device (a CUDA tensor is staged
            through host memory where the node has no GPU arena: docs/gpu.md).
        pinned: stage in RDMA-registered memory when possible (never fails for lack of it).
        ttl: end the handle this many seconds after staging, whatever its leases (views
            already handed out keep their bytes).
        lifetime: ``"detached"`` to share the data across jobs on purpose: it outlives its
            job until released or its TTL fires (``ray-velo status`` lists it). None: it
            ends with its job.

    Raises:
        UnsupportedPayload: ``obj`` is of another type.
        SharedMemoryTooSmall: the node's shm directory cannot hold the payload.
        ConfigError: ``ttl`` or ``lifetime`` is invalid.
    """
    return session.stage(obj, pinned=pinned, ttl=ttl, lifetime=lifetime)


def register_data(data: Any, *, lifetime: str | None = None) -> DataHandle:
    """Stage bytes in plain (unregistered) memory. Refcount 1; ``lifetime`` as in :func:`put`."""
    return session.stage(data, pinned=False, ttl=None, lifetime=lifetime)


def register_data_pinned(data: Any, *, lifetime: str | None = None) -> DataHandle:
    """Copy bytes into registered pool memory; falls back to plain memory, never fails.
    ``lifetime`` as in :func:`put`."""
    return session.stage(data, pinned=True, ttl=None, lifetime=lifetime)


# --- reading ---------------------------------------------------------------------------


def fetch(
    handle: DataHandle,
    *,
    release: bool = True,
    timeout: float | None = None,
    device: Any = None,
) -> Any:
    """The typed object staged under ``handle``.

    On the owner's node numpy arrays come back as read-only zero-copy views of the shared
    segment; elsewhere the bytes are brought to this node once (a second fetch on the node
    while the first copy is alive reuses it) and viewed there. ``bytes`` come back as
    ``bytes`` (one copy), torch tensors as tensors (one copy). A tensor put from a CUDA
    device comes back on this process's current CUDA device, or on the CPU in a process
    without one (docs/gpu.md).

    Args:
        release: consume a reference (the owner's handle ends at zero: every later fetch
            is refused, while this fetch's view keeps its bytes).
        timeout: bound on the fetch in seconds (``staged_fetch_timeout`` bounds it too).
        device: where a torch tensor goes: ``"cpu"``, ``"cuda"`` (the current device),
            ``"cuda:N"`` or a ``torch.device``; None: the rule above. Numpy arrays and
            bytes ignore it.

    Raises:
        ConfigError: ``device`` names a device this process does not have (checked before
            anything is fetched or consumed).
        HandleNotFound: the handle was released, expired, or its owner restarted.
        HandleReleased: ``release`` and every reference is claimed by other consumers.
        OwnerDied: the owner's agent or node is gone.
        TransferTimeout: the fetch did not finish within its bound.
        PayloadTooLarge: over this node's ``staged_payload_max``; the staged copy is freed.
    """
    target = check_fetch_device(device)
    return session.read(session.lease(handle, "release" if release else "detach", timeout), target)


def _owner_call(handle: DataHandle, handler: Entry, message: Any) -> Any:
    """Run owner ``handler`` on ``handle``'s owner, through this node's agent (over its
    socket: a release costs no more than a put)."""
    return session.current().route(handle, handler, encode(message))


def metadata(handle: DataHandle) -> HandleMetadata:
    """Size (bytes), refcount and pinned of ``handle``. Takes no lock."""
    answer = decode(MetadataResponse, _owner_call(handle, RV_METADATA, MetadataRequest(handle)))
    return HandleMetadata(answer.size, answer.refcount, answer.pinned)


def ref_handle(handle: DataHandle) -> int:
    """Add one reference, for one more consumer. Returns the new refcount."""
    return int(_owner_call(handle, RV_REF, RefRequest(handle)))


def detach(handle: DataHandle, lease_id: int) -> None:
    """Drop the read lock of ``get``/``get_pinned``/``get_into``; the handle stays usable."""
    _owner_call(handle, RV_DETACH, DetachRequest(handle, lease_id))


def release(handle: DataHandle, lease_id: int) -> None:
    """Drop the read lock and one reference; the owner ends the handle at zero."""
    _owner_call(handle, RV_RELEASE, ReleaseRequest(handle, lease_id))


def _held_lease(handle: DataHandle, timeout: float | None) -> tuple[LocalLease, int]:
    """A local lease plus the lease id the caller must detach or release (get semantics)."""
    local = session.lease(handle, "hold", timeout)
    if local.handle == handle:  # same node: the local lease is the owner's lease
        return local, local.lease_id
    return local, local.remote_lease_id


def get(handle: DataHandle, *, timeout: float | None = None) -> tuple[memoryview, int]:
    """Take a read lock, move the bytes, return ``(bytes view, lease_id)``.

    The bytes are a private copy; the lease stays held until :func:`detach` or
    :func:`release`.
    """
    local, lease_id = _held_lease(handle, timeout)
    try:
        data = bytes(session.view_of(local)) if local.total_len else b""
    finally:
        if local.handle != handle:
            session.end_lease(session.current(), local.handle, local.lease_id)
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

    def typed(self, device: Any = None) -> Any:
        """The staged object rebuilt over these bytes (zero-copy for numpy; ``device`` as
        in :func:`fetch`)."""
        return from_bytes_view(self.type_header, self.array, device=check_fetch_device(device))


def get_pinned(handle: DataHandle, *, timeout: float | None = None) -> tuple[PinnedBuf, int]:
    """Like :func:`get`, but the bytes stay in this node's pool: no copy out."""
    local, lease_id = _held_lease(handle, timeout)
    own_copy = local.handle != handle
    if local.total_len == 0:
        array = np.empty(0, dtype=np.uint8)
        if own_copy:
            session.end_lease(session.current(), local.handle, local.lease_id)
    elif own_copy:
        array = session.leased_array(local)
    else:
        # Same node: the caller's lease is the owner's, ended by detach/release; the view
        # holds a lease of its own so the memory outlives it whatever the caller does.
        own = session.current().local_acquire(handle, "detach")
        array = session.leased_array(own)
    return PinnedBuf(array, local.type_header), lease_id


def get_into(handle: DataHandle, dest: Any, *, timeout: float | None = None) -> int:
    """Move the bytes into ``dest`` (a writable buffer of at least the payload's size, or a
    :class:`PinnedWriter`). Returns the lease id to detach or release.

    Raises:
        ValueError: ``dest`` is smaller than the payload (nothing is written).
    """
    target = dest.array if isinstance(dest, PinnedWriter) else np.frombuffer(dest, dtype=np.uint8)
    if not target.flags.writeable:
        raise ValueError("get_into needs a writable destination")
    state = session.current()
    if isinstance(dest, PinnedWriter) and handle.worker_id != state.worker_id:
        # The GET (or the chunks) land in the writer's registered memory: no copy at all.
        local = session.lease(handle, "hold", timeout, writer_reservation=dest.reservation_id)
        return int(local.remote_lease_id)
    local, lease_id = _held_lease(handle, timeout)
    try:
        if local.total_len > target.nbytes:
            detach(handle, lease_id)  # nothing was written: give the lease back
            raise ValueError(
                f"destination holds {target.nbytes} bytes, payload of {handle} is "
                f"{local.total_len} bytes"
            )
        if local.total_len:
            source = np.frombuffer(session.view_of(local), dtype=np.uint8)
            session.copy_into(target[: local.total_len], source)
    finally:
        if local.handle != handle:
            session.end_lease(state, local.handle, local.lease_id)
    return lease_id


# --- caller-owned regions --------------------------------------------------------------


class _RegionSignal:
    """``deregistered()``: resolves once the region's memory is released."""

    def __init__(self, agent: Any, region_id: int) -> None:
        self._agent, self._region_id = agent, region_id

    def wait(self, timeout: float | None = None) -> bool:
        ref = self._agent.region_deregistered.remote(self._region_id, timeout)
        return bool(session.call(ref))

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
        return str(session.call(self._agent.region_unregister.remote(self.region_id, timeout_s)))

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
                timeout = session.current().config.rdma.drop_dereg_timeout or 30.0
                self._agent.region_unregister.remote(self.region_id, timeout)


def alloc_region(nbytes: int) -> RegionGuard:
    """``nbytes`` of registered memory that this process owns and writes.

    Raises:
        BudgetExceeded: the pages do not fit ``registered_bytes_budget`` (idle warm arenas
            are evicted first).
        SharedMemoryTooSmall: the node's shm directory cannot hold them.
    """
    state = session.current()
    info = session.call(state.agent.region_alloc.remote(nbytes, os.getpid()))
    view = state.segments.view(info.path, 0, nbytes)
    state.segments.unmap(info.path)  # the mapping goes with the guard's last view
    return RegionGuard(state.agent, info, view)


def register_data_in_region(
    guard: RegionGuard,
    start: int,
    stop: int,
    *,
    ttl: float | None = None,
    lifetime: str | None = None,
) -> DataHandle:
    """Stage bytes ``[start, stop)`` of ``guard``'s memory with no copy. ``lifetime`` as in
    :func:`put`.

    Raises:
        RegionDeregistered: the region is being (or was) unregistered.
        ValueError: the range is outside the region.
        ConfigError: ``lifetime`` is invalid.
    """
    if not 0 <= start <= stop <= guard.nbytes:
        raise ValueError(f"range [{start}, {stop}) outside region of {guard.nbytes} bytes")
    follows = session.job_for(lifetime)
    ref = guard._agent.region_stage.remote(
        guard.region_id, start, stop, TypeHeader(), ttl, follows.job, follows.detached
    )
    return session.call(ref)  # type: ignore[no-any-return]
