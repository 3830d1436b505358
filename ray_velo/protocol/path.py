"""Which path a transfer takes: the owner's eight checks and the consumer's offer rule
(docs/protocol.md §7, §8). The first refusal names the label counted in
``velo_rendezvous_rdma_path_total{path="chunked"}``:

====  ===============================================================  ===============
 #    check                                                            refusal label
====  ===============================================================  ===============
 1    the consumer sent an RDMA offer                                  no_offer
 2    this owner has an RDMA registry (UCX is up)                      not_configured
 3    the RDMA path is enabled here (kill switch off)                  kill_switch
 4    the slot is staged in registered memory                          not_pinned
 5    the payload is at least rdma_min_bytes                           below_min
 6    the offer names the backend this owner serves ("ucx")            no_offer
 6b   the offer names the slot's memory type (host, or cuda)           no_offer
 7    the owner is not draining                                        draining
 8    the staging still exists and the descriptor encodes              not_pinned
====  ===============================================================  ===============

Check 8 builds the descriptor (or, for a windowed plain slot, opens its windows), so it is a
callable the owner passes in; everything else is a plain fact.

The wire path (``path="wire"``): where no RDMA answer comes out of those checks, and the
offer names ``"wire"`` (the consumer reads over the agents' authenticated wire, and the owner
sends), the owner answers with a wire lease if

====  ===============================================================  ===============
 #    check                                                            refusal label
====  ===============================================================  ===============
 W1   this owner serves bulk reads on its wire                         (the RDMA label)
 W2   the slot's bytes are host memory it holds (not empty, not GPU)   (the RDMA label)
 W3   the payload is at least rdma_min_bytes                           below_min
 W4   the owner is not draining                                        draining
====  ===============================================================  ===============

A refusal there keeps the RDMA checks' label when W1 or W2 fails (the facts that kept the
payload off both paths are theirs). A plain slot whose consumer also offered windows goes
over the wire when it can: nothing has to be registered for it. Exactly one decision is
counted per acquire.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from ray_velo.errors import DescriptorError
from ray_velo.protocol.messages import RdmaOffer

__all__ = [
    "CONSUMER_FAILURE_REASONS",
    "DEVICE_STAGING_REASONS",
    "OFFER_UCX",
    "OFFER_WIRE",
    "OWNER_REFUSAL_REASONS",
    "STAGING_FALLBACK_REASONS",
    "ConsumerOffer",
    "OwnerFacts",
    "PathDecision",
    "build_offer",
    "decide_path",
]

Path = Literal["rdma", "wire", "chunked"]

#: The backend names an offer lists: a UCX GET, or a read over the agents' wire.
OFFER_UCX = "ucx"
OFFER_WIRE = "wire"

OWNER_REFUSAL_REASONS = (
    "no_offer",
    "not_configured",
    "kill_switch",
    "not_pinned",
    "below_min",
    "draining",
)
#: Reasons the consumer records after an RDMA answer it could not use.
CONSUMER_FAILURE_REASONS = ("decode_error", "pool_exhausted", "get_failed")
#: Reasons the owner records when register_data_pinned falls back to plain memory.
STAGING_FALLBACK_REASONS = ("kill_switch", "budget", "pool_exhausted")
#: Reasons the owner records (``velo_device_staged``) when a CUDA tensor is staged through
#: host memory (one device-to-host copy) instead of a GPU arena of its node. ``no_gpu_arena``:
#: the tensor's GPU has no open arena (no CUDA-capable UCX, no GPU arena configured, its
#: allocation or registration failed); ``gpu_budget``: the GPU's device budget cannot take
#: the arena; ``gpu_pool_exhausted``: the arena has no free range that large.
DEVICE_STAGING_REASONS = ("no_gpu_arena", "gpu_budget", "gpu_pool_exhausted")


@dataclass(frozen=True, slots=True)
class OwnerFacts:
    """What the owner knows when an acquire arrives."""

    offer: RdmaOffer | None
    has_registry: bool
    rdma_enabled: bool
    slot_pinned: bool
    total_len: int
    rdma_min_bytes: int
    draining: bool
    backend: str = OFFER_UCX
    windowed: bool = False  # a plain slot, and the offer says the consumer takes windows
    slot_memory_type: str = "host"  # "cuda" for a slot in a GPU arena
    serves_wire: bool = False  # this owner sends bulk reads on its wire
    slot_in_memory: bool = False  # the slot's bytes are in memory here (a buffer, a region)


@dataclass(frozen=True, slots=True)
class PathDecision:
    """The path, the reason label, and the descriptor bytes when the path is RDMA (none
    when ``windowed``: the consumer asks for each window's)."""

    path: Path
    reason: str
    descriptor: bytes = b""
    windowed: bool = False


def decide_path(
    facts: OwnerFacts,
    build_descriptor: Callable[[], bytes | None],
    open_windows: Callable[[], bool] = lambda: False,
) -> PathDecision:
    """Run the eight checks in order, then the wire's (the module's tables).
    ``build_descriptor`` runs only if checks 1-7 pass; it returns the encoded descriptor, or
    None when the staging is gone (check 8). For a windowed slot ``open_windows`` runs
    instead: False when no window can be registered."""
    wire = facts.offer is not None and OFFER_WIRE in facts.offer.backends
    if wire and not facts.slot_pinned:  # plain memory: nothing to register for the wire
        facts = dataclasses.replace(facts, windowed=False)
    rdma = _decide_rdma(facts, build_descriptor, open_windows)
    if rdma.path == "rdma" or not wire:
        return rdma
    if not facts.serves_wire or not facts.slot_in_memory or facts.slot_memory_type != "host":
        return rdma
    if facts.total_len < facts.rdma_min_bytes:
        return PathDecision("chunked", "below_min")
    if facts.draining:
        return PathDecision("chunked", "draining")
    return PathDecision("wire", "ok")


def _decide_rdma(
    facts: OwnerFacts,
    build_descriptor: Callable[[], bytes | None],
    open_windows: Callable[[], bool],
) -> PathDecision:
    """The protocol's eight checks."""
    if facts.offer is None:
        return PathDecision("chunked", "no_offer")
    if not facts.has_registry:
        return PathDecision("chunked", "not_configured")
    if not facts.rdma_enabled:
        return PathDecision("chunked", "kill_switch")
    windowed = not facts.slot_pinned and facts.windowed
    if not facts.slot_pinned and not windowed:
        return PathDecision("chunked", "not_pinned")
    if facts.total_len < facts.rdma_min_bytes:
        return PathDecision("chunked", "below_min")
    if facts.backend not in facts.offer.backends:
        return PathDecision("chunked", "no_offer")
    if facts.slot_memory_type not in facts.offer.memory_types:
        # A consumer that cannot GET device memory (an old one, or one without GPU arenas):
        # its offer does not cover this slot, so the owner serves it by chunks.
        return PathDecision("chunked", "no_offer")
    if facts.draining:
        return PathDecision("chunked", "draining")
    if windowed:
        if not open_windows():
            return PathDecision("chunked", "not_pinned")
        return PathDecision("rdma", "ok", windowed=True)
    try:
        descriptor = build_descriptor()
    except DescriptorError:
        descriptor = None
    if not descriptor:
        return PathDecision("chunked", "not_pinned")
    return PathDecision("rdma", "ok", descriptor)


@dataclass(frozen=True, slots=True)
class ConsumerOffer:
    """The consumer's offer (None: no offer) and, without one, the reason it records."""

    offer: RdmaOffer | None
    reason: str | None


def build_offer(
    has_registry: bool,
    rdma_enabled: bool,
    peer_registered: bool,
    backend: str = OFFER_UCX,
    *,
    windows: bool = False,
    memory_types: tuple[str, ...] = ("host",),
    wire: bool = False,
) -> ConsumerOffer:
    """The consumer's offer from its three local facts; ``windows``: it can GET through
    windows (it reaches the owner's ``_rv_window``); ``memory_types``: the memory it can GET
    from (``("host", "cuda")`` once it has GPU arenas); ``wire``: it can read this owner's
    bytes over the agents' wire (the owner has a bulk port, this agent its credentials).

    A peer not registered yet (cold start) gets no UCX offer: the first transfer from an
    unknown owner pulls chunks (or reads over the wire), later ones take the RDMA path. The
    wire needs no registration: it is offered whatever the three facts say (the kill switch
    turns the RDMA path off, not the wire).
    """
    reason: str | None = None
    if not has_registry:
        reason = "not_configured"
    elif not rdma_enabled:
        reason = "kill_switch"
    elif not peer_registered:
        reason = "no_offer"
    if reason is not None and not wire:
        return ConsumerOffer(None, reason)
    backends = (() if reason is not None else (backend,)) + ((OFFER_WIRE,) if wire else ())
    offer = RdmaOffer(backends=backends, windows=windows, memory_types=memory_types)
    return ConsumerOffer(offer, None)
