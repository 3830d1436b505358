"""Faults on a real two-node cluster: dead owners, stalled owners, regions torn down."""

from __future__ import annotations

import os
import signal
import time
import zlib

import numpy as np
import pytest
import ray

import ray_velo as rv
from ray_velo.actors import ensure_agent
from ray_velo.config import MiB
from tests.on_ray.conftest import (
    TEST_CONFIG,
    agent_info,
    node_ids,
    pid_alive,
    stop_agent,
    wait_until_freed,
)

pytestmark = [pytest.mark.ray, pytest.mark.multinode]

ON_B = {"resources": {"node_b": 1}, "num_cpus": 0}


def used_bytes(node: str) -> int:
    info = agent_info(node)
    return int(info["plain_used_bytes"] + info["pinned_used_bytes"])


@ray.remote(**ON_B)
def fetch_crc_on_b(handle: rv.DataHandle, timeout: float | None = None) -> int:
    data = rv.fetch(handle, timeout=timeout)
    return zlib.crc32(data if isinstance(data, bytes) else np.ascontiguousarray(data))


def test_stalled_owner_times_out_within_the_callers_bound(velo: None) -> None:
    """The owner's agent stops answering (SIGSTOP): the fetch fails with TransferTimeout
    naming the bound, close to it, and works again once the owner resumes. What the
    abandoned fetch leaves ends on the owner: its lease's deadline if the acquire ran, or
    the TTL if it never did (the spec's two bounds)."""
    handle = rv.put(np.arange(MiB, dtype=np.uint8), ttl=15.0)
    rv.ref_handle(handle)
    owner_pid = agent_info("node_a")["pid"]
    os.kill(owner_pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(rv.TransferTimeout) as info:
            ray.get(fetch_crc_on_b.remote(handle, timeout=1.0))
        elapsed = time.monotonic() - started
    finally:
        os.kill(owner_pid, signal.SIGCONT)
    assert "1.0 s" in str(info.value) and "caller timeout" in str(info.value)
    assert elapsed < 8.0
    # the abandoned fetch's lease expires on the owner (a chunked lease at lease_ms, an RDMA
    # lease at lease_timeout, 2 s here); the second reference still reads the payload
    assert ray.get(fetch_crc_on_b.remote(handle)) == zlib.crc32(np.arange(MiB, dtype=np.uint8))
    wait_until_freed(handle, 25)


def test_caller_owned_region_stages_without_copy_and_drains(velo: None) -> None:
    """register_data_in_region: consumers read the range; unregister waits for live slots
    up to its timeout, then releases the memory."""
    guard = rv.alloc_region(3 * MiB)
    guard.array[:] = np.arange(3 * MiB, dtype=np.uint64).astype(np.uint8)
    handle = rv.register_data_in_region(guard, MiB, 2 * MiB + 5)
    expected = zlib.crc32(guard.array[MiB : 2 * MiB + 5].tobytes())
    assert rv.metadata(handle).size == MiB + 5
    rv.ref_handle(handle)
    assert ray.get(fetch_crc_on_b.remote(handle)) == expected
    local = rv.fetch(handle, release=False)  # same node: a copy, never the caller's memory
    assert zlib.crc32(np.ascontiguousarray(local)) == expected
    local[0:1]
    del local
    started = time.monotonic()
    assert guard.unregister(timeout_s=0.3) == "drain_timed_out"  # one reference still staged
    assert time.monotonic() - started >= 0.3
    assert guard.deregistered().wait(5.0)
    with pytest.raises(rv.HandleNotFound, match="region was unregistered"):
        ray.get(fetch_crc_on_b.remote(handle))


def test_region_without_slots_drains_at_once(velo: None) -> None:
    guard = rv.alloc_region(MiB)
    handle = rv.register_data_in_region(guard, 0, 100)
    assert ray.get(fetch_crc_on_b.remote(handle)) == zlib.crc32(bytes(100))
    assert guard.unregister(timeout_s=5.0) == "drained"
    with pytest.raises(rv.RegionDeregistered):
        rv.register_data_in_region(guard, 0, 10)


def test_owner_killed_mid_pull_gives_owner_died_and_consumer_keeps_serving(velo: None) -> None:
    """The owner's agent dies while node b pulls: OwnerDied naming the node, within the
    bound; node b's agent keeps serving, and node a gets a fresh agent on next use."""
    node_a = node_ids()["node_a"]
    handle = rv.register_data(np.ones(90 * MiB, dtype=np.uint8))  # plain memory: chunked
    used_before = used_bytes("node_b")
    ref = fetch_crc_on_b.remote(handle, timeout=60.0)
    deadline = time.monotonic() + 30
    while used_bytes("node_b") == used_before:  # the pull has begun
        assert time.monotonic() < deadline, "the fetch never started"
        time.sleep(0.005)
    os.kill(agent_info("node_a")["pid"], signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(rv.OwnerDied) as info:
        ray.get(ref)
    assert time.monotonic() - started < 30
    assert node_a in str(info.value)
    # node b's agent is alive and freed the half-filled copy
    assert used_bytes("node_b") == used_before
    # node a: the driver's next put stages on a fresh agent; everything works again
    payload = np.arange(2 * MiB, dtype=np.uint8)
    assert ray.get(fetch_crc_on_b.remote(rv.put(payload))) == zlib.crc32(payload)
    assert ensure_agent(node_a) is not None


def test_concurrent_first_use_on_a_node_creates_one_agent(velo: None) -> None:
    """Node b's agent is gone; eight tasks there stage at the same moment: exactly one new
    agent comes up (get_if_exists is atomic in Ray's GCS) and all eight use it."""
    from ray_velo.actors.directory import register_all_peers

    stop_agent(node_ids()["node_b"])

    @ray.remote(**ON_B)
    def stage(i: int) -> rv.DataHandle:
        return rv.put(np.full(1024, i, dtype=np.uint8))

    handles = ray.get([stage.remote(i) for i in range(8)])
    assert len({h.worker_id for h in handles}) == 1
    assert agent_info("node_b")["worker_id"] == handles[0].worker_id
    for handle in handles:
        rv.release(handle, 0)
    register_all_peers()


def test_get_of_a_region_slot_on_its_own_node_holds_a_real_lease(velo: None) -> None:
    """get() on the region's node reads a copy (never the caller's memory) and hands back
    the region slot's own lease id, which detach then ends."""
    guard = rv.alloc_region(MiB)
    guard.array[:] = 9
    handle = rv.register_data_in_region(guard, 0, 4096)
    view, lease_id = rv.get(handle)
    assert bytes(view) == b"\x09" * 4096 and lease_id != 0
    rv.detach(handle, lease_id)
    assert rv.metadata(handle).refcount == 1
    rv.release(handle, 0)
    assert guard.unregister(timeout_s=5.0) == "drained"


def _wait(condition: object, what: str, bound_s: float = 30.0) -> None:
    deadline = time.monotonic() + bound_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"never happened within {bound_s} s: {what}"
        time.sleep(0.01)


def test_owner_killed_mid_get_gives_owner_died(velo: None) -> None:
    """Node a's agent dies while node b holds an RDMA lease and is about to GET: the fetch
    ends with OwnerDied naming node a within its bound, and node b keeps nothing of it."""
    node_a = node_ids()["node_a"]
    agent_b = ensure_agent(node_ids()["node_b"])
    used_before = used_bytes("node_b")
    ray.get(agent_b.inject_fault.remote("stall_before_get_s", 2.0))
    try:
        ref = fetch_crc_on_b.remote(rv.put(np.ones(4 * MiB, dtype=np.uint8)), 60.0)
        _wait(lambda: agent_info("node_a")["live_leases"] >= 1, "the RDMA lease granted")
        os.kill(agent_info("node_a")["pid"], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(rv.OwnerDied) as info:
            ray.get(ref, timeout=90)
        assert time.monotonic() - started < 30
        assert node_a in str(info.value)
    finally:
        ray.get(agent_b.inject_fault.remote("stall_before_get_s", 0.0))
    _wait(lambda: used_bytes("node_b") == used_before, "node b freed the GET's destination")
    assert agent_info("node_b")["live_leases"] == 0


@ray.remote(num_cpus=0, resources={"node_c": 1})
def _stage_on_c(nbytes: int) -> rv.DataHandle:
    return rv.register_data(np.ones(nbytes, dtype=np.uint8))  # plain memory: chunked


def test_a_node_removed_mid_pull_gives_owner_died_and_leaks_nothing(
    velo: None, cluster: object, node_c: str
) -> None:
    """The owner's whole node leaves the cluster while node b pulls from it: OwnerDied within
    the bound, node b frees what it had filled, and the segments the dead agent could not
    unlink are removed by cleanup (the node's processes are gone)."""
    from ray_velo.actors import find_agent
    from ray_velo.ops import cleanup_local

    handle = ray.get(_stage_on_c.remote(48 * MiB))
    agent_c = find_agent(node_c)
    ray.get(agent_c.inject_fault.remote("slow_pulls_s", 0.05))
    pid_c = ray.get(agent_c.info.remote())["pid"]
    used_before = used_bytes("node_b")
    ref = fetch_crc_on_b.remote(handle, 120.0)
    _wait(lambda: used_bytes("node_b") > used_before, "the pull began")
    node = next(n for n in cluster.worker_nodes if n.node_id == node_c)  # type: ignore[attr-defined]
    cluster.remove_node(node)  # type: ignore[attr-defined]
    started = time.monotonic()
    with pytest.raises(rv.OwnerDied) as info:
        ray.get(ref, timeout=90)
    assert time.monotonic() - started < 45
    assert node_c in str(info.value)
    _wait(lambda: used_bytes("node_b") == used_before, "node b freed the half-filled copy")
    _wait(lambda: not pid_alive(pid_c), "node c's agent process ended")
    removed = cleanup_local(TEST_CONFIG.shm_dir).removed
    assert all(f"ray_velo-{pid_c}-" not in n for n in os.listdir(TEST_CONFIG.shm_dir))
    assert any(f"/ray_velo-{pid_c}-" in path for path, _ in removed)


def test_an_agent_restarted_ends_its_old_handles_naming_the_restart(velo: None) -> None:
    """Node a's agent is replaced: a handle the old one issued gives HandleNotFound saying
    its owner restarted, from a fetch on another node and from the driver; new handles work."""
    from tests.on_ray.conftest import restart_agent

    handle = rv.put(np.ones(MiB, dtype=np.uint8))
    restart_agent("node_a")
    with pytest.raises(rv.HandleNotFound, match="restarted"):
        ray.get(fetch_crc_on_b.remote(handle, 30.0))
    with pytest.raises(rv.HandleNotFound, match="restarted"):
        rv.metadata(handle)
    fresh = np.arange(MiB, dtype=np.uint8)
    assert ray.get(fetch_crc_on_b.remote(rv.put(fresh), 30.0)) == zlib.crc32(fresh)


@ray.remote(max_retries=0, **ON_B)
def _put_then_die(nbytes: int, ttl: float) -> None:
    handle = rv.put(np.ones(nbytes, dtype=np.uint8), ttl=ttl)
    rv.metadata(handle)  # a round trip after the put's commit, which put does not wait for
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_producer_killed_after_put_has_its_payload_freed_by_the_ttl(velo: None) -> None:
    """The task that staged a payload dies before handing its handle to anyone: nobody can
    release it, so its TTL frees it on the owner (node b), within TTL + the timer's slack."""
    before = agent_info("node_b")["counters"]
    with pytest.raises(ray.exceptions.WorkerCrashedError):
        ray.get(_put_then_die.remote(3 * MiB, 2.0), timeout=60)
    after_put = agent_info("node_b")["counters"]
    assert after_put["slots_staged"] == before["slots_staged"] + 1
    _wait(
        lambda: agent_info("node_b")["counters"]["slots_expired"] == before["slots_expired"] + 1,
        "the TTL freed the payload",
        bound_s=15.0,
    )
    counters = agent_info("node_b")["counters"]
    assert counters["slots_freed"] == before["slots_freed"] + 1
