"""Payloads above the spec's 1 GiB budget on a real two-node cluster: with the agents'
defaults (UCX closed) 1.5 GiB and 3 GiB cross node over the wire, the bytes right and nothing
registered for them; with UCX allowed over TCP (an operator's opt-in) and its own default
budget (a quarter of the node's memory, at least 1 GiB) they cross by one RDMA GET, the
registered bytes never above the budget while they move; a payload that truly cannot be
registered (a small budget set on the owner) still arrives, over the wire, counted with its
reason; and against a consumer that cannot read the owner's wire, by GETs through windows."""

from __future__ import annotations

import threading
import zlib
from collections.abc import Iterator

import numpy as np
import pytest
import ray

import ray_velo as rv
from ray_velo.config import GiB, MiB, RdmaConfig, RdmaPoolConfig, UcxConfig, VeloConfig
from ray_velo.wire.server import WIRE_DISABLE_ENV
from tests.on_ray.conftest import (
    TEST_CONFIG,
    agent_info,
    moved,
    path_counts,
    restart_agent,
    wait_until_freed,
)

pytestmark = [pytest.mark.ray, pytest.mark.multinode, pytest.mark.slow]

#: The test config without its 96 MiB receiver limit, and with the node's own budget.
LARGE = VeloConfig(chunk_size=16 * MiB, pulls_in_flight=4, plain_arena_bytes=16 * MiB)
#: LARGE with UCX allowed over TCP.
LARGE_UCX = LARGE.replace(rdma=RdmaConfig(ucx=UcxConfig(tcp=True)))


@ray.remote(num_cpus=0, resources={"node_b": 1})
def crc_on_b(handle: rv.DataHandle) -> int:
    return zlib.crc32(rv.fetch(handle).data)


def pattern(nbytes: int) -> np.ndarray:
    """Bytes with a period of 251 (prime): a chunk landing at a wrong offset shows."""
    return np.resize(np.arange(251, dtype=np.uint8), nbytes)


@pytest.fixture()
def large_agents(velo: None, request: pytest.FixtureRequest) -> Iterator[str]:
    """Both agents with the node's own budget, UCX closed (the default, ``wire``) or allowed
    over TCP (``rdma``), as the test's ``path`` says; that path."""
    path = request.node.callspec.params["path"]
    for node in ("node_a", "node_b"):
        restart_agent(node, LARGE if path == "wire" else LARGE_UCX)
    yield path
    for node in ("node_a", "node_b"):
        restart_agent(node, TEST_CONFIG)


class RegisteredPeak:
    """The largest registered-bytes count of each agent while the body runs (sampled)."""

    def __init__(self) -> None:
        self.peak = {"node_a": 0, "node_b": 0}
        self.budget = {n: agent_info(n)["budget_bytes"] for n in self.peak}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            for node in self.peak:
                self.peak[node] = max(self.peak[node], agent_info(node)["registered_bytes"])

    def __enter__(self) -> RegisteredPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.mark.parametrize(
    ("path", "size"),
    [
        pytest.param("wire", 3 * GiB // 2, id="wire-1.5GiB"),
        pytest.param("wire", 3 * GiB, id="wire-3GiB"),
        pytest.param("rdma", 3 * GiB // 2, id="ucx-1.5GiB"),
    ],
)
def test_a_payload_above_the_specs_budget_crosses_in_one_transfer(
    large_agents: str, path: str, size: int
) -> None:
    payload = pattern(size)
    crc = zlib.crc32(payload.data)
    before = path_counts("node_b")
    with RegisteredPeak() as registered:
        handle = rv.put(payload)
        del payload
        assert ray.get(crc_on_b.remote(handle), timeout=600) == crc
    assert moved(before, path_counts("node_b")) == {f"{large_agents}/ok": 1}
    for node, peak in registered.peak.items():
        if large_agents == "wire":  # nothing is registered without UCX
            assert peak == 0, (node, peak)
        else:
            assert 0 < peak <= registered.budget[node], (node, peak, registered.budget)
    assert registered.budget["node_a"] >= 2 * GiB  # this machine: a quarter of 23 GiB
    wait_until_freed(handle)


def test_a_payload_that_cannot_be_registered_still_arrives_over_the_wire(velo: None) -> None:
    """An owner with UCX (allowed over TCP) whose budget (64 MiB) its first pooled arena
    fills: an 80 MiB pinned put falls back to plain memory (counted ``chunked/budget``) and
    node b gets it over the wire, nothing registered for it."""
    small = VeloConfig(
        chunk_size=16 * MiB,
        plain_arena_bytes=16 * MiB,
        rdma=RdmaConfig(
            pool=RdmaPoolConfig(registered_bytes_budget=64 * MiB), ucx=UcxConfig(tcp=True)
        ),
    )
    restart_agent("node_a", small)
    try:
        payload = pattern(80 * MiB)
        owner_before = path_counts("node_a")
        fetches_before = dict(agent_info("node_b")["metrics"]["velo_fetches_total"])
        handle = rv.put(payload)
        assert ray.get(crc_on_b.remote(handle), timeout=600) == zlib.crc32(payload.data)
        owner_moved = moved(owner_before, path_counts("node_a"))
        assert owner_moved == {"chunked/budget": 1, "wire/ok": 1}, owner_moved
        fetches = agent_info("node_b")["metrics"]["velo_fetches_total"]
        assert fetches.get("wire", 0) == fetches_before.get("wire", 0) + 1
    finally:
        restart_agent("node_a", TEST_CONFIG)


#: Budgets far below the payload on both nodes (UCX allowed over TCP): the owner stages it in
#: plain memory and the consumer's destination is plain too; both register 64 MiB windows of
#: it as it moves.
SMALL_BUDGET = VeloConfig(
    chunk_size=16 * MiB,
    plain_arena_bytes=16 * MiB,
    rdma=RdmaConfig(
        pool=RdmaPoolConfig(registered_bytes_budget=256 * MiB), ucx=UcxConfig(tcp=True)
    ),
)


@pytest.fixture()
def small_budget_agents(velo: None) -> Iterator[None]:
    """The owner serves no wire (``VELO_PEER_WIRE_DISABLE=1``: an older agent, or one an
    operator closed), so its plain slot can only be read by GETs through windows."""
    restart_agent("node_a", SMALL_BUDGET, env={WIRE_DISABLE_ENV: "1"})
    restart_agent("node_b", SMALL_BUDGET)
    yield
    for node in ("node_a", "node_b"):
        restart_agent(node, TEST_CONFIG)


@pytest.mark.parametrize("size", [3 * GiB // 2 + 12345], ids=["1.5GiB"])  # a short last window
def test_a_payload_above_the_budget_crosses_by_get_through_windows(
    small_budget_agents: None, size: int
) -> None:
    """1.5 GiB against a 256 MiB budget on each node: staged plain (``chunked/budget`` at
    staging), then moved by GETs through registered 64 MiB windows (``rdma/ok`` on both
    ends), the bytes right, each node's registered bytes within its budget throughout, and
    every window unregistered once the handle is gone."""
    payload = pattern(size)
    crc = zlib.crc32(payload.data)
    owner_before, consumer_before = path_counts("node_a"), path_counts("node_b")
    with RegisteredPeak() as registered:
        handle = rv.put(payload)
        del payload
        assert ray.get(crc_on_b.remote(handle), timeout=600) == crc
    assert moved(consumer_before, path_counts("node_b")) == {"rdma/ok": 1}
    assert moved(owner_before, path_counts("node_a")) == {"chunked/budget": 1, "rdma/ok": 1}
    owner, consumer = agent_info("node_a"), agent_info("node_b")
    assert owner["windowed_leases"] == 1
    assert owner["windows_registered"] == -(-size // (64 * MiB))  # each window once
    assert consumer["windowed_gets"] == 1
    for node, peak in registered.peak.items():
        assert 0 < peak <= registered.budget[node] == 256 * MiB, (node, peak)
    wait_until_freed(handle)
    # the owner's windows closed with the lease: only its pooled arena stays registered
    assert agent_info("node_a")["registered_bytes"] <= 64 * MiB
