"""Everything ray_velo uses of Ray that is not Ray's public API, in one place, each with the Ray
versions it was checked on (docs/architecture.md §11)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import ray

from ray_velo.errors import RayFeatureUnavailable

__all__ = [
    "CHECKED_VERSIONS",
    "RAY_VERSION",
    "RDT_MIN_VERSION",
    "RdtApi",
    "auth_mode",
    "dead_jobs",
    "has_tensor_transport",
    "in_detached_actor",
    "in_rdt_queued_transfer_callback",
    "is_worker_process",
    "job_setup_hook",
    "kv_delete",
    "kv_exists",
    "kv_get",
    "kv_put",
    "rdt_api",
    "rdt_fetch_timeout_s",
    "rdt_incoming_tensor",
    "rdt_outgoing_tensors",
    "rdt_serializer_table",
    "record_zero",
    "remote_function_parts",
    "tensor_transport_enabled",
    "torch_zero_copy_reducer",
    "version_text",
]

_log = logging.getLogger(__name__)


def _parse(text: str) -> tuple[int, int, int]:
    parts = [int("".join(c for c in p if c.isdigit()) or 0) for p in text.split(".")[:3]]
    major, minor, patch = [*parts, 0, 0, 0][:3]
    return major, minor, patch


#: This process's Ray, as (major, minor, patch).
RAY_VERSION = _parse(ray.__version__)
#: The Ray versions every function here was checked on (the version smoke runs them).
CHECKED_VERSIONS = ("2.40.0", "2.55.0", "2.60.0")
#: The first Ray whose tensor-transport API sits where ray_velo's transports import it
#: (``ray.experimental.rdt``): ``tensor_transport="VELO"`` needs it. (2.54 has an earlier
#: form under ``ray.experimental.gpu_object_manager``; 2.53 and older have none.)
RDT_MIN_VERSION = (2, 55, 0)


def version_text(version: tuple[int, int, int] = RAY_VERSION) -> str:
    return ".".join(str(part) for part in version)


# --- Ray's internal KV (the agents' directory, the wire's secret, the cluster config) -----


def kv_put(key: bytes, value: bytes, *, namespace: str, overwrite: bool = True) -> bool:
    """Store ``value`` under ``key`` in Ray's internal KV (which Ray's token guards); True
    when the key already existed. ``ray.experimental.internal_kv._internal_kv_{put,get,del,
    exists}``, checked on every version: ray_velo cannot find its agents without them, so
    where they are gone the first call fails loudly (an AttributeError naming them)."""
    from ray.experimental import internal_kv

    return bool(internal_kv._internal_kv_put(key, value, overwrite=overwrite, namespace=namespace))


def kv_get(key: bytes, *, namespace: str) -> bytes | None:
    from ray.experimental import internal_kv

    value = internal_kv._internal_kv_get(key, namespace=namespace)
    return value if isinstance(value, bytes) else None


def kv_delete(key: bytes, *, namespace: str) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(key, namespace=namespace)


def kv_exists(key: bytes, *, namespace: str) -> bool:
    from ray.experimental import internal_kv

    return bool(internal_kv._internal_kv_exists(key, namespace=namespace))


# --- this worker ---------------------------------------------------------------------------


def auth_mode() -> str:
    """This process's Ray token-auth mode: ``"token"`` or ``"disabled"``
    (``ray._raylet.get_authentication_mode``, checked on 2.55.0 and 2.60.0); ``"none"`` on a
    Ray without token auth (2.51 and older)."""
    try:
        from ray._raylet import (  # type: ignore[attr-defined]
            AuthenticationMode,
            get_authentication_mode,
        )
    except ImportError:
        return "none"
    return "token" if get_authentication_mode() == AuthenticationMode.TOKEN else "disabled"


def _global_worker() -> Any:
    from ray._private.worker import global_worker

    return global_worker


def is_worker_process() -> bool:
    """Whether this process is a Ray worker (a task or actor), not a driver
    (``global_worker.mode == WORKER_MODE``, checked on 2.60.0)."""
    worker = _global_worker()
    return bool(worker.mode == ray._private.worker.WORKER_MODE)


def job_setup_hook() -> str | None:
    """The ``worker_process_setup_hook`` of this process's job (its import path, or the
    callable's name), None without one (the runtime context's ``runtime_env``, checked on
    2.60.0)."""
    hook = ray.get_runtime_context().runtime_env.get("worker_process_setup_hook")
    return None if hook is None else str(hook)


def in_detached_actor() -> bool:
    """Whether this process's work is rooted in a detached actor (Ray keeps such work past
    the job that created it). ``core_worker.get_current_root_detached_actor_id``: checked on
    every version; where it is gone, False (staged data then follows its job: the safe side).
    """
    try:
        core_worker = _global_worker().core_worker
        return not core_worker.get_current_root_detached_actor_id().is_nil()
    except Exception:
        return False


def dead_jobs(jobs: Collection[str], timeout_s: float, filtered_max: int) -> set[str]:
    """The jobs of ``jobs`` (hex ids) that Ray's job table says ended (one filtered read per
    job up to ``filtered_max`` of them, else one read of the whole table), read through this
    process's GCS client (``global_worker.gcs_client.get_all_job_info``: checked on every
    version, with its ``job_or_submission_id`` filter and ``skip_*`` flags; a Ray without the
    flags is asked without them).

    Raises:
        Exception: the table could not be read (the caller retries later).
    """
    client = _global_worker().gcs_client
    skip = {"skip_submission_job_info_field": True, "skip_is_running_tasks_field": True}

    def read(**filters: Any) -> dict[Any, Any]:
        try:
            return dict(client.get_all_job_info(timeout=timeout_s, **filters, **skip))
        except TypeError:  # a Ray without the skip flags
            return dict(client.get_all_job_info(timeout=timeout_s, **filters))

    infos: dict[Any, Any] = {}
    if len(jobs) <= filtered_max:
        for job in jobs:
            infos.update(read(job_or_submission_id=job))
    else:
        infos = read()
    ended = {job_id.hex() for job_id, info in infos.items() if info.is_dead}
    return ended & set(jobs)


# --- remote functions (the @rv.transfer decorator) -----------------------------------------


def remote_function_parts(remote_function: Any) -> tuple[Callable[..., Any], dict[str, Any]]:
    """The plain function behind a ``@ray.remote`` function and its default options
    (``RemoteFunction._function``, ``._default_options``: checked on every version).

    Raises:
        RayFeatureUnavailable: this Ray keeps them elsewhere (``@rv.transfer`` on functions
            cannot work on it).
    """
    try:
        return remote_function._function, dict(remote_function._default_options)
    except AttributeError as exc:
        raise RayFeatureUnavailable(
            feature="@ray_velo.transfer on a remote function",
            needs=f"a Ray whose RemoteFunction keeps _function (checked: {CHECKED_VERSIONS})",
            found=version_text(),
        ) from exc


# --- metrics --------------------------------------------------------------------------------


def record_zero(metric: Any, tags: dict[str, str] | None = None) -> bool:
    """Record 0 on a ``ray.util.metrics`` counter, so its series exists before first use
    (``inc`` refuses 0): through its ``_record`` (checked on every version). False where it
    is gone: the series then appear on first use."""
    record = getattr(metric, "_record", None)
    if record is None:
        return False
    if tags:
        record(0, tags)
    else:
        record(0)
    return True


# --- Ray Direct Transport (tensor_transport="VELO" / "VELO_NUMPY") -----------------------


@dataclass(frozen=True, slots=True)
class RdtApi:
    """What ray_velo's tensor transports build on: the base classes a transport subclasses,
    the registration call and the table of what is registered."""

    manager: type[Any]  # ray.experimental.TensorTransportManager
    metadata: type[Any]  # ray.experimental.TensorTransportMetadata
    communicator_metadata: type[Any]  # ray.experimental.rdt.tensor_transport_manager
    register: Callable[..., Any]  # ray.experimental.register_tensor_transport
    registered: Any  # ray.experimental.rdt.util.transport_manager_info (a mapping)


def has_tensor_transport() -> bool:
    """Whether this Ray lets a library register a tensor transport."""
    try:
        rdt_api()
    except RayFeatureUnavailable:
        return False
    return True


def rdt_api() -> RdtApi:
    """Ray's tensor-transport API (checked on 2.55.0 and 2.60.0; absent on 2.40.0).

    Raises:
        RayFeatureUnavailable: this Ray has none (it needs :data:`RDT_MIN_VERSION`).
    """
    try:
        from ray.experimental import (
            TensorTransportManager,
            TensorTransportMetadata,
            register_tensor_transport,
        )
        from ray.experimental.rdt.tensor_transport_manager import CommunicatorMetadata
        from ray.experimental.rdt.util import transport_manager_info
    except ImportError as exc:
        raise RayFeatureUnavailable(
            feature='the "VELO" / "VELO_NUMPY" tensor transports (Ray Direct Transport)',
            needs=f"Ray >= {version_text(RDT_MIN_VERSION)} (register_tensor_transport)",
            found=version_text(),
        ) from exc
    return RdtApi(
        TensorTransportManager,
        TensorTransportMetadata,
        CommunicatorMetadata,
        register_tensor_transport,
        transport_manager_info,
    )


def rdt_fetch_timeout_s() -> float | None:
    """Ray's bound on an RDT fetch (``ray_constants.RDT_FETCH_FAIL_TIMEOUT_SECONDS``, checked
    on 2.55.0 and 2.60.0), or None where Ray has none (receives are then bounded by their own timeout)."""
    try:
        from ray._private import ray_constants

        return float(ray_constants.RDT_FETCH_FAIL_TIMEOUT_SECONDS)
    except (ImportError, AttributeError, TypeError, ValueError):
        return None


def tensor_transport_enabled(actor: Any) -> bool:
    """Whether an actor handle's class was declared ``enable_tensor_transport=True``
    (``ActorHandle._ray_enable_tensor_transport``, checked on 2.55.0 and 2.60.0)."""
    return getattr(actor, "_ray_enable_tensor_transport", None) is True


def _serialization_context() -> Any:
    return _global_worker().get_serialization_context()


def rdt_outgoing_tensors() -> list[Any] | None:
    """While Ray serializes an RDT return in this thread, the list it collects the
    out-of-band tensors in (``serialization context._thread_local.use_external_transport`` /
    ``.rdt_tensors``, checked on 2.55.0 and 2.60.0); None otherwise, and where Ray has no such
    fields (the value is then pickled as an ordinary one)."""
    local = getattr(_serialization_context(), "_thread_local", None)
    if local is None or not getattr(local, "use_external_transport", False):
        return None
    tensors = getattr(local, "rdt_tensors", None)
    return tensors if isinstance(tensors, list) else None


def rdt_incoming_tensor(index: int) -> Any:
    """Tensor ``index`` of the RDT object Ray deserializes in this thread (its
    ``_thread_local.rdt_tensors``, checked on 2.55.0 and 2.60.0).

    Raises:
        RayFeatureUnavailable: this Ray keeps them elsewhere.
    """
    local = getattr(_serialization_context(), "_thread_local", None)
    tensors = getattr(local, "rdt_tensors", None)
    if tensors is None:
        raise RayFeatureUnavailable(
            feature="reading a tensor transport object",
            needs=f"Ray >= {version_text(RDT_MIN_VERSION)} (its RDT serialization fields)",
            found=version_text(),
        )
    return tensors[index]


def rdt_serializer_table() -> dict[Any, Any] | None:
    """The table in which Ray notes that it registered its RDT serializer for a data type
    (``_rdt_custom_serializer_registered``, checked on 2.55.0 and 2.60.0): ray_velo marks its
    own there so Ray does not put its own back. None where Ray has no such table or no
    per-thread RDT fields (Ray's serializer then stays)."""
    context = _serialization_context()
    table = getattr(context, "_rdt_custom_serializer_registered", None)
    if not isinstance(table, dict) or not hasattr(context, "_thread_local"):
        return None
    return table


def torch_zero_copy_reducer() -> Any:
    """Ray's zero-copy reducer for torch tensors when this worker has zero-copy tensors on
    (``_zero_copy_tensors_enabled``, ``tensor_serialization_utils.zero_copy_tensors_reducer``,
    checked on 2.55.0 and 2.60.0), else None (tensors then pickle as torch pickles them)."""
    if not getattr(_serialization_context(), "_zero_copy_tensors_enabled", False):
        return None
    try:
        from ray._private import tensor_serialization_utils

        return tensor_serialization_utils.zero_copy_tensors_reducer
    except (ImportError, AttributeError):
        return None


def in_rdt_queued_transfer_callback() -> bool:
    """Whether Ray's callback for transfers it queued until their object existed is on this
    thread's stack (``set_tensor_transport_metadata_and_trigger_queued_operations``, checked on
    2.55.0 and 2.60.0): an error raised there reaches no caller. False where Ray renamed it
    (the error is then raised, as to a caller)."""
    frame: Any = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "set_tensor_transport_metadata_and_trigger_queued_operations":
            return True
        frame = frame.f_back
    return False
