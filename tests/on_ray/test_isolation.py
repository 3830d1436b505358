"""One sick node never slows the others: a three-node cluster where one owner's agent is
stalled (SIGSTOP) while a hundred fetches wait on it."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import ray

import ray_velo as rv
from ray_velo.actors import ensure_agent
from ray_velo.config import MiB
from tests.on_ray.conftest import node_ids

pytestmark = [pytest.mark.ray, pytest.mark.multinode, pytest.mark.slow]

HUNG = 100


@ray.remote(num_cpus=0, resources={"node_c": 1})
def stage_on_c(nbytes: int) -> rv.DataHandle:
    handle = rv.put(np.ones(nbytes, np.uint8), ttl=120.0)
    for _ in range(HUNG):
        rv.ref_handle(handle)
    return handle


@ray.remote(num_cpus=0, max_concurrency=HUNG + 4, resources={"node_b": 1})
class Reader:
    """A process on node b that fetches from many threads at once."""

    def fetch(self, handle: rv.DataHandle, timeout: float | None) -> tuple[str, float]:
        started = time.monotonic()
        try:
            value = rv.fetch(handle, release=False, timeout=timeout)
            outcome = f"ok:{int(np.asarray(value).sum())}"
        except rv.VeloError as exc:
            outcome = type(exc).__name__
        return outcome, time.monotonic() - started


def test_a_stalled_owner_never_slows_a_healthy_ones_fetch(velo: None, node_c: str) -> None:
    """Node c's agent is stopped with a hundred fetches from node b waiting on it: a 1 MiB
    fetch from node a's healthy owner still finishes in its normal time, before any of them;
    the hung fetches end with TransferTimeout at their bound, never OwnerDied (node c's
    agent is alive), and node b's agent answers throughout."""
    sick = ray.get(stage_on_c.remote(1 * MiB))
    agent_c = ensure_agent(node_c)
    pid_c = ray.get(agent_c.info.remote())["pid"]
    healthy = rv.put(np.ones(1 * MiB, np.uint8))
    reader = Reader.remote()
    warm = rv.put(np.ones(4096, np.uint8))
    ray.get(reader.fetch.remote(warm, 30.0))  # the reader's session and endpoints are up
    os.kill(pid_c, signal.SIGSTOP)
    try:
        hung = [reader.fetch.remote(sick, 12.0) for _ in range(HUNG)]
        time.sleep(1.0)  # let them all reach node b's agent and wait on node c
        outcome, seconds = ray.get(reader.fetch.remote(healthy, 30.0), timeout=60)
        assert outcome == f"ok:{MiB}", outcome
        assert seconds < 5.0, f"a healthy owner's 1 MiB fetch took {seconds:.1f} s"
        ready, _ = ray.wait(hung, num_returns=HUNG, timeout=0)
        assert not ready, "a fetch from the stalled owner finished while it was stopped"
        info = ray.get(ensure_agent(node_ids()["node_b"]).info.remote(), timeout=10)
        assert info["fetches_in_flight"] >= HUNG
        outcomes = ray.get(hung, timeout=60)
    finally:
        os.kill(pid_c, signal.SIGCONT)
    kinds = {kind for kind, _ in outcomes}
    assert kinds == {"TransferTimeout"}, kinds
    assert all(9.0 <= s <= 30.0 for _, s in outcomes), sorted(s for _, s in outcomes)[:3]
    for handle in (healthy, warm):
        rv.release(handle, 0)
    ray.kill(reader)
