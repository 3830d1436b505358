"""A peer that speaks msgpack but not our protocol: whatever maps it sends, the control-message
decoder raises ProtocolError and nothing else (after h11: only the peer's error escapes)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ray_velo.errors import DescriptorError, ProtocolError
from ray_velo.protocol import messages
from ray_velo.protocol.descriptor import RdmaDescriptor

MESSAGE_CLASSES: list[type[Any]] = [
    messages.MetadataRequest,
    messages.MetadataResponse,
    messages.AcquireRequest,
    messages.Ready,
    messages.Rdma,
    messages.PullRequest,
    messages.RefRequest,
    messages.DetachRequest,
    messages.ReleaseRequest,
    messages.LeaseRenewRequest,
    messages.TypeHeader,
    messages.RdmaOffer,
]

#: Every field name the decoder knows, plus the nested ones: random maps hit real fields.
FIELD_NAMES = sorted(
    {f.name for cls in MESSAGE_CLASSES for f in dataclasses.fields(cls)} | {"hi", "lo", "kind"}
)

leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats()
    | st.text(max_size=6)
    | st.binary(max_size=6)
)
values = st.recursive(
    leaves,
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=3), children, max_size=3)
    ),
    max_leaves=10,
)
wire_maps = st.dictionaries(st.sampled_from(FIELD_NAMES), values, max_size=6)


@settings(max_examples=250, suppress_health_check=[HealthCheck.too_slow])
@given(wire_maps, st.sampled_from(MESSAGE_CLASSES))
def test_any_msgpack_map_decodes_or_raises_protocol_error(
    wire: dict[str, Any], cls: type[Any]
) -> None:
    """Right field names, wrong shapes (a handle that is a list, a shape of floats, ...)."""
    blob = msgpack.packb(wire, use_bin_type=True)
    try:
        decoded = messages.decode(cls, blob)
    except ProtocolError:
        pass
    else:
        assert isinstance(decoded, cls)
        assert messages.decode(cls, messages.encode(decoded)) == decoded
    try:
        answer = messages.decode_acquire_response(blob)
    except ProtocolError:
        pass
    else:
        assert isinstance(answer, (messages.Ready, messages.Rdma))


@pytest.mark.parametrize("not_bytes", [10**12, 3, None, "text", 1.5, [1, 2]])
def test_a_non_buffer_is_refused_without_allocating_it(not_bytes: Any) -> None:
    """``bytes(10**12)`` would allocate a terabyte; a non-buffer is refused at once."""
    with pytest.raises(ProtocolError):
        messages.decode(messages.PullRequest, not_bytes)
    with pytest.raises(ProtocolError):
        messages.decode_acquire_response(not_bytes)
    with pytest.raises(DescriptorError):
        RdmaDescriptor.decode(not_bytes)


def test_buffers_of_every_kind_decode() -> None:
    blob = messages.encode(messages.PullRequest(transfer_id=3, index=1))
    for data in (blob, bytearray(blob), memoryview(blob)):
        assert messages.decode(messages.PullRequest, data) == messages.PullRequest(3, 1)
    descriptor = RdmaDescriptor(generation=1, addr=4096, length=8, rkey=b"key")
    encoded = descriptor.encode()
    for data in (encoded, bytearray(encoded), memoryview(encoded)):
        assert RdmaDescriptor.decode(data) == descriptor


NESTED = 1000  # levels: past repr()'s recursion limit, within msgpack's 1024
decode_ref = functools.partial(messages.decode, messages.RefRequest)


@pytest.mark.parametrize(
    ("decode", "blob", "reason"),
    [
        (decode_ref, b"\x81\xa6handle" + b"\x91" * NESTED + b"\x01", "a DataHandle on the wire"),
        (
            decode_ref,
            b"\x81\xa6handle\x82\xa2lo\x01\xa2hi" + b"\x91" * NESTED + b"\x01",
            "DataHandle.worker_id must be a u64",
        ),
        (
            messages.decode_acquire_response,
            b"\x81\xa4kind" + b"\x81\xa1a" * NESTED + b"\x01",
            "unknown acquire answer kind",
        ),
    ],
    ids=["handle_nested_list", "handle_hi_nested_list", "kind_nested_map"],
)
def test_a_deeply_nested_value_is_refused_with_protocol_error(
    decode: Callable[[bytes], object], blob: bytes, reason: str
) -> None:
    """Found at scale (test_fuzz_at_scale): the refusal quoted the peer's value with repr(),
    which raised RecursionError 1000 levels down; the quote is now bounded."""
    with pytest.raises(ProtocolError, match=reason) as info:
        decode(blob)
    assert len(str(info.value)) < 200
