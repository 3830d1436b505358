"""``rv.shutdown()`` on the two-node cluster, in the spec's order: a chunked pull and a GET
admitted before it finish with the right bytes; a consumer stalled inside its GET is bounded
by the shutdown timeout and ends with a clear error; afterwards no segment of the agents is
left in the shm directory, their processes are gone and the driver has no ray_velo thread."""

from __future__ import annotations

import os
import threading
import time
import zlib
from collections.abc import Iterator

import numpy as np
import pytest

import ray_velo as rv
from ray_velo.config import MiB, RdmaConfig

from .conftest import TEST_CONFIG, agent_info, node_ids, pid_alive, restart_agent

ray = pytest.importorskip("ray")

ON_B = {"resources": {"node_b": 1}, "num_cpus": 0}
BOUND_S = 60.0


@ray.remote(**ON_B)
def fetch_crc_on_b(handle: rv.DataHandle, timeout: float) -> int:
    data = rv.fetch(handle, timeout=timeout)
    return zlib.crc32(np.ascontiguousarray(data))


def crc(data: np.ndarray) -> int:
    return zlib.crc32(data)


def eventually(condition: object, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


def segments_of(worker_ids: list[int]) -> list[str]:
    tags = [f"-{w:016x}-" for w in worker_ids]
    return [n for n in os.listdir(TEST_CONFIG.shm_dir) if any(t in n for t in tags)]


@pytest.fixture()
def fresh_agents(cluster: object) -> Iterator[None]:
    """Both agents restarted for one test; ray_velo restarted as the other tests expect."""
    yield
    rv.init(TEST_CONFIG)


def restart_both(shutdown_timeout: float) -> None:
    config = TEST_CONFIG.replace(rdma=RdmaConfig(
        rendezvous=TEST_CONFIG.rdma.rendezvous, shutdown_timeout=shutdown_timeout,
    ))  # fmt: skip
    rv.init(config)
    for node in ("node_a", "node_b"):
        restart_agent(node, config)


def agent_of(node: str) -> object:
    from ray_velo.actors import find_agent

    return find_agent(node_ids()[node])


def ended_cleanly(infos: dict[str, dict[str, object]]) -> None:
    """The agents' processes are gone, their segments too, and no ray_velo thread is left."""
    pids = [int(i["pid"]) for i in infos.values()]  # type: ignore[call-overload]
    deadline = time.monotonic() + BOUND_S
    while any(pid_alive(p) for p in pids):
        assert time.monotonic() < deadline, f"agent processes {pids} outlived shutdown"
        time.sleep(0.05)
    assert segments_of([int(i["worker_id"]) for i in infos.values()]) == []  # type: ignore[call-overload]
    threads = [t.name for t in threading.enumerate() if t.name.startswith("ray_velo")]
    assert threads == []


def test_a_pull_and_a_get_admitted_before_shutdown_finish_with_their_bytes(
    fresh_agents: None,
) -> None:
    restart_both(shutdown_timeout=30.0)
    # slow enough that both transfers are in flight at once even when the second task's
    # worker starts seconds after the first (40 chunks, 4 at a time: 2.5 s)
    ray.get(agent_of("node_a").inject_fault.remote("slow_pulls_s", 0.25))
    # the consumer holds its RDMA lease this long before its GET: the GET is in flight
    ray.get(agent_of("node_b").inject_fault.remote("stall_before_get_s", 4.0))
    plain = np.random.default_rng(1).integers(0, 255, 40 * MiB, dtype=np.uint8)
    pinned = np.random.default_rng(2).integers(0, 255, 8 * MiB, dtype=np.uint8)
    chunked_ref = fetch_crc_on_b.remote(rv.register_data(plain), 120.0)  # plain: chunked
    get_ref = fetch_crc_on_b.remote(rv.put(pinned), 120.0)  # pinned: RDMA
    eventually(lambda: agent_info("node_a")["live_leases"] >= 2, "both transfers admitted")
    infos = {n: agent_info(n) for n in ("node_a", "node_b")}

    reports = rv.shutdown(stop_ray=False)

    owner = reports[node_ids()["node_a"]]
    assert owner["pulls_at_gate"] == 1 and owner["gets_at_gate"] == 1, owner
    assert owner["demoted"] == 1  # the pinned payload was copied to plain memory
    assert owner["gets_drained"] == 1 and owner["pulls_drained"] == 1, owner
    assert reports[node_ids()["node_b"]]["fetches_at_gate"] == 2
    assert ray.get(chunked_ref, timeout=BOUND_S) == crc(plain)
    assert ray.get(get_ref, timeout=BOUND_S) == crc(pinned)
    ended_cleanly(infos)


def test_a_consumer_stalled_in_its_get_is_bounded_by_the_shutdown_timeout(
    fresh_agents: None,
) -> None:
    restart_both(shutdown_timeout=2.0)
    ray.get(agent_of("node_b").inject_fault.remote("stall_before_get_s", 600.0))
    ref = fetch_crc_on_b.remote(rv.put(np.ones(4 * MiB, dtype=np.uint8)), 300.0)
    eventually(lambda: agent_info("node_a")["live_leases"] >= 1, "the RDMA lease granted")
    infos = {n: agent_info(n) for n in ("node_a", "node_b")}

    started = time.monotonic()
    reports = rv.shutdown(stop_ray=False)
    assert time.monotonic() - started < 20.0  # two 2 s drains at once, and the kills

    assert reports[node_ids()["node_a"]]["gets_drained"] == 0
    assert reports[node_ids()["node_b"]]["gets_drained"] == 0
    with pytest.raises(rv.VeloError):  # a clear error, never wrong bytes
        ray.get(ref, timeout=BOUND_S)
    ended_cleanly(infos)
