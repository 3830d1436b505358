"""The Ray actor layer, installed as ``ray_velo.actors``: one :class:`RendezvousActor` per node,
and how to find it (docs/architecture.md §1).

May import: errors, config, _ray, protocol, metrics, memory, ucx, wire, state, agent, local,
owner, consumer.
"""

from ray_velo.actors.directory import (
    NAMESPACE,
    agent_name,
    alive_node_ids,
    ensure_agent,
    ensure_agents,
    find_agent,
    node_of_worker,
)

__all__ = [
    "NAMESPACE",
    "agent_name",
    "alive_node_ids",
    "ensure_agent",
    "ensure_agents",
    "find_agent",
    "node_of_worker",
]
