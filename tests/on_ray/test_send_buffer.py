"""Arrays built in the agent's memory (``rv.empty`` / ``SendBuffer.seal``) and the memory of
a PinnedWriter, on a real two-node cluster: staged without a copy when nothing else holds
the array, and never a byte a reader reads that the producer could still write.

The PinnedWriter test is the defect this file started from: dropping the writer gave its
memory back to the pool while an array over it was still alive and writable.
"""

from __future__ import annotations

import logging
import zlib
from typing import Any

import numpy as np
import pytest
import ray

import ray_velo as rv
from ray_velo.config import MiB
from tests.on_ray.conftest import agent_info, moved, path_counts, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.multinode]

ON_B = {"resources": {"node_b": 1}, "num_cpus": 0}
SIZE = 8 * MiB


@ray.remote(**ON_B)
def crc_on_b(handle: rv.DataHandle) -> tuple[int, tuple[int, ...], str]:
    data = rv.fetch(handle)
    return zlib.crc32(np.ascontiguousarray(data)), tuple(data.shape), data.dtype.str


def reservations() -> int:
    return int(agent_info("node_a")["reservations"])


def address(handle: rv.DataHandle) -> int:
    """Where the slot's bytes are mapped in this process (on the owner's node)."""
    pinned, lease_id = rv.get_pinned(handle)  # a view of the slot itself
    try:
        return int(pinned.array.ctypes.data)
    finally:
        del pinned
        rv.detach(handle, lease_id)


def test_a_sealed_buffer_is_the_slot_itself_and_crosses_nodes(velo: None) -> None:
    """Built in place, sealed with nothing else holding the array: the slot's bytes are the
    buffer's own memory (same address: no copy), node b reads them by GET, and the array is
    gone from the buffer."""
    buf = rv.empty((SIZE // 4,), np.float32)
    np.multiply(np.arange(SIZE // 4, dtype=np.float32), 0.5, out=buf.array)
    built_at = int(buf.array.ctypes.data)
    expected = zlib.crc32(np.arange(SIZE // 4, dtype=np.float32) * 0.5)
    b0 = path_counts("node_b")
    handle = buf.seal()
    # registered where UCX runs; plain memory under the default (UCX closed)
    assert buf.handle == handle
    assert rv.metadata(handle).pinned == agent_info("node_a")["rdma"]
    assert address(handle) == built_at, "seal copied the bytes"
    with pytest.raises(rv.StagingError, match="sealed"):
        buf.array  # noqa: B018
    with pytest.raises(rv.StagingError, match="sealed"):
        buf.seal()
    assert ray.get(crc_on_b.remote(handle)) == (expected, (SIZE // 4,), "<f4")
    assert moved(b0, path_counts("node_b")) == {"wire/ok": 1}


def test_a_view_alive_at_seal_can_never_write_the_sent_bytes(
    velo: None, caplog: pytest.LogCaptureFixture
) -> None:
    """A view of the array kept past seal: seal copies (and says so), the reservation under
    the view stays out of the pool until the view goes, and what the view writes afterwards
    reaches no reader, on either node, nor the next payload."""
    buf = rv.empty((4, SIZE // 4), np.uint8)
    buf.array[:] = 7
    view = buf.array[1:]
    with caplog.at_level(logging.WARNING, logger="ray_velo"):
        handle = buf.seal()
    assert "copied" in caplog.text
    # the copy's commit is a notice the agent may not have read yet: then it counts too
    wait_for("the copy committed", lambda: reservations() <= 1, 10.0)
    assert reservations() == 1, "the memory under a live view went back to the pool"
    view[:] = 9  # the producer keeps writing through its view
    following = rv.put(np.full(SIZE, 5, np.uint8))  # the pool's next payload
    same_node = rv.fetch(handle, release=False)
    assert int(same_node.min()) == int(same_node.max()) == 7
    del same_node
    assert ray.get(crc_on_b.remote(handle))[0] == zlib.crc32(np.full((4, SIZE // 4), 7, np.uint8))
    view[:] = 11
    assert ray.get(crc_on_b.remote(following))[0] == zlib.crc32(np.full(SIZE, 5, np.uint8))
    del view
    wait_for("the buffer's reservation back in the pool", lambda: reservations() == 0, 10.0)


def test_a_pinned_writers_array_keeps_its_memory_after_the_writer_goes(velo: None) -> None:
    """The array of a dropped (or closed) PinnedWriter still owns its memory: nothing staged
    meanwhile lands in it, and the memory goes back once the array is collected."""
    array = rv.alloc_pinned_writer(SIZE).array  # the writer itself is collected at once
    closed = rv.alloc_pinned_writer(SIZE)
    kept = closed.array[: SIZE // 2]
    closed.close()
    assert reservations() == 2, "a writer's memory went back under a live array"
    others = [rv.put(np.full(SIZE, n, np.uint8)) for n in (1, 2, 3)]
    assert not {address(h) for h in others} & {int(array.ctypes.data), int(kept.ctypes.data)}
    array[:] = 99
    kept[:] = 98
    for n, handle in enumerate(others, start=1):
        assert ray.get(crc_on_b.remote(handle))[0] == zlib.crc32(np.full(SIZE, n, np.uint8))
    del array, kept
    wait_for("both writers' memory back in the pool", lambda: reservations() == 0, 10.0)


def test_a_buffer_left_unsealed_gives_its_memory_back(velo: None) -> None:
    """An exception inside ``with rv.empty(...)``, a plain abort(), and a buffer simply
    dropped: each gives the reservation back; an aborted buffer cannot be sealed."""
    with pytest.raises(RuntimeError, match="producer failed"), rv.empty(SIZE, np.uint8) as buf:
        buf.array[:] = 1
        raise RuntimeError("producer failed")
    with pytest.raises(rv.StagingError, match="aborted"):
        buf.seal()
    second = rv.empty(SIZE, np.uint8)
    second.abort()
    rv.empty(SIZE, np.uint8)  # dropped unsealed
    wait_for("every unsealed buffer's memory back", lambda: reservations() == 0, 10.0)


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((0, 3), np.float64), ((), np.int16), ((3, 5, 7), np.complex64)],
    ids=["zero-size", "0-d", "3-d complex"],
)
def test_shapes_and_dtypes_arrive_as_built(velo: None, shape: Any, dtype: Any) -> None:
    with rv.empty(shape, dtype) as buf:
        buf.array[...] = np.arange(buf.array.size, dtype=dtype).reshape(shape)
        handle = buf.seal()
    expected = np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)
    crc, got_shape, got_dtype = ray.get(crc_on_b.remote(handle))
    assert (crc, got_shape, got_dtype) == (zlib.crc32(expected), shape, np.dtype(dtype).str)


def test_bad_requests_are_refused_before_any_memory_is_reserved(velo: None) -> None:
    """Bad shapes, dtypes, ttl and lifetime raise before a reservation is made."""
    with rv.empty(np.int64(3), np.uint8) as buf:  # a numpy integer is a shape too
        assert buf.array.shape == (3,)
    # its abort is a notice to the agent: wait for it, then nothing below may reserve
    wait_for("the aborted buffer's reservation back", lambda: reservations() == 0, 10.0)
    with pytest.raises(ValueError, match="negative"):
        rv.empty((4, -1), np.uint8)
    with pytest.raises(rv.UnsupportedPayload, match="Python objects"):
        rv.empty(4, object)
    with pytest.raises(rv.ConfigError, match="ttl"):
        rv.empty(4, np.uint8, ttl=0)
    with pytest.raises(rv.ConfigError, match="lifetime"):
        rv.empty(4, np.uint8, lifetime="forever")
    assert reservations() == 0
