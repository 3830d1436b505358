"""Typed payloads: what ``put`` stages comes back from ``fetch`` as the same kind of object,
with the same dtype, shape and bytes, and without pickling."""

from __future__ import annotations

import array
import ctypes
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ray_velo.client.payload import (
    as_bytes_view,
    dtype_from_wire,
    dtype_to_wire,
    from_bytes_view,
    payload_nbytes,
)
from ray_velo.errors import UnsupportedPayload
from ray_velo.protocol.messages import TypeHeader, decode, encode


def wire(header: TypeHeader) -> TypeHeader:
    """The header as the consumer sees it: through the control-message codec."""
    return decode(TypeHeader, encode(header))


def round_trip(obj: Any, *, copy: bool = False) -> Any:
    header, view = as_bytes_view(obj)
    assert view.ndim == 1 and view.format == "B" and view.c_contiguous
    # the consumer rebuilds from a fresh buffer of the fetched bytes
    return from_bytes_view(wire(header), bytearray(view), copy=copy)


def assert_same_array(got: Any, expected: np.ndarray[Any, Any]) -> None:
    assert type(got) is np.ndarray
    assert got.dtype == expected.dtype
    assert got.shape == expected.shape
    assert got.flags.c_contiguous
    # bytes, not values: NaN != NaN and padding is part of what was staged
    assert got.tobytes() == np.ascontiguousarray(expected).tobytes()


plain_dtypes = st.one_of(
    hnp.scalar_dtypes(),
    hnp.integer_dtypes(endianness="="),
    hnp.integer_dtypes(endianness=">"),
    hnp.floating_dtypes(endianness=">"),
    hnp.complex_number_dtypes(endianness="<"),
    hnp.byte_string_dtypes(),
    hnp.unicode_string_dtypes(endianness=">"),
    hnp.datetime64_dtypes(),
    hnp.timedelta64_dtypes(endianness=">"),
)
structured_dtypes = hnp.array_dtypes(subtype_strategy=hnp.scalar_dtypes(), min_size=1, max_size=4)
any_dtype = st.one_of(plain_dtypes, structured_dtypes)
shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)


@settings(max_examples=200, deadline=None)
@given(hnp.arrays(any_dtype, shapes))
def test_numpy_array_round_trips_with_dtype_shape_and_bytes(value: np.ndarray[Any, Any]) -> None:
    """A worker puts an array of any dtype and shape; the consumer gets an equal array."""
    assert_same_array(round_trip(value), value)


@settings(max_examples=100, deadline=None)
@given(
    hnp.arrays(plain_dtypes, hnp.array_shapes(min_dims=2, max_dims=4, min_side=1, max_side=5)),
    st.data(),
)
def test_non_contiguous_array_is_made_contiguous_once(
    value: np.ndarray[Any, Any], data: st.DataObject
) -> None:
    """Fortran order, transposes and strided slices stage as their C-order bytes."""
    step = data.draw(st.integers(1, 3), label="step")
    views = [
        np.asfortranarray(value),
        value.T,
        value[::step],
        value[..., ::-1],
        np.swapaxes(value, 0, -1)[::step],
    ]
    for view in views:
        assert_same_array(round_trip(view), view)


def test_zero_dimensional_array_stays_zero_dimensional() -> None:
    """np.ascontiguousarray turns a 0-d array into shape (1,); the header must not."""
    value = np.array(3.25)
    header, _ = as_bytes_view(value)
    assert header.shape == ()
    got = round_trip(value)
    assert got.shape == () and got[()] == 3.25


def test_structured_dtype_keeps_its_fields() -> None:
    """A record array's dtype.str is only "|V<n>": the fields must travel too."""
    dtype = np.dtype(
        {
            "names": ["id", "pos", "tag"],
            "formats": ["<u4", ("<f8", (3,)), "S4"],
            "offsets": [0, 8, 40],
            "itemsize": 48,
        }
    )
    value = np.zeros(5, dtype=dtype)
    value["id"] = np.arange(5)
    value["pos"] = np.arange(15.0).reshape(5, 3)
    value["tag"] = b"abcd"
    got = round_trip(value)
    assert_same_array(got, value)
    assert got.dtype.names == ("id", "pos", "tag")
    assert (got["pos"] == value["pos"]).all()


@pytest.mark.parametrize(
    "dtype",
    [np.dtype("<f8"), np.dtype(">i2"), np.dtype("<M8[ns]"), np.dtype("<U7"), np.dtype("V5")],
)
def test_plain_dtype_travels_as_its_str(dtype: np.dtype[Any]) -> None:
    """Unchanged wire form for every plain dtype (old consumers read it with np.dtype)."""
    assert dtype_to_wire(dtype) == dtype.str
    assert dtype_from_wire(dtype.str) == dtype


def test_numpy_fetch_is_a_read_only_view_unless_copied() -> None:
    value = np.arange(6, dtype=np.int32).reshape(2, 3)
    header, view = as_bytes_view(value)
    shared = from_bytes_view(header, view.toreadonly())
    assert not shared.flags.writeable
    copied = from_bytes_view(header, view.toreadonly(), copy=True)
    assert copied.flags.writeable and copied.flags.owndata
    assert (copied == value).all()


@pytest.mark.parametrize(
    "value",
    [b"", b"payload", bytearray(b"mutable"), bytes(range(256)) * 10],
    ids=["empty", "bytes", "bytearray", "large"],
)
def test_bytes_likes_come_back_as_bytes(value: bytes | bytearray) -> None:
    got = round_trip(value)
    assert type(got) is bytes and got == bytes(value)
    assert payload_nbytes(value) == len(value)


def test_contiguous_bytes_are_not_copied() -> None:
    """A 1-D bytes view is staged in place: the only copy is into the staging memory."""
    source = bytearray(b"x" * 4096)
    _, view = as_bytes_view(source)
    source[0] = ord("y")
    assert view[0] == ord("y")


@pytest.mark.parametrize(
    "view",
    [
        pytest.param(np.arange(12.0).reshape(3, 4).data, id="2d-float64"),
        pytest.param(np.arange(24, dtype=">i4").reshape(2, 3, 4).data, id="3d-big-endian"),
        pytest.param(np.arange(12.0).reshape(3, 4)[:, ::2].data, id="2d-strided"),
        pytest.param(memoryview(b"abcdefgh")[::3], id="1d-strided"),
        pytest.param(np.array(7.5).data, id="0d"),
        pytest.param(np.zeros((2, 0)).data, id="2d-empty"),
        pytest.param(memoryview(array.array("i", [1, -2, 3])), id="array-module"),
        pytest.param(memoryview((ctypes.c_double * 3)(1.0, 2.0, 3.0)), id="ctypes"),
        pytest.param(np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8")]).data, id="struct"),
    ],
)
def test_memoryview_of_any_shape_and_format_stages_its_bytes(view: memoryview) -> None:
    """A memoryview comes back as bytes in C order, whatever its shape, format or strides."""
    got = round_trip(view)
    assert type(got) is bytes
    assert got == view.tobytes()
    assert payload_nbytes(view) == view.nbytes


# The dtypes the buffer protocol can express (datetime64 and timedelta64 cannot).
buffer_dtypes = st.one_of(
    hnp.boolean_dtypes(),
    hnp.integer_dtypes(),
    hnp.unsigned_integer_dtypes(),
    hnp.floating_dtypes(),
    hnp.complex_number_dtypes(),
    hnp.byte_string_dtypes(),
)


@settings(max_examples=50, deadline=None)
@given(hnp.arrays(buffer_dtypes, shapes))
def test_memoryview_of_numpy_array_stages_its_bytes(value: np.ndarray[Any, Any]) -> None:
    view = value.data  # the array's memoryview (the buffer protocol)
    assert round_trip(view) == view.tobytes()


def test_object_arrays_are_refused() -> None:
    """Python objects cannot be staged without pickling: refused, with the dtype named."""
    for value in (
        np.array([{"a": 1}, None], dtype=object),
        np.zeros(2, dtype=[("x", "<i4"), ("o", object)]),
    ):
        with pytest.raises(UnsupportedPayload, match="Python objects") as info:
            as_bytes_view(value)
        assert isinstance(info.value, TypeError)
        assert payload_nbytes(value) is None


@pytest.mark.parametrize(
    "value", [{"a": 1}, [1, 2, 3], "text", 42, 3.5, None, object()], ids=lambda v: type(v).__name__
)
def test_unsupported_types_are_refused_with_what_to_pass(value: Any) -> None:
    with pytest.raises(UnsupportedPayload) as info:
        as_bytes_view(value)
    message = str(info.value)
    assert type(value).__name__ in message
    assert "numpy array" in message and "bytes" in message  # what to pass instead
    assert payload_nbytes(value) is None


def test_payload_nbytes_matches_the_staged_view() -> None:
    for value in (np.zeros((3, 5), dtype=np.float32), np.zeros((4, 4))[::2].T, b"abc"):
        _, view = as_bytes_view(value)
        assert payload_nbytes(value) == view.nbytes


# --- torch --------------------------------------------------------------------------------


@pytest.fixture
def torch() -> Any:
    return pytest.importorskip(
        "torch",
        reason="torch is not installed: CPU tensor payloads are NOT tested in this run "
        "(pip install torch to cover them)",
    )


def test_torch_tensor_round_trips_as_a_tensor(torch: Any) -> None:
    """A CPU tensor comes back as a tensor of the same dtype, shape and values."""
    for tensor in (
        torch.arange(24, dtype=torch.float32).reshape(2, 3, 4),
        torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),  # non-contiguous
        torch.tensor(2.5),  # 0-d
        torch.zeros(0, 3, dtype=torch.float16),
        torch.tensor([True, False, True]),
        torch.ones(3, requires_grad=True),
    ):
        header, view = as_bytes_view(tensor)
        assert header.kind == "torch"
        got = from_bytes_view(wire(header), bytearray(view))
        assert isinstance(got, torch.Tensor)
        assert got.dtype == tensor.dtype
        assert tuple(got.shape) == tuple(tensor.shape)
        assert torch.equal(got, tensor.detach())
        assert payload_nbytes(tensor) == view.nbytes


def test_torch_tensor_from_a_read_only_view_is_a_copy(torch: Any) -> None:
    """torch has no read-only tensors: a read-only fetch gets its own memory, no warning."""
    header, view = as_bytes_view(torch.arange(4, dtype=torch.int32))
    got = from_bytes_view(header, view.toreadonly())
    got[0] = 99  # writable, and not the staged bytes
    assert view.cast("i")[0] == 0
