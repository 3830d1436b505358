"""Test doubles for ray_velo's tests and users': a fake clock, a fake RDMA transport, and a pair
of real agents in one process without Ray or UCX (docs/api.md, "Testing")."""

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
