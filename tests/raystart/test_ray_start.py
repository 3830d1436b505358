"""A cluster started the documented way, ``ray start --head`` and ``ray start --address``, as
two nodes on this host (no root needed; tests/twohost does the same across two emulated
hosts): the README's quickstart runs on it, then ``ray-velo status --json`` sees both
agents, and everything the test started is ended by pid with no segment left."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from ray_velo.testbed.netns import process_running
from ray_velo.testbed.onehost import OneHostCluster

pytestmark = [pytest.mark.ray, pytest.mark.multinode, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ray_start_cluster() -> Iterator[OneHostCluster]:
    cluster = OneHostCluster(workers=1).start()
    try:
        yield cluster
    finally:
        pids = cluster.pids()
        ended = cluster.close()
        assert set(pids) <= set(ended) | {p for p in pids if not process_running(p)}
        alive = [p for p in pids if process_running(p)]
        assert not alive, f"processes of the ray start cluster outlived it: {alive}"
        left = [n for n in os.listdir("/dev/shm") if any(f"ray_velo-{p}-" in n for p in pids)]
        assert not left, f"segments left: {left}"


def test_the_quickstart_runs_on_a_ray_start_cluster(ray_start_cluster: OneHostCluster) -> None:
    done = ray_start_cluster.run([sys.executable, str(ROOT / "examples" / "quickstart.py")])
    assert done.returncode == 0, done.stderr[-3000:]
    expected = float(np.random.default_rng(0).standard_normal(32 << 20).sum())
    assert float(done.stdout.strip().splitlines()[-1]) == pytest.approx(expected, rel=1e-12)


def test_status_json_sees_an_agent_on_each_node(ray_start_cluster: OneHostCluster) -> None:
    init = "import ray_velo as rv; rv.init()"
    assert ray_start_cluster.run([sys.executable, "-c", init]).returncode == 0
    done = ray_start_cluster.run(
        [sys.executable, "-m", "ray_velo.cli", "status", "--json", "--address",
         ray_start_cluster.address]
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    statuses = json.loads(done.stdout)
    assert len(statuses) == 2 and all("error" not in s for s in statuses), statuses
    assert all(s["live_slots"] == 0 for s in statuses)
