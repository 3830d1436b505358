"""Copies of one payload on other nodes: the owner's list of copies it may hand out
(:class:`CopySources`) and a copy's record where it fills (:class:`Relay`). Pure bookkeeping."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ray_velo.protocol.handle import DataHandle

__all__ = [
    "RELAY_DISABLE_ENV",
    "RELAY_MIN_BYTES",
    "RELAY_PIECE_BYTES",
    "RELAY_WAIT_S",
    "CopySources",
    "Relay",
    "Source",
]

#: Set to 1 in an agent's environment to keep no copy for its owners and serve none to
#: other nodes (every consumer reads the owner's bytes, as before copies existed).
RELAY_DISABLE_ENV = "VELO_RELAY_DISABLE"
#: Payloads from this size up are handed out as copies: below it a second transfer from the
#: owner costs less than the relay's extra round trips.
RELAY_MIN_BYTES = 16 << 20
#: A copy being filled is GET in pieces of this size, each readable by its relays once it
#: landed: 13 ms at 10 Gbit/s, so a reader lags one piece behind (and pays one round trip
#: per piece, under 1 % on a LAN).
RELAY_PIECE_BYTES = 16 << 20
#: The longest a ``_rv_relay`` call waits for more bytes before answering with what landed
#: (it holds an agent thread while it waits).
RELAY_WAIT_S = 0.5


@dataclass(slots=True)
class Source:
    """A copy of one of the owner's handles on another node's agent."""

    node: str
    worker: int
    picks: int = 0  # consumers pointed at it so far


class CopySources:
    """The owner's copies of its handles, by slot id."""

    def __init__(self) -> None:
        self._by_slot: dict[int, dict[tuple[str, int], Source]] = {}

    def grant(
        self, slot_id: int, node: str, worker: int, *, pick: bool, announce: bool
    ) -> Source | None:
        """Consumer agent ``worker`` on ``node`` is granted a GET of ``slot_id``: with
        ``pick``, the copy it should read from first (a large payload), if there is one
        (:meth:`pick`); with ``announce``, its own copy counts from now (announced before its
        GET, so the next consumer may read it as it fills)."""
        source = self.pick(slot_id, node, worker) if pick else None
        if announce:
            self.announce(slot_id, node, worker)
        return source

    def announce(self, slot_id: int, node: str, worker: int) -> None:
        """The agent ``worker`` on ``node`` will fill (or holds) a copy of slot ``slot_id``:
        recorded when the owner grants it the GET, so a consumer that arrives a moment later
        is already pointed at it (the copy's agent tells it where the bytes are)."""
        sources = self._by_slot.setdefault(slot_id, {})
        sources.pop((node, worker), None)  # re-inserted: the newest wins a tie
        sources[(node, worker)] = Source(node, worker)

    def gone(self, slot_id: int, node: str, worker: int) -> None:
        """That copy is no more (its agent said so, or a reader could not reach it)."""
        sources = self._by_slot.get(slot_id)
        if sources is not None:
            sources.pop((node, worker), None)
            if not sources:
                del self._by_slot[slot_id]

    def superseded(self, node: str, worker: int) -> None:
        """A new incarnation of ``node``'s agent: the old one's copies went with it."""
        for slot_id in list(self._by_slot):
            for key in [k for k in self._by_slot[slot_id] if k[0] == node and k[1] != worker]:
                self.gone(slot_id, *key)

    def pick(self, slot_id: int, node: str, worker: int) -> Source | None:
        """The copy the consumer agent ``worker`` on ``node`` should read: its own (another
        receiver there fills or holds one: copied in memory, the link crossed once per node),
        else another node's read by the fewest (the newest among those), never another agent
        of its own node; None: read the owner's bytes."""
        sources = self._by_slot.get(slot_id, {})
        best = sources.get((node, worker))
        if best is None:
            for source in sources.values():
                if source.node != node and (best is None or source.picks <= best.picks):
                    best = source
        if best is not None:
            best.picks += 1
        return best

    def ended(self, slot_id: int) -> list[tuple[str, int]]:
        """Slot ``slot_id`` ended: forget its copies; the agents to tell."""
        return sorted(self._by_slot.pop(slot_id, {}))

    def count(self) -> int:
        return sum(len(s) for s in self._by_slot.values())


@dataclass(slots=True)
class Relay:
    """A copy this node fills (or holds) that other nodes' agents may read as it fills.

    ``fid``: the fetch filling it (its buffer is ``fetch:<fid>`` in the ledger); once the
    fetch staged it, ``slot_id`` names the node-local copy. ``landed``: bytes ``[0, landed)``
    are final. ``readers``: relay lease id -> deadline; while a reader holds one, the bytes
    stay (a read in progress on the slot, or ``relayed:<fid>`` after a failed fetch).
    ``failed``: no more bytes will land (the fetch failed or the copy ended). ``sealed``: a
    copy in a PinnedWriter whose fetch returned: its readers finish, nobody new joins (the
    writer is its process's once they did). ``sending``: relay lease id -> sends of its bytes
    in progress on the agents' wire; such a lease ends (its deadline passed, its reader said
    so: ``leaving``) only once they are out, so its bytes stay while a piece is on its way.
    """

    remote: DataHandle
    total_len: int
    fid: int | None
    slot_id: int | None = None
    landed: int = 0
    failed: bool = False
    sealed: bool = False
    readers: dict[int, float] = field(default_factory=dict)
    sending: Counter[int] = field(default_factory=Counter)
    leaving: set[int] = field(default_factory=set)
