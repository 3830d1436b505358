"""The control plane off Ray's call path, on a real two-node cluster: a process's waited-for
calls go over its agent's Unix socket, an agent's acquire to another node's owner over the
owner's TCP wire, and an agent without either (an older version, or turned off) is still
reached with Ray calls, the bytes the same either way."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
import ray

import ray_velo as rv
from ray_velo.actors.directory import ensure_agent
from ray_velo.config import MiB
from ray_velo.local.channel import DISABLE_ENV
from ray_velo.wire.server import WIRE_DISABLE_ENV
from tests.on_ray.conftest import agent_info, node_ids, restart_agent

pytestmark = [pytest.mark.ray, pytest.mark.multinode]

ON_B = {"resources": {"node_b": 1}, "num_cpus": 0}


@ray.remote(**ON_B)
def crc_on_b(handle: rv.DataHandle) -> int:
    return zlib.crc32(np.ascontiguousarray(rv.fetch(handle)))


@ray.remote(**ON_B)
def put_and_read_on_b(nbytes: int) -> tuple[int, int]:
    payload = np.arange(nbytes, dtype=np.uint8)
    return zlib.crc32(payload), zlib.crc32(np.ascontiguousarray(rv.fetch(rv.put(payload))))


def pattern(nbytes: int, seed: int = 7) -> np.ndarray:
    return ((np.arange(nbytes, dtype=np.uint64) * 131 + seed) % 251).astype(np.uint8)


def counts() -> dict[str, tuple[int, int]]:
    infos = {n: agent_info(n) for n in ("node_a", "node_b")}
    return {n: (i["socket_calls"], i["wire_calls"]) for n, i in infos.items()}


def test_waited_for_calls_take_the_socket_and_the_wire(velo: None) -> None:
    """A put on node a and a fetch on node b: the reservation and the fetch are socket
    calls to each node's own agent, node b's acquire a TCP call to node a's agent."""
    assert all(agent_info(n)["socket"] and agent_info(n)["wire"] for n in ("node_a", "node_b"))
    before = counts()
    payload = pattern(2 * MiB)
    handle = rv.put(payload)
    assert ray.get(crc_on_b.remote(handle)) == zlib.crc32(payload)
    after = counts()
    assert after["node_a"][0] > before["node_a"][0], (before, after)  # the reservation
    assert after["node_b"][0] > before["node_b"][0], (before, after)  # the fetch
    assert after["node_a"][1] > before["node_a"][1], (before, after)  # the acquire


def test_an_owner_without_the_wire_is_called_with_ray(velo: None) -> None:
    """Version skew: an owner that publishes no TCP wire (an older agent) is asked with Ray
    calls, and answers the same."""
    restart_agent("node_a", env={WIRE_DISABLE_ENV: "1"})
    try:
        assert agent_info("node_a")["wire"] == ""
        payloads = [pattern(MiB, seed) for seed in range(3)]
        handles = [rv.put(p) for p in payloads]
        assert ray.get([crc_on_b.remote(h) for h in handles]) == [zlib.crc32(p) for p in payloads]
        assert agent_info("node_a")["wire_calls"] == 0
    finally:
        restart_agent("node_a")


def test_a_node_whose_agent_serves_no_socket_uses_ray_calls(velo: None) -> None:
    """An agent with its socket off: its node's processes put and fetch with Ray calls,
    from their own node and from another."""
    restart_agent("node_b", env={DISABLE_ENV: "1"})
    try:
        assert agent_info("node_b")["socket"] == ""
        written, read = ray.get(put_and_read_on_b.remote(3 * MiB))
        assert written == read
        payload = pattern(MiB)
        assert ray.get(crc_on_b.remote(rv.put(payload))) == zlib.crc32(payload)
        assert agent_info("node_b")["socket_calls"] == 0
    finally:
        restart_agent("node_b")


def test_an_owner_agent_that_dies_fails_the_wire_as_owner_died(velo: None) -> None:
    """The owner's agent is gone after node b's link to it was opened: the fetch over the
    dead TCP link says the owner died (its payloads died with it), and a payload of the
    node's next agent is fetched over a fresh link."""
    first = rv.put(pattern(MiB))
    assert ray.get(crc_on_b.remote(first)) == zlib.crc32(pattern(MiB))  # the link is open
    doomed = rv.put(pattern(MiB, 2))
    old_pid = agent_info("node_a")["pid"]
    restart_agent("node_a")
    assert agent_info("node_a")["pid"] != old_pid and os.getpid() != old_pid
    with pytest.raises((rv.OwnerDied, rv.HandleNotFound)):
        ray.get(crc_on_b.remote(doomed))
    fresh = rv.put(pattern(MiB, 3))
    assert ray.get(crc_on_b.remote(fresh)) == zlib.crc32(pattern(MiB, 3))
    assert node_ids()["node_a"]


@ray.remote(**ON_B)
class Reader:
    def ready(self) -> bool:
        return True

    def crc(self, handle: rv.DataHandle) -> int:
        return zlib.crc32(np.ascontiguousarray(rv.fetch(handle)))


def fetches_on(node: str) -> dict[str, int]:
    return dict(agent_info(node)["metrics"]["velo_fetches_total"])


def test_three_tasks_taking_one_payload_at_once_move_its_bytes_once(velo: None) -> None:
    """One 32 MiB payload for three consumers (consumers=3), three actors on node b fetching
    it at the same moment: one GET crosses to node b (held back 1 s, so the three overlap),
    the other two read its node-local copy; every actor gets the right bytes, and the
    handle is gone after the third."""
    agent_b = ensure_agent(node_ids()["node_b"])
    readers = [Reader.remote() for _ in range(3)]
    ray.get([r.ready.remote() for r in readers])  # their processes are up before the fetch
    payload = pattern(32 * MiB, 5)
    handle = rv.put(payload)
    rv.ref_handle(handle)
    rv.ref_handle(handle)  # three references: consumers=3
    before = fetches_on("node_b")
    ray.get(agent_b.inject_fault.remote("stall_before_get_s", 1.0))
    try:
        crcs = ray.get([r.crc.remote(handle) for r in readers], timeout=120)
    finally:
        ray.get(agent_b.inject_fault.remote("stall_before_get_s", 0.0))
    assert crcs == [zlib.crc32(payload)] * 3
    after = fetches_on("node_b")
    moved = {path: after.get(path, 0) - before.get(path, 0) for path in after}
    assert sum(moved.get(path, 0) for path in ("rdma", "wire", "chunked")) == 1, moved
    assert moved.get("cache", 0) == 2, moved
    with pytest.raises(rv.HandleNotFound):
        rv.metadata(handle)
    for reader in readers:
        ray.kill(reader)
