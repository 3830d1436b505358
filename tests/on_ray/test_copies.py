"""One payload to several nodes on a real three-node cluster: the second node reads the first
node's copy as it fills (the owner hands it out), the copies end when the owner's handle
does, and a copy whose node dies mid-read leaves its reader to finish from the owner.

Node a owns (the driver puts); node b and a third node c (added for each test) consume. A
copy's agent pauses after each 16 MiB piece lands (``copy_piece_pause_s``), so the second
reader provably starts while the first copy is still filling.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import ray

import ray_velo as rv
from ray_velo.actors.directory import alive_node_ids, ensure_agent, register_all_peers
from ray_velo.config import MiB
from ray_velo.ops import cleanup_local
from tests.on_ray.conftest import (
    TEST_CONFIG,
    node_ids,
    pid_alive,
    wait_for,
    wait_until_freed,
)

pytestmark = [pytest.mark.ray, pytest.mark.multinode]

SIZE = 64 * MiB  # four pieces
TTL_S = 8.0


@ray.remote(num_cpus=0)
def crc_of(handle: rv.DataHandle, release: bool) -> int:
    return zlib.crc32(np.ascontiguousarray(rv.fetch(handle, release=release)))


def pattern(nbytes: int, seed: int = 3) -> np.ndarray:
    return ((np.arange(nbytes, dtype=np.uint64) * 151 + seed) % 253).astype(np.uint8)


def on(node: str) -> Any:
    return crc_of.options(resources={node: 1})


def info(node_id: str) -> dict[str, Any]:
    return ray.get(ensure_agent(node_id).info.remote(), timeout=30)  # type: ignore[no-any-return]


def relayed(node_id: str) -> int:
    return int(info(node_id)["metrics"]["velo_relay_fetches_total"])


@pytest.fixture()
def nodes(velo: None, node_c: str) -> Iterator[dict[str, str]]:
    """Node ids of a, b and c, every agent wired to every other (RDMA from the first
    fetch); copy pauses turned off again afterwards."""
    ids = {**node_ids(), "node_c": node_c}
    register_all_peers({n: ensure_agent(n) for n in alive_node_ids()})
    yield ids
    for node_id in ids.values():
        if node_id in alive_node_ids():
            ray.get(ensure_agent(node_id).inject_fault.remote("copy_piece_pause_s", 0.0))


def start_source(
    ids: dict[str, str], node: str, handle: rv.DataHandle, release: bool, pause_s: float = 1.0
) -> Any:
    """The first reader, on ``node``: its copy fills slowly (``pause_s`` after each piece,
    longer than a task's worker takes to start); returns once the owner has granted it (so
    the next reader is pointed at its copy)."""
    ray.get(ensure_agent(ids[node]).inject_fault.remote("copy_piece_pause_s", pause_s))
    sources = info(ids["node_a"])["copy_sources"]
    first = on(node).remote(handle, release)
    wait_for(
        "the owner counts the first copy", lambda: info(ids["node_a"])["copy_sources"] > sources
    )
    return first


def test_a_second_node_reads_the_first_nodes_copy_as_it_fills(nodes: dict[str, str]) -> None:
    payload = pattern(SIZE)
    handle = rv.put(payload)
    rv.ref_handle(handle)  # two consumers
    before = relayed(nodes["node_c"])
    first = start_source(nodes, "node_b", handle, release=True)
    second = on("node_c").remote(handle, True)
    assert ray.get([first, second], timeout=120) == [zlib.crc32(payload)] * 2
    assert relayed(nodes["node_c"]) == before + 1  # node c's bytes came from node b's copy
    # Both consumed: the owner ends the handle and tells both copies, which go.
    with pytest.raises(rv.HandleNotFound):
        rv.metadata(handle)
    wait_for(
        "both copies freed after the handle ended",
        lambda: all(info(nodes[n])["copies"] == 0 for n in ("node_b", "node_c")),
    )
    assert info(nodes["node_a"])["copy_sources"] == 0


def test_a_copy_kept_for_its_owner_serves_a_later_reader_then_ends_with_the_handle(
    nodes: dict[str, str],
) -> None:
    """Node b's copy outlives its reader while the owner's handle lives: a later fetch on
    node b reads it (no second transfer); releasing the handle at the owner ends it."""
    payload = pattern(SIZE, 9)
    handle = rv.put(payload)
    b = nodes["node_b"]
    fetches = dict(info(b)["metrics"]["velo_fetches_total"])
    assert ray.get(on("node_b").remote(handle, False), timeout=60) == zlib.crc32(payload)
    assert info(b)["copies"] == 1  # its reader is gone; the copy stays for the owner
    assert ray.get(on("node_b").remote(handle, False), timeout=60) == zlib.crc32(payload)
    after = dict(info(b)["metrics"]["velo_fetches_total"])
    assert after.get("cache", 0) - fetches.get("cache", 0) == 1, (fetches, after)
    rv.release(handle, 0)
    wait_for("node b's copy freed", lambda: info(b)["copies"] == 0)


@pytest.mark.parametrize("end", ["release", "ttl"])
def test_the_owner_ending_the_handle_while_copies_serve_ends_them_after_their_reads(
    nodes: dict[str, str], end: str
) -> None:
    """The handle ends at the owner (released, or its TTL fires) while node c reads node b's
    filling copy. Released: both reads finish with the right bytes (their leases hold the
    bytes). The TTL: the reader gave up, so the owner stops sending at once (the wire
    leases end with the handle) and both reads fail naming the TTL, never with a wrong
    byte. Then every copy and the owner's slot go, and the handle is gone everywhere."""
    payload = pattern(SIZE, 5)
    # The TTL: long enough for both readers to start (a worker may take seconds to start on
    # a loaded machine), short of the read (three pieces to land after pauses of 4 s).
    ttl = TTL_S if end == "ttl" else None
    handle = rv.put(payload, ttl=ttl)
    first = start_source(nodes, "node_b", handle, release=False, pause_s=4.0 if ttl else 1.0)
    second = on("node_c").remote(handle, False)
    wait_for("node c reads node b's copy", lambda: info(nodes["node_b"])["relay_readers"] > 0)
    if end == "release":
        rv.release(handle, 0)
    else:
        wait_until_freed(handle, timeout_s=TTL_S)
        assert info(nodes["node_b"])["relay_readers"] > 0, "the TTL fired after the reads"
    if end == "release":
        assert ray.get([first, second], timeout=120) == [zlib.crc32(payload)] * 2
    else:
        for read in (first, second):
            with pytest.raises(ray.exceptions.RayTaskError, match="TTL"):
                ray.get(read, timeout=120)
    with pytest.raises(rv.HandleNotFound):
        rv.metadata(handle)
    wait_for(
        "the copies freed after the release",
        lambda: all(info(nodes[n])["copies"] == 0 for n in ("node_b", "node_c")),
    )
    with pytest.raises(rv.HandleNotFound):
        ray.get(on("node_b").remote(handle, False), timeout=60)


def test_a_reader_whose_copy_dies_mid_read_finishes_from_the_owner(
    nodes: dict[str, str], cluster: Any
) -> None:
    """Node c fills the copy node b reads; node c is removed (its raylet, workers and agent
    killed) mid-read: node b's fetch finishes from the owner with the right bytes."""
    payload = pattern(SIZE, 11)
    handle = rv.put(payload)
    b, c = nodes["node_b"], nodes["node_c"]
    before, renewals = relayed(b), info(c)["relay_renewals"]
    first = start_source(nodes, "node_c", handle, release=False, pause_s=5.0)
    second = on("node_b").remote(handle, False)
    # A renewal follows node b's GET of the first piece; two pieces are still to land.
    wait_for("node b read part of node c's copy", lambda: info(c)["relay_renewals"] > renewals)
    dead_pid = info(c)["pid"]
    cluster.remove_node(next(n for n in cluster.list_all_nodes() if n.node_id == c))
    assert ray.get(second, timeout=120) == zlib.crc32(payload)
    assert relayed(b) == before + 1  # it read part of the copy before the copy died
    ray.cancel(first, force=True)  # its node is gone: Ray would retry it elsewhere, forever
    rv.release(handle, 0)  # node c's lease on it is reaped a lease timeout later
    wait_for("node c's agent is gone", lambda: not pid_alive(dead_pid))
    assert cleanup_local(TEST_CONFIG.shm_dir).removed  # what the killed agent left


@pytest.fixture()
def torch_velo() -> Any:
    """torch, with ``"VELO"`` registered in this driver (ray_velo came first)."""
    torch = pytest.importorskip("torch")
    rv.register_transports()
    return torch


def weight_sync(torch: Any) -> tuple[Any, Any]:
    """A trainer on node a returning its weights with VELO, and the rollout actor class: its
    ``load`` answers the crc of the weights it took and zeroes them when told (its own
    tensor: nobody else may see this write)."""

    @ray.remote(num_cpus=0, resources={"node_a": 1}, enable_tensor_transport=True)
    class Trainer:
        @ray.method(tensor_transport="VELO")
        def weights(self) -> Any:
            return torch.from_numpy(pattern(SIZE, 13))

    @ray.remote(num_cpus=0, enable_tensor_transport=True)
    class Rollout:
        def load(self, weights: Any, zero: bool) -> int:
            crc = zlib.crc32(weights.numpy())
            if zero:
                weights.fill_(0)
            return crc

    return Trainer.remote(), Rollout


def warm_tensor() -> Any:
    """What a rollout actor loads first, before the weights (its worker and session up)."""
    import torch

    return torch.zeros(1)


def test_one_weights_ref_to_two_nodes_reads_the_first_receivers_copy(
    nodes: dict[str, str], torch_velo: Any
) -> None:
    """One RDT ref of a trainer on node a taken by rollout actors on nodes b and c (the
    weight-sync shape): node c's receive reads node b's PinnedWriter as it fills (the link
    out of node a carries the bytes once). Node b's receiver zeroes its tensor the moment it
    has it: node c's bytes are still the trainer's (node b's receive returns only once node
    c's reads of its copy ended), and no relay or lent copy is left on node b."""
    trainer, rollout = weight_sync(torch_velo)
    b_actor = rollout.options(resources={"node_b": 1}).remote()
    c_actor = rollout.options(resources={"node_c": 1}).remote()
    c = nodes["node_c"]
    # node b fills its copy slowly; node c reads it slower still (it lags two pieces behind
    # when node b has all its bytes): node b's receive must wait for it
    ray.get(ensure_agent(c).inject_fault.remote("copy_piece_pause_s", 1.0))
    second_reads_first(nodes, trainer, b_actor, c_actor, reader_node=c)
    for actor in (trainer, b_actor, c_actor):
        ray.kill(actor)


def test_two_receivers_on_one_node_take_the_weights_over_its_link_once(
    nodes: dict[str, str], torch_velo: Any
) -> None:
    """Two rollout actors on node b (one host, several GPUs) take one RDT ref of a trainer on
    node a: the second's receive copies the first's PinnedWriter in memory as it fills, so
    node b's link carries the weights once. The first zeroes its tensor the moment it has
    it: the second's bytes are still the trainer's (the first's receive returns only once the
    second read them all), and each keeps a writer of its own."""
    trainer, rollout = weight_sync(torch_velo)
    first, second = (rollout.options(resources={"node_b": 1}).remote() for _ in range(2))
    b = nodes["node_b"]
    fetches = dict(info(b)["metrics"]["velo_fetches_total"])
    second_reads_first(nodes, trainer, first, second, reader_node=b)
    after = dict(info(b)["metrics"]["velo_fetches_total"])
    # two receives over the wire (one of them copied the first's writer: relayed)
    assert after.get("wire", 0) - fetches.get("wire", 0) == 2, (fetches, after)
    for actor in (trainer, first, second):
        ray.kill(actor)


def second_reads_first(
    nodes: dict[str, str], trainer: Any, first: Any, second: Any, reader_node: str
) -> None:
    """``first`` (on node b, its copy filling slowly) and then ``second`` take the trainer's
    weights; ``first`` zeroes its own the moment it has them. Both must get the trainer's
    bytes, ``second``'s from ``first``'s writer (``reader_node``'s agent counts the relayed
    fetch), and nothing of the copy is left on node b."""
    want = zlib.crc32(pattern(SIZE, 13))
    b = nodes["node_b"]
    ray.get([first.load.remote(warm_tensor(), False), second.load.remote(warm_tensor(), False)])
    ref = trainer.weights.remote()
    before = relayed(reader_node)
    ray.get(ensure_agent(b).inject_fault.remote("copy_piece_pause_s", 0.5))
    sources = info(nodes["node_a"])["copy_sources"]
    taken = first.load.remote(ref, True)
    wait_for(
        "the owner counts node b's copy",
        lambda: info(nodes["node_a"])["copy_sources"] > sources,
    )
    assert ray.get([taken, second.load.remote(ref, False)], timeout=120) == [want, want]
    assert relayed(reader_node) == before + 1  # its bytes came from the first's writer
    assert info(b)["relay_readers"] == 0
    wait_for("the owner forgot node b's copy", lambda: info(nodes["node_a"])["copy_sources"] == 0)
