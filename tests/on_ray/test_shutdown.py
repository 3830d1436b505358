"""``rv.shutdown()`` on the two-node cluster, in the spec's order: a chunked pull and a GET
(UCX allowed over TCP), or a read over the wire (the default), admitted before it finish
with the right bytes; a consumer stalled inside its GET or read is bounded by the shutdown
timeout and ends with a clear error; afterwards no segment of the agents is left in the shm
directory, their processes are gone and the driver has no ray_velo thread."""

from __future__ import annotations

import os
import threading
import time
import zlib
from collections.abc import Iterator

import numpy as np
import pytest

import ray_velo as rv
from ray_velo.config import MiB, RdmaConfig, UcxConfig
from ray_velo.wire.server import WIRE_DISABLE_ENV

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


def restart_both(
    shutdown_timeout: float, ucx_tcp: bool = False, owner_env: dict[str, str] | None = None
) -> None:
    """Both agents with ``shutdown_timeout``; ``ucx_tcp``: UCX allowed over TCP (the
    operator's opt-in); ``owner_env``: node a's agent's environment."""
    config = TEST_CONFIG.replace(
        rdma=RdmaConfig(
            rendezvous=TEST_CONFIG.rdma.rendezvous,
            shutdown_timeout=shutdown_timeout,
            ucx=UcxConfig(tcp=ucx_tcp),
        )
    )
    rv.init(config)
    restart_agent("node_a", config, env=owner_env)
    restart_agent("node_b", config)


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
    """UCX allowed over TCP and node a serving no wire (an operator closed it): its pinned
    payload moves by a GET, its plain one by chunks; both admitted before the shutdown
    finish."""
    restart_both(shutdown_timeout=30.0, ucx_tcp=True, owner_env={WIRE_DISABLE_ENV: "1"})
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


def test_a_read_over_the_wire_admitted_before_shutdown_finishes_with_its_bytes(
    fresh_agents: None,
) -> None:
    """The default (the owner sends the bytes over the wire): node b's read waits 4 s under
    its wire lease when the shutdown begins; node a drains it before it closes its bulk
    port, and node b gets every byte."""
    restart_both(shutdown_timeout=30.0)
    ray.get(agent_of("node_b").inject_fault.remote("stall_before_get_s", 4.0))
    payload = np.random.default_rng(3).integers(0, 255, 8 * MiB, dtype=np.uint8)
    ref = fetch_crc_on_b.remote(rv.put(payload), 120.0)
    eventually(lambda: agent_info("node_a")["live_leases"] >= 1, "the wire lease granted")
    infos = {n: agent_info(n) for n in ("node_a", "node_b")}

    reports = rv.shutdown(stop_ray=False)

    owner = reports[node_ids()["node_a"]]
    assert owner["reads_at_gate"] == 1 and owner["gets_drained"] == 1, owner
    assert ray.get(ref, timeout=BOUND_S) == crc(payload)
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
