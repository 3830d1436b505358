"""Test doubles for ray_velo's tests and users': a fake clock, a fake RDMA transport, and a pair
of real agents in one process without Ray or UCX (docs/api.md, "Testing").

May import: errors, config, protocol, memory, ucx, wire, state, agent, local, consumer, actors,
client.
"""

from typing import TYPE_CHECKING

from ray_velo.actors.faults import FaultyRdma
from ray_velo.testing.fakes import FakeClock, FakeJobs, FakeRdma
from ray_velo.testing.pair import AgentPair, InProcessLink, InProcessPeers

__all__ = [
    "AgentPair",
    "FakeClock",
    "FakeJobs",
    "FakeRdma",
    "FaultyRdma",
    "InProcessLink",
    "InProcessPeers",
]

if TYPE_CHECKING:  # mypy holds every implementation to the agent's RDMA protocol
    from ray_velo.agent.backend import RdmaBackend
    from ray_velo.ucx.backend import UcxRdmaBackend

    def _implementations(
        ucx: UcxRdmaBackend, fake: FakeRdma, faulty: FaultyRdma
    ) -> tuple[RdmaBackend, RdmaBackend, RdmaBackend]:
        return ucx, fake, faulty
