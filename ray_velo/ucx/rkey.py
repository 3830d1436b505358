"""Framing pre-check of a UCX packed remote key, before any pointer reaches
``ucp_ep_rkey_unpack`` (the layout: docs/architecture.md §10). Pure Python, no UCX."""

from __future__ import annotations

from dataclasses import dataclass

from ray_velo.errors import DescriptorError
from ray_velo.protocol.memtype import (
    SUPPORTED_MEMORY_TYPES,
    UCS_MEMORY_TYPE_LAST,
    MemoryType,
    memory_type_name,
)

__all__ = [
    "MAX_MD_MAP_BITS",
    "PACKED_RKEY_MAX_BYTES",
    "PackedRkeyLayout",
    "check_packed_rkey",
    "parse_packed_rkey",
]

PACKED_RKEY_MAX_BYTES = 1024
"""Largest packed key the UCX backend accepts (the protocol's bound, docs/protocol.md §14; the
descriptor allows 4096)."""

MD_MAP_BYTES = 8
"""``ucp_md_map_t``: one bit per remote memory domain."""

MEM_TYPE_BYTES = 1
HEADER_BYTES = MD_MAP_BYTES + MEM_TYPE_BYTES
"""md_map + mem_type: the shortest key (9 bytes, md_map == 0, the tcp/cma dummy key)."""

SYS_DEVICE_ID_UNKNOWN = 0xFF
"""``UCS_SYS_DEVICE_ID_UNKNOWN``: no distance list follows; also the list terminator."""

PACKED_DISTANCE_BYTES = 3
"""``ucp_rkey_packed_distance_t``: u8 sys_dev, fp8 latency, fp8 bandwidth."""

MAX_MD_MAP_BITS = 16
"""More memory domains than any real transport set has: refuse rather than trust."""


@dataclass(frozen=True, slots=True)
class PackedRkeyLayout:
    """What a well-framed packed key says about itself (for diagnostics)."""

    length: int
    md_map: int
    mem_type: int
    tl_rkey_sizes: tuple[int, ...]
    sys_dev: int | None
    distance_count: int


def _refuse(reason: str) -> DescriptorError:
    return DescriptorError(reason=f"packed rkey: {reason}")


def parse_packed_rkey(
    blob: bytes | bytearray | memoryview,
    max_len: int = PACKED_RKEY_MAX_BYTES,
    memory_types: frozenset[MemoryType] = SUPPORTED_MEMORY_TYPES,
) -> PackedRkeyLayout:
    """Walk a packed key exactly as UCX will and describe it.

    Args:
        blob: the key bytes as received from the peer.
        max_len: the largest key accepted, in bytes.
        memory_types: the memory types accepted (default: host, CUDA, CUDA managed).

    Raises:
        DescriptorError: for any blob UCX could not parse within its own bytes, or one this
            library refuses (a memory type outside ``memory_types``, more than
            ``MAX_MD_MAP_BITS`` memory domains).
    """
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise DescriptorError(reason=f"a packed rkey is bytes, got {type(blob).__name__}")
    data = bytes(blob)
    n = len(data)
    md_map, mem_type = _header(data, max_len, memory_types)
    sizes, pos = _md_bodies(data, md_map.bit_count())
    if md_map == 0:
        # The dummy key: UCX reads no sys_dev byte and runs no stage 2.
        if pos != n:
            raise _refuse(f"{n - pos} trailing bytes after a key with no memory domains")
        return PackedRkeyLayout(n, md_map, mem_type, (), None, 0)
    if pos >= n:
        raise _refuse("sys_dev byte is missing")
    sys_dev = data[pos]
    pos, distances = _distances(data, pos + 1, sys_dev)
    if pos != n:
        raise _refuse(f"{n - pos} trailing bytes")
    return PackedRkeyLayout(n, md_map, mem_type, tuple(sizes), sys_dev, distances)


def _header(data: bytes, max_len: int, memory_types: frozenset[MemoryType]) -> tuple[int, int]:
    """The md_map and mem_type, checked: length bounds, an accepted memory type, few
    enough domains."""
    n = len(data)
    if n > max_len:
        raise _refuse(f"{n} bytes is over the {max_len}-byte limit")
    if n < HEADER_BYTES:
        raise _refuse(f"{n} bytes is shorter than the {HEADER_BYTES}-byte header")
    md_map = int.from_bytes(data[:MD_MAP_BYTES], "little")
    mem_type = data[MD_MAP_BYTES]
    if mem_type >= UCS_MEMORY_TYPE_LAST:
        raise _refuse(f"mem_type {mem_type} is out of range (< {UCS_MEMORY_TYPE_LAST})")
    if mem_type not in memory_types:
        accepted = ", ".join(sorted(memory_type_name(t) for t in memory_types))
        raise _refuse(
            f"mem_type {mem_type} ({memory_type_name(mem_type)}) is not accepted here ({accepted})"
        )
    md_count = md_map.bit_count()
    if md_count > MAX_MD_MAP_BITS:
        raise _refuse(
            f"md_map {md_map:#018x} names {md_count} memory domains (> {MAX_MD_MAP_BITS})"
        )
    return md_map, mem_type


def _md_bodies(data: bytes, md_count: int) -> tuple[list[int], int]:
    """Stage 1: one (size, body) per set bit of md_map, driven by md_map, not by the
    length. Returns the body sizes and the position after them."""
    n = len(data)
    pos = HEADER_BYTES
    sizes: list[int] = []
    for index in range(md_count):
        if pos >= n:
            raise _refuse(f"md body {index} of {md_count}: size byte at {pos} is past the end")
        size = data[pos]
        end = pos + 1 + size
        if end > n:
            raise _refuse(f"md body {index} of {md_count}: {size} bytes run past the end")
        sizes.append(size)
        pos = end
    return sizes, pos


def _distances(data: bytes, pos: int, sys_dev: int) -> tuple[int, int]:
    """Stage 2: with a known sys_dev, UCX walks 3-byte records until a 0xFF byte, which
    must be inside the blob. Returns the position after it and the record count."""
    if sys_dev == SYS_DEVICE_ID_UNKNOWN:
        return pos, 0
    n = len(data)
    distances = 0
    while True:
        if pos >= n:
            raise _refuse("distance list is not terminated by 0xFF")
        if data[pos] == SYS_DEVICE_ID_UNKNOWN:
            return pos + 1, distances
        if pos + PACKED_DISTANCE_BYTES > n:
            raise _refuse("distance record runs past the end")
        pos += PACKED_DISTANCE_BYTES
        distances += 1


def check_packed_rkey(
    blob: bytes | bytearray | memoryview,
    max_len: int = PACKED_RKEY_MAX_BYTES,
    memory_types: frozenset[MemoryType] = SUPPORTED_MEMORY_TYPES,
) -> None:
    """Refuse a packed key that UCX could not parse within its own bytes: the arguments and
    the ``DescriptorError`` of :func:`parse_packed_rkey`, without the layout."""
    parse_packed_rkey(blob, max_len, memory_types)
