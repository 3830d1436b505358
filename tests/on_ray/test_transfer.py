"""Payloads moved by handle on a real two-node cluster: chunked path and same-node reads."""

from __future__ import annotations

import os
import signal
import time
import zlib
from typing import Any

import numpy as np
import pytest
import ray

import ray_velo as rv
from ray_velo.config import MiB
from tests.on_ray.conftest import TEST_CHUNK, agent_info, node_ids, wait_for, wait_until_freed
from tests.on_ray.test_faults import used_bytes

pytestmark = [pytest.mark.ray, pytest.mark.multinode]

ON_B = {"resources": {"node_b": 1}, "num_cpus": 0}
ON_A = {"resources": {"node_a": 1}, "num_cpus": 0}


@ray.remote(**ON_B)
def crc_on_b(handle: rv.DataHandle, release: bool = True) -> tuple[int, int, str]:
    data = rv.fetch(handle, release=release)
    raw = data if isinstance(data, bytes) else np.ascontiguousarray(data).tobytes()
    return zlib.crc32(raw), len(raw), ray.get_runtime_context().get_node_id()


@ray.remote(**ON_B)
def fetch_on_b(handle: rv.DataHandle, **kwargs: Any) -> Any:
    value = rv.fetch(handle, **kwargs)
    return np.array(value) if isinstance(value, np.ndarray) else value


@pytest.mark.parametrize(
    "size",
    [0, 1, TEST_CHUNK - 1, TEST_CHUNK, TEST_CHUNK + 1, 64 * MiB],
    ids=["0B", "1B", "chunk-1", "chunk", "chunk+1", "64MiB"],
)
def test_cross_node_round_trip(velo: None, size: int) -> None:
    """A producer on node a stages bytes; a task on node b fetches them, byte-exact."""
    payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    handle = rv.put(payload)
    crc, length, node = ray.get(crc_on_b.remote(handle))
    assert (crc, length) == (zlib.crc32(payload), size)
    assert node == node_ids()["node_b"]
    with pytest.raises(rv.HandleNotFound):  # single consumer released it: the owner freed it
        rv.metadata(handle)


@pytest.mark.parametrize(
    "array",
    [
        np.arange(24, dtype=np.float32).reshape(2, 3, 4),
        np.arange(30, dtype=np.int64).reshape(5, 6).T,  # Fortran order, non-contiguous
        np.arange(100, dtype=np.complex128)[::3],  # strided
        np.array([True, False, True]),
        np.zeros((0, 7), dtype=np.uint16),
        np.array(["ab", "cde"], dtype="<U3"),
        np.arange(6, dtype=">i4").reshape(3, 2),  # big-endian
    ],
    ids=["f32-3d", "fortran", "strided", "bool", "empty-2d", "unicode", "big-endian"],
)
def test_numpy_dtypes_shapes_orders_round_trip(velo: None, array: np.ndarray) -> None:
    """Arrays of any dtype, shape and memory order come back equal, with dtype and shape."""
    back = ray.get(fetch_on_b.remote(rv.put(array)))
    assert back.dtype == array.dtype and back.shape == array.shape
    np.testing.assert_array_equal(back, array)


def test_torch_cpu_tensor_round_trip(velo: None) -> None:
    """A CPU torch tensor comes back a tensor with its dtype and shape, on both nodes."""
    torch = pytest.importorskip("torch", reason="SKIPPED (optional): torch is not installed")
    tensor = torch.arange(3 * MiB // 4, dtype=torch.float32).reshape(3, -1)

    @ray.remote(**ON_B)
    def on_b(handle: rv.DataHandle) -> tuple[str, tuple[int, ...], float]:
        value = rv.fetch(handle)
        return type(value).__name__, tuple(value.shape), float(value.sum())

    assert ray.get(on_b.remote(rv.put(tensor))) == ("Tensor", (3, MiB // 4), float(tensor.sum()))
    local = rv.fetch(rv.put(tensor))
    assert isinstance(local, torch.Tensor) and torch.equal(local, tensor)


def test_bytes_like_round_trip(velo: None) -> None:
    for value in (b"abc", bytearray(b"\x00\x01"), memoryview(b"xyz" * 1000)):
        assert ray.get(fetch_on_b.remote(rv.put(value))) == bytes(value)


def test_same_node_read_shares_the_segment(velo: None) -> None:
    """On the owner's node a fetch is a read-only view of the shared segment: no copy."""
    array = np.arange(1 << 20, dtype=np.float64)
    handle = rv.put(array)
    view = rv.fetch(handle, release=False)
    assert not view.flags.writeable and not view.flags.owndata
    # the same bytes, seen through a second lease, sit at the same address
    pinned, lease_id = rv.get_pinned(handle)
    assert pinned.array.ctypes.data == view.ctypes.data
    np.testing.assert_array_equal(view, array)
    rv.release(handle, lease_id)
    before = agent_info("node_a")["live_slots"]
    del view, pinned
    deadline = time.monotonic() + 5
    while agent_info("node_a")["live_slots"] >= before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert agent_info("node_a")["live_slots"] == before - 1  # the view's lease freed it


def test_two_consumers_with_ref_handle(velo: None) -> None:
    """ref_handle: two consumers on node b each release once; the slot goes after both."""
    handle = rv.put(np.arange(3 * TEST_CHUNK // 8, dtype=np.int64))
    assert rv.ref_handle(handle) == 2
    first = ray.get(crc_on_b.remote(handle))
    # each consumer's release reaches the owner as a notice after its fetch returned
    wait_for("the first release", lambda: rv.metadata(handle).refcount == 1)
    assert rv.metadata(handle).refcount == 1
    second = ray.get(crc_on_b.remote(handle))
    assert first == second
    wait_until_freed(handle)
    with pytest.raises(rv.HandleNotFound):
        rv.metadata(handle)


def test_pool_returns_to_baseline_after_last_release(velo: None) -> None:
    """Staged and fetched bytes are all given back once every consumer released."""
    base_a, base_b = agent_info("node_a"), agent_info("node_b")
    handles = [rv.put(np.full(2 * MiB, i, dtype=np.uint8)) for i in range(5)]
    assert used_bytes("node_a") > base_a["plain_used_bytes"] + base_a["pinned_used_bytes"]
    ray.get([crc_on_b.remote(h) for h in handles])
    time.sleep(0.3)
    for node, base in (("node_a", base_a), ("node_b", base_b)):
        info = agent_info(node)
        assert info["plain_used_bytes"] == base["plain_used_bytes"], node
        assert info["pinned_used_bytes"] == base["pinned_used_bytes"], node


def test_second_fetch_on_a_node_reuses_the_live_copy(velo: None) -> None:
    """An actor on node b holding a fetched array: a second fetch there pulls nothing."""

    @ray.remote(**ON_B)
    class Holder:
        def hold(self, handle: rv.DataHandle) -> int:
            self.kept = rv.fetch(handle)
            return int(self.kept.ctypes.data)

        def again(self, handle: rv.DataHandle) -> int:
            return int(rv.fetch(handle).ctypes.data)

        def drop(self) -> None:
            del self.kept

    handle = rv.put(np.arange(2 * MiB, dtype=np.uint8))
    rv.ref_handle(handle)
    holder = Holder.remote()
    before = agent_info("node_b")["metrics"]["velo_fetches_total"]
    first = ray.get(holder.hold.remote(handle))
    second = ray.get(holder.again.remote(handle))
    after = agent_info("node_b")["metrics"]["velo_fetches_total"]
    assert first == second  # the same local copy
    assert after.get("cache", 0) == before.get("cache", 0) + 1  # the second fetch
    moved_bytes = sum(after.values()) - sum(before.values())
    assert moved_bytes == 2  # one real transfer (rdma or chunked) plus the cache hit
    with pytest.raises(rv.HandleNotFound):  # both references consumed on the owner
        rv.metadata(handle)
    ray.get(holder.drop.remote())
    ray.kill(holder)


def test_oversized_payload_is_refused_before_allocation(velo: None) -> None:
    """Over staged_payload_max (96 MiB here): refused with both sizes, freed on the owner."""
    big = np.zeros(97 * MiB, dtype=np.uint8)
    handle = rv.put(big)
    del big
    used_before = used_bytes("node_b")
    with pytest.raises(rv.PayloadTooLarge) as info:
        ray.get(fetch_on_b.remote(handle))
    assert str(97 * MiB) in str(info.value) and str(96 * MiB) in str(info.value)
    assert used_bytes("node_b") == used_before
    wait_until_freed(handle, 5)


def test_ttl_frees_an_unfetched_payload(velo: None) -> None:
    handle = rv.put(b"x" * 4096, ttl=0.3)
    assert rv.metadata(handle).size == 4096
    time.sleep(0.6)
    with pytest.raises(rv.HandleNotFound, match="TTL"):
        rv.metadata(handle)


def test_unknown_handle_names_handle_and_node(velo: None) -> None:
    handle = rv.put(b"abc")
    assert ray.get(fetch_on_b.remote(handle)) == b"abc"
    with pytest.raises(rv.HandleNotFound) as info:
        ray.get(fetch_on_b.remote(handle))
    assert str(handle) in str(info.value) and node_ids()["node_a"] in str(info.value)


def test_killed_reader_process_has_its_lease_reaped(velo: None) -> None:
    """A task process on node a holding a zero-copy view dies: its lease is reaped and the
    bytes go. The handle itself ended when the fetch consumed its only reference."""

    @ray.remote(**ON_A)
    class Reader:
        def read(self, handle: rv.DataHandle) -> int:
            self.view = rv.fetch(handle)
            return os.getpid()

    before = agent_info("node_a")["live_slots"]
    handle = rv.put(np.ones(MiB, dtype=np.uint8))
    reader = Reader.remote()
    pid = ray.get(reader.read.remote(handle))
    with pytest.raises(rv.HandleNotFound, match="released by its last consumer"):
        rv.metadata(handle)
    info = agent_info("node_a")
    assert info["live_leases"] >= 1 and info["live_slots"] == before + 1  # the view holds it
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while agent_info("node_a")["live_slots"] > before:
        assert time.monotonic() < deadline, "the dead reader's lease was never reaped"
        time.sleep(0.1)
    assert agent_info("node_a")["counters"]["local_leases_reaped"] >= 1


def test_get_into_a_pinned_writer_and_the_spec_handle_api(velo: None) -> None:
    """get / get_pinned / get_into with leases held until detach or release; a PinnedWriter
    on node b receives the bytes from node a directly; a too-small destination is refused
    and its lease given back."""
    payload = np.arange(3 * MiB, dtype=np.uint8)
    handle = rv.put(payload)
    rv.ref_handle(handle)

    @ray.remote(**ON_B)
    def on_b(h: rv.DataHandle) -> tuple[int, int, bool]:
        writer = rv.alloc_pinned_writer(4 * MiB)
        lease_id = rv.get_into(h, writer)
        got = zlib.crc32(writer.array[: 3 * MiB].tobytes())
        rv.detach(h, lease_id)  # the handle stays usable
        view, lease2 = rv.get(h)
        same = bytes(view) == writer.array[: 3 * MiB].tobytes()
        rv.release(h, lease2)
        writer.close()
        small = bytearray(10)
        try:
            rv.get_into(h, small)
        except ValueError:
            refused = True
        else:
            refused = False
        return got, int(refused), same

    crc, refused, same = ray.get(on_b.remote(handle))
    assert crc == zlib.crc32(payload.tobytes()) and refused == 1 and same
    assert rv.metadata(handle).refcount == 1  # get_into+detach kept it, get+release took one
    rv.release(handle, 0)
