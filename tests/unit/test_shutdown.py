"""The spec's shutdown order on real agents in one process (ray_velo.testing): a chunked pull
admitted before the gate finishes from the demoted copy after the registered memory is gone;
an RDMA lease holds the registered memory until it ends; a stalled consumer is bounded by the
shutdown timeout; nothing of the owner is left in the shm directory afterwards."""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from ray_velo.actors.agent import RendezvousAgent
from ray_velo.config import MiB
from ray_velo.errors import StagingError
from ray_velo.protocol import (
    AcquireRequest,
    DataHandle,
    DetachRequest,
    PullRequest,
    RdmaOffer,
    Ready,
    ReleaseRequest,
    decode_acquire_response,
    encode,
)
from ray_velo.protocol.descriptor import RdmaDescriptor
from ray_velo.protocol.messages import Rdma
from ray_velo.testing import AgentPair

CHUNK = 512 * 1024
BOUND_S = 30.0  # how long a test waits for a condition that must come


def payload(nbytes: int, seed: int = 3) -> bytes:
    return ((np.arange(nbytes, dtype=np.uint64) * 7 + seed) % 253).astype(np.uint8).tobytes()


def eventually(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.005)


def owner_segments(shm: Path, agent: RendezvousAgent) -> list[str]:
    return sorted(p.name for p in shm.iterdir() if f"-{agent.worker_id:016x}-" in p.name)


class Shutdown:
    """The owner's shutdown on a thread of its own, as the Ray actor runs it."""

    def __init__(self, agent: RendezvousAgent, timeout_s: float) -> None:
        self.report: dict[str, int] = {}
        self.elapsed_s = 0.0
        self._thread = threading.Thread(target=self._run, args=(agent, timeout_s), daemon=True)
        self._thread.start()

    def _run(self, agent: RendezvousAgent, timeout_s: float) -> None:
        start = time.monotonic()
        self.report = agent.shutdown(timeout_s)
        self.elapsed_s = time.monotonic() - start

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self) -> dict[str, int]:
        self._thread.join(BOUND_S)
        assert self.done, "shutdown did not end within its bound"
        return self.report


@pytest.fixture()
def shm(tmp_path: Path) -> Path:
    return tmp_path / "shm"


@pytest.fixture()
def pair(shm: Path) -> Iterator[AgentPair]:
    with AgentPair(shm) as p:
        yield p


def chunked_acquire(agent: RendezvousAgent, handle: DataHandle) -> Ready:
    answer = decode_acquire_response(agent.owner._rv_acquire(encode(AcquireRequest(handle))))
    assert isinstance(answer, Ready)
    return answer


def pull(agent: RendezvousAgent, ready: Ready, index: int) -> bytes:
    return bytes(agent.owner._rv_pull(encode(PullRequest(ready.transfer_id, index))))


def test_a_chunked_pull_admitted_before_the_gate_finishes_from_the_demoted_copy(
    pair: AgentPair, shm: Path
) -> None:
    owner = pair.owner
    data = payload(4 * CHUNK + 1000)
    handle = pair.put(data)  # pinned: registered pool memory
    assert owner.info()["registered_bytes"] > 0
    ready = chunked_acquire(owner, handle)
    got = [pull(owner, ready, 0)]

    stopping = Shutdown(owner, timeout_s=20.0)
    # Step 5 ran: the registered memory is gone while the pull still runs.
    eventually(lambda: owner.core.memory.budget.registered_bytes == 0, "registered memory unmapped")
    assert not stopping.done
    got += [pull(owner, ready, i) for i in range(1, ready.chunk_count)]
    assert b"".join(got) == data
    owner.owner._rv_release(encode(ReleaseRequest(handle, ready.lease_id)))

    report = stopping.join()
    assert report["demoted"] == 1
    assert report["pulls_drained"] == 1
    assert stopping.elapsed_s < 15.0
    assert owner_segments(shm, owner) == []


def test_a_get_admitted_before_the_gate_keeps_the_registered_memory_until_its_lease_ends(
    pair: AgentPair, shm: Path
) -> None:
    owner = pair.owner
    data = payload(2 * MiB)
    handle = pair.put(data)
    answer = decode_acquire_response(
        owner.owner._rv_acquire(encode(AcquireRequest(handle, rdma=RdmaOffer())))
    )
    assert isinstance(answer, Rdma)
    registered = owner.info()["registered_bytes"]

    stopping = Shutdown(owner, timeout_s=20.0)
    eventually(lambda: owner.core.state.counts().draining, "the gate closed")
    # The GET still reads the registered bytes: they stay mapped and unchanged.
    time_limit = time.monotonic() + 0.3
    while time.monotonic() < time_limit:
        assert owner.core.memory.budget.registered_bytes == registered
        assert not stopping.done
    descriptor = RdmaDescriptor.decode(answer.descriptor)
    assert ctypes.string_at(descriptor.addr, descriptor.length) == data  # the GET
    owner.owner._rv_release(encode(ReleaseRequest(handle, answer.lease_id)))

    report = stopping.join()
    assert report["gets_drained"] == 1
    assert owner.core.memory.budget.registered_bytes == 0
    assert owner_segments(shm, owner) == []


def test_a_stalled_consumer_is_bounded_by_the_shutdown_timeout(pair: AgentPair, shm: Path) -> None:
    owner = pair.owner
    chunked = chunked_acquire(owner, pair.put(payload(3 * CHUNK)))
    pull(owner, chunked, 0)  # and the consumer never pulls again
    get = decode_acquire_response(
        owner.owner._rv_acquire(encode(AcquireRequest(pair.put(payload(MiB)), rdma=RdmaOffer())))
    )
    assert isinstance(get, Rdma)  # and never released

    stopping = Shutdown(owner, timeout_s=1.0)
    with pair.clock.passing():  # the bound is on the agent's clock
        report = stopping.join()
    assert stopping.elapsed_s < 5.0
    assert (report["gets_drained"], report["pulls_drained"]) == (0, 0)
    assert report["slots"] == 2
    assert owner_segments(shm, owner) == []
    assert owner.info()["live_leases"] == 0


def test_after_the_gate_nothing_new_is_staged_and_acquires_answer_chunked(pair: AgentPair) -> None:
    owner = pair.owner
    handle = pair.put(payload(MiB))
    chunked = chunked_acquire(owner, handle)  # holds the drain open
    stopping = Shutdown(owner, timeout_s=20.0)
    eventually(lambda: owner.core.state.counts().draining, "the gate closed")
    with pytest.raises(StagingError, match="shutting down"):
        owner.producers.reserve(MiB, True, pair.pid)
    late = decode_acquire_response(
        owner.owner._rv_acquire(encode(AcquireRequest(handle, rdma=RdmaOffer())))
    )
    assert isinstance(late, Ready)
    # Before step 3 the slot is still registered (check 7 says draining); after it the slot
    # was demoted to plain memory (check 4 says not_pinned). The shutdown runs on its own
    # thread, so either may come first: both answer chunked, and exactly one is counted.
    paths = owner.info()["metrics"]["velo_rendezvous_rdma_path_total"]
    assert paths.get("chunked/draining", 0) + paths.get("chunked/not_pinned", 0) == 1, paths
    for lease_id in (chunked.lease_id, late.lease_id):
        owner.owner._rv_detach(encode(DetachRequest(handle, lease_id)))
    stopping.join()


def test_a_second_shutdown_returns_at_once(pair: AgentPair) -> None:
    pair.put(payload(MiB))
    first = pair.owner.shutdown(5.0)
    assert first["slots"] == 1
    assert pair.owner.shutdown(5.0) == {"slots": 0}


def test_a_lease_past_its_deadline_does_not_hold_the_drain(pair: AgentPair) -> None:
    """The reaper is stopped during shutdown, but a lease whose deadline passed has no
    consumer left: the drain passes over it instead of waiting out the bound."""
    owner = pair.owner
    get = decode_acquire_response(
        owner.owner._rv_acquire(encode(AcquireRequest(pair.put(payload(MiB)), rdma=RdmaOffer())))
    )
    assert isinstance(get, Rdma) and get.lease_timeout_ms > 0
    pair.clock.advance(get.lease_timeout_ms / 1000 + 1)  # abandoned; no tick reaped it
    stopping = Shutdown(owner, timeout_s=20.0)
    report = stopping.join()
    assert report["gets_drained"] == 1
    assert stopping.elapsed_s < 5.0
