"""Run by test_wheel.py with the python of a venv that holds only the built wheel: a
two-node ``ray.cluster_utils.Cluster``, ``rv.put`` of 32 MiB on node a (this driver's),
``rv.fetch`` of it in a task pinned to node b. Prints one JSON line of what it saw (where
ray_velo was imported from on each side, whether the bytes came back equal, how each agent's
path counters moved) for the test to judge. Everything it starts, it stops, even on error.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
import ray
from ray.cluster_utils import Cluster

import ray_velo as rv
from ray_velo.actors import ensure_agent
from ray_velo.config import GiB, MiB, RdmaConfig, RdmaPoolConfig, UcxConfig, VeloConfig

PAYLOAD_BYTES = 32 * MiB
# tests/on_ray's config: small arenas for a 2-core CI machine
CONFIG = VeloConfig(
    chunk_size=1 * MiB,
    pulls_in_flight=4,
    staged_payload_max=96 * MiB,
    plain_arena_bytes=16 * MiB,
    # UCX over TCP allowed (the operator's opt-in): the wheel's compiled binding moves the bytes
    rdma=RdmaConfig(pool=RdmaPoolConfig(registered_bytes_budget=1 * GiB), ucx=UcxConfig(tcp=True)),
)


@ray.remote(resources={"node_b": 1}, num_cpus=0)
def fetch_on_b(handle: rv.DataHandle) -> tuple[np.ndarray, str]:
    import ray_velo

    return np.array(rv.fetch(handle), copy=True), ray_velo.__file__


def node_id(resource: str) -> str:
    return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"])


def path_counts(resource: str) -> dict[str, int]:
    """The node agent's velo_rendezvous_rdma_path_total, as {"path/reason": n}."""
    info = ray.get(ensure_agent(node_id(resource)).info.remote(), timeout=60)
    return dict(info["metrics"]["velo_rendezvous_rdma_path_total"])


def moved(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after)
            if after.get(k, 0) != before.get(k, 0)}  # fmt: skip


def transfer() -> dict[str, Any]:
    payload = (np.arange(PAYLOAD_BYTES, dtype=np.uint64) * 2654435761 % 251).astype(np.uint8)
    a0, b0 = path_counts("node_a"), path_counts("node_b")
    handle = rv.put(payload)
    pinned = rv.metadata(handle).pinned  # before the fetch: its last consumer releases it
    fetched, file_on_b = ray.get(fetch_on_b.remote(handle), timeout=90)
    return {
        "driver_ray_velo": rv.__file__,
        "node_b_ray_velo": file_on_b,
        "pinned": pinned,
        "equal": bool(fetched.dtype == payload.dtype and np.array_equal(fetched, payload)),
        "nbytes": int(fetched.nbytes),
        "moved_a": moved(a0, path_counts("node_a")),
        "moved_b": moved(b0, path_counts("node_b")),
    }


def main() -> int:
    node_args: dict[str, Any] = {"num_cpus": 2, "object_store_memory": 256 * MiB}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**node_args, "resources": {"node_a": 2}, "include_dashboard": False},
    )
    try:
        cluster.add_node(**node_args, resources={"node_b": 2})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        rv.init(CONFIG)
        try:
            result = transfer()
        finally:
            rv.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
