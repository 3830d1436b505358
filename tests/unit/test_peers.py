"""The consumer's directory of owners (ray_velo.consumer.peers): links to a dead owner
incarnation are dropped, and every fetch that met it may look the node up again."""

from __future__ import annotations

from ray_velo.consumer.links import RayOwnerLink
from ray_velo.consumer.peers import PeerDirectory
from ray_velo.protocol import DataHandle


def directory(actors: list[str]) -> PeerDirectory:
    """A directory whose node lookup hands out the next of ``actors`` (the node's agent of
    the moment)."""
    return PeerDirectory(None, lambda node: actors.pop(0), lambda worker: None, "node-b")


def test_every_fetch_that_met_a_dead_owner_looks_it_up_again() -> None:
    """Three fetches on one node share the cached link to the owner's old agent; all three
    meet OwnerDied. The first drops the link, and the other two (whose link is no longer
    cached) may look the node up again too: each finds the new agent. (Answering "not
    cached" to them made those fetches fail with OwnerDied beside the one that retried.)"""
    peers = directory(["old agent", "new agent"])
    handle = DataHandle(7, 1, "node-a")
    links = [peers.link(handle) for _ in range(3)]
    assert all(link is links[0] for link in links)
    assert isinstance(links[0], RayOwnerLink) and links[0].actor == "old agent"
    assert [peers.forget(link) for link in links] == [True, True, True]
    fresh = peers.link(handle)
    assert isinstance(fresh, RayOwnerLink) and fresh.actor == "new agent"
    assert [peers.link(handle) for _ in range(2)] == [fresh, fresh]
