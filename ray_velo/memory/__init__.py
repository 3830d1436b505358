"""Staging memory: shared-memory arenas, the registered arena pool and caller-owned regions. No
Ray, no UCX: the UCX backend plugs in as a :class:`Registrar` (docs/architecture.md §2).

May import: errors, config, protocol.
"""

from __future__ import annotations

from ray_velo.memory.allocator import (
    GRANULE_BYTES,
    Allocation,
    OffsetAllocator,
    bytes_to_granules,
)
from ray_velo.memory.arena import (
    PAGE_BYTES,
    SEGMENT_PREFIX,
    SegmentMap,
    ShmArena,
    page_round_up,
    remove_stale_segments,
    segment_name,
)
from ray_velo.memory.pool import (
    ArenaPool,
    Fallback,
    FallbackReason,
    NoopRegistrar,
    NoopRegistration,
    Placement,
    Registrar,
    Registration,
    RegistrationBudget,
    page_range,
)
from ray_velo.memory.region import (
    COPY_GATE_CHUNK_BYTES,
    Deregistered,
    DeregisteredSignal,
    Drained,
    DrainTimedOut,
    InFlight,
    Region,
    RegionGuard,
    RegionState,
    RegionWatch,
)

__all__ = [
    "COPY_GATE_CHUNK_BYTES",
    "GRANULE_BYTES",
    "PAGE_BYTES",
    "SEGMENT_PREFIX",
    "Allocation",
    "ArenaPool",
    "Deregistered",
    "DeregisteredSignal",
    "DrainTimedOut",
    "Drained",
    "Fallback",
    "FallbackReason",
    "InFlight",
    "NoopRegistrar",
    "NoopRegistration",
    "OffsetAllocator",
    "Placement",
    "Region",
    "RegionGuard",
    "RegionState",
    "RegionWatch",
    "Registrar",
    "Registration",
    "RegistrationBudget",
    "SegmentMap",
    "ShmArena",
    "bytes_to_granules",
    "page_range",
    "page_round_up",
    "remove_stale_segments",
    "segment_name",
]
