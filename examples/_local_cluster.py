"""Start an embedded two-node Ray cluster on this machine (node "a" and node "b"), or join
a running cluster when RAY_ADDRESS is set, then start ray_velo."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import ray

import ray_velo as rv

MiB = 1 << 20


@contextmanager
def two_nodes() -> Iterator[None]:
    if os.environ.get("RAY_ADDRESS"):
        ray.init(runtime_env=rv.runtime_env())  # every worker knows the VELO transports
        rv.init()
        yield
        rv.shutdown()
        return
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"a": 4}, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=2, resources={"b": 4})
    ray.init(address=cluster.address, log_to_driver=False, runtime_env=rv.runtime_env())
    rv.init()
    try:
        yield
    finally:
        rv.shutdown()
        ray.shutdown()
        cluster.shutdown()
