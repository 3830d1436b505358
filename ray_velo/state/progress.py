"""What the owner state tracks beside its slots: the reads in progress that keep a slot's bytes
(its read gate) and the slots whose producer still writes them (streamed staging); pure, no
I/O (docs/architecture.md §4)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from ray_velo.errors import HandleNotFound
from ray_velo.protocol.handle import DataHandle
from ray_velo.state.store import FreedSlot

__all__ = ["ReadGate", "StreamedWrites"]

#: How many slots whose producer stopped writing early are remembered as such.
TORN_REMEMBERED = 1024


class ReadGate:
    """Reads in progress per slot (a copy out of it, a region's chunk, a producer still
    writing it): a slot whose bytes are freed meanwhile is parked here until its last read
    ends."""

    def __init__(self) -> None:
        self._reading: Counter[int] = Counter()
        self._parked: dict[int, list[FreedSlot]] = {}

    def begin(self, slot_id: int) -> None:
        """A read of slot ``slot_id`` starts: its bytes stay until :meth:`end`."""
        self._reading[slot_id] += 1

    def end(self, slot_id: int) -> list[FreedSlot]:
        """A read of slot ``slot_id`` ended; the bytes freed meanwhile that may go now."""
        self._reading[slot_id] -= 1
        if self._reading[slot_id] > 0:
            return []
        del self._reading[slot_id]
        return self._parked.pop(slot_id, [])

    def park(self, freed: FreedSlot) -> bool:
        """Keep ``freed``'s bytes while a read of its slot is in progress; False if none is
        (they may go now)."""
        if self._reading[freed.slot_id] > 0:
            self._parked.setdefault(freed.slot_id, []).append(freed)
            return True
        self._reading.pop(freed.slot_id, None)
        return False

    def parked(self) -> list[FreedSlot]:
        """Every slot's bytes kept for a read in progress."""
        return [freed for parked in self._parked.values() for freed in parked]

    def clear(self) -> list[FreedSlot]:
        """Forget every read (shutdown); the bytes that were parked."""
        parked = self.parked()
        self._reading.clear()
        self._parked.clear()
        return parked

    def reads(self, slot_id: int) -> int:
        return self._reading[slot_id]

    def check(self) -> None:
        """Raises AssertionError: a slot with no read in progress is counted."""
        for slot_id, count in self._reading.items():
            if count <= 0:
                raise AssertionError(f"slot {slot_id} has {count} reads in progress")


@dataclass(slots=True)
class _Writing:
    done: int
    total: int
    pid: int


class StreamedWrites:
    """Slots committed before their producer wrote all their bytes (streamed staging): how
    far each is written and by whom, and the slots whose producer stopped before the end
    (``torn``: a reader that waited for their bytes must not take what is there; bounded,
    the slot itself says it ended to any later lookup)."""

    def __init__(self, worker_id: int, node: str) -> None:
        self._worker_id, self._node = worker_id, node
        self._writing: dict[int, _Writing] = {}
        self._torn: dict[int, str] = {}

    def begin(self, slot_id: int, pid: int, total_len: int) -> None:
        self._writing[slot_id] = _Writing(0, total_len, pid)

    def advance(self, slot_id: int, upto: int) -> bool:
        """Bytes ``[0, upto)`` of slot ``slot_id`` are written; True when that was the last
        of them (it is no longer being written)."""
        writing = self._writing.get(slot_id)
        if writing is None:
            return False
        writing.done = max(writing.done, upto)
        if writing.done < writing.total:
            return False
        del self._writing[slot_id]
        return True

    def stop(self, slot_id: int, why: str) -> None:
        """The producer of slot ``slot_id`` will write no more of it (``why``)."""
        del self._writing[slot_id]
        self._torn[slot_id] = why
        if len(self._torn) > TORN_REMEMBERED:
            del self._torn[next(iter(self._torn))]

    def through(self, slot_id: int, upto: int | None = None) -> bool:
        """Whether bytes ``[0, upto)`` (None: all) of slot ``slot_id`` may be read: written,
        or the slot is no longer being written.

        Raises:
            HandleNotFound: its producer stopped writing before the end.
        """
        if slot_id in self._torn:
            handle = DataHandle(self._worker_id, slot_id)
            raise HandleNotFound(handle=str(handle), node=self._node, reason=self._torn[slot_id])
        writing = self._writing.get(slot_id)
        return writing is None or (upto is not None and writing.done >= upto)

    def upto(self, slot_id: int, total_len: int) -> int:
        """How many of slot ``slot_id``'s ``total_len`` bytes its producer has written.

        Raises:
            HandleNotFound: its producer stopped writing before the end.
        """
        self.through(slot_id, 0)
        writing = self._writing.get(slot_id)
        return total_len if writing is None else writing.done

    def active(self, slot_id: int) -> bool:
        """Whether slot ``slot_id``'s producer is still writing its bytes."""
        return slot_id in self._writing

    def pids(self) -> set[int]:
        """The producers still writing."""
        return {writing.pid for writing in self._writing.values()}

    def written_by(self, pids: Iterable[int]) -> list[int]:
        """The slots still being written by one of ``pids``."""
        pids = set(pids)
        return [slot_id for slot_id, w in self._writing.items() if w.pid in pids]

    def clear(self) -> None:
        self._writing.clear()
        self._torn.clear()

    def check(self, gate: ReadGate) -> None:
        """Raises AssertionError: a slot being written is past its end, or its write does
        not hold a read in ``gate``."""
        for slot_id, writing in self._writing.items():
            if not 0 <= writing.done < writing.total or gate.reads(slot_id) <= 0:
                raise AssertionError(
                    f"slot {slot_id} being written: {writing.done} of {writing.total} bytes"
                )
