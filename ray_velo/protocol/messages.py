"""Control messages of the seven handlers, and their msgpack codec.

Version-skew rule (spec): every field has a default, and every default means what the
protocol did before the field existed (no offer, no deadline, no budget). Decoding ignores
unknown fields and fills missing ones with their defaults, so old and new peers interoperate.
A handle travels as ``{hi, lo}``.

Handlers: ``_rv_metadata`` (MetadataRequest -> MetadataResponse), ``_rv_acquire``
(AcquireRequest -> Ready | Rdma), ``_rv_pull`` (PullRequest -> raw chunk bytes), ``_rv_ref``,
``_rv_detach``, ``_rv_release`` and ``_rv_lease_renew`` (-> empty answer or an error).
"""

from __future__ import annotations

import dataclasses
import reprlib
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack

from ray_velo.errors import ProtocolError
from ray_velo.protocol.handle import DataHandle

__all__ = [
    "NULL_HANDLE",
    "AcquireRequest",
    "AcquireResponse",
    "DetachRequest",
    "LeaseRenewRequest",
    "MetadataRequest",
    "MetadataResponse",
    "PullRequest",
    "Rdma",
    "RdmaOffer",
    "Ready",
    "RefRequest",
    "ReleaseRequest",
    "TypeHeader",
    "decode",
    "decode_acquire_response",
    "encode",
]

#: Slot ids start at 1, so the all-zero handle names nothing; it is the decoding default.
NULL_HANDLE = DataHandle(0, 0)


@dataclass(frozen=True, slots=True)
class RdmaOffer:
    """What a consumer can GET with: the backend names it has an endpoint for."""

    backends: tuple[str, ...] = ("ucx",)


@dataclass(frozen=True, slots=True)
class TypeHeader:
    """How to rebuild the typed object from the staged bytes, without pickling them.

    ``kind`` is ``bytes`` (raw bytes), ``numpy`` or ``torch``; ``dtype`` is a numpy dtype
    string; ``shape`` the array shape; ``order`` "C" (staged bytes are always contiguous).
    """

    kind: str = "bytes"
    dtype: str = "|u1"
    shape: tuple[int, ...] = ()
    order: str = "C"


@dataclass(frozen=True, slots=True)
class MetadataRequest:
    """``_rv_metadata``: size, refcount and pinned of ``handle``; takes no lock."""

    handle: DataHandle = NULL_HANDLE


@dataclass(frozen=True, slots=True)
class MetadataResponse:
    """The ``_rv_metadata`` answer: size in bytes, live references, pinned or not."""

    size: int = 0
    refcount: int = 0
    pinned: bool = False


@dataclass(frozen=True, slots=True)
class AcquireRequest:
    """Take a read lease and learn the path.

    Attributes:
        rdma: the consumer's offer; None (the old behaviour) means chunked only.
        lease_ms: the chunked lease deadline the consumer asks for (spec ``_rv_lease_ms``);
            0 means no deadline, as before the field existed.
        budget_ms: what is left of the caller's bound (spec ``_rv_budget_ms``); 0 = none.
        holder_pid: a process on the owner's node that reads the slot in place; the owner
            reaps its lease if that process dies. 0 = not a local reader.
        claim: this acquire is a consuming one (a ``fetch`` that releases, a transparent
            resolution): it claims one of the handle's unclaimed references, or is refused
            with ``HandleReleased``, so N references allow exactly N consumers however many
            race. The claim ends with a release (consumed) or a detach (given back) carrying
            ``claim``. False, as before the field existed: nothing is claimed.
        consumer_node, consumer_worker: the consumer agent's node and incarnation. An acquire
            from a new incarnation on a node tells the owner the old one is gone: it ends the
            old one's leases at once and gives their claims back, rather than reaping them a
            lease timeout later (a consuming fetch retried on the node's fresh agent finds
            its reference again). Empty / 0, as before the fields existed: nothing is known.
    """

    handle: DataHandle = NULL_HANDLE
    rdma: RdmaOffer | None = None
    lease_ms: int = 0
    budget_ms: int = 0
    holder_pid: int = 0
    claim: bool = False
    consumer_node: str = ""
    consumer_worker: int = 0


@dataclass(frozen=True, slots=True)
class Ready:
    """Chunked answer: pull ``chunk_count`` chunks of ``chunk_size`` with ``transfer_id``."""

    lease_id: int = 0
    transfer_id: int = 0
    chunk_size: int = 0
    chunk_count: int = 0
    total_len: int = 0
    type_header: TypeHeader = TypeHeader()


@dataclass(frozen=True, slots=True)
class Rdma:
    """RDMA answer: GET ``descriptor``; renew within ``lease_timeout_ms`` (0 = no deadline)."""

    lease_id: int = 0
    descriptor: bytes = b""
    lease_timeout_ms: int = 0
    total_len: int = 0
    type_header: TypeHeader = TypeHeader()


AcquireResponse = Ready | Rdma


@dataclass(frozen=True, slots=True)
class PullRequest:
    """``_rv_pull``: chunk ``index`` of chunked transfer ``transfer_id``; renews its lease."""

    transfer_id: int = 0
    index: int = 0


@dataclass(frozen=True, slots=True)
class RefRequest:
    """``_rv_ref``: one more reference on ``handle``, for one more consumer."""

    handle: DataHandle = NULL_HANDLE


@dataclass(frozen=True, slots=True)
class DetachRequest:
    """``_rv_detach``: drop the read lock ``lease_id``; the handle stays usable.

    ``claim``: also give back one claim (a resolution whose task Ray retries); ``lease_id``
    may then be 0. False, as before the field existed.
    """

    handle: DataHandle = NULL_HANDLE
    lease_id: int = 0
    claim: bool = False


@dataclass(frozen=True, slots=True)
class ReleaseRequest:
    """``_rv_release``: drop the read lock and one reference (``lease_id`` 0: no lock).

    ``claim``: the reference released is one this consumer claimed at acquire. False, as
    before the field existed: an unclaimed reference.
    """

    handle: DataHandle = NULL_HANDLE
    lease_id: int = 0
    claim: bool = False


@dataclass(frozen=True, slots=True)
class LeaseRenewRequest:
    """``_rv_lease_renew``: push the lease's deadline one lease timeout past now."""

    handle: DataHandle = NULL_HANDLE
    lease_id: int = 0


Message = TypeVar("Message")

_ACQUIRE_KINDS: dict[str, type[Ready] | type[Rdma]] = {"ready": Ready, "rdma": Rdma}


def _to_wire(value: Any) -> Any:
    if isinstance(value, DataHandle):
        return value.to_wire()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple):
        return [_to_wire(v) for v in value]
    return value


def encode(message: Any) -> bytes:
    """msgpack bytes of a message dataclass (an acquire answer carries its kind)."""
    wire = _to_wire(message)
    if isinstance(message, Ready):
        wire["kind"] = "ready"
    elif isinstance(message, Rdma):
        wire["kind"] = "rdma"
    return msgpack.packb(wire, use_bin_type=True)  # type: ignore[no-any-return]


def _expect(value: Any, types: type | tuple[type, ...], where: str) -> Any:
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ProtocolError(f"{where}: expected {types}, got bool")
    if not isinstance(value, types):
        raise ProtocolError(f"{where}: expected {types}, got {type(value).__name__}")
    return value


def _from_wire(cls: type[Message], wire: Any) -> Message:
    if not isinstance(wire, dict):
        raise ProtocolError(f"{cls.__name__}: expected a map, got {type(wire).__name__}")
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in wire:
            continue  # missing: the default, i.e. the behaviour before the field existed
        raw = wire[f.name]
        where = f"{cls.__name__}.{f.name}"
        kind = f.type
        if kind == "DataHandle":
            kwargs[f.name] = DataHandle.from_wire(raw)
        elif kind == "RdmaOffer | None":
            kwargs[f.name] = None if raw is None else _from_wire(RdmaOffer, raw)
        elif kind == "TypeHeader":
            kwargs[f.name] = _from_wire(TypeHeader, raw)
        elif kind == "tuple[str, ...]":
            kwargs[f.name] = tuple(_expect(v, str, where) for v in _expect(raw, list, where))
        elif kind == "tuple[int, ...]":
            kwargs[f.name] = tuple(_expect(v, int, where) for v in _expect(raw, list, where))
        elif kind == "int":
            kwargs[f.name] = _expect(raw, int, where)
        elif kind == "bool":
            kwargs[f.name] = _expect(raw, bool, where)
        elif kind == "str":
            kwargs[f.name] = _expect(raw, str, where)
        elif kind == "bytes":
            kwargs[f.name] = bytes(_expect(raw, (bytes, bytearray), where))
        else:  # pragma: no cover - a new field type needs a branch here
            raise AssertionError(f"no decoder for {where}: {kind}")
    return cls(**kwargs)


def _unpack(data: bytes | bytearray | memoryview) -> Any:
    try:
        # memoryview, not bytes(): bytes(n) of an int would allocate n zero bytes.
        return msgpack.unpackb(memoryview(data).tobytes(), raw=False, strict_map_key=True)
    except Exception as exc:
        raise ProtocolError(f"control message does not decode as msgpack: {exc}") from exc


def decode(cls: type[Message], data: bytes | bytearray | memoryview) -> Message:
    """Decode ``data`` as ``cls``; unknown fields are ignored, missing ones defaulted.

    Raises:
        ProtocolError: the bytes are not msgpack, or a field has the wrong type.
    """
    return _from_wire(cls, _unpack(data))


def decode_acquire_response(data: bytes | bytearray | memoryview) -> Ready | Rdma:
    """Decode an ``_rv_acquire`` answer; an absent kind means Ready (the chunked default)."""
    wire = _unpack(data)
    if not isinstance(wire, dict):
        raise ProtocolError("acquire answer is not a map")
    kind = wire.get("kind", "ready")
    cls = _ACQUIRE_KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        # reprlib: a peer's kind may be nested past repr()'s recursion limit.
        raise ProtocolError(f"unknown acquire answer kind {reprlib.repr(kind)}")
    return _from_wire(cls, wire)
