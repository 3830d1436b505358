"""The RDMA descriptor codec: byte-exact, and nothing but DescriptorError for bad bytes."""

from __future__ import annotations

import contextlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_velo.errors import DescriptorError
from ray_velo.protocol.descriptor import (
    DESCRIPTOR_HEADER_BYTES,
    MAX_DESCRIPTOR_RKEY_BYTES,
    RdmaDescriptor,
)

u64 = st.integers(min_value=0, max_value=(1 << 64) - 1)
descriptors = st.builds(
    RdmaDescriptor,
    generation=u64,
    addr=u64,
    length=st.integers(min_value=1, max_value=(1 << 64) - 1),
    rkey=st.binary(max_size=MAX_DESCRIPTOR_RKEY_BYTES),
)


@given(descriptors)
def test_decode_inverts_encode(descriptor: RdmaDescriptor) -> None:
    blob = descriptor.encode()
    assert len(blob) == DESCRIPTOR_HEADER_BYTES + len(descriptor.rkey)
    assert RdmaDescriptor.decode(blob) == descriptor


@settings(max_examples=500)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_raise_only_descriptor_error(blob: bytes) -> None:
    with contextlib.suppress(DescriptorError):
        RdmaDescriptor.decode(blob)


@given(descriptors, st.data())
def test_any_single_byte_corruption_decodes_or_raises_descriptor_error(
    descriptor: RdmaDescriptor, data: st.DataObject
) -> None:
    blob = bytearray(descriptor.encode())
    index = data.draw(st.integers(min_value=0, max_value=len(blob) - 1))
    blob[index] ^= data.draw(st.integers(min_value=1, max_value=255))
    with contextlib.suppress(DescriptorError):
        RdmaDescriptor.decode(bytes(blob))
    cut = data.draw(st.integers(min_value=0, max_value=len(blob) - 1))
    with pytest.raises(DescriptorError):
        RdmaDescriptor.decode(descriptor.encode()[:cut])


def test_header_layout_is_the_spec_layout() -> None:
    blob = RdmaDescriptor(generation=7, addr=0x1000, length=4096, rkey=b"\x01\x02").encode()
    assert DESCRIPTOR_HEADER_BYTES == 29
    assert blob[:3] == b"\x01\x01\x00"  # backend ucx, version 1, flags 0
    assert struct.unpack_from("<QQQH", blob, 3) == (7, 0x1000, 4096, 2)
    assert blob[29:] == b"\x01\x02"


GOOD = RdmaDescriptor(generation=1, addr=2, length=3, rkey=b"key").encode()


@pytest.mark.parametrize(
    ("blob", "reason"),
    [
        (b"\x02" + GOOD[1:], "unknown backend"),
        (GOOD[:1] + b"\x02" + GOOD[2:], "unknown version"),
        (GOOD[:2] + b"\x01" + GOOD[3:], "non-zero flags"),
        (GOOD[:19] + b"\x00" * 8 + GOOD[27:], "zero length"),
        (GOOD[:-1], "only 2 key bytes"),
        (GOOD + b"\x00", "trailing"),
        (GOOD[:28], "shorter than"),
        (GOOD[:27] + struct.pack("<H", 5000) + b"x" * 5000, "over 4096"),
    ],
)
def test_decode_refuses(blob: bytes, reason: str) -> None:
    with pytest.raises(DescriptorError, match=reason):
        RdmaDescriptor.decode(blob)


def test_encode_refuses_what_decode_would() -> None:
    with pytest.raises(DescriptorError):
        RdmaDescriptor(generation=0, addr=0, length=0, rkey=b"").encode()
    with pytest.raises(DescriptorError):
        RdmaDescriptor(generation=0, addr=0, length=1, rkey=b"x" * 4097).encode()
    with pytest.raises(DescriptorError):
        RdmaDescriptor(generation=-1, addr=0, length=1, rkey=b"").encode()
