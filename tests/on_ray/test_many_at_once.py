"""Many at once (issue 28): a thousand fetches of distinct handles on one node at the same
time, and two hundred cross-node fetches at the same time, all with the right bytes, none
refused, and the agents' threads and open files bounded while they run (a process's threads
beyond its socket connections make Ray calls; the agent's thread pool is fixed)."""

from __future__ import annotations

import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import ray

import ray_velo as rv
from ray_velo.actors import ensure_agent
from ray_velo.actors.directory import AGENT_THREADS
from ray_velo.local.channel import MAX_CONNECTIONS
from tests.on_ray.conftest import node_ids

pytestmark = [pytest.mark.ray, pytest.mark.multinode, pytest.mark.slow]

KiB = 1 << 10
#: Growth of an agent's open files and threads under the storm, at most: the calling process's
#: socket connections (one process here), a short-lived connection per agent thread (a notice
#: to another agent), and a margin for Ray's own; its thread pool, whatever the load.
FD_MARGIN = MAX_CONNECTIONS + AGENT_THREADS + 32
THREAD_MARGIN = AGENT_THREADS + 8


def payload(n: int) -> np.ndarray[Any, Any]:
    return ((np.arange(64 * KiB, dtype=np.uint32) * 2654435761 + n) % 251).astype(np.uint8)


@ray.remote(num_cpus=0)
class Storm:
    """Stages handles on its node, and fetches many at once from a thread pool."""

    def stage(self, count: int, first: int) -> list[rv.DataHandle]:
        return [rv.put(payload(first + n)) for n in range(count)]

    def fetch_all(self, handles: list[rv.DataHandle], first: int) -> list[bool]:
        def one(n: int) -> bool:
            got = rv.fetch(handles[n])  # release=True: its reference is consumed
            return bool(zlib.crc32(got) == zlib.crc32(payload(first + n)))

        with ThreadPoolExecutor(len(handles)) as pool:
            return list(pool.map(one, range(len(handles))))


def process_of(node: str) -> dict[str, int]:
    return ray.get(ensure_agent(node_ids()[node]).status.remote())["process"]  # type: ignore[no-any-return]


def peak_during(work: Any, node: str) -> tuple[Any, dict[str, int]]:
    """Run ``work`` (an ObjectRef) while sampling ``node``'s agent: its result and the
    largest fd and thread counts seen."""
    peak = {"fds": 0, "threads": 0}
    while True:
        ready, _ = ray.wait([work], timeout=0.2)
        stats = process_of(node)
        peak = {k: max(peak[k], stats[k]) for k in peak}
        if ready:
            return ray.get(work), peak


def test_a_thousand_fetches_at_once_on_one_node(velo: None) -> None:
    """1,000 threads of one actor each fetch a distinct 64 KiB handle of their own node at
    the same moment: every one gets its bytes, and the agent's open files and threads grow
    by a bounded amount, not by a thousand."""
    on_a = Storm.options(resources={"node_a": 1}).remote()
    handles = ray.get(on_a.stage.remote(1000, 0), timeout=300)
    before = process_of("node_a")
    results, peak = peak_during(on_a.fetch_all.remote(handles, 0), "node_a")
    assert results == [True] * 1000
    assert peak["fds"] - before["fds"] <= FD_MARGIN, (before, peak)
    assert peak["threads"] - before["threads"] <= THREAD_MARGIN, (before, peak)
    ray.kill(on_a)


def test_two_hundred_cross_node_fetches_at_once(velo: None) -> None:
    """200 threads on node b each fetch a distinct 64 KiB handle of node a at once: all
    right, none refused, both agents bounded."""
    on_a = Storm.options(resources={"node_a": 1}).remote()
    on_b = Storm.options(resources={"node_b": 1}).remote()
    handles = ray.get(on_a.stage.remote(200, 5000), timeout=300)
    before = {node: process_of(node) for node in ("node_a", "node_b")}
    results, peak_b = peak_during(on_b.fetch_all.remote(handles, 5000), "node_b")
    assert results == [True] * 200
    assert peak_b["fds"] - before["node_b"]["fds"] <= FD_MARGIN, (before, peak_b)
    assert peak_b["threads"] - before["node_b"]["threads"] <= THREAD_MARGIN, (before, peak_b)
    after_a = process_of("node_a")
    assert after_a["fds"] - before["node_a"]["fds"] <= FD_MARGIN
    assert after_a["threads"] - before["node_a"]["threads"] <= THREAD_MARGIN
    for actor in (on_a, on_b):
        ray.kill(actor)
