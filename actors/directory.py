"""Node directory: create, find and route to the rendezvous agent of each Ray node."""

from __future__ import annotations

import pickle
from typing import Any

import ray
from ray.experimental import internal_kv
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_velo.actors.agent import RendezvousAgent
from ray_velo.config import VeloConfig

__all__ = [
    "NAMESPACE",
    "RendezvousActor",
    "agent_name",
    "alive_node_ids",
    "cluster_config_stored",
    "ensure_agent",
    "ensure_agents",
    "find_agent",
    "load_cluster_config",
    "node_of_worker",
    "register_all_peers",
    "store_cluster_config",
]

NAMESPACE = "ray_velo"
_KV_NAMESPACE = "ray_velo"
_CONFIG_KEY = b"config"
#: Concurrent calls one agent serves: pulls for many consumers, acquires, local leases.
AGENT_MAX_CONCURRENCY = 64


def agent_name(node_id: str) -> str:
    """The well-known actor name of ``node_id``'s agent."""
    return f"ray_velo_agent_{node_id}"


class _RendezvousActor(RendezvousAgent):
    """The agent as a Ray actor: records its worker id for routing."""

    def __init__(self, config: VeloConfig, node_id: str) -> None:
        super().__init__(config, node_id)
        internal_kv._internal_kv_put(
            _worker_key(self.worker_id), node_id.encode(), overwrite=True, namespace=_KV_NAMESPACE
        )


RendezvousActor: Any = ray.remote(num_cpus=0, max_concurrency=AGENT_MAX_CONCURRENCY)(  # type: ignore[call-overload]
    _RendezvousActor
)


def _worker_key(worker_id: int) -> bytes:
    return f"worker:{worker_id:016x}".encode()


def node_of_worker(worker_id: int) -> str | None:
    """The node whose agent issued handles with ``worker_id``, if known."""
    value = internal_kv._internal_kv_get(_worker_key(worker_id), namespace=_KV_NAMESPACE)
    return value.decode() if value else None


def store_cluster_config(config: VeloConfig) -> None:
    """Publish the config so agents created later (new nodes) use the same one."""
    internal_kv._internal_kv_put(
        _CONFIG_KEY, pickle.dumps(config), overwrite=True, namespace=_KV_NAMESPACE
    )


def cluster_config_stored() -> bool:
    """Whether some driver published a config (``rv.init``) in this cluster."""
    return bool(internal_kv._internal_kv_exists(_CONFIG_KEY, namespace=_KV_NAMESPACE))


def load_cluster_config() -> VeloConfig:
    value = internal_kv._internal_kv_get(_CONFIG_KEY, namespace=_KV_NAMESPACE)
    if not value:
        return VeloConfig()
    config = pickle.loads(value)
    assert isinstance(config, VeloConfig)
    return config


def alive_node_ids() -> list[str]:
    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    return [n["NodeID"] for n in nodes if n.get("Alive")]


def ensure_agent(
    node_id: str, config: VeloConfig | None = None, env: dict[str, str] | None = None
) -> Any:
    """The agent of ``node_id``, created there if it does not exist yet (race-free).

    ``env``: environment variables of a newly created agent (over its node's), e.g. the
    kill switch for one agent; an existing agent keeps its own.
    """
    if config is None:
        config = load_cluster_config()
    extra: dict[str, Any] = {"runtime_env": {"env_vars": env}} if env else {}
    return RendezvousActor.options(
        name=agent_name(node_id),
        namespace=NAMESPACE,
        get_if_exists=True,
        # Detached: an agent must not share the fate of whichever process created it (a task
        # worker Ray may recycle), nor die when that process drops its handle. shutdown()
        # (or `ray-velo stop`) ends it; with the embedded local cluster, Ray's exit does.
        lifetime="detached",
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        **extra,
    ).remote(config, node_id)


def ensure_agents(
    config: VeloConfig, timeout_s: float = 120.0, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """An agent on every alive node, each answering a ping. Returns them by node id."""
    agents = {node_id: ensure_agent(node_id, config, env) for node_id in alive_node_ids()}
    ray.get([agent.ping.remote() for agent in agents.values()], timeout=timeout_s)
    register_all_peers(agents, timeout_s)
    return agents


def register_all_peers(agents: dict[str, Any] | None = None, timeout_s: float = 120.0) -> None:
    """Tell every agent every other agent's UCX worker address, so the first fetch between
    two nodes can already offer RDMA (otherwise each pair's first transfer is chunked)."""
    if agents is None:
        agents = {node_id: find_agent(node_id) for node_id in alive_node_ids()}
    addresses = dict(
        zip(
            agents,
            ray.get([a.ucx_address.remote() for a in agents.values()], timeout=timeout_s),
            strict=False,
        )
    )
    ray.get([a.register_peers.remote(addresses) for a in agents.values()], timeout=timeout_s)


def find_agent(node_id: str) -> Any:
    """The existing agent of ``node_id``. Raises ValueError if there is none."""
    return ray.get_actor(agent_name(node_id), namespace=NAMESPACE)
