"""ray_velo's binding to UCX (libucp). Importing this package loads no UCX: the first object
created, or :func:`ucx_available`, does.

May import: errors, config, protocol, memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ray_velo.ucx.loader import ucx_available, ucx_version
from ray_velo.ucx.rkey import PACKED_RKEY_MAX_BYTES, check_packed_rkey
from ray_velo.ucx.status import UcsStatus

if TYPE_CHECKING:
    from ray_velo.ucx.binding import (
        Endpoint,
        MemoryRegistration,
        RemoteKey,
        UcxContext,
        UcxWorker,
        get,
    )

__all__ = [
    "PACKED_RKEY_MAX_BYTES",
    "Endpoint",
    "MemoryRegistration",
    "RemoteKey",
    "UcsStatus",
    "UcxContext",
    "UcxWorker",
    "check_packed_rkey",
    "get",
    "ucx_available",
    "ucx_version",
]

_BINDING_NAMES = frozenset(
    {"Endpoint", "MemoryRegistration", "RemoteKey", "UcxContext", "UcxWorker", "get"}
)


def __getattr__(name: str) -> Any:
    # binding.py itself loads nothing at import; this only keeps `import ray_velo.ucx` small.
    if name in _BINDING_NAMES:
        from ray_velo.ucx import binding

        return getattr(binding, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
