"""The operator's commands against the two-node cluster, run as a user runs them (a separate
process): ``ray-velo status --json`` has one object per node agent with the documented
fields; ``ray-velo cleanup`` removes what a SIGKILLed agent left in the shm directory and
nothing of a live one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest

import ray_velo as rv
from ray_velo.actors.directory import register_all_peers
from ray_velo.config import MiB

from .conftest import TEST_CONFIG, agent_info, node_ids

ray = pytest.importorskip("ray")

STATUS_FIELDS = {
    "node_id", "worker_id", "transport", "registered_bytes", "budget_bytes", "live_slots",
    "live_leases", "staged_bytes", "paths", "bytes_moved",
}  # fmt: skip


def ray_velo_cli(*args: str, address: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ray_velo.cli", *args, "--address", address],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def segments_of(pid: int) -> list[str]:
    return sorted(n for n in os.listdir(TEST_CONFIG.shm_dir) if n.startswith(f"ray_velo-{pid}-"))


@ray.remote(resources={"node_b": 1}, num_cpus=0)
def stage_on_b(nbytes: int) -> rv.DataHandle:
    return rv.put(np.ones(nbytes, dtype=np.uint8))


def test_status_json_has_one_object_per_node_agent(velo: None, cluster: Any) -> None:
    handle = rv.put(np.ones(2 * MiB, dtype=np.uint8))
    try:
        done = ray_velo_cli("status", "--json", address=cluster.address)
        assert done.returncode == 0, done.stderr
        statuses = json.loads(done.stdout)
        assert sorted(s["node_id"] for s in statuses) == sorted(node_ids().values())
        for status in statuses:
            assert set(status) >= STATUS_FIELDS, sorted(STATUS_FIELDS - set(status))
            assert status["transport"].startswith(("ucx: ", "none: "))
            assert 0 <= status["registered_bytes"] <= status["budget_bytes"]
        head = next(s for s in statuses if s["node_id"] == node_ids()["node_a"])
        assert head["live_slots"] >= 1 and head["staged_bytes"] >= 2 * MiB
    finally:
        rv.fetch(handle)  # its one reference consumed: the slot goes


def test_cleanup_removes_a_killed_agents_segments_and_nothing_live(
    velo: None, cluster: Any
) -> None:
    ray.get(stage_on_b.remote(3 * MiB))  # node b's agent maps an arena for it
    killed = agent_info("node_b")["pid"]
    live = agent_info("node_a")["pid"]
    left = segments_of(killed)
    live_before = segments_of(live)
    assert left and live_before
    os.kill(killed, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while True:  # Ray notices the death; the files stay behind
        try:
            os.kill(killed, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert segments_of(killed) == left

    done = ray_velo_cli("cleanup", address=cluster.address)
    assert done.returncode == 0, done.stderr
    assert segments_of(killed) == []
    assert segments_of(live) == live_before
    for name in left:
        assert name in done.stdout
    assert "segments of dead processes" in done.stdout
    total = int(done.stdout.rsplit("segments of dead processes, ", 1)[1].split(" B")[0])
    assert total >= 3 * MiB
    # node b gets a fresh agent on its next use; wired to its peers as rv.init would
    assert agent_info("node_b")["pid"] != killed
    register_all_peers()
