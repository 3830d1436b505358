"""Frames of the owner handlers over a byte stream, the agents' TCP control plane
(docs/architecture.md §13). Pure: a decoder raises only ``ProtocolError``."""

from __future__ import annotations

import struct
from typing import Any

import msgpack

from ray_velo import errors
from ray_velo.errors import ProtocolError, VeloError
from ray_velo.protocol.entry import WIRE_METHODS as _WIRE_METHODS

__all__ = [
    "HEADER",
    "MAX_FRAME_BYTES",
    "WIRE_METHODS",
    "decode_answer",
    "decode_request",
    "encode_answer",
    "encode_error",
    "encode_request",
]

#: The handlers agents call over TCP, in wire-number order (declared in ray_velo.protocol.entry;
#: ``_rv_pull`` moves chunks: it stays a Ray call).
WIRE_METHODS = _WIRE_METHODS
_METHOD_INDEX = {name: index for index, name in enumerate(WIRE_METHODS)}
#: After the length: the method (request) or status (answer), and the call id.
HEADER = struct.Struct("!IBQ")
_AFTER_LENGTH = HEADER.size - 4
#: The largest frame either side accepts (every message is far smaller).
MAX_FRAME_BYTES = 1 << 20


def encode_request(method: str, call_id: int, message: bytes) -> bytes:
    """A request frame for handler ``method`` (call id 0: no answer wanted)."""
    return HEADER.pack(_AFTER_LENGTH + len(message), _METHOD_INDEX[method], call_id) + message


def decode_request(kind: int, body: bytes) -> str:
    """The handler a request names. Raises ProtocolError for an unknown one."""
    if kind >= len(WIRE_METHODS):
        raise ProtocolError(f"unknown handler number {kind} in a request frame")
    return WIRE_METHODS[kind]


def encode_answer(call_id: int, value: Any) -> bytes:
    """The answer frame carrying a handler's return value (bytes, int or None)."""
    body: bytes = msgpack.packb(value, use_bin_type=True)
    return HEADER.pack(_AFTER_LENGTH + len(body), 0, call_id) + body


def encode_error(call_id: int, error: BaseException) -> bytes:
    """The answer frame carrying what a handler raised."""
    if isinstance(error, VeloError):
        wire = {"type": type(error).__name__, "message": error.message, "fields": error.fields}
    else:
        wire = {"type": "VeloError", "message": f"the owner's handler failed: {error!r}"}
    body: bytes
    try:
        body = msgpack.packb(wire, use_bin_type=True, default=repr)
    except (TypeError, ValueError, OverflowError):
        body = msgpack.packb({"type": type(error).__name__, "message": str(error)})
    return HEADER.pack(_AFTER_LENGTH + len(body), 1, call_id) + body


def decode_answer(status: int, body: bytes) -> tuple[bool, Any]:
    """(True, the return value) or (False, the error to raise), from an answer frame.

    Raises:
        ProtocolError: the frame is malformed.
    """
    try:
        value = msgpack.unpackb(body, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"an answer frame is not msgpack: {exc}") from None
    if status == 0:
        return True, value
    if status != 1 or not isinstance(value, dict):
        raise ProtocolError(f"malformed answer frame (status {status})")
    return False, _rebuild_error(value)


def _rebuild_error(wire: dict[Any, Any]) -> VeloError:
    message = wire.get("message")
    message = message if isinstance(message, str) else "the owner's handler failed"
    cls = getattr(errors, str(wire.get("type")), None)
    if not (isinstance(cls, type) and issubclass(cls, VeloError)):
        return VeloError(message)
    fields = wire.get("fields")
    if isinstance(fields, dict) and all(isinstance(k, str) for k in fields):
        try:
            return cls(message, **fields)
        except Exception:  # fields this class does not take: keep the message
            pass
    return cls(message)
