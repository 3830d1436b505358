"""A real two-node Ray cluster (``ray.cluster_utils.Cluster``) shared by the Ray tests.

Two raylets on this machine, each its own Ray node with its own object store, so every
cross-node path in these tests is the real one. Node "a" (the head) runs the driver and the
producers; node "b" runs consumers (``resources={"node_b": 1}``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

import ray_velo as rv  # noqa: E402
from ray_velo.config import (  # noqa: E402
    GiB,
    MiB,
    RdmaConfig,
    RdmaPoolConfig,
    RdmaRendezvousConfig,
    VeloConfig,
)

#: Small chunks so tests exercise many chunks without moving much data.
TEST_CHUNK = 1 * MiB
TEST_CONFIG = VeloConfig(
    fault_injection=True,  # the fault tests arm faults in these agents
    chunk_size=TEST_CHUNK,
    pulls_in_flight=4,
    staged_payload_max=96 * MiB,
    plain_arena_bytes=16 * MiB,
    rdma=RdmaConfig(
        # short RDMA leases, so an abandoned GET's lease is reaped within a test's patience
        rendezvous=RdmaRendezvousConfig(lease_timeout=2.0),
        # the spec's budget, which the budget tests are written around (the default is the
        # node's own: test_large.py)
        pool=RdmaPoolConfig(registered_bytes_budget=1 * GiB),
    ),
)


def _node_cpus() -> dict[str, Any]:
    return {"num_cpus": 4, "object_store_memory": 512 * MiB}


# Package scope: the cluster is gone before other folders (the two-host testbed) start
# their own Ray nodes on this 2-core machine.
@pytest.fixture(scope="package")
def cluster() -> Iterator[Cluster]:
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    c = Cluster(
        initialize_head=True,
        head_node_args={
            **_node_cpus(),
            "resources": {"node_a": 4},
            "include_dashboard": False,
            # metrics reach each node's Prometheus export within ~1 s (Ray's default: 10 s)
            "_system_config": {"metrics_report_interval_ms": 1000},
        },
    )
    c.add_node(**_node_cpus(), resources={"node_b": 4})
    c.wait_for_nodes()
    ray.init(
        address=c.address,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env=rv.runtime_env(),
    )
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
    # a test that killed an agent leaves a fresh one on next use: wire it to its peers, as
    # rv.init does, so the next test's first fetch can offer RDMA
    from ray_velo.actors import alive_node_ids, ensure_agent
    from ray_velo.actors.directory import register_all_peers

    register_all_peers({n: ensure_agent(n) for n in alive_node_ids()})
    deadline = time.monotonic() + 10
    while True:
        infos = {n: agent_info(n) for n in ("node_a", "node_b")}
        state = {n: (i["live_slots"], i["reservations"]) for n, i in infos.items()}
        if all(state[n] == (before[n], 0) for n in state) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert all(state[n] == (before[n], 0) for n in state), (
        before,
        state,
        {n: i["slots"] for n, i in infos.items()},
    )


@pytest.fixture()
def node_c(cluster: Cluster) -> Iterator[str]:
    """A third node (``resources={"node_c": ...}``) for one test, removed afterwards with
    its agent (unless the test removed it itself)."""
    node = cluster.add_node(num_cpus=2, object_store_memory=256 * MiB, resources={"node_c": 4})
    cluster.wait_for_nodes()
    node_id = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and "node_c" in n["Resources"])
    yield node_id
    if any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
        stop_agent(node_id)  # its segments go with a clean shutdown
        cluster.remove_node(node)


def stop_agent(node_id: str) -> None:
    """Shut down and kill ``node_id``'s agent, and wait until its name is free again."""
    import time

    from ray_velo.actors import find_agent

    try:
        old = find_agent(node_id)
        ray.get(old.shutdown.remote(), timeout=30)
        ray.kill(old)
    except ValueError:
        return
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            find_agent(node_id)
        except ValueError:
            return
        time.sleep(0.05)


def restart_agent(
    node: str, config: VeloConfig | None = None, env: dict[str, str] | None = None
) -> None:
    """Replace ``node``'s agent with a fresh one (its own config and environment).

    Everything the old agent staged is lost; the driver's cached view of its own node's
    agent is dropped so its next call finds the new one.
    """

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from ray_velo.actors import NAMESPACE, agent_name, ensure_agent
    from ray_velo.actors.directory import RendezvousActor, register_all_peers
    from ray_velo.client import session

    node_id = node_ids()[node]
    stop_agent(node_id)
    options: dict[str, Any] = {
        "name": agent_name(node_id),
        "namespace": NAMESPACE,
        "lifetime": "detached",
        "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False),
    }
    if env:
        options["runtime_env"] = {"env_vars": env}
    agent = RendezvousActor.options(**options).remote(config or TEST_CONFIG, node_id)
    ray.get(agent.ping.remote(), timeout=60)
    session.forget()
    register_all_peers()
    assert ensure_agent(node_id) is not None


def path_counts(node: str) -> dict[str, int]:
    """The node agent's velo_rendezvous_rdma_path_total, as {"path/reason": n}."""
    return dict(agent_info(node)["metrics"]["velo_rendezvous_rdma_path_total"])


def moved(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    keys = set(before) | set(after)
    return {
        k: after.get(k, 0) - before.get(k, 0) for k in keys if after.get(k, 0) != before.get(k, 0)
    }


def wait_until_freed(handle: rv.DataHandle, timeout_s: float = 10.0) -> rv.HandleNotFound:
    """Poll the owner until ``handle`` is gone; returns the HandleNotFound it then gives."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            rv.metadata(handle)
        except rv.HandleNotFound as exc:
            return exc
        assert time.monotonic() < deadline, f"{handle} still staged after {timeout_s} s"
        time.sleep(0.05)


def wait_for(what: str, ready: Callable[[], bool], timeout_s: float = 30.0) -> float:
    """Seconds until ``ready()``, polled every 50 ms; fails after ``timeout_s`` naming
    ``what``."""
    import time

    started = time.monotonic()
    while not ready():
        assert time.monotonic() - started < timeout_s, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)
    return time.monotonic() - started


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` still exists (on this machine)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
