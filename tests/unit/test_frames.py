"""The agents' TCP frames (ray_velo.protocol.frames): requests and answers round-trip, an
owner's error comes back as the same VeloError class with its fields, and nothing a peer
sends makes the decoder raise anything but ProtocolError or build a class outside our
error tree."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ray_velo.errors import HandleNotFound, HandleReleased, ProtocolError, VeloError
from ray_velo.protocol.frames import (
    HEADER,
    WIRE_METHODS,
    decode_answer,
    decode_request,
    encode_answer,
    encode_error,
    encode_request,
)

INT64 = st.integers(-(2**63), 2**63 - 1)  # what msgpack carries


def split(frame: bytes) -> tuple[int, int, bytes]:
    length, kind, call_id = HEADER.unpack(frame[: HEADER.size])
    body = frame[HEADER.size :]
    assert length == len(frame) - 4
    return kind, call_id, body


@pytest.mark.parametrize("method", WIRE_METHODS)
def test_a_request_names_its_handler_and_carries_the_message(method: str) -> None:
    kind, call_id, body = split(encode_request(method, 7, b"\x81\xa1a\x01"))
    assert decode_request(kind, body) == method and call_id == 7 and body == b"\x81\xa1a\x01"


def test_pulls_are_not_carried() -> None:
    with pytest.raises(KeyError):
        encode_request("_rv_pull", 1, b"")
    with pytest.raises(ProtocolError, match="unknown handler number"):
        decode_request(len(WIRE_METHODS), b"")


@pytest.mark.parametrize("value", [b"\x00answer", 42, None])
def test_an_answer_carries_the_return_value(value: Any) -> None:
    status, call_id, body = split(encode_answer(3, value))
    assert call_id == 3 and decode_answer(status, body) == (True, value)


def test_an_owner_error_comes_back_as_itself() -> None:
    raised = HandleNotFound(handle="h:1", reason="its TTL (2.0 s) ended it")
    status, _, body = split(encode_error(9, raised))
    ok, error = decode_answer(status, body)
    assert not ok and type(error) is HandleNotFound
    assert str(error) == str(raised) and error.fields == raised.fields
    ok, error = decode_answer(*split(encode_error(9, HandleReleased(handle="h:2")))[::2])
    assert type(error) is HandleReleased


def test_a_foreign_error_becomes_a_velo_error_naming_it() -> None:
    status, _, body = split(encode_error(1, KeyError("x")))
    ok, error = decode_answer(status, body)
    assert not ok and type(error) is VeloError and "KeyError('x')" in str(error)


@pytest.mark.parametrize("name", ["ValueError", "SystemExit", "__builtins__", "os", 5])
def test_a_peer_cannot_name_a_class_outside_our_errors(name: Any) -> None:
    body = msgpack.packb({"type": name, "message": "boom"})
    ok, error = decode_answer(1, body)
    assert not ok and type(error) is VeloError and str(error) == "boom"


@given(st.integers(0, 255), st.binary(max_size=200))
def test_any_answer_bytes_decode_or_raise_protocol_error(status: int, body: bytes) -> None:
    try:
        ok, value = decode_answer(status, body)
    except ProtocolError:
        return
    assert ok or isinstance(value, VeloError)


@given(
    st.dictionaries(
        st.sampled_from(["type", "message", "fields"]),
        st.one_of(
            st.text(max_size=20),
            st.sampled_from(["HandleNotFound", "TransferTimeout", "OwnerDied", "VeloError"]),
            st.dictionaries(st.text(max_size=8), st.one_of(INT64, st.text(max_size=8))),
            INT64,
            st.none(),
        ),
    )
)
def test_any_error_map_rebuilds_an_error_of_our_tree(wire: dict[str, Any]) -> None:
    ok, error = decode_answer(1, msgpack.packb(wire))
    assert not ok and isinstance(error, VeloError)
