"""What an agent hands the processes of its node, as small frozen records: a segment path and a
byte range, never memory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ray_velo.protocol import DataHandle, TypeHeader

__all__ = ["LocalLease", "RegionInfo", "Reservation", "lease_of"]


@dataclass(frozen=True, slots=True)
class Reservation:
    """Where a local producer writes a payload before committing it, and the handle the
    slot will have once committed."""

    reservation_id: int
    path: str
    offset: int
    nbytes: int
    dedicated: bool
    handle: DataHandle


@dataclass(frozen=True, slots=True)
class LocalLease:
    """A lease a local process holds on a slot of its own node's agent, read in place.

    ``handle`` is the slot the lease is on (a local copy for a cross-node fetch);
    ``remote_lease_id`` is the owner's lease still held for ``get``-style reads (0: none).
    """

    handle: DataHandle
    lease_id: int
    path: str
    offset: int
    total_len: int
    type_header: TypeHeader
    dedicated: bool
    remote_lease_id: int = 0


@dataclass(frozen=True, slots=True)
class RegionInfo:
    """A caller-owned region as its process sees it: a segment to map and write."""

    region_id: int
    path: str
    nbytes: int
    effective_range: tuple[int, int]


def lease_of(
    worker_id: int, node: str, slot: Any, lease_id: int, remote_lease_id: int = 0
) -> LocalLease:
    """The record for a lease ``lease_id`` on ``slot`` (a store Slot) of this agent."""
    handle = DataHandle(worker_id, slot.slot_id, node)
    placement = slot.location
    if placement is None or not hasattr(placement, "arena"):
        return LocalLease(
            handle, lease_id, "", 0, slot.total_len, slot.type_header, False, remote_lease_id
        )
    return LocalLease(
        handle,
        lease_id,
        placement.arena.path,
        placement.offset_bytes,
        slot.total_len,
        slot.type_header,
        placement.dedicated,
        remote_lease_id,
    )
