"""The RDMA path between two agents on a real two-node cluster: UCX over cma and tcp here,
which an operator allows on a network they trust (``UcxConfig(tcp=True)``, as
``VELO_UCX_TCP=1``): this module's agents are started so, and the suite's default agents
(UCX closed, payloads over the wire) are back after it."""

from __future__ import annotations

import dataclasses
import os
import time
import zlib
from collections.abc import Iterator

import numpy as np
import pytest
import ray

import ray_velo as rv
from ray_velo.actors.directory import ensure_agent
from ray_velo.client import session
from ray_velo.config import MiB, RdmaConfig, UcxConfig
from ray_velo.ucx.loader import ucx_available
from tests.on_ray.conftest import (
    TEST_CONFIG,
    agent_info,
    moved,
    node_ids,
    path_counts,
    restart_agent,
)

pytestmark = [pytest.mark.ray, pytest.mark.multinode, pytest.mark.ucx]

if not ucx_available()[0]:
    pytest.skip(f"UCX unavailable: {ucx_available()[1]}", allow_module_level=True)

ON_B = {"resources": {"node_b": 1}, "num_cpus": 0}
#: The suite's config with UCX allowed over TCP: the opt-in for a trusted network.
TCP_CONFIG = dataclasses.replace(
    TEST_CONFIG,
    rdma=dataclasses.replace(
        TEST_CONFIG.rdma, ucx=dataclasses.replace(TEST_CONFIG.rdma.ucx, tcp=True)
    ),
)


@pytest.fixture(scope="module", autouse=True)
def ucx_over_tcp(cluster: object) -> Iterator[None]:
    """Both nodes' agents with UCX allowed over TCP for this module; the suite's after."""
    for node in ("node_a", "node_b"):
        restart_agent(node, TCP_CONFIG)
    assert all(agent_info(n)["rdma"] for n in ("node_a", "node_b"))
    yield
    for node in ("node_a", "node_b"):
        restart_agent(node, TEST_CONFIG)


@ray.remote(**ON_B)
def crc_on_b(handle: rv.DataHandle) -> int:
    data = rv.fetch(handle)
    return zlib.crc32(data if isinstance(data, bytes) else np.ascontiguousarray(data))


def pattern(nbytes: int) -> np.ndarray:
    return (np.arange(nbytes, dtype=np.uint64) * 2654435761 % 251).astype(np.uint8)


def test_cross_node_fetch_takes_the_rdma_path(velo: None) -> None:
    """64 MiB staged pinned on node a, fetched on node b: one GET, proved by the
    consumer's path="rdma",reason="ok" counter and the owner's ok; bytes verified."""
    payload = pattern(64 * MiB)
    a0, b0 = path_counts("node_a"), path_counts("node_b")
    handle = rv.put(payload)
    assert rv.metadata(handle).pinned
    assert ray.get(crc_on_b.remote(handle)) == zlib.crc32(payload)
    assert moved(b0, path_counts("node_b")) == {"rdma/ok": 1}
    assert moved(a0, path_counts("node_a")) == {"rdma/ok": 1}
    metrics = agent_info("node_b")["metrics"]
    assert metrics["velo_rendezvous_rdma_get_duration_seconds"]["count"] >= 1
    assert agent_info("node_a")["metrics"]["velo_rdma_registered_bytes"] > 0


def test_payload_below_rdma_min_bytes_answers_chunked(velo: None) -> None:
    """A 32 KiB pinned slot is under rdma_min_bytes (64 KiB): the owner says below_min."""
    payload = pattern(32 * 1024)
    a0 = path_counts("node_a")
    handle = rv.put(payload)
    assert ray.get(crc_on_b.remote(handle)) == zlib.crc32(payload)
    assert moved(a0, path_counts("node_a")) == {"chunked/below_min": 1}


def test_plain_memory_goes_over_the_wire_not_by_a_get(velo: None) -> None:
    """A slot in plain memory has no descriptor (the RDMA checks say not_pinned); the
    consumer offered the wire too, so the owner sends it: nothing to register."""
    payload = pattern(MiB)
    a0 = path_counts("node_a")
    handle = rv.register_data(payload)
    assert not rv.metadata(handle).pinned
    assert ray.get(crc_on_b.remote(handle)) == zlib.crc32(payload)
    assert moved(a0, path_counts("node_a")) == {"wire/ok": 1}


def test_corrupt_descriptor_falls_back_to_chunks_exactly_once(velo: None) -> None:
    """The owner's descriptor has a trailing byte: the consumer records decode_error,
    detaches, acquires once more with no offer (owner: no_offer) and pulls chunks."""
    payload = pattern(4 * MiB)
    handle = rv.put(payload)
    owner = session.current().agent
    ray.get(owner.inject_fault.remote("corrupt_descriptors", 1))
    a0, b0 = path_counts("node_a"), path_counts("node_b")
    assert ray.get(crc_on_b.remote(handle)) == zlib.crc32(payload)
    assert moved(b0, path_counts("node_b")) == {"chunked/decode_error": 1}
    assert moved(a0, path_counts("node_a")) == {"rdma/ok": 1, "chunked/no_offer": 1}


@ray.remote(max_restarts=0, max_task_retries=0, **ON_B)
class Fetcher:
    def pid(self) -> int:
        return os.getpid()

    def crc(self, handle: rv.DataHandle) -> int:
        return zlib.crc32(np.ascontiguousarray(rv.fetch(handle)))


def _wait_for_a_lease() -> None:
    deadline = time.monotonic() + 20
    while agent_info("node_a")["live_leases"] == 0:  # the RDMA lease is granted
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.3)  # a renewal or two go out


def test_consumer_agent_killed_mid_get_has_its_lease_reaped(velo: None) -> None:
    """Node b's agent and the fetching actor die while the agent holds an RDMA lease, and
    nothing retries: node a's reaper force-releases the lease between 1 and 1.5 lease
    timeouts (2 s here) after the last renewal; the consuming fetch's reference goes with
    it."""
    lease_timeout = TCP_CONFIG.rdma.rendezvous.lease_timeout
    ray.get(ensure_agent(node_ids()["node_b"]).inject_fault.remote("stall_before_get_s", 60.0))
    fetcher = Fetcher.remote()
    fetcher_pid = ray.get(fetcher.pid.remote())
    handle = rv.put(pattern(MiB))
    reaped0 = agent_info("node_a")["metrics"]["velo_rendezvous_rdma_leases_reaped_total"]
    fetcher.crc.remote(handle)
    _wait_for_a_lease()
    os.kill(fetcher_pid, 9)
    os.kill(agent_info("node_b")["pid"], 9)
    killed = time.monotonic()
    while agent_info("node_a")["metrics"]["velo_rendezvous_rdma_leases_reaped_total"] == reaped0:
        assert time.monotonic() - killed < 5 * lease_timeout, "lease never reaped"
        time.sleep(0.02)
    elapsed = time.monotonic() - killed
    # the last renewal went out at most lease_timeout/2 before the kill
    assert 0.5 * lease_timeout - 0.2 <= elapsed <= 1.5 * lease_timeout + 0.3
    with pytest.raises(rv.HandleNotFound, match="reaped"):
        rv.metadata(handle)
    restart_agent("node_b", TCP_CONFIG)  # node b's next agent


def test_consumer_agent_restarted_mid_get_supersedes_its_old_lease(velo: None) -> None:
    """Node b's agent dies mid-GET and the fetching task retries on node b's fresh agent:
    the owner ends the dead incarnation's lease at the new one's first acquire (giving its
    claim back), so the retry gets the single-use payload, byte-exact.

    The owner's leases last 30 s here: the supersede must come before the reaper, and a
    fresh agent's start on this 2-core machine can take longer than the suite's 2 s."""
    patient = dataclasses.replace(
        TCP_CONFIG,
        rdma=dataclasses.replace(
            TCP_CONFIG.rdma,
            rendezvous=dataclasses.replace(TCP_CONFIG.rdma.rendezvous, lease_timeout=30.0),
        ),
    )
    restart_agent("node_a", config=patient)
    try:
        ray.get(ensure_agent(node_ids()["node_b"]).inject_fault.remote("stall_before_get_s", 60.0))
        handle = rv.put(pattern(MiB))
        before = agent_info("node_a")["counters"]["leases_superseded"]
        ref = crc_on_b.remote(handle)
        _wait_for_a_lease()
        os.kill(agent_info("node_b")["pid"], 9)
        # the retry's fresh agent (the cluster's config: UCX closed) reads over the wire
        assert ray.get(ref, timeout=60) == zlib.crc32(pattern(MiB))
        assert agent_info("node_a")["counters"]["leases_superseded"] == before + 1
        with pytest.raises(rv.HandleNotFound, match="released by its last consumer"):
            rv.metadata(handle)
    finally:
        restart_agent("node_a", TCP_CONFIG)
        restart_agent("node_b", TCP_CONFIG)


def test_owner_kill_switch_serves_no_get(velo: None) -> None:
    """VELO_RDMA_RENDEZVOUS_DISABLE=1 on the owner: it stages pinned requests in plain
    memory (kill_switch at staging) and answers no acquire with a descriptor; the kill
    switch is the RDMA path's, so the bytes cross over the wire (chunks where that is off
    too)."""
    restart_agent("node_a", TCP_CONFIG, env={"VELO_RDMA_RENDEZVOUS_DISABLE": "1"})
    try:
        payload = pattern(4 * MiB)
        a0, b0 = path_counts("node_a"), path_counts("node_b")
        handle = rv.put(payload)
        assert not rv.metadata(handle).pinned
        assert ray.get(crc_on_b.remote(handle)) == zlib.crc32(payload)
        assert moved(a0, path_counts("node_a")) == {"chunked/kill_switch": 1, "wire/ok": 1}
        assert moved(b0, path_counts("node_b")) == {"wire/ok": 1}
    finally:
        restart_agent("node_a", TCP_CONFIG)


def test_a_consumer_without_ucx_reads_over_the_wire(velo: None) -> None:
    """A consumer node without UCX (simulated by config) offers no GET, only the wire: the
    owner sends the bytes over it."""
    no_ucx = dataclasses.replace(
        TCP_CONFIG, rdma=dataclasses.replace(TCP_CONFIG.rdma, ucx=UcxConfig(enabled=False))
    )
    assert isinstance(no_ucx.rdma, RdmaConfig)
    restart_agent("node_b", config=no_ucx)
    try:
        assert agent_info("node_b")["rdma"] is False
        payload = pattern(4 * MiB)
        a0, b0 = path_counts("node_a"), path_counts("node_b")
        handle = rv.put(payload)
        assert ray.get(crc_on_b.remote(handle)) == zlib.crc32(payload)
        assert moved(b0, path_counts("node_b")) == {"wire/ok": 1}
        assert moved(a0, path_counts("node_a")) == {"wire/ok": 1}
    finally:
        restart_agent("node_b", TCP_CONFIG)


def test_idle_agents_burn_almost_no_cpu(velo: None) -> None:
    """With nothing to do, what each agent spends beyond Ray's own worker runtime (a bare
    actor on the same node, measured in the same 10 s) is < 1% of a core: the UCX progress
    thread sleeps in poll(), the ticker waits on a condition."""

    @ray.remote(num_cpus=0)
    class Bare:
        def pid(self) -> int:
            return os.getpid()

    nodes = ("node_a", "node_b")
    bares = [Bare.options(resources={n: 1}).remote() for n in nodes]  # type: ignore[attr-defined]
    pids = [
        (agent_info(n)["pid"], ray.get(b.pid.remote())) for n, b in zip(nodes, bares, strict=True)
    ]

    def cpu_seconds(pid: int) -> float:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    time.sleep(1)  # let the bare actors settle after their first call
    start = [(cpu_seconds(a), cpu_seconds(b)) for a, b in pids]
    time.sleep(10)
    used = [
        (cpu_seconds(a) - a0, cpu_seconds(b) - b0)
        for (a, b), (a0, b0) in zip(pids, start, strict=True)
    ]
    for bare in bares:
        ray.kill(bare)
    extra = [agent - bare for agent, bare in used]
    assert all(e < 0.1 for e in extra), f"(agent, bare actor) CPU seconds over 10 s: {used}"


def test_idle_endpoint_reaper_closes_unused_endpoints(velo: None) -> None:
    """ep_idle_timeout (0.5 s, the floor): after a GET the consumer's endpoint to the owner
    closes within timeout + scan period + slack; the next fetch wires up a new one."""
    reaping = dataclasses.replace(
        TCP_CONFIG,
        rdma=dataclasses.replace(TCP_CONFIG.rdma, ucx=UcxConfig(ep_idle_timeout=0.1, tcp=True)),
    )
    assert reaping.rdma.ucx.ep_idle_timeout == 0.5  # raised to the floor
    restart_agent("node_b", config=reaping)
    try:
        payload = pattern(MiB)
        b0 = path_counts("node_b")
        assert ray.get(crc_on_b.remote(rv.put(payload))) == zlib.crc32(payload)
        assert moved(b0, path_counts("node_b")) == {"rdma/ok": 1}
        closed_after = None
        started = time.monotonic()
        while time.monotonic() - started < 5:
            if agent_info("node_b")["ucx_endpoints"] == 0:
                closed_after = time.monotonic() - started
                break
            time.sleep(0.05)
        assert closed_after is not None and closed_after <= 0.5 + 0.25 + 0.5
        assert ray.get(crc_on_b.remote(rv.put(payload))) == zlib.crc32(payload)
        assert moved(b0, path_counts("node_b")) == {"rdma/ok": 2}
    finally:
        restart_agent("node_b", TCP_CONFIG)


def test_spec_series_reach_rays_prometheus_export(velo: None) -> None:
    """The path counter (and the registered-bytes gauge) show on the nodes' Prometheus
    export under Ray's prefix: ray_velo_rendezvous_rdma_path_total{path="rdma",reason="ok"}."""
    import urllib.request

    payload = pattern(MiB)
    assert ray.get(crc_on_b.remote(rv.put(payload))) == zlib.crc32(payload)
    wanted = ("ray_velo_rendezvous_rdma_path_total{", 'path="rdma"', 'reason="ok"')
    deadline = time.monotonic() + 30
    seen: set[str] = set()
    while time.monotonic() < deadline:
        for node in ray.nodes():  # type: ignore[no-untyped-call]
            if not node["Alive"]:
                continue
            url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
            try:
                body = urllib.request.urlopen(url, timeout=5).read().decode()
            except OSError:
                continue
            for line in body.splitlines():
                if all(w in line for w in wanted):
                    seen.add("path")
                if line.startswith("ray_velo_rdma_registered_bytes{"):
                    seen.add("registered")
        if seen == {"path", "registered"}:
            break
        time.sleep(0.5)
    assert seen == {"path", "registered"}
