"""Lifetimes on a real two-node cluster: a handle ends before its bytes, and bytes are never
handed to anyone while someone may still read them.

Each test here is a defect a user met (issue 9): it failed before the owner kept the end of a
handle apart from the end of its bytes.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import ray

import ray_velo as rv
from ray_velo.config import MiB
from tests.on_ray.conftest import agent_info, wait_until_freed

pytestmark = [pytest.mark.ray, pytest.mark.multinode]

ON_A = {"resources": {"node_a": 1}, "num_cpus": 0}
ON_B = {"resources": {"node_b": 1}, "num_cpus": 0}


def test_ttl_ends_the_handle_never_the_bytes_under_a_live_view(velo: None) -> None:
    """A same-node zero-copy view outlives its slot's TTL; six more puts follow. The view still
    reads its own bytes, the handle is gone with the TTL named, and the pages return to the
    pool once the view is collected."""
    handle = rv.put(np.full(8 * MiB, 7, np.uint8), ttl=1.0)
    view = rv.fetch(handle, release=False)
    gone = wait_until_freed(handle, timeout_s=10.0)
    assert "TTL" in str(gone)
    others = [rv.put(np.full(8 * MiB, 9, np.uint8)) for _ in range(6)]
    assert int(view.min()) == int(view.max()) == 7, "the view read another payload's bytes"
    with pytest.raises(rv.HandleNotFound, match="TTL"):
        rv.fetch(handle)
    for other in others:
        rv.fetch(other)  # consumes them; the views die at once
    live = agent_info("node_a")["live_slots"]
    del view
    deadline = time.monotonic() + 10
    while agent_info("node_a")["live_slots"] >= live:
        assert time.monotonic() < deadline, "the TTL'd slot's bytes outlived its last view"
        time.sleep(0.05)


@ray.remote(**ON_B)
def fetch_twice_on_b(handle: rv.DataHandle) -> tuple[int, str]:
    first = rv.fetch(handle)  # consumes the only reference
    try:
        rv.fetch(handle)
    except rv.HandleNotFound as exc:
        return int(first.sum()), str(exc)
    return int(first.sum()), "second fetch succeeded"


def test_a_released_handle_is_refused_while_its_bytes_are_still_read(velo: None) -> None:
    """fetch() consumes the only reference: a second fetch of the handle is refused, on the
    owner's node and on another node, even while the first fetch's view is alive."""
    handle = rv.put(np.ones(4 * MiB, np.uint8))
    x = rv.fetch(handle)
    with pytest.raises(rv.HandleNotFound, match="released"):
        rv.fetch(handle)
    assert int(x.sum()) == 4 * MiB
    del x
    remote = rv.put(np.ones(4 * MiB, np.uint8))
    total, second = ray.get(fetch_twice_on_b.remote(remote))
    assert total == 4 * MiB
    assert "released" in second, second


@rv.transfer(consumers=2)
@ray.remote(**ON_A)
def two_uses() -> np.ndarray:
    return np.arange(2 * MiB, dtype=np.uint8)


@rv.transfer
@ray.remote(num_cpus=0)
def hold_and_sum(array: np.ndarray, hold_s: float) -> int:
    time.sleep(hold_s)  # every resolution overlaps the others'
    return int(array.sum(dtype=np.uint64))


def test_consumers_n_is_exact_under_concurrency(velo: None) -> None:
    """consumers=2, four decorated consumers at once (two on the owner's node, two on the
    other, where they may share a node-local copy): exactly two succeed, two get
    HandleReleased naming the option."""
    staged = two_uses.remote()
    calls = [
        hold_and_sum.options(resources={node: 1}).remote(staged, 1.0)
        for node in ("node_a", "node_a", "node_b", "node_b")
    ]
    outcomes: list[Any] = []
    for call in calls:
        try:
            outcomes.append(ray.get(call))
        except rv.HandleReleased as exc:
            outcomes.append(exc)
    expected = int(np.arange(2 * MiB, dtype=np.uint8).sum(dtype=np.uint64))
    assert sorted(o for o in outcomes if isinstance(o, int)) == [expected, expected], outcomes
    refused = [o for o in outcomes if isinstance(o, rv.HandleReleased)]
    assert len(refused) == 2 and all("consumers=" in str(o) for o in refused)


def test_idle_warm_memory_never_refuses_a_region(velo: None) -> None:
    """After a 512 MiB payload is staged and released, its dedicated arena stays warm; a
    640 MiB region still fits the 1 GiB budget: idle warm memory is evicted first."""
    handle = rv.put(np.zeros(512 * MiB, np.uint8))
    rv.fetch(handle)
    wait_until_freed(handle)
    guard = rv.alloc_region(640 * MiB)
    try:
        assert guard.nbytes == 640 * MiB
        info = agent_info("node_a")
        assert info["registered_bytes"] <= 1 << 30
    finally:
        guard.unregister()
