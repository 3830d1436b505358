"""DataHandle: the compact name of a staged payload (docs/protocol.md §2)."""

from __future__ import annotations

import reprlib
from dataclasses import dataclass, field
from typing import Any

from ray_velo.errors import ProtocolError

__all__ = ["U64_MAX", "DataHandle", "HandleMetadata"]

U64_MAX = (1 << 64) - 1


@dataclass(frozen=True, slots=True, order=True)
class DataHandle:
    """Names one staged payload: ``(worker_id << 64) | slot_id``.

    Hashable, picklable, and cheap to pass as a Ray task argument.
    """

    worker_id: int
    slot_id: int
    #: The owner agent's Ray node id, a routing hint carried by pickled handles. Not part of
    #: the u128 identity and not on the wire; a handle without it is routed by worker id.
    owner_node: str = field(default="", compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("worker_id", "slot_id"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value <= U64_MAX:
                # reprlib: the value may be a peer's, nested past repr()'s recursion limit.
                raise ProtocolError(f"DataHandle.{name} must be a u64, got {reprlib.repr(value)}")

    @property
    def value(self) -> int:
        """The handle as one u128 integer."""
        return (self.worker_id << 64) | self.slot_id

    @classmethod
    def from_int(cls, value: int) -> DataHandle:
        """The handle whose u128 value is ``value``. Raises ProtocolError out of range."""
        if not 0 <= value < (1 << 128):
            raise ProtocolError(f"a DataHandle is a u128, got {value!r}")
        return cls(value >> 64, value & U64_MAX)

    def to_wire(self) -> dict[str, int]:
        """The wire form ``{"hi": worker_id, "lo": slot_id}`` (MessagePack has no u128)."""
        return {"hi": self.worker_id, "lo": self.slot_id}

    @classmethod
    def from_wire(cls, wire: Any) -> DataHandle:
        """Parse the wire form ``{hi, lo}``. Raises ProtocolError for anything else."""
        if not isinstance(wire, dict) or "hi" not in wire or "lo" not in wire:
            raise ProtocolError(f"a DataHandle on the wire is {{hi, lo}}, got {reprlib.repr(wire)}")
        return cls(wire["hi"], wire["lo"])

    def __str__(self) -> str:
        return f"{self.worker_id:016x}:{self.slot_id:x}"

    def __repr__(self) -> str:
        return f"DataHandle({self})"


@dataclass(frozen=True, slots=True)
class HandleMetadata:
    """What ``metadata(handle)`` answers: size in bytes, live references, pinned or not."""

    size: int
    refcount: int
    pinned: bool
