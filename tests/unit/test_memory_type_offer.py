"""The consumer's offer says which memory it can GET from, and the owner answers RDMA for a
GPU slot only to an offer that covers CUDA memory: an old consumer (no field) is host only."""

from __future__ import annotations

import dataclasses

import pytest

from ray_velo.protocol import AcquireRequest, OwnerFacts, RdmaOffer, build_offer, decide_path
from ray_velo.protocol.messages import decode, encode

HOST_ONLY = RdmaOffer()
WITH_CUDA = RdmaOffer(memory_types=("host", "cuda"))
FACTS = OwnerFacts(
    offer=HOST_ONLY,
    has_registry=True,
    rdma_enabled=True,
    slot_pinned=True,
    total_len=1 << 20,
    rdma_min_bytes=64 << 10,
    draining=False,
)


@pytest.mark.parametrize(
    ("offer", "slot", "path", "reason"),
    [
        (HOST_ONLY, "host", "rdma", "ok"),  # as before the field existed
        (WITH_CUDA, "host", "rdma", "ok"),
        (WITH_CUDA, "cuda", "rdma", "ok"),
        (HOST_ONLY, "cuda", "chunked", "no_offer"),  # an old or GPU-less consumer
    ],
)
def test_the_offer_must_cover_the_slots_memory(
    offer: RdmaOffer, slot: str, path: str, reason: str
) -> None:
    facts = dataclasses.replace(FACTS, offer=offer, slot_memory_type=slot)
    decision = decide_path(facts, lambda: b"descriptor")
    assert (decision.path, decision.reason) == (path, reason)


def test_an_old_consumers_offer_is_host_only() -> None:
    """An offer map without memory_types (an old consumer) decodes as host only; a new
    one's list survives the wire."""
    old = encode(AcquireRequest(rdma=HOST_ONLY)).replace(b"memory_types", b"memory_typeX")
    assert decode(AcquireRequest, old).rdma == HOST_ONLY
    new = decode(AcquireRequest, encode(AcquireRequest(rdma=WITH_CUDA)))
    assert new.rdma is not None and new.rdma.memory_types == ("host", "cuda")


def test_build_offer_carries_the_memory_types() -> None:
    offer = build_offer(True, True, True, memory_types=("host", "cuda")).offer
    assert offer == WITH_CUDA
    assert build_offer(True, True, True).offer == HOST_ONLY
