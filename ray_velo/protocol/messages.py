"""Control messages of the owner's handlers and their msgpack codec, under the version-skew rule
(docs/protocol.md §4, §5, §19)."""

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
    "CopyNotice",
    "DetachRequest",
    "LeaseRenewRequest",
    "MetadataRequest",
    "MetadataResponse",
    "PullRequest",
    "Rdma",
    "RdmaOffer",
    "ReadRequest",
    "Ready",
    "RefRequest",
    "RelayEnd",
    "RelayProgress",
    "RelayRequest",
    "ReleaseRequest",
    "TypeHeader",
    "WindowAnswer",
    "WindowRequest",
    "decode",
    "decode_acquire_response",
    "encode",
]

#: Slot ids start at 1, so the all-zero handle names nothing; it is the decoding default.
NULL_HANDLE = DataHandle(0, 0)


@dataclass(frozen=True, slots=True)
class RdmaOffer:
    """What a consumer can GET with: the backend names it has an endpoint for (``"ucx"``),
    and ``"wire"`` when it can read the owner's bytes over the agents' authenticated wire
    (the owner sends them; an owner from before the wire path ignores the name).

    ``windows``: it can GET a payload staged in plain memory through windows the owner
    registers one after another (``_rv_window``). False, as before the field existed.
    ``memory_types``: the memory it can GET from (``"host"``, ``"cuda"``: a consumer with GPU
    arenas and a CUDA-capable UCX); host only, as before the field existed.
    """

    backends: tuple[str, ...] = ("ucx",)
    windows: bool = False
    memory_types: tuple[str, ...] = ("host",)


@dataclass(frozen=True, slots=True)
class TypeHeader:
    """How to rebuild the typed object from the staged bytes, without pickling them.

    ``kind`` is ``bytes`` (raw bytes), ``numpy`` or ``torch``; ``dtype`` is a numpy dtype
    string; ``shape`` the array shape; ``order`` "C" (staged bytes are always contiguous).
    ``device``: the torch device kind the tensor was on when staged (``"cpu"`` or ``"cuda"``,
    no index: the consumer picks its own device); ``"cpu"``, as before the field existed.
    """

    kind: str = "bytes"
    dtype: str = "|u1"
    shape: tuple[int, ...] = ()
    order: str = "C"
    device: str = "cpu"


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
        lease_ms: the chunked lease deadline the consumer asks for (the protocol's
            ``_rv_lease_ms``, docs/protocol.md §11); 0 means no deadline, as before the field
            existed.
        budget_ms: what is left of the caller's bound (the protocol's ``_rv_budget_ms``);
            0 = none.
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
        copies: the consumer keeps a node-local copy of what it fetches and can announce it
            and serve it to other nodes (``_rv_copy``, ``_rv_relay``). False, as before the
            field existed: the owner neither asks for nor hands out copies.
    """

    handle: DataHandle = NULL_HANDLE
    rdma: RdmaOffer | None = None
    lease_ms: int = 0
    budget_ms: int = 0
    holder_pid: int = 0
    claim: bool = False
    consumer_node: str = ""
    consumer_worker: int = 0
    copies: bool = False


@dataclass(frozen=True, slots=True)
class Ready:
    """Chunked answer: pull ``chunk_count`` chunks of ``chunk_size`` with ``transfer_id``.

    ``unclaimed`` (here and in :class:`Rdma`): after a consuming acquire, the references no
    consumer has claimed yet; 0 tells a node-local copy that no later consumer can come (it
    goes with its last reader). -1, as before the field existed: not said."""

    lease_id: int = 0
    transfer_id: int = 0
    chunk_size: int = 0
    chunk_count: int = 0
    total_len: int = 0
    type_header: TypeHeader = TypeHeader()
    unclaimed: int = -1


@dataclass(frozen=True, slots=True)
class Rdma:
    """RDMA answer: GET ``descriptor``; renew within ``lease_timeout_ms`` (0 = no deadline).

    Copies (defaults: none of it, as before the fields existed):
        announce: the owner counts this consumer's node-local copy among the handle's copies:
            keep it until the owner says the handle ended (a ``_rv_copy`` with ``gone``), say
            so if it fails, and serve it to the consumers the owner points at it.
        relay_node, relay_worker: a copy of the same bytes on another node's agent, being
            filled or complete: read it as it fills (``_rv_relay`` on that agent, which
            answers where the bytes are) instead of ``descriptor``. ``descriptor`` stays
            valid under this lease: whatever the copy cannot give, GET from the owner.
        window_bytes: not 0: the slot is in plain memory and ``descriptor`` is empty; the
            consumer GETs it window by window (bytes ``[i * window_bytes, ...)``), asking
            for each window's descriptor with ``_rv_window``. 0, as before the field existed.
            Not 0 with a ``descriptor``: the slot's producer is still writing it (streamed
            staging); ``_rv_window`` for window ``i`` answers, once that window is written,
            the descriptor of the bytes from it to as far as they are written.
        wire: the bytes come over the agents' wire, not by a GET: the consumer reads ranges
            of this lease (:class:`ReadRequest`) at the owner's bulk port, the owner sends
            them; ``descriptor`` is empty and ``window_bytes`` 0. A copy it is pointed at
            (``relay_node``) is read the same way at that agent's port. False, as before
            the field existed (only a consumer that offered ``"wire"`` gets it).
    """

    lease_id: int = 0
    descriptor: bytes = b""
    lease_timeout_ms: int = 0
    total_len: int = 0
    type_header: TypeHeader = TypeHeader()
    announce: bool = False
    relay_node: str = ""
    relay_worker: int = 0
    unclaimed: int = -1
    window_bytes: int = 0
    wire: bool = False


@dataclass(frozen=True, slots=True)
class ReadRequest:
    """A bulk read on the agents' wire: send bytes ``[start, stop)`` of ``handle`` to the
    holder of ``lease_id`` (a wire lease on the owner's slot; with ``copy``, a relay lease on
    this agent's copy of another owner's handle, read as it fills)."""

    handle: DataHandle = NULL_HANDLE
    lease_id: int = 0
    start: int = 0
    stop: int = 0
    copy: bool = False


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


@dataclass(frozen=True, slots=True)
class CopyNotice:
    """``_rv_copy`` (no answer). To the owner: the copy of ``handle`` on the agent ``worker``
    of ``node`` is gone (sent by that agent, or by a reader that could not reach it). To a
    copy's agent: the handle ended at its owner, the copy goes with its last reader."""

    handle: DataHandle = NULL_HANDLE
    node: str = ""
    worker: int = 0


@dataclass(frozen=True, slots=True)
class RelayRequest:
    """``_rv_relay`` (to a copy's agent): take (``lease_id`` 0) or renew a relay lease on its
    copy of ``handle`` and answer once ``at_least`` bytes have landed (or after a short
    wait, with what has)."""

    handle: DataHandle = NULL_HANDLE
    lease_id: int = 0
    at_least: int = 0


@dataclass(frozen=True, slots=True)
class RelayProgress:
    """The ``_rv_relay`` answer: bytes ``[0, landed)`` of the copy are final; the lease ends
    ``lease_timeout_ms`` after this answer unless renewed. ``descriptor`` (where the copy is)
    comes with the first answer. (The agent's UCX worker address never travels here: agents
    exchange those over Ray calls only, see docs/deployment.md "Security".)"""

    lease_id: int = 0
    landed: int = 0
    total_len: int = 0
    lease_timeout_ms: int = 0
    descriptor: bytes = b""


@dataclass(frozen=True, slots=True)
class RelayEnd:
    """``_rv_relay_end`` (no answer): the relay lease ``lease_id`` on ``handle``'s copy ends."""

    handle: DataHandle = NULL_HANDLE
    lease_id: int = 0


@dataclass(frozen=True, slots=True)
class WindowRequest:
    """``_rv_window``: register window ``index`` of ``handle``'s slot for the RDMA lease
    ``lease_id`` (renewing it) and answer its descriptor; first unregister every window up
    to ``done`` (-1: none), whose GETs completed. ``index`` -1: only that."""

    handle: DataHandle = NULL_HANDLE
    lease_id: int = 0
    index: int = 0
    done: int = -1


@dataclass(frozen=True, slots=True)
class WindowAnswer:
    """The ``_rv_window`` answer: the descriptor of the window (its bytes only)."""

    descriptor: bytes = b""


Message = TypeVar("Message")

_ACQUIRE_KINDS: dict[str, type[Ready] | type[Rdma]] = {"ready": Ready, "rdma": Rdma}
#: Field types read from one wire value, and those read from a list of them.
_SCALARS: dict[str, type] = {"int": int, "bool": bool, "str": str}
_TUPLES: dict[str, type] = {"tuple[str, ...]": str, "tuple[int, ...]": int}


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
    for kind, cls in _ACQUIRE_KINDS.items():
        if isinstance(message, cls):
            wire["kind"] = kind
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
        elif kind in _TUPLES:
            items = _expect(raw, list, where)
            kwargs[f.name] = tuple(_expect(v, _TUPLES[kind], where) for v in items)
        elif kind in _SCALARS:
            kwargs[f.name] = _expect(raw, _SCALARS[kind], where)
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
