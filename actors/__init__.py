"""The Ray actor layer: one :class:`RendezvousActor` per node, and how to find it.

Installed as ``ray_velo.actors``. An agent is pinned to its node (node affinity, hard), named
after the node id in the ``ray_velo`` namespace, and created with ``get_if_exists`` so many
tasks racing to create it end up with one. Its worker id is recorded in Ray's internal KV so a
handle that lost its node hint can still be routed.
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
