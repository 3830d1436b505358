"""Loads UCX and the compiled binding on first use, and says why when it cannot
(docs/deployment.md §3, docs/architecture.md §10)."""

from __future__ import annotations

import importlib
import os
import threading
from typing import Any, NamedTuple

from ray_velo.errors import UcxError
from ray_velo.ucx.status import UcsStatus, status_name

__all__ = [
    "MIN_UCX_VERSION",
    "Binding",
    "check_status",
    "forked_after_load",
    "load_binding",
    "status_text",
    "ucx_available",
    "ucx_version",
]

MIN_UCX_VERSION = (1, 20, 0)
"""Oldest runtime accepted: the packed-rkey pre-check assumes the >= 1.20 layout."""

EXTENSION_MODULE = "ray_velo.ucx._ucx_binding"

_ENV_DEFAULTS = {"UCX_MEM_EVENTS": "n"}
"""Process-wide UCM settings; only honoured when present before libucs loads."""

# Statuses the Python side names; checked against the compiled constants at load time.
_CHECKED_STATUSES = (
    "OK",
    "INPROGRESS",
    "ERR_NO_MESSAGE",
    "ERR_IO_ERROR",
    "ERR_INVALID_PARAM",
    "ERR_NO_ELEM",
    "ERR_BUSY",
    "ERR_CANCELED",
    "ERR_TIMED_OUT",
    "ERR_EXCEEDS_LIMIT",
    "ERR_UNSUPPORTED",
    "ERR_NOT_CONNECTED",
    "ERR_CONNECTION_RESET",
    "ERR_ENDPOINT_TIMEOUT",
    "ERR_LAST",
)


class Binding(NamedTuple):
    """The cffi ``ffi`` and ``lib`` objects of the compiled extension."""

    ffi: Any
    lib: Any


_lock = threading.Lock()
_binding: Binding | None = None
_failure: str | None = None
_forked_after_load = False


def _after_fork_in_child() -> None:
    # UCX state copied by fork() (threads gone, sockets shared with the parent) is unusable.
    global _forked_after_load
    if _binding is not None:
        _forked_after_load = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def forked_after_load() -> bool:
    """True in a child forked from a process that had loaded UCX: UCX must not be touched."""
    return _forked_after_load


def _load_locked() -> Binding:
    global _binding, _failure
    if _binding is not None:
        return _binding
    if _failure is not None:
        raise _unavailable(_failure)
    try:
        import libucx
    except ImportError as exc:
        _failure = f"the libucx package is not installed ({exc})"
        raise _unavailable(_failure) from exc
    # Only the environment at libucs load time reaches UCM: set our defaults for the load
    # and put the environment back, so child processes inherit nothing from us.
    saved = {key: os.environ.get(key) for key in _ENV_DEFAULTS}
    for key, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    try:
        handles = libucx.load_library()
    except OSError as exc:
        _failure = f"libucx.load_library() failed: {exc}"
        raise _unavailable(_failure) from exc
    finally:
        for key, previous in saved.items():
            if previous is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = previous
    if handles is not None and any(h is None for h in handles):
        _failure = "libucx.load_library() found no libucs/libuct/libucp to load"
        raise _unavailable(_failure)
    try:
        module = importlib.import_module(EXTENSION_MODULE)
    except ImportError as exc:
        _failure = (
            f"cannot import {EXTENSION_MODULE} ({exc}); build it with "
            "`pip install -e .` or `python ray_velo/ucx/_build.py`"
        )
        raise _unavailable(_failure) from exc
    binding = Binding(module.ffi, module.lib)
    for name in _CHECKED_STATUSES:
        compiled = int(getattr(binding.lib, f"UCS_{name}"))
        if compiled != UcsStatus[name]:
            _failure = f"UCS_{name} is {compiled} in the headers, {int(UcsStatus[name])} here"
            raise _unavailable(_failure)
    version = _version_of(binding)
    if version < MIN_UCX_VERSION:
        _failure = (
            f"UCX {'.'.join(map(str, version))} is older than the "
            f"{'.'.join(map(str, MIN_UCX_VERSION))} this binding needs"
        )
        raise _unavailable(_failure)
    _binding = binding
    return binding


def _unavailable(why: str) -> UcxError:
    return UcxError(
        operation="load",
        status=int(UcsStatus.ERR_UNSUPPORTED),
        status_text=f"UCX unavailable: {why}",
    )


def _version_of(binding: Binding) -> tuple[int, int, int]:
    ffi, lib = binding
    major, minor, release = ffi.new("unsigned *"), ffi.new("unsigned *"), ffi.new("unsigned *")
    lib.ucp_get_version(major, minor, release)
    return (int(major[0]), int(minor[0]), int(release[0]))


def load_binding() -> Binding:
    """Load UCX and the extension once per process; later calls return the same objects.

    Raises:
        UcxError: (operation ``load``, status ``UCS_ERR_UNSUPPORTED``) when UCX or the
            extension cannot be loaded, or the runtime is older than ``MIN_UCX_VERSION``.
            The failure is remembered: a process does not retry.
    """
    if _forked_after_load:
        raise _unavailable(
            "this process was forked after UCX was loaded; start workers with the spawn method"
        )
    binding = _binding
    if binding is not None:
        return binding
    with _lock:
        return _load_locked()


def ucx_available() -> tuple[bool, str]:
    """Whether UCX can be used in this process, and why not (or which version) as text.

    Never raises. Loads UCX on the first call (which UCX: docs/deployment.md §3).
    """
    try:
        binding = load_binding()
    except UcxError as exc:
        return False, str(exc.fields.get("status_text", exc))
    major, minor, release = _version_of(binding)
    source = (
        "system UCX preferred"
        if os.environ.get("RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY", "false").lower() != "false"
        else "libucx wheel"
    )
    return True, f"UCX {major}.{minor}.{release} ({source})"


def ucx_version() -> tuple[int, int, int]:
    """``(major, minor, release)`` of the loaded UCX runtime.

    Raises:
        UcxError: when UCX cannot be loaded (see :func:`load_binding`).
    """
    return _version_of(load_binding())


def status_text(status: int) -> str:
    """UCX's own text for a status, with its symbolic name."""
    binding = _binding
    if binding is None:
        return status_name(status)
    text = binding.ffi.string(binding.lib.ucs_status_string(status)).decode(errors="replace")
    return f"{text} ({status_name(status)})"


def check_status(status: int, operation: str) -> None:
    """Raise :class:`UcxError` for any status but ``UCS_OK``.

    Raises:
        UcxError: with ``operation``, the status and its text.
    """
    if status != UcsStatus.OK:
        raise UcxError(operation=operation, status=int(status), status_text=status_text(status))
