"""The ``"VELO"`` (torch) and ``"VELO_NUMPY"`` Ray tensor transports, backed by the node agents;
lifetimes, streaming and devices: docs/transports.md."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import math
import os
import pickle
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray

from ray_velo import _ray
from ray_velo.client import session
from ray_velo.client.payload import host_tensor, to_fetch_device
from ray_velo.client.writable import alloc_pinned_writer, fetched_pinned_writer
from ray_velo.errors import TransferError, UnsupportedPayload
from ray_velo.protocol import DataHandle

__all__ = [
    "VELO",
    "VELO_NUMPY",
    "WORKER_SETUP_HOOK",
    "VeloNumpyTransport",
    "VeloTensorTransport",
    "VeloTransportMetadata",
    "register_transports",
    "worker_setup",
]

VELO = "VELO"
VELO_NUMPY = "VELO_NUMPY"

_log = logging.getLogger(__name__)

#: Ray's tensor-transport API: importing this module on a Ray without it raises
#: RayFeatureUnavailable, naming the Ray version the transports need.
_RDT = _ray.rdt_api()


@dataclass
class VeloTransportMetadata(_RDT.metadata):  # type: ignore[name-defined,misc]
    """What a receiver needs: the one slot all the object's tensors were packed into (None
    when every tensor is empty) and where each tensor starts in it (None: an empty one)."""

    handle: DataHandle | None = None
    #: The packed slot's size in bytes.
    nbytes: int = 0
    offsets: list[int | None] = field(default_factory=list)
    #: Ray's fetch bound (seconds) when the source staged them; bounds the receive.
    fetch_timeout_s: float | None = None


@dataclass
class VeloCommunicatorMetadata(_RDT.communicator_metadata):  # type: ignore[name-defined,misc]
    """One-sided: the receiver needs nothing but the handles."""


class VeloNumpyTransport(_RDT.manager):  # type: ignore[name-defined,misc]
    """``tensor_transport="VELO_NUMPY"``: numpy arrays through the node agents."""

    backend = VELO_NUMPY
    #: The torch device types Ray may hand this transport (``register_tensor_transport``).
    devices: tuple[str, ...] = ("cpu",)

    def __init__(self) -> None:
        self._aborted: set[str] = set()
        self._lock = threading.Lock()
        _keep_ordinary_returns_zero_copy(self.data_type())

    # --- what Ray asks of a transport ----------------------------------------------------

    def tensor_transport_backend(self) -> str:
        return self.backend

    @staticmethod
    def is_one_sided() -> bool:
        return True

    @staticmethod
    def can_abort_transport() -> bool:
        # Every receive is bounded (Ray's own RDT fetch timeout): an abort never leaves a
        # party blocked, so Ray need not kill the actors.
        return True

    def actor_has_tensor_transport(self, actor: Any) -> bool:
        # Any process of the cluster reaches its node's agent; nothing to create per actor.
        return True

    def get_communicator_metadata(
        self, src_actor: Any, dst_actor: Any, backend: str | None = None
    ) -> VeloCommunicatorMetadata:
        if dst_actor is not None and not _ray.tensor_transport_enabled(dst_actor):
            # Ray delivers the tensors through the receiver's "_ray_system" concurrency
            # group, which only such actors have: without it the receive waits out Ray's
            # RDT fetch timeout (60 s) instead of failing now.
            message = (
                f"{dst_actor} cannot receive a {self.backend} tensor transport object: its "
                "class was created without enable_tensor_transport, so Ray's transfer would "
                "time out. Declare it with @ray.remote(enable_tensor_transport=True), or "
                "hand it the value through Ray's object store instead."
            )
            if _ray.in_rdt_queued_transfer_callback():
                # A transfer Ray queued until the object existed, run from its callback:
                # the caller's .remote() has returned already, nobody would see a raise.
                _log.error("ray_velo: %s", message)
            else:
                raise ValueError(message)
        return VeloCommunicatorMetadata()

    def extract_tensor_transport_metadata(
        self, obj_id: str, rdt_object: list[Any]
    ) -> VeloTransportMetadata:
        _keep_ordinary_returns_zero_copy(self.data_type())
        devices = {self._device(value) for value in rdt_object}
        if len(devices) > 1:
            raise ValueError(
                f"object {obj_id}: all tensors of one {self.backend} object must be on one "
                f"device type, got {sorted(devices)}"
            )
        device = devices.pop() if devices else None
        tensor_meta = [self._meta(value) for value in rdt_object]
        if device not in (None, *self.devices):
            # Nothing staged: Ray refuses the device, naming it and the transport.
            return VeloTransportMetadata(tensor_meta=tensor_meta, tensor_device=device)
        parts = [self._bytes(value) for value in rdt_object]
        packed = [part for part in parts if part.nbytes]
        if not packed:
            return VeloTransportMetadata(
                tensor_meta=tensor_meta, tensor_device=device, offsets=[None] * len(parts)
            )
        # One slot for the whole object: one reservation here, one GET for each receiver.
        staged = session.stage_packed(packed, ttl=None, follow_producer=True, staged_from=device)
        assert staged is not None  # a reservation that may map is never declined
        handle, starts = staged
        at = iter(starts)
        return VeloTransportMetadata(
            tensor_meta=tensor_meta,
            tensor_device=device,
            handle=handle,
            nbytes=starts[-1] + packed[-1].nbytes,
            offsets=[next(at) if part.nbytes else None for part in parts],
            fetch_timeout_s=_ray.rdt_fetch_timeout_s(),
        )

    def recv_multiple_tensors(
        self,
        obj_id: str,
        tensor_transport_metadata: Any,
        communicator_metadata: Any,
        target_buffers: list[Any] | None = None,
    ) -> list[Any]:
        meta = tensor_transport_metadata
        if not isinstance(meta, VeloTransportMetadata):
            raise TransferError(
                f"object {obj_id}: {self.backend} got metadata of another transport "
                f"({type(meta).__name__})"
            )
        with self._lock:
            if obj_id in self._aborted:
                raise TransferError(f"object {obj_id}: Ray aborted its {self.backend} transfer")
        if target_buffers is not None and len(target_buffers) != len(meta.offsets):
            raise ValueError(
                f"object {obj_id} holds {len(meta.offsets)} tensors, "
                f"{len(target_buffers)} target buffers were given"
            )
        slot = None
        if meta.handle is not None:
            owned = self._owns(target_buffers)
            slot = self._fetch(meta.handle, meta.nbytes, owned, meta.fetch_timeout_s)
        out = []
        for index, offset in enumerate(meta.offsets):
            shape, dtype = meta.tensor_meta[index]
            target = target_buffers[index] if target_buffers is not None else None
            if offset is None or slot is None:
                received = self._empty(shape, dtype) if target is None else target
            else:
                received = self._unpacked(slot, offset, shape, dtype, target, meta.handle)
            out.append(self._placed(received, meta.tensor_device, target))
        return out

    def _placed(self, received: Any, staged_from: str | None, target: Any) -> Any:
        """A received value on the device its object was staged from (VELO: CUDA tensors go
        to the receiver's current device); numpy arrays and filled targets as they are."""
        return received

    def send_multiple_tensors(
        self,
        tensors: list[Any],
        tensor_transport_metadata: Any,
        communicator_metadata: Any,
    ) -> None:
        # One-sided: Ray never calls this for such a transport.
        raise TransferError(f"{self.backend} is one-sided: the receiver fetches, nothing sends")

    def garbage_collect(self, obj_id: str, tensor_transport_meta: Any, tensors: list[Any]) -> None:
        """Ray freed the ObjectRef: end its slot (views handed out keep their bytes)."""
        handle = getattr(tensor_transport_meta, "handle", None)
        if handle is not None:
            session.release_soon(handle)
        with self._lock:
            self._aborted.discard(obj_id)

    def abort_transport(self, obj_id: str, communicator_metadata: Any) -> None:
        """Ray gave up on a transfer: a receive that has not started refuses it. One in
        progress ends by its own bound (Ray's RDT fetch timeout)."""
        with self._lock:
            self._aborted.add(obj_id)

    # --- per data type -------------------------------------------------------------------

    @staticmethod
    def data_type() -> type:
        return np.ndarray

    def _device(self, value: Any) -> str:
        if not isinstance(value, np.ndarray):
            raise UnsupportedPayload(
                type_name=f"{type(value).__name__} (VELO_NUMPY moves numpy arrays)"
            )
        return "cpu"

    @staticmethod
    def _meta(value: Any) -> tuple[Any, Any]:
        return (tuple(value.shape), value.dtype)

    @staticmethod
    def _owns(targets: list[Any] | None) -> bool:
        """Whether a receive needs memory of its own: not for numpy arrays, which get a
        read-only view of the fetched slot (as Ray's own ray.get gives arrays)."""
        return False

    @staticmethod
    def _bytes(value: Any) -> np.ndarray[Any, Any]:
        """The value's bytes, flat (copied once only if it is not contiguous)."""
        if value.dtype.hasobject:
            raise UnsupportedPayload(
                type_name=f"numpy array of dtype {value.dtype} (Python objects)"
            )
        return np.ascontiguousarray(value).reshape(-1).view(np.uint8)

    @staticmethod
    def _empty(shape: Any, dtype: Any) -> Any:
        return np.empty(shape, dtype=dtype)

    def _fetch(
        self, handle: DataHandle, nbytes: int, owned: bool, timeout_s: float | None
    ) -> np.ndarray[Any, Any]:
        """The packed slot's bytes here: a read-only view of a detached copy (or of the
        owner's slot on its node); ``owned``: memory of this receiver's own (VELO)."""
        return session.read(session.lease(handle, "detach", timeout_s))  # type: ignore[no-any-return]

    @staticmethod
    def _unpacked(
        slot: np.ndarray[Any, Any], offset: int, shape: Any, dtype: Any, target: Any, handle: Any
    ) -> Any:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        part = slot[offset : offset + nbytes]
        if target is None:
            return part.view(dtype).reshape(shape)
        _copy_checked(np.asarray(target), part, handle)
        return target


class VeloTensorTransport(VeloNumpyTransport):
    """``tensor_transport="VELO"``: torch tensors (CPU or CUDA) through the node agents."""

    backend = VELO
    devices = ("cpu", "cuda")

    @staticmethod
    def data_type() -> type:
        import torch

        return torch.Tensor

    def _device(self, value: Any) -> str:
        import torch

        if not isinstance(value, torch.Tensor):
            raise UnsupportedPayload(type_name=f"{type(value).__name__} (VELO moves torch tensors)")
        return str(value.device.type)

    @staticmethod
    def _meta(value: Any) -> tuple[Any, Any]:
        return (value.shape, value.dtype)

    @staticmethod
    def _bytes(value: Any) -> np.ndarray[Any, Any]:
        # Raw bytes: any dtype travels, bfloat16 included (numpy has none). A CUDA tensor is
        # copied to host memory once (no GPU arena yet), and the agent counts it as such.
        return host_tensor(value).reshape(-1).view(_uint8()).numpy()  # type: ignore[no-any-return]

    @staticmethod
    def _empty(shape: Any, dtype: Any) -> Any:
        import torch

        return torch.empty(shape, dtype=dtype)

    def _placed(self, received: Any, staged_from: str | None, target: Any) -> Any:
        if target is not None or staged_from != "cuda":
            return received
        return to_fetch_device(received, staged_from)

    @staticmethod
    def _owns(targets: list[Any] | None) -> bool:
        """Tensors of the receiver's own (writable: receivers never see each other's
        writes), and CUDA targets fill from host memory of this receiver's."""
        return targets is None or any(target.device.type != "cpu" for target in targets)

    def _fetch(
        self, handle: DataHandle, nbytes: int, owned: bool, timeout_s: float | None
    ) -> np.ndarray[Any, Any]:
        """``owned``: the slot in a PinnedWriter of this node's registered pool: across nodes
        the GET lands in it directly (no copy, and warm memory rather than fresh pages to
        fault in); on the owner's node one copy out of the shared slot. No other reader can
        see what the receiver writes. The writer is freed with the last tensor (or view of
        one) over its memory: one tensor kept keeps the object's whole slot."""
        if not owned:
            return super()._fetch(handle, nbytes, owned, timeout_s)
        if handle.worker_id != session.current().worker_id:
            writer = fetched_pinned_writer(handle, nbytes, timeout_s)
        else:
            writer = alloc_pinned_writer(nbytes)
            try:
                view = session.read(session.lease(handle, "detach", timeout_s))
                _copy_checked(writer.array, view, handle)
            except BaseException:
                writer.close()
                raise
        # the writer's array leads to its memory's exporter: slices of it keep the memory
        return writer.array

    @staticmethod
    def _unpacked(
        slot: np.ndarray[Any, Any], offset: int, shape: Any, dtype: Any, target: Any, handle: Any
    ) -> Any:
        import torch

        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        part = slot[offset : offset + nbytes]
        if target is None:
            return torch.from_numpy(part).view(dtype).reshape(shape)
        if not target.is_contiguous() or target.device.type not in VeloTensorTransport.devices:
            raise ValueError(
                f"target buffer for {handle} must be a contiguous CPU or CUDA tensor, got "
                f"one on {target.device} (contiguous: {target.is_contiguous()})"
            )
        if target.device.type != "cpu":
            return _fill_device_target(target, torch.from_numpy(part))
        _copy_checked(target.reshape(-1).view(_uint8()).numpy(), part, handle)
        return target


def _fill_device_target(target: Any, host: Any) -> Any:
    """Copy a received CPU tensor into a CUDA target buffer (one host-to-device copy)."""
    if target.numel() * target.element_size() != host.numel() * host.element_size():
        raise ValueError(
            f"target buffer holds {target.numel() * target.element_size()} bytes, the "
            f"tensor {host.numel() * host.element_size()}"
        )
    target.reshape(-1).view(_uint8()).copy_(host.reshape(-1).view(_uint8()))
    return target


def _uint8() -> Any:
    import torch

    return torch.uint8


def _copy_checked(dest: np.ndarray[Any, Any], source: np.ndarray[Any, Any], handle: Any) -> None:
    if dest.nbytes != source.nbytes:
        raise ValueError(
            f"target buffer holds {dest.nbytes} bytes, {handle} holds {source.nbytes} bytes"
        )
    session.copy_into(dest.reshape(-1).view(np.uint8), source.reshape(-1).view(np.uint8))


# --- registration ----------------------------------------------------------------------

#: Ray's ``worker_process_setup_hook`` for a job that uses the transports: every worker
#: process of the job registers them before it runs user code (:func:`worker_setup`).
WORKER_SETUP_HOOK = "ray_velo.rdt.worker_setup"


def register_transports(*, import_torch: bool = True) -> list[str]:
    """Register ``VELO_NUMPY`` (and ``VELO`` where torch is installed) with Ray, in this
    process, before it defines classes that name them and creates those actors (Ray hands
    registrations to the actors a process creates afterwards).

    ``import ray_velo`` calls it when Ray is already imported (``VELO`` once torch is
    imported too), :func:`ray_velo.init` calls it where Ray has the API, and so does every
    worker of a job started with :func:`ray_velo.runtime_env`; call it yourself when a class naming
    ``tensor_transport="VELO"`` is defined before either. Returns the names registered now;
    idempotent.

    Args:
        import_torch: import torch to register ``VELO`` when it is installed but not yet
            imported.

    Raises:
        RayFeatureUnavailable: this Ray has no tensor-transport API (raised when this module
            is imported: ``rv.register_transports`` names the Ray version it needs).
    """
    wanted: list[tuple[str, type[VeloNumpyTransport]]] = [(VELO_NUMPY, VeloNumpyTransport)]
    if "torch" in sys.modules or (import_torch and importlib.util.find_spec("torch")):
        wanted.append((VELO, VeloTensorTransport))
    done = []
    for name, manager in wanted:
        with _register_lock:
            if name in _RDT.registered:
                continue
            try:
                _RDT.register(name, list(manager.devices), manager, manager.data_type())
            except ValueError:
                if name not in _RDT.registered:
                    raise
                continue  # Ray's own registration task (from the actor's creator) came first
        done.append(name)
    return done


_register_lock = threading.Lock()


def worker_setup() -> None:
    """Register the transports in this process now: ``VELO_NUMPY`` at once, ``VELO`` at once
    if torch is imported, else the moment it is (importing torch costs every worker about
    two seconds, and a worker that never imports it never moves a tensor).

    Ray's registration reaches only the actors the registering process creates, by a task
    that races their first method; run in every worker (:data:`WORKER_SETUP_HOOK`), this makes
    ``ray.put(..., _tensor_transport="VELO")`` in any actor, RDT calls submitted by any
    worker and restarted actors find the transports."""
    register_transports(import_torch=False)
    if VELO not in _RDT.registered and importlib.util.find_spec("torch") is not None:
        _after_torch_import.arm()


class _AfterTorchImport:
    """A one-shot import hook: registers ``VELO`` right after torch's module has run, in the
    thread that imported it (a second thread importing torch waits for that import and so
    sees the registration)."""

    def __init__(self) -> None:
        self._armed = False

    def arm(self) -> None:
        with _register_lock:
            if not self._armed and "torch" not in sys.modules:
                self._armed = True
                sys.meta_path.insert(0, self)
        if "torch" in sys.modules:
            register_transports(import_torch=False)

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch":
            return None
        self._disarm()
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run_module = loader.exec_module

        def exec_module(module: Any) -> None:
            run_module(module)
            try:
                register_transports(import_torch=False)
            except Exception:  # never fail the user's import of torch over it
                _log.warning("ray_velo: VELO not registered after torch's import", exc_info=True)

        loader.exec_module = exec_module
        return spec

    def _disarm(self) -> None:
        with _register_lock:
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            self._armed = False


_after_torch_import = _AfterTorchImport()


# --- ordinary values of the data type stay zero-copy ------------------------------------

_zero_copy_types: set[type] = set()
_zero_copy_lock = threading.Lock()


class _Ordinary:
    """An ordinary (non-RDT) value pickled by its type's own reduction: for numpy arrays
    that is protocol 5's out-of-band buffer, so Ray's zero-copy object store path holds."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __reduce_ex__(self, protocol: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(self.value, torch.Tensor):
            reducer = _ray.torch_zero_copy_reducer()
            if reducer is not None:
                return reducer(self.value)
        return self.value.__reduce_ex__(protocol)


def _serialize(value: Any) -> Any:
    pending = _ray.rdt_outgoing_tensors()
    if pending is not None:  # an RDT return: Ray moves it out of band
        pending.append(value)
        return len(pending) - 1
    return _Ordinary(value)


def _deserialize(value: Any) -> Any:
    if isinstance(value, int):
        return _ray.rdt_incoming_tensor(value)
    if isinstance(value, bytes):  # pickled in band by Ray's own fallback
        return pickle.loads(value)
    return value


def _keep_ordinary_returns_zero_copy(data_type: type) -> None:
    """Replace Ray's RDT serializer for ``data_type`` in this process by one whose ordinary
    branch keeps the type's own (out-of-band) reduction. Needs the serialization context's
    thread-local RDT fields (Ray 2.5x); without them Ray's own serializer stays."""
    if data_type in _zero_copy_types or not ray.is_initialized():
        return
    with _zero_copy_lock:
        if data_type in _zero_copy_types:
            return
        registered = _ray.rdt_serializer_table()
        if registered is None:
            _log.info("ray_velo: this Ray's RDT serializer is kept for %s", data_type)
            _zero_copy_types.add(data_type)
            return
        ray.util.serialization.register_serializer(
            data_type, serializer=_serialize, deserializer=_deserialize
        )
        registered[data_type] = True  # Ray must not put its own back
        _zero_copy_types.add(data_type)
        _log.debug("ray_velo: zero-copy serializer for %s in pid %d", data_type, os.getpid())
