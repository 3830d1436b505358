"""The buffer ledger: the one holder of each pool buffer an agent handed out, moved only by
checked transitions (docs/architecture.md §4). Pure: no I/O, no clock."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

from ray_velo.protocol.handle import DataHandle

if TYPE_CHECKING:
    from ray_velo.memory.pool import Registration
    from ray_velo.memory.windows import WindowSet

__all__ = [
    "QUARANTINE", "Anchor", "Buffer", "BufferLedger", "Effects", "Holder", "HolderKind", "Holdings",
]  # fmt: skip


class Buffer(Protocol):
    """A range of a pool's memory (``memory.pool.Placement`` in the agent; the ledger needs
    only ``key`` and ``nbytes``, the roles reading or GETting it the rest)."""

    @property
    def key(self) -> tuple[str, int]: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def address(self) -> int: ...

    @property
    def registration(self) -> Registration | None: ...

    def view(self) -> memoryview: ...


class Anchor(Protocol):
    """A region's in-flight anchor (``memory.region.Anchor``): released once, when the slot
    staged over it has no reader left."""

    def release(self) -> None: ...


@dataclass(slots=True)
class Effects:
    """What the caller performs, outside the lock, after a call.

    ``free``: (buffer, pinned) pairs to give back to the pinned or plain pool, in order.
    ``anchors``: region in-flight anchors to release. ``poke``: a deadline may have moved:
    let the timer look again. ``copy_ends``: (handle, node, worker) of copies on other nodes
    whose agents must hear that the handle ended. ``windows``: window sets of ended RDMA
    leases (``ray_velo.memory.windows``), closed before anything in ``free`` goes back.
    """

    free: list[tuple[Buffer, bool]] = field(default_factory=list)
    windows: list[WindowSet] = field(default_factory=list)
    anchors: list[Anchor] = field(default_factory=list)
    poke: bool = False
    copy_ends: list[tuple[DataHandle, str, int]] = field(default_factory=list)


HolderKind = Literal[
    "reservation", "slot", "parked", "grace", "demoted", "quarantine", "fetch", "relayed"
]  # fmt: skip


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds a buffer out of its pool: a kind of record (docs/architecture.md §4) and its
    id there (a slot's, a fetch's, a reservation's; 0 for the quarantine)."""

    kind: HolderKind
    id: int = 0

    def __str__(self) -> str:
        return self.kind if self.kind == "quarantine" else f"{self.kind}:{self.id}"


#: The ledger's own holder: memory a timed-out GET may still write.
QUARANTINE = Holder("quarantine")
#: Expected holdings of one side: buffer key -> holder.
Holdings = dict[tuple[str, int], Holder]


class BufferLedger:
    """Buffer key -> its one holder."""

    def __init__(self) -> None:
        self._holders: Holdings = {}
        #: Memory a timed-out GET may still write, (buffer, pinned): never given back (the
        #: pool's close unmaps it with the process).
        self.quarantined: list[tuple[Buffer, bool]] = []

    def hold(self, buffer: Buffer, holder: Holder) -> None:
        """``buffer`` leaves its pool for ``holder``."""
        key = buffer.key
        if key in self._holders:
            raise AssertionError(f"buffer {key} handed to {holder}, already {self._holders[key]}")
        self._holders[key] = holder

    def move(self, buffer: Buffer, source: Holder, target: Holder) -> None:
        """``buffer`` passes from ``source`` (who must hold it) to ``target``."""
        current = self._holders.get(buffer.key)
        if current != source:
            raise AssertionError(f"buffer {buffer.key} moved from {source}, held by {current}")
        self._holders[buffer.key] = target

    def give_back(self, buffer: Buffer, source: Holder, pinned: bool, fx: Effects) -> None:
        """``source`` gives ``buffer`` back to its (pinned or plain) pool, in ``fx``."""
        current = self._holders.get(buffer.key)
        if current != source:
            raise AssertionError(
                f"buffer {buffer.key} given back by {source}, held by {current} (double free?)"
            )
        del self._holders[buffer.key]
        fx.free.append((buffer, pinned))

    def quarantine(self, buffer: Buffer, pinned: bool, source: Holder) -> None:
        """``source`` gives ``buffer`` up to the quarantine: a timed-out GET may still write
        it, so it never goes back to a pool."""
        self.move(buffer, source, QUARANTINE)
        self.quarantined.append((buffer, pinned))

    @property
    def quarantined_bytes(self) -> int:
        return sum(buffer.nbytes for buffer, _ in self.quarantined)

    def holder_of(self, buffer: Buffer) -> Holder | None:
        """Who holds ``buffer`` now (None: its pool)."""
        return self._holders.get(buffer.key)

    def check(self, kinds: tuple[HolderKind, ...], expected: Holdings) -> None:
        """The entries whose holder is of one of ``kinds`` (``"slot"``, ``"fetch"``...) must be
        exactly ``expected``: no buffer lost, none held twice, none held by a stranger.

        Raises:
            AssertionError: they differ; the message names the buffers.
        """
        recorded = {k: v for k, v in self._holders.items() if v.kind in kinds}
        if expected != recorded:
            missing = {k: v for k, v in expected.items() if recorded.get(k) != v}
            extra = {k: v for k, v in recorded.items() if expected.get(k) != v}
            raise AssertionError(f"ledger disagrees: expected {missing}, recorded {extra}")
        quarantined = {buffer.key: QUARANTINE for buffer, _ in self.quarantined}
        held = {k: v for k, v in self._holders.items() if v == QUARANTINE}
        if len(quarantined) != len(self.quarantined) or quarantined != held:
            raise AssertionError(f"quarantine {sorted(quarantined)} != ledger {sorted(held)}")

    def held(self) -> set[tuple[str, int]]:
        """The keys of every buffer out of its pool."""
        return set(self._holders)
