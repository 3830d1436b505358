"""The agent's quick calls on its event loop (ray_velo.agent.nonblocking): a call that would block
says so before it changed anything, and its slow effects leave the loop. Real agents
(ray_velo.testing), no Ray: ``on_loop`` is what the actor wraps each quick call in."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import numpy as np
import pytest

from ray_velo.agent import nonblocking
from ray_velo.config import MiB
from ray_velo.protocol import AcquireRequest, ReleaseRequest, TypeHeader, encode
from ray_velo.testing import AgentPair


@pytest.fixture()
def pair(tmp_path: Path) -> Iterator[AgentPair]:
    with AgentPair(tmp_path / "shm") as p:
        yield p
        p.validate()


class Offloaded:
    """Stands in for the agent's threads: holds the deferred work until the test runs it."""

    def __init__(self) -> None:
        self.work: list[Callable[[], None]] = []

    def __call__(self, work: Callable[[], None]) -> None:
        self.work.append(work)

    def run(self) -> None:
        work, self.work = self.work, []
        for item in work:
            item()


def on_loop(offloaded: Offloaded | None = None) -> AbstractContextManager[None]:
    return nonblocking.on_loop(offloaded or Offloaded())


def test_outside_the_loop_nothing_changes() -> None:
    ran: list[int] = []
    assert not nonblocking.active()
    nonblocking.check("anything")
    nonblocking.defer(lambda: ran.append(1))
    assert ran == [1]
    offloaded = Offloaded()
    with nonblocking.on_loop(offloaded):
        assert nonblocking.active()
        nonblocking.defer(lambda: ran.append(2))
        with pytest.raises(nonblocking.WouldBlock, match="anything"):
            nonblocking.check("anything")
    assert not nonblocking.active() and ran == [1]
    offloaded.run()
    assert ran == [1, 2]


def test_a_reservation_that_needs_a_new_arena_leaves_the_loop_untouched(pair: AgentPair) -> None:
    """A put into memory not mapped yet: mapping may take long, so the loop refuses before
    anything is reserved, mapped or counted; the same call on a thread maps, and the next
    put of that size fits the mapped arena right on the loop."""
    owner, pid = pair.owner, os.getpid()
    arenas = owner.core.memory.pinned_pool.arenas  # type: ignore[union-attr]
    with on_loop(), pytest.raises(nonblocking.WouldBlock, match="mapping an arena"):
        owner.producers.reserve(2 * MiB, True, pid)
    assert owner.info()["reservations"] == 0
    assert owner.core.memory.pinned_pool.arenas == arenas  # type: ignore[union-attr]
    first = owner.producers.reserve(2 * MiB, True, pid)  # on a thread: maps
    owner.producers.abort(first.reservation_id)
    with on_loop():
        second = owner.producers.reserve(1 * MiB, True, pid)
    assert second is not None and second.path == first.path
    owner.producers.abort(second.reservation_id)


def test_the_kill_switch_fallback_is_counted_once_when_the_loop_hands_over(
    tmp_path: Path,
) -> None:
    with AgentPair(tmp_path / "shm") as pair:
        owner = pair.owner
        owner.core.rdma_enabled = False
        with on_loop(), pytest.raises(nonblocking.WouldBlock):
            owner.producers.reserve(MiB, True, os.getpid())
        reservation = owner.producers.reserve(MiB, True, os.getpid())
        owner.producers.abort(reservation.reservation_id)
        assert pair.owner_paths() == {"chunked/kill_switch": 1}


def test_a_call_naming_a_handle_still_being_committed_waits_off_the_loop(
    pair: AgentPair,
) -> None:
    """The producer's commit is on its way (it does not wait for the answer): an acquire
    that arrives first must wait for it, which the loop cannot; once committed, the same
    acquire runs on the loop."""
    owner, pid = pair.owner, os.getpid()
    pair.put(np.zeros(MiB, np.uint8))  # maps the arena
    reservation = owner.producers.reserve(MiB, True, pid)
    handle = reservation.handle
    request = encode(AcquireRequest(handle))
    with on_loop():
        with pytest.raises(nonblocking.WouldBlock, match="commit"):
            owner.readers.acquire(handle, pid, "detach")
        with pytest.raises(nonblocking.WouldBlock, match="commit"):
            owner.owner._rv_acquire(request)
    assert owner.info()["live_leases"] == 0
    owner.producers.commit(reservation.reservation_id, MiB, TypeHeader(), None, 1)
    with on_loop():
        lease = owner.readers.acquire(handle, pid, "release")
    assert lease.total_len == MiB
    owner.readers.end_lease(lease.handle, lease.lease_id, False)


def test_freeing_a_dedicated_arena_on_the_loop_is_deferred(pair: AgentPair) -> None:
    """The last reference of a 32 MiB payload (its own arena) released on the loop: the
    slot ends at once, the arena's unmapping goes to a thread."""
    owner = pair.owner
    handle = pair.put(np.ones(32 * MiB, np.uint8))
    pool = owner.core.memory.pinned_pool
    assert pool is not None
    used = owner.core.memory.pinned_used_bytes
    offloaded = Offloaded()
    with on_loop(offloaded):
        owner.owner._rv_release(encode(ReleaseRequest(handle, 0)))
    assert owner.info()["live_slots"] == 0
    assert len(offloaded.work) == 1
    assert owner.core.memory.pinned_used_bytes == used  # not given back yet
    offloaded.run()
    assert owner.core.memory.pinned_used_bytes < used


def test_a_region_slot_is_copied_off_the_loop(pair: AgentPair) -> None:
    owner, pid = pair.owner, os.getpid()
    info = owner.regions.alloc(4 * MiB, pid)
    handle = owner.regions.stage(info.region_id, 0, MiB, TypeHeader(), None)
    with on_loop(), pytest.raises(nonblocking.WouldBlock, match="region"):
        owner.readers.acquire(handle, pid, "detach")
    assert owner.info()["live_leases"] == 0
    lease = owner.readers.acquire(handle, pid, "detach")  # on a thread: copies
    assert lease.total_len == MiB
    owner.readers.end_lease(lease.handle, lease.lease_id, False)
    owner.regions.unregister(info.region_id, 5.0)
