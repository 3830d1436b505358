"""The RDMA descriptor, byte-exact to docs/protocol.md §14: a decoder that accounts for every byte
and raises :class:`DescriptorError`, and nothing else, for any input."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ray_velo.errors import DescriptorError

__all__ = [
    "BACKEND_UCX",
    "DESCRIPTOR_HEADER_BYTES",
    "DESCRIPTOR_VERSION",
    "MAX_DESCRIPTOR_RKEY_BYTES",
    "RdmaDescriptor",
]

BACKEND_UCX = 1
BACKEND_NAMES = {BACKEND_UCX: "ucx"}
DESCRIPTOR_VERSION = 1
MAX_DESCRIPTOR_RKEY_BYTES = 4096
_HEADER = struct.Struct("<BBBQQQH")
DESCRIPTOR_HEADER_BYTES = _HEADER.size  # 29
_U64_MAX = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class RdmaDescriptor:
    """Where and how to GET a pinned slot. ``generation`` is for diagnostics only."""

    generation: int
    addr: int
    length: int
    rkey: bytes
    backend: int = BACKEND_UCX

    def encode(self) -> bytes:
        """The wire bytes. Raises DescriptorError if a field cannot be encoded."""
        if self.backend not in BACKEND_NAMES:
            raise DescriptorError(reason=f"unknown backend {self.backend}")
        for name, value in (
            ("generation", self.generation),
            ("addr", self.addr),
            ("length", self.length),
        ):
            if not 0 <= value <= _U64_MAX:
                raise DescriptorError(reason=f"{name}={value} is not a u64")
        if self.length == 0:
            raise DescriptorError(reason="zero length: a GET has nothing to transfer")
        if len(self.rkey) > MAX_DESCRIPTOR_RKEY_BYTES:
            raise DescriptorError(
                reason=f"rkey is {len(self.rkey)} bytes, over {MAX_DESCRIPTOR_RKEY_BYTES}"
            )
        header = _HEADER.pack(
            self.backend,
            DESCRIPTOR_VERSION,
            0,
            self.generation,
            self.addr,
            self.length,
            len(self.rkey),
        )
        return header + bytes(self.rkey)

    @classmethod
    def decode(cls, blob: bytes | bytearray | memoryview) -> RdmaDescriptor:
        """Parse ``blob``, refusing anything not accounted for byte for byte.

        Raises:
            DescriptorError: for any malformed input (and only that).
        """
        try:
            # memoryview, not bytes(): bytes(n) of an int would allocate n zero bytes.
            data = memoryview(blob).tobytes()
        except Exception as exc:  # a non-buffer: still only DescriptorError escapes
            raise DescriptorError(reason=f"not a byte string: {type(blob).__name__}") from exc
        if len(data) < DESCRIPTOR_HEADER_BYTES:
            raise DescriptorError(
                reason=f"{len(data)} bytes, shorter than the {DESCRIPTOR_HEADER_BYTES}-byte header"
            )
        backend, version, flags, generation, addr, length, rkey_len = _HEADER.unpack_from(data)
        if backend not in BACKEND_NAMES:
            raise DescriptorError(reason=f"unknown backend {backend}")
        if version != DESCRIPTOR_VERSION:
            raise DescriptorError(reason=f"unknown version {version}")
        if flags != 0:
            raise DescriptorError(reason=f"non-zero flags 0x{flags:02x}")
        if length == 0:
            raise DescriptorError(reason="zero length")
        if rkey_len > MAX_DESCRIPTOR_RKEY_BYTES:
            raise DescriptorError(reason=f"rkey_len {rkey_len} over {MAX_DESCRIPTOR_RKEY_BYTES}")
        body = len(data) - DESCRIPTOR_HEADER_BYTES
        if body < rkey_len:
            raise DescriptorError(reason=f"rkey_len {rkey_len} but only {body} key bytes follow")
        if body > rkey_len:
            raise DescriptorError(reason=f"{body - rkey_len} trailing bytes after the key")
        return cls(
            generation=generation,
            addr=addr,
            length=length,
            rkey=data[DESCRIPTOR_HEADER_BYTES:],
            backend=backend,
        )
