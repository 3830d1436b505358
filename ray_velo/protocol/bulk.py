"""Frames of the bulk reads on the agents' wire: payload bytes sent by their owner over an
authenticated connection (docs/architecture.md §13). Pure: a decoder raises only
``ProtocolError`` (or rebuilds the error a peer sent, always a ``VeloError``).

One read at a time per connection, after the same handshake as the control wire::

    consumer -> owner   [u32 length][u8 0][u64 call id][ReadRequest, msgpack]
    owner -> consumer   [u32 12][u8 0][u64 call id][u64 nbytes]  then exactly nbytes bytes
                  or    [u32 length][u8 1][u64 call id][the error, as the control wire's]

An owner that must stop mid-range (its lease ended, it shuts down) closes the connection
with a reset: the consumer sees fewer bytes than announced, and the read fails. No byte
after the header is trusted until all ``nbytes`` arrived.
"""

from __future__ import annotations

import struct

from ray_velo.errors import ProtocolError
from ray_velo.protocol.frames import HEADER, MAX_FRAME_BYTES, decode_answer, encode_error
from ray_velo.protocol.messages import ReadRequest, decode, encode

__all__ = [
    "HEADER",
    "READ",
    "decode_read",
    "decode_sending",
    "encode_error",
    "encode_read",
    "encode_sending",
]

#: The one request kind.
READ = 0
_AFTER_LENGTH = HEADER.size - 4
_NBYTES = struct.Struct("!Q")


def encode_read(call_id: int, request: ReadRequest) -> bytes:
    """The request frame of a bulk read."""
    body = encode(request)
    return HEADER.pack(_AFTER_LENGTH + len(body), READ, call_id) + body


def decode_read(length: int, kind: int, body: bytes) -> ReadRequest:
    """The read a request frame asks for (``length`` as its header said).

    Raises:
        ProtocolError: an unknown kind, a bad length, or a malformed or empty range.
    """
    if kind != READ:
        raise ProtocolError(f"unknown bulk request kind {kind}")
    if length - _AFTER_LENGTH != len(body) or len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(f"a bulk request frame of {length} bytes")
    request = decode(ReadRequest, body)
    if not 0 <= request.start < request.stop:
        raise ProtocolError(f"bulk read of bytes [{request.start}, {request.stop})")
    return request


def encode_sending(call_id: int, nbytes: int) -> bytes:
    """The answer that ``nbytes`` bytes follow."""
    return HEADER.pack(_AFTER_LENGTH + _NBYTES.size, 0, call_id) + _NBYTES.pack(nbytes)


def decode_sending(length: int, status: int, body: bytes) -> int:
    """How many bytes follow an answer whose header said ``length`` and ``status``.

    Raises:
        VeloError: the owner refused the read (what it raised: LeaseNotFound...).
        ProtocolError: the answer is malformed.
    """
    if length - _AFTER_LENGTH != len(body):
        raise ProtocolError(f"a bulk answer frame of {length} bytes")
    if status == 0:
        if len(body) != _NBYTES.size:
            raise ProtocolError(f"a bulk answer of {len(body)} bytes, expected 8")
        nbytes: int = _NBYTES.unpack(body)[0]
        return nbytes
    ok, error = decode_answer(status, body)
    if ok:
        raise ProtocolError("a bulk error answer that decodes as a value")
    raise error
