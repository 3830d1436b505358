"""ray_velo: move large arrays, bytes and tensors between Ray tasks and actors by handle.

Importing ``ray_velo`` is cheap: Ray itself is imported on first use of the API.
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import TYPE_CHECKING, Any

from ray_velo.config import (
    RdmaConfig,
    RdmaPoolConfig,
    RdmaRendezvousConfig,
    UcxConfig,
    VeloConfig,
)
from ray_velo.errors import (
    AgentDied,
    AgentShuttingDown,
    BudgetExceeded,
    ConfigError,
    DescriptorError,
    HandleError,
    HandleNotFound,
    HandleReleased,
    LeaseNotFound,
    NotInitialized,
    OwnerDied,
    PayloadTooLarge,
    ProtocolError,
    RayFeatureUnavailable,
    RegionDeregistered,
    SharedMemoryTooSmall,
    StagingError,
    TransferError,
    TransferTimeout,
    UcxError,
    UnsupportedPayload,
    VeloError,
)
from ray_velo.protocol.handle import DataHandle, HandleMetadata

if TYPE_CHECKING:
    from ray_velo.api import (
        PinnedBuf,
        PinnedWriter,
        RegionGuard,
        SendBuffer,
        alloc_pinned_writer,
        alloc_region,
        detach,
        empty,
        fetch,
        get,
        get_into,
        get_pinned,
        init,
        is_initialized,
        metadata,
        put,
        ref_handle,
        register_data,
        register_data_in_region,
        register_data_pinned,
        release,
        runtime_env,
        shutdown,
        worker_setup,
    )
    from ray_velo.rdt import register_transports
    from ray_velo.staging import (
        StagedValue,
        TransferOptions,
        resolve,
        resolve_stream,
        transfer,
    )

__version__ = "0.1.0"

# Ray-facing names that load on first use, so `import ray_velo` (and the pure protocol core
# under it) never imports Ray.
_LAZY = {
    name: module
    for module, names in (
        ("ray_velo.staging", "StagedValue TransferOptions resolve resolve_stream transfer"),
        ("ray_velo.rdt", "register_transports"),
        (
            "ray_velo.api",
            "PinnedBuf PinnedWriter RegionGuard SendBuffer alloc_pinned_writer alloc_region detach"
            " empty fetch get get_into get_pinned init is_initialized metadata put ref_handle"
            " register_data register_data_in_region register_data_pinned release runtime_env shutdown"
            " worker_setup",
        ),
    )
    for name in names.split()
}

__all__ = [
    "AgentDied",
    "AgentShuttingDown",
    "BudgetExceeded",
    "ConfigError",
    "DataHandle",
    "DescriptorError",
    "HandleError",
    "HandleMetadata",
    "HandleNotFound",
    "HandleReleased",
    "LeaseNotFound",
    "NotInitialized",
    "OwnerDied",
    "PayloadTooLarge",
    "PinnedBuf",
    "PinnedWriter",
    "ProtocolError",
    "RayFeatureUnavailable",
    "RdmaConfig",
    "RdmaPoolConfig",
    "RdmaRendezvousConfig",
    "RegionDeregistered",
    "RegionGuard",
    "SendBuffer",
    "SharedMemoryTooSmall",
    "StagedValue",
    "StagingError",
    "TransferError",
    "TransferOptions",
    "TransferTimeout",
    "UcxConfig",
    "UcxError",
    "UnsupportedPayload",
    "VeloConfig",
    "VeloError",
    "__version__",
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
    "register_transports",
    "release",
    "resolve",
    "resolve_stream",
    "runtime_env",
    "shutdown",
    "transfer",
    "worker_setup",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ray_velo' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if "ray" in sys.modules:
    # Ray checks a tensor_transport name when @ray.method(tensor_transport="VELO") runs,
    # which is at class definition, usually before rv.init(), and in a worker at ray.put or
    # when it submits an RDT call: a process that imported Ray before ray_velo gets the
    # transports registered now ("VELO" once torch is imported).
    try:
        from ray_velo.rdt import worker_setup as _worker_setup

        _worker_setup()
    except Exception:  # never fail an import over an optional integration
        logging.getLogger(__name__).debug("tensor transports not registered", exc_info=True)
