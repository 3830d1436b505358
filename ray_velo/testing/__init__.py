"""Test doubles for ray_velo's own tests and for users': a fake clock, a fake RDMA transport,
and an owner/consumer pair of real agents in one process, without Ray or UCX.

The pair runs the agents' real code (owner state, handlers, the fetch machine and its driver,
the memory pools over real shared-memory segments in a directory you choose); only the two
things a single process cannot have are replaced: Ray's actor calls (an :class:`InProcessLink`
calls the owner's handlers directly) and UCX (a :class:`FakeRdma` "GET" copies the owner's
bytes with ``memmove``, and can be told to fail, to time out, or to leave the destination
unsafe). Time is a :class:`FakeClock` you advance; timers run when you call
:meth:`AgentPair.tick`. So fetch, fallback, lease, TTL and quarantine scenarios run as unit
tests in milliseconds::

    from ray_velo.testing import AgentPair

    with AgentPair(tmp_path) as pair:
        handle = pair.put(b"x" * (1 << 20), ttl=5.0)
        assert pair.fetch(handle) == b"x" * (1 << 20)
        assert pair.consumer_paths() == {"rdma/ok": 1}

Faults around an agent's real parts (a faulty RDMA backend, slow chunk answers), armed on a
live agent by its ``inject_fault`` entry point: :mod:`ray_velo.testing.faults`.

GPU memory without a GPU: :mod:`ray_velo.testing.device` (host memory labelled CUDA, and a
registrar that records the memory type it maps) for the GPU arena pools.
"""

from ray_velo.testing.fakes import FakeClock, FakeJobs, FakeRdma
from ray_velo.testing.faults import FaultyRdma
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
