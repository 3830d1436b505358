"""The consumer's RDMA lease renewals (one thread per agent for every GET in flight): a GET
that outlives half its lease timeout keeps the lease renewed, renewals stop with the GET,
and the thread ends with the agent. A link that records sends, real time, no Ray."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from ray_velo.consumer.driver import LeaseRenewals
from ray_velo.errors import StagingError
from ray_velo.protocol import DataHandle, LeaseRenewRequest, decode


class RecordingLink:
    node = "node-a"

    def __init__(self) -> None:
        self.sent: list[tuple[str, int, float]] = []
        self.lock = threading.Lock()

    def send(self, method: str, message: bytes) -> None:
        request = decode(LeaseRenewRequest, message)
        with self.lock:
            self.sent.append((method, request.lease_id, time.monotonic()))

    def count(self, lease_id: int) -> int:
        with self.lock:
            return sum(1 for _, lease, _ in self.sent if lease == lease_id)


def renewal_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ray_velo-lease-renewals"]


def test_a_long_get_renews_every_half_timeout_and_stops_with_the_get() -> None:
    """Two GETs at once, 200 ms leases: each renewed about every 100 ms while it runs (a
    lease unrenewed for a whole timeout would be reaped by the owner mid-GET), never after
    its GET ended; one thread serves both and ends with close()."""
    renewals, link = LeaseRenewals(), RecordingLink()
    handle = DataHandle(7, 1, "node-a")
    with renewals.renewing(link, handle, 11, 200):  # type: ignore[arg-type]
        with renewals.renewing(link, handle, 12, 200):  # type: ignore[arg-type]
            time.sleep(1.0)
        ended_12 = link.count(12)
        time.sleep(0.5)
    ended_11 = link.count(11)
    assert len(renewal_threads()) == 1
    time.sleep(0.3)
    assert link.count(12) == ended_12 and link.count(11) == ended_11  # none after the GET
    assert ended_12 >= 5 and ended_11 >= ended_12 + 3, link.sent
    times = [at for _, lease, at in link.sent if lease == 11]
    assert max(b - a for a, b in itertools.pairwise(times)) < 0.2  # < one timeout
    renewals.close()
    assert not renewal_threads()
    with (
        pytest.raises(StagingError, match="shutting down"),
        renewals.renewing(link, handle, 13, 40),  # type: ignore[arg-type]
    ):
        pass


def test_a_lease_without_deadline_starts_no_thread() -> None:
    renewals, link = LeaseRenewals(), RecordingLink()
    with renewals.renewing(link, DataHandle(7, 1, "n"), 1, 0):  # type: ignore[arg-type]
        time.sleep(0.05)
    assert link.sent == [] and not renewal_threads()
    renewals.close()


def test_the_floor_bounds_a_tiny_timeout() -> None:
    """A 1 ms lease timeout would renew every 0.5 ms: the 5 ms floor holds it back."""
    renewals, link = LeaseRenewals(), RecordingLink()
    with renewals.renewing(link, DataHandle(7, 1, "n"), 3, 1):  # type: ignore[arg-type]
        time.sleep(0.1)
    renewals.close()
    assert 2 <= link.count(3) <= 21
