"""The packed-rkey pre-parse: UCX's framing walked byte for byte, DescriptorError for the rest.

Pure: no UCX, no cffi. The blobs are the ones research/ucx.md §6 measured from UCX 1.21/1.22
plus hand-built ones in the >= 1.20 layout.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_velo.errors import DescriptorError
from ray_velo.protocol.descriptor import RdmaDescriptor
from ray_velo.protocol.memtype import SUPPORTED_MEMORY_TYPES, MemoryType
from ray_velo.ucx.rkey import (
    MAX_MD_MAP_BITS,
    PACKED_RKEY_MAX_BYTES,
    PackedRkeyLayout,
    check_packed_rkey,
    parse_packed_rkey,
)

TCP_CMA_KEY = bytes.fromhex("000000000000000000")  # md_map 0: the dummy key (tcp, cma, shm)
DEFAULT_TLS_KEY = bytes.fromhex("01000000000000000000ff")  # self md, empty body, sys_dev unknown


def build_key(
    bodies: dict[int, bytes], mem_type: int = 0, sys_dev: int | None = None, distances: int = 0
) -> bytes:
    """A packed key in the UCX >= 1.20 layout (what ucp_rkey_pack_memh writes)."""
    md_map = sum(1 << i for i in bodies)
    out = md_map.to_bytes(8, "little") + bytes([mem_type])
    for index in sorted(bodies):
        out += bytes([len(bodies[index])]) + bodies[index]
    if md_map:
        out += bytes([0xFF if sys_dev is None else sys_dev])
        if sys_dev is not None and sys_dev != 0xFF:
            out += b"".join(bytes([d, 0x10, 0x20]) for d in range(distances)) + b"\xff"
    return out


def refused(blob: bytes, **kwargs: Any) -> str:
    with pytest.raises(DescriptorError) as info:
        check_packed_rkey(blob, **kwargs)
    return str(info.value)


def test_keys_ucx_packed_on_this_machine_pass() -> None:
    """The 9-byte tcp/cma dummy key and the 11-byte default-TLS key (research §6) pass."""
    check_packed_rkey(TCP_CMA_KEY)
    layout = parse_packed_rkey(DEFAULT_TLS_KEY)
    assert layout == PackedRkeyLayout(11, 1, 0, (0,), 0xFF, 0)


def test_key_with_distance_list_passes() -> None:
    """A key from a device-aware owner: sys_dev 3, two distance records, 0xFF terminator."""
    blob = build_key({0: b"\x01" * 16, 5: b"\x02" * 40}, sys_dev=3, distances=2)
    layout = parse_packed_rkey(blob)
    assert layout.tl_rkey_sizes == (16, 40)
    assert layout.sys_dev == 3 and layout.distance_count == 2


@pytest.mark.parametrize(
    ("blob", "reason"),
    [
        (b"", "shorter than the 9-byte header"),
        (TCP_CMA_KEY[:5], "shorter than the 9-byte header"),
        (TCP_CMA_KEY[:8] + b"\x7f", "mem_type 127 is out of range"),  # segfaults UCX 1.22
        (TCP_CMA_KEY[:8] + b"\x0a", "mem_type 10 is out of range"),
        (TCP_CMA_KEY[:8] + b"\x03", "mem_type 3 (rocm) is not accepted"),
        (TCP_CMA_KEY[:8] + b"\x09", "mem_type 9 (gaudi) is not accepted"),
        ((1 << 40).to_bytes(8, "little") + b"\x00", "past the end"),  # UCX said "OK"
        (b"\xff" * 8 + b"\x00", "memory domains"),
        (DEFAULT_TLS_KEY[:-1], "sys_dev byte is missing"),
        (build_key({0: b"ab"})[:-2], "run past the end"),
        (build_key({0: b""}, sys_dev=2, distances=1)[:-1], "not terminated"),
        (build_key({0: b""}, sys_dev=2, distances=1)[:-2], "distance record runs past the end"),
        (TCP_CMA_KEY + b"\x00", "trailing bytes"),
        (DEFAULT_TLS_KEY + b"\xff", "trailing bytes"),
    ],
    ids=[
        "empty",
        "truncated",
        "mem_type_0x7f",
        "mem_type_last",
        "mem_type_rocm",
        "mem_type_gaudi",
        "md_bit40_no_body",
        "md_map_all_ones",
        "no_sys_dev",
        "short_md_body",
        "unterminated_distances",
        "partial_distance",
        "trailing_after_dummy",
        "trailing_after_sys_dev",
    ],
)
def test_malformed_keys_are_refused(blob: bytes, reason: str) -> None:
    """Each malformed key UCX mishandles (over-read, crash) is refused, naming why."""
    assert reason in refused(blob)


@pytest.mark.parametrize("mem_type", [MemoryType.CUDA, MemoryType.CUDA_MANAGED])
def test_cuda_keys_pass(mem_type: MemoryType) -> None:
    """A GPU arena's key (cuda_ipc/cuda_copy bodies, a known sys_dev with its distances)
    passes the pre-parse, and says which memory it names."""
    blob = build_key({2: b"\x07" * 24, 4: b"\x08" * 8}, mem_type=mem_type, sys_dev=1, distances=2)
    layout = parse_packed_rkey(blob)
    assert layout.mem_type == mem_type
    assert parse_packed_rkey(TCP_CMA_KEY[:8] + bytes([mem_type])).mem_type == mem_type


def test_a_caller_narrows_the_memory_types() -> None:
    """A consumer that can only take host bytes refuses a CUDA key, naming both sides."""
    host_only = frozenset({MemoryType.HOST})
    check_packed_rkey(TCP_CMA_KEY, memory_types=host_only)
    reason = refused(TCP_CMA_KEY[:8] + b"\x01", memory_types=host_only)
    assert "mem_type 1 (cuda) is not accepted here (host)" in reason


def test_descriptor_carries_a_cuda_key_unchanged() -> None:
    """The descriptor's wire is memory-type agnostic (UCX writes the type into the key): a
    CUDA key round-trips through the 29-byte header, and the pre-parse still sees CUDA."""
    key = build_key({1: b"\x05" * 30}, mem_type=MemoryType.CUDA)
    wire = RdmaDescriptor(generation=7, addr=0x7F00_0000_0000, length=1 << 28, rkey=key).encode()
    decoded = RdmaDescriptor.decode(wire)
    assert decoded.rkey == key
    assert parse_packed_rkey(decoded.rkey).mem_type == MemoryType.CUDA
    garbage = RdmaDescriptor.decode(
        RdmaDescriptor(generation=7, addr=1, length=1, rkey=key[:8] + b"\x7f" + key[9:]).encode()
    )  # framing passes: the key is the pre-parse's to refuse, before UCX sees it
    with pytest.raises(DescriptorError, match="out of range"):
        check_packed_rkey(garbage.rkey)


def test_length_limit() -> None:
    """Keys over the backend's 1024-byte bound (or a caller's lower one) are refused."""
    blob = build_key({i: b"\x00" * 200 for i in range(6)})
    assert len(blob) > PACKED_RKEY_MAX_BYTES
    assert "over the 1024-byte limit" in refused(blob)
    assert "over the 10-byte limit" in refused(DEFAULT_TLS_KEY, max_len=10)


def test_md_map_bit_limit() -> None:
    """16 memory domains pass (well formed); 17 are refused before their bodies are read."""
    check_packed_rkey(build_key({i: b"" for i in range(MAX_MD_MAP_BITS)}))
    assert "17 memory domains" in refused(build_key({i: b"" for i in range(MAX_MD_MAP_BITS + 1)}))


def test_accepts_bytes_like() -> None:
    """bytearray and memoryview blobs parse like bytes."""
    check_packed_rkey(bytearray(DEFAULT_TLS_KEY))
    check_packed_rkey(memoryview(DEFAULT_TLS_KEY))


well_formed = st.builds(
    build_key,
    bodies=st.dictionaries(st.integers(0, 63), st.binary(max_size=40), max_size=MAX_MD_MAP_BITS),
    sys_dev=st.none() | st.integers(0, 0xFF),
    distances=st.integers(0, 5),
)


@settings(max_examples=300)
@given(well_formed)
def test_well_formed_keys_pass_and_every_truncation_is_refused(blob: bytes) -> None:
    """Any key in UCX's own layout passes; every proper prefix of it is refused."""
    if len(blob) > PACKED_RKEY_MAX_BYTES:
        return
    check_packed_rkey(blob)
    for cut in range(len(blob)):
        with pytest.raises(DescriptorError):
            check_packed_rkey(blob[:cut])


@settings(max_examples=1000)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_raise_only_descriptor_error(blob: bytes) -> None:
    """Fuzz: for any bytes at all, the pre-parse passes or raises DescriptorError, nothing else."""
    try:
        layout = parse_packed_rkey(blob)
    except DescriptorError:
        return
    assert layout.length == len(blob) and layout.mem_type in SUPPORTED_MEMORY_TYPES


def test_rkey_module_loads_no_ucx() -> None:
    """The pre-parse is pure Python: importing it pulls in neither cffi, libucx nor the binding."""
    code = (
        "import sys, ray_velo.ucx.rkey, ray_velo.ucx\n"
        "bad = [m for m in ('cffi', 'libucx', 'ray_velo.ucx._ucx_binding', 'numpy') "
        "if m in sys.modules]\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
