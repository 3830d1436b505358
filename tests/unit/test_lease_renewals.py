"""The consumer's RDMA lease renewals (one thread per agent for every GET in flight): a GET
that outlives half its lease timeout keeps the lease renewed, renewals stop with the GET,
and the thread ends with the agent. On the agent's injected clock (a FakeClock moved by
hand), a link that records sends, no Ray; the tests wait on conditions, with bounds."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

import pytest

from ray_velo.consumer.driver import LeaseRenewals
from ray_velo.errors import StagingError
from ray_velo.protocol import DataHandle, LeaseRenewRequest, decode
from ray_velo.protocol.entry import RV_LEASE_RENEW, Entry
from ray_velo.testing import FakeClock

HANDLE = DataHandle(7, 1, "node-a")


class RecordingLink:
    node = "node-a"

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.sent: list[tuple[int, float]] = []  # (lease id, fake time)
        self.cond = threading.Condition()

    def send(self, entry: Entry, message: bytes) -> None:
        assert entry is RV_LEASE_RENEW
        request = decode(LeaseRenewRequest, message)
        with self.cond:
            self.sent.append((request.lease_id, self.clock()))
            self.cond.notify_all()

    def count(self, lease_id: int) -> int:
        with self.cond:
            return sum(1 for lease, _ in self.sent if lease == lease_id)

    def wait_for(self, what: str, ready: Callable[[], bool], timeout_s: float = 5.0) -> None:
        with self.cond:
            assert self.cond.wait_for(ready, timeout_s), f"not within {timeout_s} s: {what}"


def renewal_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ray_velo-lease-renewals"]


def step(clock: FakeClock, renewals: LeaseRenewals, seconds: float) -> None:
    clock.advance(seconds)
    renewals.wake()


def test_a_long_get_renews_every_half_timeout_and_stops_with_the_get() -> None:
    """Two GETs at once, 200 ms leases: each is renewed at every half timeout while it runs
    (a lease unrenewed for a whole timeout would be reaped by the owner mid-GET), never
    after its GET ended; one thread serves both and ends with close()."""
    clock = FakeClock(100.0)
    renewals, link = LeaseRenewals("node-b", clock), RecordingLink(clock)
    with renewals.renewing(link, HANDLE, 11, 200):  # type: ignore[arg-type]
        with renewals.renewing(link, HANDLE, 12, 200):  # type: ignore[arg-type]
            for n in range(1, 6):
                step(clock, renewals, 0.1)
                link.wait_for(f"renewal {n}", lambda n=n: link.count(11) == link.count(12) == n)
        for n in range(6, 9):  # the first GET goes on alone
            step(clock, renewals, 0.1)
            link.wait_for(f"renewal {n} of 11", lambda n=n: link.count(11) == n)
        assert link.count(12) == 5
    assert len(renewal_threads()) == 1
    step(clock, renewals, 1.0)
    time.sleep(0.05)  # a renewal after the GETs would have been sent by now
    assert (link.count(11), link.count(12)) == (8, 5)
    # every renewal of 11 came one half timeout after the previous: never a whole timeout
    times = [at for lease, at in link.sent if lease == 11]
    assert [round(b - a, 6) for a, b in itertools.pairwise(times)] == [0.1] * 7
    renewals.close()
    assert not renewal_threads()
    with (
        pytest.raises(StagingError, match="shutting down"),
        renewals.renewing(link, HANDLE, 13, 40),  # type: ignore[arg-type]
    ):
        pass


def test_a_renewal_not_yet_due_is_not_sent() -> None:
    clock = FakeClock()
    renewals, link = LeaseRenewals("node-b", clock), RecordingLink(clock)
    with renewals.renewing(link, HANDLE, 5, 1000):  # type: ignore[arg-type]
        step(clock, renewals, 0.499)
        time.sleep(0.05)
        assert link.count(5) == 0
        step(clock, renewals, 0.001)
        link.wait_for("the renewal at half the timeout", lambda: link.count(5) == 1)
    renewals.close()


def test_a_lease_without_deadline_starts_no_thread() -> None:
    clock = FakeClock()
    renewals, link = LeaseRenewals("node-b", clock), RecordingLink(clock)
    with renewals.renewing(link, HANDLE, 1, 0):  # type: ignore[arg-type]
        clock.advance(60.0)
    assert link.sent == [] and not renewal_threads()
    renewals.close()


def test_the_floor_bounds_a_tiny_timeout() -> None:
    """A 1 ms lease timeout would renew every 0.5 ms: the 5 ms floor holds it back."""
    clock = FakeClock()
    renewals, link = LeaseRenewals("node-b", clock), RecordingLink(clock)
    with renewals.renewing(link, HANDLE, 3, 1):  # type: ignore[arg-type]
        step(clock, renewals, 0.004)
        time.sleep(0.05)
        assert link.count(3) == 0
        step(clock, renewals, 0.001)
        link.wait_for("the renewal at the floor", lambda: link.count(3) == 1)
    renewals.close()
