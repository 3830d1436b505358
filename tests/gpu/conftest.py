"""GPU tests: run for real on a machine with a CUDA GPU, skip loudly everywhere else.

Every module here starts with ``torch = require_cuda("what this module checks")``: without
torch or a visible CUDA device the module is skipped at collection, before Ray, UCX or CUDA
start, with a reason naming the checks left for a GPU machine. docs/gpu.md has the command.

The Ray tests share a two-node ``ray.cluster_utils.Cluster`` on this machine, each node
declaring the one GPU (``num_gpus=1``): two raylets, two agents, so a fetch from node b of a
tensor put on node a takes the real cross-node path, and both processes share the GPU (the
issue's "two processes on one GPU").
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

from ray_velo.config import GiB, MiB, RdmaConfig, RdmaPoolConfig, VeloConfig

GPU_CONFIG = VeloConfig(
    staged_payload_max=2 * GiB,
    rdma=RdmaConfig(pool=RdmaPoolConfig(registered_bytes_budget=2 * GiB)),
)


def require_cuda(left_unchecked: str) -> ModuleType:
    """torch, when it sees a CUDA device; else skip the calling module, loudly.

    Args:
        left_unchecked: what the module would have checked (goes into the skip reason).
    """
    try:
        import torch
    except ImportError:
        pytest.skip(
            f"SKIPPED (optional): torch is not installed; left for a GPU machine: {left_unchecked}",
            allow_module_level=True,
        )
    if not torch.cuda.is_available():
        pytest.skip(
            f"SKIPPED (hardware): no CUDA GPU visible to torch (torch {torch.__version__}, "
            f"CUDA build {torch.version.cuda}); left for a GPU machine: {left_unchecked}",
            allow_module_level=True,
        )
    return torch


@pytest.fixture(scope="package")
def gpu_cluster() -> Iterator[Any]:
    """Two Ray nodes on this machine, each with the GPU; ray_velo initialised on both."""
    require_cuda("the two-node GPU cluster")
    import ray
    from ray.cluster_utils import Cluster

    import ray_velo as rv

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    node = {"num_cpus": 4, "num_gpus": 1, "object_store_memory": 2 * GiB}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**node, "resources": {"node_a": 4}, "include_dashboard": False},
    )
    cluster.add_node(**node, resources={"node_b": 4})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    rv.init(GPU_CONFIG)
    yield cluster
    rv.shutdown()
    ray.shutdown()
    cluster.shutdown()
    threads = [t.name for t in threading.enumerate() if t.name.startswith("ray_velo")]
    assert not threads, f"ray_velo threads outlived shutdown: {threads}"


def node_id(key: str) -> str:
    import ray

    return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and key in n["Resources"])


def agent_metrics(key: str) -> dict[str, Any]:
    """The snapshot of node ``key``'s agent metrics (``node_a`` or ``node_b``)."""
    import ray

    from ray_velo.actors import ensure_agent

    info = ray.get(ensure_agent(node_id(key)).info.remote())
    return info["metrics"]  # type: ignore[no-any-return]


def counts(key: str) -> dict[str, int]:
    """Path decisions and device stagings of node ``key``'s agent, flat."""
    metrics = agent_metrics(key)
    out = {f"path:{k}": v for k, v in metrics["velo_rendezvous_rdma_path_total"].items()}
    out.update({f"device:{k}": v for k, v in metrics["velo_device_staged_total"].items()})
    return out


def grown(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


__all__ = ["GPU_CONFIG", "MiB", "counts", "grown", "node_id", "require_cuda"]
