"""A real two-node Ray cluster (``ray.cluster_utils.Cluster``) shared by the Ray tests.

Two raylets on this machine, each its own Ray node with its own object store, so every
cross-node path in these tests is the real one. Node "a" (the head) runs the driver and the
producers; node "b" runs consumers (``resources={"node_b": 1}``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

import ray_velo as rv  # noqa: E402
from ray_velo.config import (  # noqa: E402
    MiB,
    RdmaConfig,
    RdmaRendezvousConfig,
    VeloConfig,
)

#: Small chunks so tests exercise many chunks without moving much data.
TEST_CHUNK = 1 * MiB
TEST_CONFIG = VeloConfig(
    chunk_size=TEST_CHUNK,
    pulls_in_flight=4,
    staged_payload_max=96 * MiB,
    plain_arena_bytes=16 * MiB,
    # short RDMA leases, so an abandoned GET's lease is reaped within a test's patience
    rdma=RdmaConfig(rendezvous=RdmaRendezvousConfig(lease_timeout=2.0)),
)


def _node_cpus() -> dict[str, Any]:
    return {"num_cpus": 4, "object_store_memory": 512 * MiB}


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    c = Cluster(
        initialize_head=True,
        head_node_args={**_node_cpus(), "resources": {"node_a": 4}, "include_dashboard": False},
    )
    c.add_node(**_node_cpus(), resources={"node_b": 4})
    c.wait_for_nodes()
    ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
    rv.init(TEST_CONFIG)
    yield c
    rv.shutdown()
    ray.shutdown()
    c.shutdown()
    threads = [t.name for t in threading.enumerate() if t.name.startswith("ray_velo")]
    assert not threads, f"ray_velo threads outlived shutdown: {threads}"


def node_ids() -> dict[str, str]:
    out = {}
    for node in ray.nodes():
        if node["Alive"]:
            for key in ("node_a", "node_b"):
                if key in node["Resources"]:
                    out[key] = node["NodeID"]
    return out


def agent_info(node: str) -> dict[str, Any]:
    from ray_velo.actors import ensure_agent

    return ray.get(ensure_agent(node_ids()[node]).info.remote())  # type: ignore[no-any-return]


@pytest.fixture()
def velo(cluster: Cluster) -> Iterator[None]:
    """Every Ray test leaves both agents with no slots, leases or reservations it made."""
    import time

    before = {n: agent_info(n)["live_slots"] for n in ("node_a", "node_b")}
    yield
    deadline = time.monotonic() + 10
    while True:
        infos = {n: agent_info(n) for n in ("node_a", "node_b")}
        state = {n: (i["live_slots"], i["reservations"]) for n, i in infos.items()}
        if all(state[n] == (before[n], 0) for n in state) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert all(state[n] == (before[n], 0) for n in state), (before, state)
