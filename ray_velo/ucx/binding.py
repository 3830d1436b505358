"""Typed UCX objects with one parent/child lifetime, closed children first, and the one-sided
GET (docs/architecture.md §10)."""

from __future__ import annotations

import abc
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Final

from ray_velo.errors import ConfigError, UcxError
from ray_velo.memory.pool import page_range
from ray_velo.protocol.memtype import SUPPORTED_MEMORY_TYPES, MemoryType
from ray_velo.ucx.loader import (
    Binding,
    check_status,
    forked_after_load,
    load_binding,
    status_text,
    ucx_version,
)
from ray_velo.ucx.rkey import PACKED_RKEY_MAX_BYTES, check_packed_rkey, parse_packed_rkey
from ray_velo.ucx.status import UcsStatus

__all__ = [
    "DEFAULT_CLOSE_TIMEOUT_S",
    "Endpoint",
    "MemoryRegistration",
    "RemoteKey",
    "UcxContext",
    "UcxWorker",
    "get",
    "quiet_log",
]

#: What a RemoteKey accepts unless told more (see RemoteKey).
HOST_MEMORY_ONLY = frozenset({MemoryType.HOST})

_log = logging.getLogger(__name__)

DEFAULT_CLOSE_TIMEOUT_S: Final = 5.0
"""Bound on each wait inside a ``close()`` (GETs still in flight, a progress thread stopping)."""

ABORT_GRACE_S: Final = 5.0
"""How long a force-closed endpoint's requests get to complete with ``UCS_ERR_CANCELED``."""

SELF_PROGRESS_S: Final = 0.002
"""How long a GET's own thread progresses its worker before it leaves the rest to the
worker's progress thread and only checks back (``rv_request_wait``). A GET this short keeps
its latency; a longer one stops two threads contending for the worker's lock: on the
two-host testbed a 3 GiB GET over tcp then needed 1.3-1.7 s of the consumer's CPU instead of
3.2-3.9 s, and ran at 1.10-1.50 GB/s instead of 0.94-1.13 (docs/tuning.md)."""

MAX_WORKER_ADDRESS_BYTES: Final = 1 << 16
"""A worker address is 81-217 bytes on tcp/cma; refuse absurd ones before UCX parses them."""

_U64_MAX: Final = (1 << 64) - 1

_REQUIRED_OPTIONS: Final = {"RNDV_THRESH": "inf"}
"""PEER error mode drops cma for RMA unless rendezvous is off (research/ucx.md §8, pitfall 4)."""

_DEFAULT_OPTIONS: Final = {"RCACHE_ENABLE": "n"}
"""The protocol's defaults (docs/protocol.md §10); every ucp_mem_map is then a fresh
registration and nothing is cached."""

TUNED_DEFAULTS: Final = {"TCP_TX_SEG_SIZE": "128k", "TCP_RX_SEG_SIZE": "128k"}
"""Applied unless ``UCX_<NAME>`` is in the environment (or in the caller's options). UCX's own
tcp segments (8 KiB) cap a GET near 1 GB/s on any link; 128 KiB ran the 10 Gbit/s testbed link
at line rate, the 25 Gbit/s one at 0.9 of a plain socket and the unshaped veth at 4-5 GB/s,
where larger segments measured slower under shaping (docs/tuning.md has the sweep)."""

# Error cells and requests UCX may still write after a close we could not confirm. Keeping
# them reachable forever is the safe failure (a leak, not a write into freed memory).
_leaked: list[object] = []
_leaked_lock = threading.Lock()


def _leak(obj: object, what: str) -> None:
    with _leaked_lock:
        _leaked.append(obj)
    _log.error("ray_velo.ucx: %s; its UCX state is leaked on purpose", what)


def _error(operation: str, status: int, why: str) -> UcxError:
    return UcxError(operation=operation, status=int(status), status_text=why)


def _leaked_error(obj: object, what: str, operation: str, why: str) -> UcxError:
    """Leak ``obj`` (see :func:`_leak`); the UCS_ERR_BUSY error that says so."""
    _leak(obj, what)
    return _error(operation, UcsStatus.ERR_BUSY, why)


def _check_not_forked(operation: str) -> None:
    if forked_after_load():
        raise _error(
            operation,
            UcsStatus.ERR_UNSUPPORTED,
            "UCX was loaded before this process forked; use the spawn start method",
        )


def _closed_error(operation: str, what: str) -> UcxError:
    return _invalid(operation, f"{what} is closed")


def _invalid(operation: str, why: str) -> UcxError:
    return _error(operation, UcsStatus.ERR_INVALID_PARAM, why)


def _drain(
    cond: threading.Condition,
    idle: Callable[[], bool],
    endpoint: Endpoint | None = None,
    why: str = "",
) -> bool:
    """Wait up to DEFAULT_CLOSE_TIMEOUT_S for ``idle``; if it still is not, force-close
    ``endpoint`` (its requests then complete CANCELED) and wait up to ABORT_GRACE_S more."""
    with cond:
        if cond.wait_for(idle, DEFAULT_CLOSE_TIMEOUT_S):
            return True
    if endpoint is None:
        return False
    endpoint._abort(int(UcsStatus.ERR_CANCELED), why)
    with cond:
        return cond.wait_for(idle, ABORT_GRACE_S)


def _check_u64(operation: str, name: str, value: int) -> None:
    if not isinstance(value, int) or not 0 <= value <= _U64_MAX:
        raise _invalid(operation, f"{name}={value!r} is not an unsigned 64-bit integer")


@contextmanager
def quiet_log() -> Iterator[None]:
    """UCX logs nothing below FATAL while the block runs: a probe whose failure the caller
    expects and reports itself (process-wide for that moment; the level is restored)."""
    ffi, lib = load_binding()
    saved = ffi.new("char[]", 64)
    known = lib.ucs_global_opts_get_value(b"LOG_LEVEL", saved, 64) == int(UcsStatus.OK)
    lib.ucs_global_opts_set_value(b"LOG_LEVEL", b"fatal")
    try:
        yield
    finally:
        if known:
            lib.ucs_global_opts_set_value(b"LOG_LEVEL", ffi.string(saved))


def _normalize_options(options: Mapping[str, str]) -> dict[str, str]:
    """Caller's options as ucp_config_modify names (no ``UCX_`` prefix), checked."""
    out: dict[str, str] = dict(_DEFAULT_OPTIONS)
    out.update({k: v for k, v in TUNED_DEFAULTS.items() if f"UCX_{k}" not in os.environ})
    for raw_key, raw_value in options.items():
        key = str(raw_key).upper()
        key = key.removeprefix("UCX_")
        value = str(raw_value)
        if not key:
            raise ConfigError(field="ucx option", value=raw_key, rule="name must not be empty")
        if key.startswith("MEM_"):
            raise ConfigError(
                field=f"ucx option {key}",
                value=value,
                rule=(
                    "UCM (MEM_*) options are read once when libucs loads; set "
                    f"UCX_{key} in the environment before ray_velo loads UCX"
                ),
            )
        required = _REQUIRED_OPTIONS.get(key)
        if required is not None and value.lower() != required:
            raise ConfigError(
                field=f"ucx option {key}",
                value=value,
                rule=f"must be {required}: PEER error handling drops cma RMA otherwise",
            )
        out[key] = value
    out.update(_REQUIRED_OPTIONS)
    return out


class _Node(abc.ABC):
    """Shared lifetime bookkeeping: open children, idempotent ordered close."""

    _kind = "object"
    _b: Binding

    def __init__(self, parent: _Node | None) -> None:
        _check_not_forked(f"create {self._kind}")
        self._parent = parent
        if parent is not None:
            self._b = parent._b
        self._lock = threading.Lock()
        self._open = True
        self._closing = False
        self._children: dict[int, _Node] = {}

    # -- children ------------------------------------------------------------------------

    def _adopt(self, child: _Node, operation: str) -> None:
        # Caller holds self._lock.
        if not self._open or self._closing:
            raise _closed_error(operation, f"the parent {self._kind}")
        self._children[id(child)] = child

    def _create_child(
        self, child: _Node, operation: str, out_type: str, create: Any, *args: Any
    ) -> Any:
        """Adopt ``child`` and run ``create(*args, out)`` under this node's lock; the new UCX
        handle. On failure the child is forgotten again (nothing was created)."""
        out = self._b.ffi.new(out_type)
        with self._lock:
            self._adopt(child, operation)
            try:
                check_status(create(*args, out), operation)
            except BaseException:
                self._children.pop(id(child), None)
                raise
        return out[0]

    def _forget(self, child: _Node) -> None:
        with self._lock:
            self._children.pop(id(child), None)

    # -- close ---------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True once ``close()`` has started; the object takes no new work."""
        return not self._open or self._closing

    def close(self) -> None:
        """Close the open children, then release this object's UCX state. Idempotent.

        Raises:
            UcxError: the first failure met; everything else is still attempted, and what
                could not be confirmed released is leaked on purpose (logged at error).
        """
        with self._lock:
            if not self._open or self._closing:
                return
            self._closing = True
            children = list(self._children.values())
            if forked_after_load():
                # A forked copy: the UCX state belongs to the parent. Touch nothing.
                self._open = False
                return
        first: UcxError | None = None
        # Newest first, and a context's registrations before its workers (so before their
        # endpoints: docs/protocol.md §18).
        registrations_first = sorted(
            reversed(children), key=lambda c: not isinstance(c, MemoryRegistration)
        )
        for child in registrations_first:
            try:
                child.close()
            except UcxError as exc:
                first = first or exc
        try:
            self._release()
        except UcxError as exc:
            first = first or exc
        finally:
            with self._lock:
                self._open = False
            self._detach_from_parent()
        if first is not None:
            raise first

    @abc.abstractmethod
    def _release(self) -> None:
        """Free this object's own UCX resource (its children are already closed)."""

    def _detach_from_parent(self) -> None:
        if self._parent is not None:
            self._parent._forget(self)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class UcxContext(_Node):
    """A ``ucp_context``: features RMA and WAKEUP, thread-safe (``mt_workers_shared``).

    Settings: ``ucp_config_read`` reads the ``UCX_*`` environment (so ``UCX_TLS`` and the like
    apply), then ``RCACHE_ENABLE=n``, the tcp defaults of :data:`TUNED_DEFAULTS` (only where
    the environment does not set them), then the caller's ``options``, then ``RNDV_THRESH=inf``
    are applied with ``ucp_config_modify`` (they win over the environment).

    Args:
        options: UCX settings, with or without the ``UCX_`` prefix, e.g. ``{"TLS": "tcp"}``.

    Raises:
        UcxError: UCX cannot be loaded, is older than 1.20, or refuses a setting.
        ConfigError: an option this library must control (``RNDV_THRESH``) or one that only the
            environment can set (``MEM_*``).
    """

    _kind = "UCX context"

    def __init__(self, options: Mapping[str, str] | None = None) -> None:
        super().__init__(None)
        self.options: dict[str, str] = _normalize_options(options or {})
        self._b = load_binding()
        ffi, lib = self._b
        self.version: tuple[int, int, int] = ucx_version()

        config_p = ffi.new("ucp_config_t **")
        check_status(lib.ucp_config_read(ffi.NULL, ffi.NULL, config_p), "ucp_config_read")
        try:
            for key, value in self.options.items():
                check_status(
                    lib.ucp_config_modify(config_p[0], key.encode(), value.encode()),
                    f"ucp_config_modify({key}={value})",
                )
            params = ffi.new("ucp_params_t *")
            params.field_mask = lib.UCP_PARAM_FIELD_FEATURES | lib.UCP_PARAM_FIELD_MT_WORKERS_SHARED
            params.features = lib.UCP_FEATURE_RMA | lib.UCP_FEATURE_WAKEUP
            # One worker per context here, but registrations may come from any thread.
            params.mt_workers_shared = 1
            context_p = ffi.new("ucp_context_h *")
            check_status(lib.ucp_init(params, config_p[0], context_p), "ucp_init")
        finally:
            lib.ucp_config_release(config_p[0])
        self._handle: Any = context_p[0]

    def _release(self) -> None:
        with self._lock:
            leaked = any(isinstance(c, UcxWorker) and c._leaked for c in self._children.values())
        if leaked:
            raise _leaked_error(
                self,
                "a worker of this UCX context could not be destroyed",
                "ucp_cleanup",
                "a worker could not be stopped; the context is leaked",
            )
        self._b.lib.ucp_cleanup(self._handle)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"UcxContext({state}, UCX {'.'.join(map(str, self.version))})"


class UcxWorker(_Node):
    """A ``ucp_worker`` in ``UCS_THREAD_MODE_MULTI`` with its own progress thread.

    The progress thread (``progress_thread=True``) is a C loop running without the GIL. With
    ``blocking=True`` it sleeps in ``poll()`` on the worker's event fd when there is nothing to
    progress, so an idle worker costs ~0 CPU, and wakes on transport events, on
    :meth:`signal`, and every ``idle_wakeup_s`` (timer work such as keepalive). With
    ``blocking=False`` it polls and yields the CPU between rounds (lower latency, one core).

    An owner needs progress for tcp (RMA is emulated in software by the owner's worker), for
    wireup and for PEER keepalive; without a progress thread, call :meth:`progress`.

    Raises:
        UcxError: the worker cannot be created, or UCX did not grant MULTI thread mode.
    """

    _kind = "UCX worker"

    def __init__(
        self,
        context: UcxContext,
        *,
        progress_thread: bool = True,
        blocking: bool = True,
        idle_wakeup_s: float | None = 1.0,
    ) -> None:
        super().__init__(context)
        self.context = context
        ffi, lib = self._b
        self._leaked = False
        params = ffi.new("ucp_worker_params_t *")
        params.field_mask = lib.UCP_WORKER_PARAM_FIELD_THREAD_MODE
        params.thread_mode = lib.UCS_THREAD_MODE_MULTI
        self._handle: Any = context._create_child(
            self,
            "ucp_worker_create",
            "ucp_worker_h *",
            lib.ucp_worker_create,
            context._handle,
            params,
        )
        try:
            self._check_thread_mode()
            self.address: bytes = self._worker_address()
        except BaseException:
            lib.ucp_worker_destroy(self._handle)
            context._forget(self)
            raise

        self._stop_cell: Any = ffi.new("int *", 0)
        self._wakeups: Any = ffi.new("uint64_t *", 0)
        self._thread: threading.Thread | None = None
        self.blocking = blocking
        if progress_thread:
            self._start_progress_thread(blocking, idle_wakeup_s)

    def _check_thread_mode(self) -> None:
        """Raise unless UCX granted MULTI thread mode (it may quietly grant less)."""
        ffi, lib = self._b
        attr = ffi.new("ucp_worker_attr_t *")
        attr.field_mask = lib.UCP_WORKER_ATTR_FIELD_THREAD_MODE
        check_status(lib.ucp_worker_query(self._handle, attr), "ucp_worker_query")
        if attr.thread_mode != lib.UCS_THREAD_MODE_MULTI:
            raise _error(
                "ucp_worker_create",
                UcsStatus.ERR_UNSUPPORTED,
                f"thread mode MULTI not granted (got {int(attr.thread_mode)}): "
                "this UCX was built without --enable-mt",
            )

    def _worker_address(self) -> bytes:
        """The worker's address (what a peer connects to), copied; UCX's copy is released."""
        ffi, lib = self._b
        address_p = ffi.new("ucp_address_t **")
        length_p = ffi.new("size_t *")
        check_status(
            lib.ucp_worker_get_address(self._handle, address_p, length_p),
            "ucp_worker_get_address",
        )
        address = bytes(ffi.buffer(address_p[0], length_p[0]))
        lib.ucp_worker_release_address(self._handle, address_p[0])
        return address

    def _start_progress_thread(self, blocking: bool, idle_wakeup_s: float | None) -> None:
        """The C progress loop (:meth:`_run_progress`) on a daemon thread of its own."""
        wakeup_ms = -1 if idle_wakeup_s is None else max(1, int(idle_wakeup_s * 1000))
        self._thread = threading.Thread(
            target=self._run_progress,
            args=(1 if blocking else 0, wakeup_ms),
            name="ray_velo-ucx-progress",
            daemon=True,
        )
        self._thread.start()

    def _run_progress(self, blocking: int, wakeup_ms: int) -> None:
        status = int(
            self._b.lib.rv_progress_loop(
                self._handle, self._stop_cell, blocking, wakeup_ms, self._wakeups
            )
        )
        if status != UcsStatus.OK:
            _log.error("ray_velo.ucx: progress thread ended: %s", status_text(status))

    @property
    def progress_thread_alive(self) -> bool:
        """Whether the progress thread is running."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def progress_wakeups(self) -> int:
        """How many times the blocking progress thread woke from ``poll()`` (diagnostics)."""
        return int(self._wakeups[0])

    def signal(self) -> None:
        """Wake the progress thread (``ucp_worker_signal``); safe from any thread."""
        if self.closed or forked_after_load():
            return
        check_status(self._b.lib.ucp_worker_signal(self._handle), "ucp_worker_signal")

    def progress(self) -> int:
        """One ``ucp_worker_progress`` round; returns how many events it processed.

        Raises:
            UcxError: the worker is closed.
        """
        _check_not_forked("ucp_worker_progress")
        if self.closed:
            raise _closed_error("ucp_worker_progress", self._kind)
        return int(self._b.lib.ucp_worker_progress(self._handle))

    def _stop_progress_thread(self, timeout_s: float) -> bool:
        thread = self._thread
        if thread is None:
            return True
        self._b.lib.rv_cell_store(self._stop_cell, 1)
        self._b.lib.ucp_worker_signal(self._handle)
        thread.join(timeout_s)
        return not thread.is_alive()

    def _release(self) -> None:
        # Endpoints are closed (children first) while the progress thread still runs, so a
        # peer-side close handshake over tcp can progress; only then is the thread stopped.
        if not self._stop_progress_thread(DEFAULT_CLOSE_TIMEOUT_S):
            self._leaked = True
            raise _leaked_error(
                self,  # with its endpoints' error cells
                "the UCX progress thread did not stop",
                "ucp_worker_destroy",
                "the progress thread did not stop; the worker is leaked",
            )
        self._b.lib.ucp_worker_destroy(self._handle)

    def _detach_from_parent(self) -> None:
        if not self._leaked:  # a leaked worker stays its context's child: see UcxContext
            super()._detach_from_parent()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        thread = "progress thread" if self.progress_thread_alive else "no progress thread"
        return f"UcxWorker({state}, {thread}, address={len(self.address)} bytes)"


class Endpoint(_Node):
    """A ``ucp_ep`` to a remote worker, in PEER error mode with a C error callback.

    A transport failure (peer died, stale memory on cma) marks the endpoint failed: the
    callback stores the status in :attr:`error_status` and later GETs fail fast. Creating the
    endpoint does not connect it; the first GET pays the wireup (about 1 ms on cma, 10 ms on tcp).

    Args:
        worker: the local worker.
        remote_address: the peer worker's address (:attr:`UcxWorker.address`).

    Raises:
        UcxError: the address is empty or absurdly long, or ``ucp_ep_create`` fails.
    """

    _kind = "UCX endpoint"

    def __init__(self, worker: UcxWorker, remote_address: bytes) -> None:
        super().__init__(worker)
        self.worker = worker
        ffi, lib = self._b
        address = bytes(remote_address)
        if not 0 < len(address) <= MAX_WORKER_ADDRESS_BYTES:
            raise _invalid("ucp_ep_create", f"worker address of {len(address)} bytes")
        self._cond = threading.Condition(self._lock)
        self._inflight = 0
        self._ucp_closed = False  # the UCX endpoint is gone (closed or aborted)
        self._error_cell: Any = ffi.new("int *", 0)
        address_buf = ffi.from_buffer(address)
        params = ffi.new("ucp_ep_params_t *")
        params.field_mask = (
            lib.UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
            | lib.UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
            | lib.UCP_EP_PARAM_FIELD_ERR_HANDLER
        )
        params.address = ffi.cast("const ucp_address_t *", address_buf)
        params.err_mode = lib.UCP_ERR_HANDLING_MODE_PEER
        params.err_handler.cb = ffi.addressof(lib, "rv_ep_error_cb")
        params.err_handler.arg = self._error_cell
        self._handle: Any = worker._create_child(
            self, "ucp_ep_create", "ucp_ep_h *", lib.ucp_ep_create, worker._handle, params
        )

    @property
    def error_status(self) -> int:
        """0 while healthy; else the first failure status (a ``UcsStatus`` value)."""
        return int(self._b.lib.rv_cell_load(self._error_cell))

    def _check_usable(self, operation: str) -> None:
        # Caller holds self._lock. A failed endpoint reports its failure, not just "closed".
        if not self._open or self._closing:
            raise _closed_error(operation, self._kind)
        status = self.error_status
        if status != UcsStatus.OK:
            raise _error(operation, status, f"endpoint failed earlier: {status_text(status)}")
        if self._ucp_closed:
            raise _closed_error(operation, self._kind)

    def _adopt(self, child: _Node, operation: str) -> None:
        # Caller holds self._lock. A remote key needs a usable endpoint, not just an open one.
        self._check_usable(operation)
        super()._adopt(child, operation)

    def _abort(self, status: int, why: str) -> None:
        """Force-close the UCX endpoint now: its outstanding requests complete CANCELED.

        Used when a GET overran its timeout (an RMA request cannot be cancelled otherwise).
        The Python object stays open until ``close()``, which destroys its remote keys; they
        must outlive the cancelled requests that reference them, and ucp_rkey_destroy does
        not touch the endpoint.
        """
        with self._lock:
            if self._ucp_closed:
                return
            self._ucp_closed = True
        # Same first-failure-wins rule as the C callback (which this reuses).
        self._b.lib.rv_ep_error_cb(self._error_cell, self._b.ffi.NULL, status)
        _log.warning("ray_velo.ucx: force-closing endpoint: %s", why)
        self._close_ucp()

    def _close_ucp(self) -> None:
        # Always FORCE (legal in PEER mode). Nothing is left to flush: get() returns only once
        # its request completed and close() drains in-flight GETs first, while a graceful
        # close (or a flush) waits on the peer and cannot be bounded: a dead peer would cost
        # the full timeout per endpoint at shutdown.
        lib = self._b.lib
        request = lib.rv_ep_close_submit(self._handle, 1)
        status = int(lib.rv_request_wait(self.worker._handle, request, -1.0, ABORT_GRACE_S))
        if status == UcsStatus.ERR_TIMED_OUT:
            _leak((self._error_cell, request), "an endpoint close did not complete")
            raise _error(
                "ucp_ep_close_nbx", status, "force close did not complete; the endpoint is leaked"
            )

    def _release(self) -> None:
        # Remote keys are closed already (children first); wait for GETs still in flight.
        _drain(self._cond, lambda: self._inflight == 0, self, "closed with GETs in flight")
        with self._lock:
            if self._ucp_closed:
                return
            self._ucp_closed = True
        self._close_ucp()

    def transports(self) -> list[tuple[str, str]]:
        """The ``(transport, device)`` pairs this endpoint's lanes use (``ucp_ep_query``),
        e.g. ``[("tcp", "veth0")]``; empty before wireup chose them.

        Raises:
            UcxError: the endpoint is closed or the query fails.
        """
        ffi, lib = self._b
        capacity = 16
        entries = ffi.new("ucp_transport_entry_t[]", capacity)
        attr = ffi.new("ucp_ep_attr_t *")
        attr.field_mask = lib.UCP_EP_ATTR_FIELD_TRANSPORTS
        attr.transports.entries = entries
        attr.transports.num_entries = capacity
        attr.transports.entry_size = ffi.sizeof("ucp_transport_entry_t")
        with self._lock:
            self._check_usable("ucp_ep_query")
            check_status(lib.ucp_ep_query(self._handle, attr), "ucp_ep_query")
            pairs = []
            for i in range(min(int(attr.transports.num_entries), capacity)):
                entry = entries[i]
                name = ffi.string(entry.transport_name).decode() if entry.transport_name else ""
                device = ffi.string(entry.device_name).decode() if entry.device_name else ""
                pairs.append((name, device))
        return pairs

    @property
    def in_flight(self) -> int:
        """GETs posted on this endpoint that UCX has not completed yet."""
        with self._lock:
            return self._inflight

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"Endpoint({state}, error_status={self.error_status}, in_flight={self._inflight})"


class MemoryRegistration(_Node):
    """Host memory mapped with ``ucp_mem_map`` and its packed remote key.

    The registration holds the buffer (a cffi buffer export) until a confirmed unmap, so the
    pages outlive it: an ``mmap`` cannot be closed and a numpy array is not freed while it is
    registered. The key is packed once and checked with the same pre-parse a consumer runs.

    Args:
        context: the UCX context.
        buffer: a writable, C-contiguous buffer (numpy array, mmap, bytearray, memoryview).
        remote_write: also grant remote write (default: read only; GET needs no more).

    Raises:
        UcxError: an unusable buffer, a failed map or pack, or a packed key over 1024 bytes
            or one that the pre-parse refuses.
    """

    _kind = "UCX memory registration"

    def __init__(self, context: UcxContext, buffer: Any, *, remote_write: bool = False) -> None:
        ffi = context._b.ffi
        try:
            export = ffi.from_buffer("char[]", buffer, require_writable=True)
        except (TypeError, ValueError, BufferError) as exc:
            raise _invalid("ucp_mem_map", f"buffer is not writable and contiguous: {exc}") from exc
        address = int(ffi.cast("uintptr_t", export))
        self._init(context, address, len(export), export, remote_write, MemoryType.HOST)

    @classmethod
    def from_address(
        cls,
        context: UcxContext,
        address: int,
        nbytes: int,
        *,
        keepalive: object,
        remote_write: bool = False,
        memory_type: MemoryType = MemoryType.HOST,
    ) -> MemoryRegistration:
        """Map ``nbytes`` at ``address``; ``keepalive`` is held until the unmap is confirmed.

        The caller guarantees that ``keepalive`` owns writable memory covering the range, of
        ``memory_type`` (host, or a CUDA device allocation for ``MemoryType.CUDA``): UCX is
        told the type instead of detecting it, and the packed key must say the same.

        Raises:
            UcxError: as for the constructor; also a memory type this library does not move,
                or a key whose memory type is not the one asked for (a UCX built without
                CUDA support registers device memory as something else, or refuses it).
        """
        if memory_type not in SUPPORTED_MEMORY_TYPES:
            raise _invalid("ucp_mem_map", f"memory_type={memory_type!r} is not supported")
        self = cls.__new__(cls)
        self._init(context, address, nbytes, keepalive, remote_write, MemoryType(memory_type))
        return self

    def _init(
        self,
        context: UcxContext,
        address: int,
        nbytes: int,
        keepalive: object,
        remote_write: bool,
        memory_type: MemoryType,
    ) -> None:
        super().__init__(context)
        self.context = context
        ffi, lib = self._b
        _check_u64("ucp_mem_map", "address", address)
        if not isinstance(nbytes, int) or not 0 < nbytes <= _U64_MAX - address:
            raise _invalid("ucp_mem_map", f"nbytes={nbytes!r} must be positive and not wrap")
        self.address = address
        self.nbytes = nbytes
        self.memory_type = memory_type
        self._keepalive: object = keepalive
        self._cond = threading.Condition(self._lock)
        self._inflight = 0
        self._unmapped = False
        params = ffi.new("ucp_mem_map_params_t *")
        params.field_mask = (
            lib.UCP_MEM_MAP_PARAM_FIELD_ADDRESS
            | lib.UCP_MEM_MAP_PARAM_FIELD_LENGTH
            | lib.UCP_MEM_MAP_PARAM_FIELD_PROT
            | lib.UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE
        )
        params.address = ffi.cast("void *", address)
        params.length = nbytes
        params.prot = (
            lib.UCP_MEM_MAP_PROT_LOCAL_READ
            | lib.UCP_MEM_MAP_PROT_LOCAL_WRITE
            | lib.UCP_MEM_MAP_PROT_REMOTE_READ
            | (lib.UCP_MEM_MAP_PROT_REMOTE_WRITE if remote_write else 0)
        )
        # Said, not detected: detection costs a driver query per map, and a host buffer must
        # never be taken for device memory. UCX's enum numbers are ABI.
        params.memory_type = int(memory_type)
        self._handle: Any = context._create_child(
            self, "ucp_mem_map", "ucp_mem_h *", lib.ucp_mem_map, context._handle, params
        )
        try:
            self.packed_rkey: bytes = self._pack()
            self.effective_range: tuple[int, int] = self._query_range()
        except BaseException:
            self._unmap_now()
            context._forget(self)
            raise

    def _pack(self) -> bytes:
        ffi, lib = self._b
        buffer_p = ffi.new("void **")
        size_p = ffi.new("size_t *")
        check_status(
            lib.ucp_rkey_pack(self.context._handle, self._handle, buffer_p, size_p), "ucp_rkey_pack"
        )
        try:
            packed = bytes(ffi.buffer(buffer_p[0], size_p[0]))
        finally:
            lib.ucp_rkey_buffer_release(buffer_p[0])
        if len(packed) > PACKED_RKEY_MAX_BYTES:
            raise _error(
                "ucp_rkey_pack",
                UcsStatus.ERR_EXCEEDS_LIMIT,
                f"packed rkey of {len(packed)} bytes is over {PACKED_RKEY_MAX_BYTES}",
            )
        try:
            # The key must say the type we asked for: a UCX without CUDA support would pack
            # device memory under another type, and peers would mis-handle the bytes.
            parse_packed_rkey(packed, memory_types=frozenset({self.memory_type}))
        except ValueError as exc:  # DescriptorError: this UCX packs a layout we cannot check
            raise _error(
                "ucp_rkey_pack",
                UcsStatus.ERR_UNSUPPORTED,
                f"this UCX packs keys the pre-parse refuses: {exc}",
            ) from exc
        return packed

    def _query_range(self) -> tuple[int, int]:
        ffi, lib = self._b
        attr = ffi.new("ucp_mem_attr_t *")
        attr.field_mask = lib.UCP_MEM_ATTR_FIELD_ADDRESS | lib.UCP_MEM_ATTR_FIELD_LENGTH
        check_status(lib.ucp_mem_query(self._handle, attr), "ucp_mem_query")
        # (start, end) of what is pinned, in whole pages: the Registration protocol's form
        return page_range(int(ffi.cast("uintptr_t", attr.address)), int(attr.length))

    def _unmap_now(self) -> None:
        status = int(self._b.lib.ucp_mem_unmap(self.context._handle, self._handle))
        if status != UcsStatus.OK:
            _leak(self._keepalive, "ucp_mem_unmap failed; the buffer stays referenced")
            check_status(status, "ucp_mem_unmap")
        self._keepalive = None  # confirmed: the pages may go now
        self._unmapped = True

    @property
    def packed_key(self) -> bytes:
        """The packed remote key (the pool's ``Registration`` protocol name)."""
        return self.packed_rkey

    def contains(self, address: int, nbytes: int) -> bool:
        """Whether ``[address, address + nbytes)`` lies inside the mapped range."""
        return self.address <= address and address + nbytes <= self.address + self.nbytes

    @property
    def mapped(self) -> bool:
        """True until the unmap is confirmed (a failed unmap leaves it True: do not free)."""
        return not self._unmapped

    def unmap(self) -> None:
        """Unmap (``ucp_mem_unmap``) and let go of the buffer. Idempotent; same as ``close()``.

        Waits up to ``DEFAULT_CLOSE_TIMEOUT_S`` for GETs still writing into this memory.

        Raises:
            UcxError: the unmap failed, or GETs into it did not finish; the memory then stays
                mapped and referenced (do not free it).
        """
        self.close()

    def _release(self) -> None:
        if not _drain(self._cond, lambda: self._inflight == 0):
            raise _leaked_error(
                self,
                "a registration was closed with GETs still writing into it",
                "ucp_mem_unmap",
                "GETs into this memory are still in flight; it stays mapped",
            )
        self._unmap_now()

    def __repr__(self) -> str:
        state = "mapped" if self.mapped else "unmapped"
        return f"MemoryRegistration({state}, address={self.address:#x}, nbytes={self.nbytes})"


class RemoteKey(_Node):
    """A peer's packed key unpacked on one endpoint (``ucp_ep_rkey_unpack``).

    The blob is pre-parsed first (:func:`ray_velo.ucx.rkey.check_packed_rkey`): UCX reads it
    without a length, and a corrupt one is an out-of-bounds read or a crash inside UCX.
    ``memory_types``: the memory a key may name. Host only unless the caller says more: a
    consumer widens it to CUDA only where its own UCX moves CUDA memory (a GPU arena
    consumer), so a host key relabelled CUDA never reaches a UCX that has no CUDA domain.

    Raises:
        DescriptorError: the pre-parse refuses the blob (it never reaches UCX).
        UcxError: the endpoint is closed or failed, or UCX refuses the key.
    """

    _kind = "UCX remote key"

    def __init__(
        self,
        endpoint: Endpoint,
        packed: bytes,
        memory_types: frozenset[MemoryType] = HOST_MEMORY_ONLY,
    ) -> None:
        super().__init__(endpoint)
        blob = bytes(packed)
        check_packed_rkey(blob, memory_types=memory_types)
        self.endpoint = endpoint
        ffi, lib = self._b
        self._inflight = 0
        self._handle: Any = endpoint._create_child(
            self,
            "ucp_ep_rkey_unpack",
            "ucp_rkey_h *",
            lib.ucp_ep_rkey_unpack,
            endpoint._handle,
            ffi.from_buffer(blob),
        )

    def _release(self) -> None:
        ep, why = self.endpoint, "remote key closed with GETs in flight"
        if not _drain(ep._cond, lambda: self._inflight == 0, ep, why):
            raise _leaked_error(
                self,
                "a remote key is still used by a GET that does not complete",
                "ucp_rkey_destroy",
                "a GET using this key did not complete; the key is leaked",
            )
        self._b.lib.ucp_rkey_destroy(self._handle)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"RemoteKey({state}, in_flight={self._inflight})"


def get(
    ep: Endpoint,
    local_addr: int,
    nbytes: int,
    remote_addr: int,
    rkey: RemoteKey,
    timeout_s: float,
    *,
    local_memh: MemoryRegistration | None = None,
    self_progress_s: float = SELF_PROGRESS_S,
) -> None:
    """One-sided GET of ``nbytes`` from the peer's ``remote_addr`` into ``local_addr``.

    Posts ``ucp_get_nbx``, signals the worker (its progress thread may be asleep), then waits in
    C without the GIL, progressing the worker for ``self_progress_s`` (< 0: throughout) and
    then leaving it to the worker's progress thread (a worker without one is progressed here
    throughout). Safe from any thread; GETs may run concurrently.

    Args:
        ep: endpoint to the owner.
        local_addr: destination address in this process; the caller keeps it alive and
            writable until this returns.
        nbytes: bytes to read (0 is a no-op).
        remote_addr: source address in the owner's registered memory.
        rkey: the owner's key, unpacked on ``ep``.
        timeout_s: bound on the whole GET, in seconds (> 0).
        local_memh: registration covering the destination (needed for speed on InfiniBand).

    Raises:
        UcxError: the transfer failed (e.g. ``UCS_ERR_IO_ERROR`` for memory the owner freed
            over cma, ``UCS_ERR_CONNECTION_RESET`` when the owner died), an object is closed,
            or it timed out (``UCS_ERR_TIMED_OUT``). After a timeout the endpoint is
            force-closed and unusable; if its request still did not complete within
            ``ABORT_GRACE_S``, the destination may yet be written: do not reuse it.
    """
    operation = "ucp_get_nbx"
    _check_not_forked(operation)
    _check_u64(operation, "local_addr", local_addr)
    _check_u64(operation, "remote_addr", remote_addr)
    if not isinstance(nbytes, int) or nbytes < 0:
        raise _invalid(operation, f"nbytes={nbytes!r} must be a non-negative integer")
    if not timeout_s > 0:
        raise _invalid(operation, f"timeout_s={timeout_s!r} must be positive")
    if rkey.endpoint is not ep:
        raise _invalid(operation, "the remote key was unpacked on another endpoint")
    if local_memh is not None and not local_memh.contains(local_addr, nbytes):
        raise _invalid(operation, "the destination range is outside local_memh")
    if nbytes == 0:
        return
    with _in_flight(ep, rkey, local_memh) as memh_handle:
        _post_and_wait(
            ep, local_addr, nbytes, remote_addr, rkey, timeout_s, memh_handle, self_progress_s
        )


@contextmanager
def _in_flight(
    ep: Endpoint, rkey: RemoteKey, local_memh: MemoryRegistration | None
) -> Iterator[Any]:
    """Count a GET in flight on ``local_memh``, ``ep`` and ``rkey`` so that none closes under
    it; yields the destination's memory handle (NULL without ``local_memh``)."""
    operation = "ucp_get_nbx"
    memh_handle: Any = ep._b.ffi.NULL
    if local_memh is not None:
        with local_memh._lock:
            if local_memh.closed:
                raise _closed_error(operation, local_memh._kind)
            local_memh._inflight += 1
        memh_handle = local_memh._handle
    try:
        with ep._cond:
            ep._check_usable(operation)
            if rkey.closed:
                raise _closed_error(operation, rkey._kind)
            ep._inflight += 1
            rkey._inflight += 1
        try:
            yield memh_handle
        finally:
            with ep._cond:
                ep._inflight -= 1
                rkey._inflight -= 1
                ep._cond.notify_all()
    finally:
        if local_memh is not None:
            with local_memh._cond:
                local_memh._inflight -= 1
                local_memh._cond.notify_all()


def _post_and_wait(
    ep: Endpoint,
    local_addr: int,
    nbytes: int,
    remote_addr: int,
    rkey: RemoteKey,
    timeout_s: float,
    memh_handle: Any,
    self_progress_s: float,
) -> None:
    ffi, lib = ep._b
    worker = ep.worker._handle
    request = lib.rv_get_submit(
        ep._handle, ffi.cast("void *", local_addr), nbytes, remote_addr, rkey._handle, memh_handle
    )
    if lib.rv_ptr_is_err(request):
        check_status(int(lib.rv_ptr_status(request)), "ucp_get_nbx")
    if request == ffi.NULL:
        return  # completed in place
    # A blocking progress thread may be asleep in poll(): wake it (research/ucx.md §7).
    lib.ucp_worker_signal(worker)
    progress_s = self_progress_s if ep.worker.progress_thread_alive else -1.0
    status = int(lib.rv_request_wait(worker, request, progress_s, float(timeout_s)))
    if status == UcsStatus.ERR_TIMED_OUT:
        ep._abort(status, f"GET of {nbytes} bytes did not finish within {timeout_s} s")
        after = int(lib.rv_request_wait(worker, request, -1.0, ABORT_GRACE_S))
        completed = after != UcsStatus.ERR_TIMED_OUT
        if not completed:
            lib.ucp_request_free(request)  # released by UCX when it completes
        raise UcxError(
            operation="ucp_get_nbx",
            status=int(UcsStatus.ERR_TIMED_OUT),
            destination_unsafe=not completed,
            status_text=(
                f"GET of {nbytes} bytes did not finish within {timeout_s} s; endpoint "
                + (
                    "force-closed"
                    if completed
                    else "force-closed but the request did not complete: the destination "
                    "may still be written"
                )
            ),
        )
    check_status(status, "ucp_get_nbx")
