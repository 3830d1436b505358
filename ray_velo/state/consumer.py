"""The node's consumer-side state: destinations, node-local copies, relays and claims, beside (not
inside) what the agent owns (docs/architecture.md §4)."""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Iterable

from ray_velo.errors import HandleNotFound, LeaseNotFound, ProtocolError
from ray_velo.protocol.handle import DataHandle
from ray_velo.protocol.ids import IdSequence
from ray_velo.protocol.messages import TypeHeader
from ray_velo.state.ledger import Buffer, BufferLedger, Effects, Holder, HolderKind, Holdings
from ray_velo.state.owner import OwnerState, RegionSlot
from ray_velo.state.relays import Relay
from ray_velo.state.store import SlotKind, SlotView

__all__ = ["COPY_ENDED", "COPY_IDLE", "COPY_UNUSED", "KEPT_IDLE_S", "ConsumerState"]

#: A node-local copy whose last reader is gone ends with this reason.
COPY_UNUSED = "its node-local copy has no reader left"
#: A node-local copy kept for its owner ends with this reason once the owner says so.
COPY_ENDED = "its owner ended the handle"
#: A copy kept for its owner ends anyway once it had no reader for this long: the owner's
#: word that the handle ended may never come (its agent died, the notice was lost).
KEPT_IDLE_S = 60.0
COPY_IDLE = f"its node-local copy had no reader for {KEPT_IDLE_S:.0f} s"
#: The ledger's holder kinds this side keeps.
HOLDS: tuple[HolderKind, ...] = ("fetch", "relayed")


class ConsumerState:
    """One node's fetch destinations, copies, relays and claims.
    Not thread-safe: the agent holds one lock around every call."""

    def __init__(self, owner: OwnerState, id_key: bytes) -> None:
        """``id_key``: the key of the relay-lease ids (they reach other nodes' agents: as
        unguessable as the owner's lease ids)."""
        self.owner = owner
        self.ledger: BufferLedger = owner.ledger
        self._fetches: dict[int, tuple[Buffer, bool]] = {}
        self._fetch_ids = itertools.count(1)
        self._copies: dict[DataHandle, int] = {}  # remote handle -> local copy slot id
        self._copy_of: dict[int, DataHandle] = {}
        self._relays: dict[DataHandle, Relay] = {}
        self._relay_fids: dict[int, DataHandle] = {}
        self._relayed: dict[int, tuple[Buffer, bool]] = {}
        #: PinnedWriters' buffers that other nodes read while a fetch fills them, by relay id
        #: (the writer's reservation owns the memory: never in the ledger here).
        self._lent: dict[int, Buffer] = {}
        self._relay_leases = IdSequence(id_key, b"relay")
        #: Copies the owner counts: kept past their last reader until it says the handle ended.
        self._kept: set[DataHandle] = set()
        self._kept_idle: dict[DataHandle, float] = {}  # kept copy -> when it ends unread
        self._kept_due: list[tuple[float, int, DataHandle]] = []  # a heap over _kept_idle
        self._kept_seq = itertools.count()
        self._claims: dict[int, Counter[DataHandle]] = {}  # pid -> claims it holds
        owner.watcher = self

    # --- fetch destinations ----------------------------------------------------------

    def fetch_take(self, buffer: Buffer, pinned: bool) -> int:
        """A fetch (or a copy) now owns ``buffer``. Returns its fetch id."""
        fid = next(self._fetch_ids)
        self.ledger.hold(buffer, Holder("fetch", fid))
        self._fetches[fid] = (buffer, pinned)
        return fid

    @property
    def fetches_in_flight(self) -> int:
        """Fetches (and copies) that own a destination now: their bytes are still moving."""
        return len(self._fetches)

    def fetch_buffer(self, fid: int) -> Buffer | None:
        """Fetch ``fid``'s buffer while it owns one."""
        entry = self._fetches.get(fid)
        return None if entry is None else entry[0]

    def fetch_give_back(self, fid: int, fx: Effects) -> None:
        """The fetch failed or moved elsewhere: its buffer goes back to its pool, once no
        other node reads the copy it was filling."""
        buffer, pinned = self._fetches.pop(fid)
        relay = self._relay_failed(fid)
        if relay is not None and relay.readers:
            self.ledger.move(buffer, Holder("fetch", fid), Holder("relayed", fid))
            self._relayed[fid] = (buffer, pinned)
            return
        self.ledger.give_back(buffer, Holder("fetch", fid), pinned, fx)

    def fetch_quarantine(self, fid: int) -> None:
        """A timed-out GET may still write the fetch's buffer: it never goes back (other
        nodes reading the bytes that had landed may go on: those stay as they were)."""
        buffer, pinned = self._fetches.pop(fid)
        self._relay_failed(fid)
        self.ledger.quarantine(buffer, pinned, Holder("fetch", fid))

    def fetch_stage(
        self,
        fid: int,
        total_len: int,
        type_header: TypeHeader,
        kind: SlotKind,
        now: float,
        fx: Effects,
        *,
        copy_of: DataHandle | None = None,
    ) -> SlotView:
        """The fetch's buffer becomes a local slot (refcount 1). ``copy_of``: it is the
        node-local copy of that remote handle, found again by :meth:`copy_for`."""
        buffer, pinned = self._fetches.pop(fid)
        slot = self.owner.stage(
            buffer, Holder("fetch", fid), total_len, type_header, now, fx, kind=kind, pinned=pinned
        )
        remote = self._relay_fids.pop(fid, None)
        if remote is not None:  # the copy's readers now read a slot: reads in progress
            relay = self._relays[remote]
            relay.fid, relay.slot_id, relay.landed = None, slot.slot_id, total_len
            for _ in relay.readers:
                self.owner.reads.begin(slot.slot_id)
        if copy_of is not None:
            # A copy that two fetches made at once: the newest serves later fetches; every
            # copy still ends with its own last reader.
            self._copies[copy_of] = slot.slot_id
            self._copy_of[slot.slot_id] = copy_of
        return slot

    def fetch_demote(self, fid: int, slot: SlotView, now: float, fx: Effects) -> bool:
        """Shutdown copied ``slot`` into fetch ``fid``'s plain buffer: the slot moves there
        (:meth:`OwnerState.demote`). Returns whether it moved (else the buffer went back)."""
        buffer, _ = self._fetches.pop(fid)
        return self.owner.demote(slot, (buffer, Holder("fetch", fid)), now, fx)

    # --- node-local copies -----------------------------------------------------------

    def copy_for(self, remote: DataHandle) -> SlotView | None:
        """The live node-local copy of ``remote``, if any."""
        slot_id = self._copies.get(remote)
        slot = None if slot_id is None else self.owner.held_slot(slot_id)
        return slot if slot is not None and slot.ended is None else None

    def copy_ended(self, remote: DataHandle, now: float, fx: Effects) -> None:
        """``remote``'s owner says the handle ended: its copy here goes with its last
        reader (now, if it has none), and a copy still filling is not kept."""
        self._kept.discard(remote)
        self._kept_idle.pop(remote, None)
        copy = self.copy_for(remote)
        if copy is not None and not copy.leases:
            self.owner.end_slot(copy.slot_id, COPY_ENDED, now, fx)

    def slot_ended(self, slot_id: int) -> None:
        """The owner state: slot ``slot_id``'s bytes may go (its handle ended, no lease is
        left). A copy it was leaves the index; a relay over it serves nobody new."""
        remote = self._copy_of.pop(slot_id, None)
        if remote is None:
            return
        if self._copies.get(remote) == slot_id:
            del self._copies[remote]
            self._kept.discard(remote)
            self._kept_idle.pop(remote, None)
        relay = self._relays.get(remote)
        if relay is not None and relay.slot_id == slot_id:
            relay.failed = True  # its readers' reads in progress keep the bytes (parked)
            self._relay_drop(relay)

    def reader_left(self, slot_id: int, now: float, fx: Effects) -> None:
        """The owner state: a reader of slot ``slot_id`` just ended. If it is a live
        node-local copy with no reader left, it ends now, unless its owner counts it: then it
        stays until the owner says the handle ended, or until it sat unread for KEPT_IDLE_S."""
        remote = self._copy_of.get(slot_id)
        if remote is None:
            return
        slot = self.owner.held_slot(slot_id)  # a copy in the index is held
        if slot is None or slot.ended is not None or slot.leases:
            return
        if remote not in self._kept:
            self.owner.end_slot(slot_id, COPY_UNUSED, now, fx)
        else:
            self._kept_idle[remote] = due = now + KEPT_IDLE_S
            heapq.heappush(self._kept_due, (due, next(self._kept_seq), remote))
            fx.poke = True

    # --- copies other nodes read as they fill (relays) -------------------------------

    def relay_open(self, remote: DataHandle, fid: int, total_len: int) -> bool:
        """Fetch ``fid`` fills a copy of ``remote`` that its owner counts: other nodes may
        read it as it fills, and it stays until the owner says the handle ended. False (not
        relayed, not kept) while an older copy of it still has readers."""
        if self._relay_busy(remote):
            return False
        self._relays[remote] = Relay(remote, total_len, fid)
        self._relay_fids[fid] = remote
        self._kept.add(remote)
        return True

    def relay_open_lent(self, remote: DataHandle, buffer: Buffer, total_len: int) -> Relay | None:
        """A fetch into a PinnedWriter fills ``buffer`` with ``remote``'s bytes: other nodes
        may read it as it fills, until :meth:`relay_seal` (then the writer is its process's,
        which may write it: the copy is never kept). None (not relayed) while an older copy
        of it still has readers."""
        if self._relay_busy(remote):
            return None
        relay = Relay(remote, total_len, next(self._fetch_ids))
        assert relay.fid is not None
        self._lent[relay.fid] = buffer
        self._relays[remote] = relay
        self._relay_fids[relay.fid] = remote
        return relay

    def _relay_busy(self, remote: DataHandle) -> bool:
        """Whether a copy of ``remote`` here still fills or has readers (no second opens)."""
        old = self._relays.get(remote)
        return old is not None and (not old.failed or bool(old.readers))

    @staticmethod
    def relay_seal(relay: Relay) -> None:
        """The fetch filling lent copy ``relay`` returned: nobody new joins; its readers
        finish what landed (all of it, or as far as a failed fetch got)."""
        relay.sealed = True
        relay.failed = relay.landed < relay.total_len

    @staticmethod
    def relay_reading(relay: Relay, now: float) -> bool:
        """Whether a reader of ``relay`` may still GET its bytes: one holds a relay lease not
        yet past its deadline (a reader's GET ends within its lease), or this agent is still
        sending some of them over the wire."""
        return any(due > now for due in relay.readers.values()) or any(relay.sending.values())

    def relay_close_lent(self, relay: Relay) -> None:
        """Lent copy ``relay`` is its writer's alone again (sealed, its readers gone or past
        their leases): it serves nobody from now."""
        assert relay.fid is not None and relay.sealed
        relay.failed = True
        relay.readers.clear()
        self._lent.pop(relay.fid, None)  # gone already when the agent shut down
        self._relay_fids.pop(relay.fid, None)
        if self._relays.get(relay.remote) is relay:
            del self._relays[relay.remote]

    def relay_landed(self, remote: DataHandle, landed: int) -> None:
        """Bytes ``[0, landed)`` of the copy being filled are final."""
        relay = self._relays.get(remote)
        if relay is not None and not relay.failed and relay.fid is not None:
            relay.landed = max(relay.landed, landed)

    def relay(self, remote: DataHandle) -> Relay | None:
        return self._relays.get(remote)

    def relay_buffer(self, relay: Relay) -> Buffer | None:
        """Where ``relay``'s bytes are: the filling fetch's buffer, then the copy's slot."""
        if relay.slot_id is not None:
            slot = self.owner.held_slot(relay.slot_id)
            location = None if slot is None else slot.location
            return None if isinstance(location, RegionSlot) else location
        if relay.fid in self._fetches:
            return self._fetches[relay.fid][0]
        if relay.fid in self._lent:
            return self._lent[relay.fid]
        return self._relayed[relay.fid][0] if relay.fid in self._relayed else None

    def relay_join(self, remote: DataHandle, now: float, timeout: float) -> tuple[int, Relay]:
        """A relay lease on the copy of ``remote``: its bytes stay until the lease ends.

        Raises:
            HandleNotFound: no copy of it here (or it failed).
        """
        relay = self._relays.get(remote)
        if relay is None or relay.failed or relay.sealed:
            raise HandleNotFound(
                handle=str(remote), node=self.owner.node, reason="no copy of it here"
            )
        lease_id = next(self._relay_leases)
        relay.readers[lease_id] = now + timeout
        if relay.slot_id is not None:
            self.owner.reads.begin(relay.slot_id)
        return lease_id, relay

    def relay_renew(self, remote: DataHandle, lease_id: int, now: float, timeout: float) -> Relay:
        """Push relay lease ``lease_id`` on; the copy (check ``failed``).

        Raises:
            LeaseNotFound: the lease ended (or expired).
        """
        relay = self._relays.get(remote)
        if relay is None or lease_id not in relay.readers:
            raise LeaseNotFound(handle=str(remote), lease_id=lease_id)
        relay.readers[lease_id] = now + timeout
        return relay

    def relay_send_begin(
        self, remote: DataHandle, lease_id: int, start: int, stop: int, now: float
    ) -> Buffer:
        """This agent starts sending bytes ``[start, stop)`` of its copy of ``remote`` to the
        holder of relay lease ``lease_id`` over the wire: the buffer they are in, held (the
        lease cannot end) until :meth:`relay_send_end`.

        Raises:
            LeaseNotFound: no such live relay lease.
            ProtocolError: the bytes have not landed (the reader asks ``_rv_relay`` first).
        """
        relay = self._relay_sending(remote, lease_id, now)
        buffer = self.relay_buffer(relay)
        if not 0 <= start < stop <= relay.landed or buffer is None:
            raise ProtocolError(
                f"bytes [{start}, {stop}) of the copy of {remote} have not landed "
                f"({relay.landed} of {relay.total_len})"
            )
        relay.sending[lease_id] += 1
        return buffer

    def relay_still_sending(self, remote: DataHandle, lease_id: int, now: float) -> None:
        """Check, before each piece, that relay lease ``lease_id`` still holds.

        Raises:
            LeaseNotFound: it ended (its reader said so) or its deadline passed.
        """
        self._relay_sending(remote, lease_id, now)

    def _relay_sending(self, remote: DataHandle, lease_id: int, now: float) -> Relay:
        relay = self._relays.get(remote)
        due = None if relay is None else relay.readers.get(lease_id)
        if relay is None or due is None or due <= now or lease_id in relay.leaving:
            raise LeaseNotFound(handle=str(remote), lease_id=lease_id)
        return relay

    def relay_send_end(self, remote: DataHandle, lease_id: int, now: float, fx: Effects) -> None:
        """A send under relay lease ``lease_id`` ended; the lease ends now if its reader or
        its deadline ended it meanwhile."""
        relay = self._relays.get(remote)
        if relay is None or relay.sending[lease_id] <= 0:
            return
        relay.sending[lease_id] -= 1
        if relay.sending[lease_id] > 0:
            return
        del relay.sending[lease_id]
        due = relay.readers.get(lease_id)
        if lease_id in relay.leaving or (due is not None and due <= now):
            relay.leaving.discard(lease_id)
            self.relay_leave(remote, lease_id, now, fx)

    def relay_leave(self, remote: DataHandle, lease_id: int, now: float, fx: Effects) -> None:
        """Relay lease ``lease_id`` ends (unknown: already ended, nothing to do); with a send
        under it in progress, once that send ends."""
        relay = self._relays.get(remote)
        if relay is not None and relay.sending[lease_id] > 0:
            relay.leaving.add(lease_id)
            return
        if relay is None or relay.readers.pop(lease_id, None) is None:
            return
        if relay.slot_id is not None:
            self.owner.end_read(relay.slot_id, now, fx)
        elif relay.fid in self._relayed and not relay.readers:
            fid = relay.fid
            buffer, pinned = self._relayed.pop(fid)
            self.ledger.give_back(buffer, Holder("relayed", fid), pinned, fx)
        self._relay_drop(relay)

    def _relay_failed(self, fid: int) -> Relay | None:
        """Fetch ``fid`` failed: the copy it filled gets no more bytes."""
        remote = self._relay_fids.get(fid)
        if remote is None:
            return None
        relay = self._relays[remote]
        relay.failed = True
        self._kept.discard(remote)
        self._relay_drop(relay)
        return relay

    def _relay_drop(self, relay: Relay) -> None:
        if relay.failed and not relay.readers and self._relays.get(relay.remote) is relay:
            del self._relays[relay.remote]
            if relay.fid is not None:
                self._relay_fids.pop(relay.fid, None)

    # --- claims held by local processes ----------------------------------------------

    def claim_held(self, pid: int, handle: DataHandle) -> None:
        """Process ``pid`` holds a claim on ``handle`` (whatever node owns it)."""
        self._claims.setdefault(pid, Counter())[handle] += 1

    def claim_end(self, pid: int, handle: DataHandle) -> bool:
        """Process ``pid`` consumed or gave back a claim on ``handle``; False if it held
        none (ended already, e.g. by its death)."""
        held = self._claims.get(pid)
        if not held or held[handle] <= 0:
            return False
        held[handle] -= 1
        if held[handle] == 0:
            del held[handle]
        if not held:
            del self._claims[pid]
        return True

    def claim_pids(self) -> set[int]:
        """Processes holding claims (the agent watches them)."""
        return set(self._claims)

    def reap(self, dead: Iterable[int]) -> list[DataHandle]:
        """Processes ``dead`` died: their claims end. Returns one handle per claim, to give
        back to its owner."""
        unclaim: list[DataHandle] = []
        for pid in set(dead) & set(self._claims):
            for handle, count in self._claims.pop(pid).items():
                unclaim += [handle] * count
        return unclaim

    # --- timers, counts, shutdown ----------------------------------------------------

    def sweep(self, now: float, fx: Effects) -> None:
        """End the relay leases past their deadline and the kept copies idle too long."""
        for relay in list(self._relays.values()):
            for lease_id, due in list(relay.readers.items()):
                if due <= now and not relay.sending[lease_id]:  # else: when its send ends
                    self.relay_leave(relay.remote, lease_id, now, fx)
        while self._kept_due and self._kept_due[0][0] <= now:
            due, _, remote = heapq.heappop(self._kept_due)
            if self._kept_idle.get(remote) != due:
                continue  # read (or ended) since: a later entry stands for it, or none
            del self._kept_idle[remote]
            copy = self.copy_for(remote)
            if copy is not None and not copy.leases:  # read again meanwhile: not idle
                self.owner.end_slot(copy.slot_id, COPY_IDLE, now, fx)

    def next_due(self) -> float | None:
        """The earliest relay lease deadline or kept copy's idle end, or None."""
        due = [
            d
            for relay in self._relays.values()
            for lease_id, d in relay.readers.items()
            if not relay.sending[lease_id]  # ends with its send, not by the timer
        ]
        while self._kept_due and self._kept_idle.get(self._kept_due[0][2]) != self._kept_due[0][0]:
            heapq.heappop(self._kept_due)  # stale
        if self._kept_due:
            due.append(self._kept_due[0][0])
        return min(due, default=None)

    @property
    def copies(self) -> int:
        return len(self._copies)

    @property
    def relay_readers(self) -> int:
        """Relay leases other nodes hold on this node's copies."""
        return sum(len(relay.readers) for relay in self._relays.values())

    def clear(self, fx: Effects) -> None:
        """Shutdown (before the owner state's): every relay read ends with the agent, every
        destination and relayed buffer goes back, the copies and claims are forgotten."""
        for relay in self._relays.values():
            relay.readers.clear()
        for fid in list(self._fetches):
            self.fetch_give_back(fid, fx)
        for fid, (buffer, pinned) in list(self._relayed.items()):
            self.ledger.give_back(buffer, Holder("relayed", fid), pinned, fx)
        self._relayed.clear()
        self._lent.clear()
        self._relays.clear()
        self._relay_fids.clear()
        self._kept.clear()
        self._kept_idle.clear()
        self._kept_due.clear()
        self._claims.clear()

    def validate(self) -> None:
        """Check this side's invariants; tests call it after each step (with the owner
        state's).

        Its part of the ledger, rebuilt from the destinations and relayed buffers, equals
        what the ledger records for ``fetch:`` and ``relayed:``; every indexed copy is a slot
        the owner holds, and the two copy indexes agree.

        Raises:
            AssertionError: an invariant is broken; the message names it.
        """
        expected: Holdings = {}
        for fid, (buffer, _) in self._fetches.items():
            expected[buffer.key] = Holder("fetch", fid)
        for fid, (buffer, _) in self._relayed.items():
            if buffer.key in expected:
                raise AssertionError(f"buffer {buffer.key} is both a fetch's and relayed:{fid}")
            expected[buffer.key] = Holder("relayed", fid)
        self.ledger.check(HOLDS, expected)
        timed = {(due, remote) for due, _, remote in self._kept_due}
        for remote, due in self._kept_idle.items():
            if (due, remote) not in timed:
                raise AssertionError(f"kept copy of {remote} idle until {due} has no timer")
        for remote, slot_id in self._copies.items():
            if self._copy_of.get(slot_id) != remote:
                raise AssertionError(f"copy index of {remote} disagrees")
        for slot_id in self._copy_of:
            if self.owner.held_slot(slot_id) is None:
                raise AssertionError(f"copy slot {slot_id} is indexed but its bytes are gone")
