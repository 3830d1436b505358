"""Cost that does not grow with the work (issue 28), counted, not timed: the pure state objects
driven to 1,000 and to 100,000 live slots (with TTLs, jobs, thousands of leases held by other
processes and consumers), then one of each operation at each size. The work an operation does
is the lines of ray_velo code it runs (a trace: deterministic, whatever else the machine does);
an operation that walked the slots or leases would run a hundred times more at 100k."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import pytest

from ray_velo.protocol import DataHandle, TypeHeader
from ray_velo.state.agent import AgentStates
from ray_velo.state.owner import Effects
from tests.unit.test_owner_state import Buf

WORKER = 0x5CA1E
RAW = TypeHeader()
PRODUCER, READER, OTHER_READER, DEAD = 100, 200, 201, 300
CONSUMER = ("node-b", 7)


def lines_run(operation: Callable[[], object]) -> int:
    """Lines of ray_velo code executed while ``operation`` runs."""
    count = 0

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        if "ray_velo" not in frame.f_code.co_filename:
            return None  # not ours: do not trace inside it
        if event == "line":
            count += 1
        return trace

    sys.settrace(trace)
    try:
        operation()
    finally:
        sys.settrace(None)
    return count


@dataclass
class Node:
    """One agent's state with ``live`` slots: every tenth with a TTL far ahead, every slot of
    one of ten jobs, a local lease by a reader process on every fifth, an RDMA lease of a
    consumer agent on every tenth."""

    state: AgentStates
    handles: list[DataHandle]
    now: float = 0.0
    next_buf: int = 0

    @classmethod
    def with_slots(cls, live: int) -> Node:
        node = cls(AgentStates.new(WORKER, "node-a", id_key=bytes(16)), [])
        owner = node.state.owner
        for n in range(live):
            handle = node.put(ttl=3600.0 if n % 10 == 0 else None, job=f"job-{n % 10}")
            if n % 5 == 0:
                owner.local_acquire(handle, READER, "detach", 0.0)
            if n % 10 == 1:
                owner.grant(handle, 0.0, kind="rdma", timeout=600.0, consumer=CONSUMER)
        owner.supersede(*CONSUMER, 0.0, Effects())  # the consumer agent is known
        return node

    def put(self, **commit: Any) -> DataHandle:
        self.next_buf += 1
        writers = self.state.reservations
        rid, _ = writers.reserve(Buf(self.next_buf), "pooled", True, PRODUCER)
        handle = writers.commit(rid, 4096, RAW, commit.get("ttl"), 1, self.now, Effects(),
                                job=commit.get("job", ""))  # fmt: skip
        self.handles.append(handle)
        return handle


def operations(node: Node) -> dict[str, Callable[[], object]]:
    """One of each operation, on fresh slots of this node (so each runs the same steps at any
    size)."""
    owner, fx = node.state.owner, Effects()
    timed = node.put(ttl=1.0, job="job-new")
    leased, released, reffed, renewed = (node.put() for _ in range(4))
    owner.local_acquire(node.put(), DEAD, "detach", 0.0)
    assert timed.slot_id  # its TTL is the one due at 1.5
    rdma = owner.grant(renewed, 0.0, kind="rdma", timeout=600.0, consumer=CONSUMER)
    local: list[int] = []
    return {
        "put": lambda: node.put(),
        "local acquire": lambda: local.append(
            owner.local_acquire(leased, OTHER_READER, "detach", 0.0)[1].lease_id
        ),
        "end lease": lambda: owner.end_lease(leased, local[0], False, 0.0, fx),
        "ref": lambda: owner.ref(reffed),
        "renew": lambda: owner.renew(renewed, rdma.lease_id, 1.0),
        "release": lambda: owner.end_lease(released, 0, True, 0.0, fx),
        "sweep, nothing due": lambda: node.state.sweep(0.5, fx),
        "next due": lambda: node.state.next_due(),
        "sweep, one TTL due": lambda: node.state.sweep(1.5, fx),
        "job end": lambda: owner.end_job("job-new", 1.5, fx),
        "reap a dead reader": lambda: node.state.reap({DEAD}, 1.5, fx),
        "watched processes": lambda: node.state.watched_pids(),
        "counts": lambda: owner.counts(),
    }


@pytest.mark.slow
def test_no_operation_does_more_with_a_hundred_times_the_live_slots() -> None:
    small, large = Node.with_slots(1_000), Node.with_slots(100_000)
    work: dict[str, tuple[int, int]] = {}
    for (name, at_small), at_large in zip(
        operations(small).items(), operations(large).values(), strict=True
    ):
        work[name] = (lines_run(at_small), lines_run(at_large))
    for name, (lines_small, lines_large) in work.items():
        # the same steps at either size (a heap's Python-free sift aside)
        assert lines_large <= lines_small + 8, f"{name}: {lines_small} -> {lines_large} lines"
    assert small.state.owner.counts().live_handles < large.state.owner.counts().live_handles
    small.state.validate()
    large.state.validate()  # every count kept as the work happened equals a recount
