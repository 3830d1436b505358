"""The owner store under random traffic: a hypothesis state machine against a small model.

Consumers stage, ref, acquire (chunked, RDMA, local; with and without deadlines), renew,
pull, detach and release in any order, also with stale handles and lease ids; the reaper
sweeps while time advances; local reader processes die. After every step the store's own
``validate()`` holds and the store agrees with the model:

* a slot exists iff its modelled refcount is above 0 or it holds a live lease, unless its TTL
  expired at a sweep (then it is gone with every lease on it);
* every slot comes back exactly once as a ``FreedSlot``, from the step the model predicts,
  with the location it was staged (or relocated) to: staged == live + freed, always;
* leases, deadlines, refcounts and counters match.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from ray_velo.errors import HandleNotFound, LeaseNotFound, ProtocolError
from ray_velo.protocol.handle import DataHandle
from ray_velo.protocol.messages import TypeHeader
from ray_velo.store import FreedSlot, LeaseKind, SlotKind, SlotStore, SweepResult

WORKER = 0x5EED
PIDS = (0, 101, 102)
#: Time that passes before a consumer's next call (s); binary fractions, so deadlines that
#: should coincide do so exactly.
PAUSES = st.sampled_from([0.0, 0.125, 0.25, 0.5])


@dataclass
class ModelLease:
    lease_id: int
    slot_id: int
    kind: LeaseKind
    timeout: float | None
    deadline: float | None
    holder_pid: int


@dataclass
class ModelSlot:
    handle: DataHandle
    total_len: int
    kind: SlotKind
    pinned: bool
    location: object
    refcount: int
    ttl_deadline: float | None
    leases: set[int] = field(default_factory=set)


@dataclass
class ModelCounters:
    slots_staged: int = 0
    slots_freed: int = 0
    bytes_staged: int = 0
    leases_granted: int = 0
    rdma_leases_reaped: int = 0
    chunked_leases_expired: int = 0
    local_leases_reaped: int = 0
    slots_expired: int = 0


class SlotStoreMachine(RuleBasedStateMachine):
    """Random owner traffic against a model of refcounts, leases, deadlines and TTLs."""

    handles = Bundle("handles")
    leases = Bundle("leases")

    @initialize()
    def start(self) -> None:
        self.store = SlotStore(WORKER, node="node-a")
        self.now = 0.0
        self.slots: dict[int, ModelSlot] = {}  # live, by slot id
        self.model_leases: dict[int, ModelLease] = {}  # held, by lease id
        self.freed: dict[int, FreedSlot] = {}  # every FreedSlot the store returned
        self.counters = ModelCounters()

    # --- helpers ---------------------------------------------------------------------

    def collect(self, freed: list[FreedSlot], expected: set[int]) -> None:
        """The step freed exactly ``expected``; each slot comes back once, as staged."""
        ids = [f.slot_id for f in freed]
        assert len(ids) == len(set(ids)), f"a slot freed twice in one step: {ids}"
        assert set(ids) == expected, f"freed {sorted(ids)}, model expected {sorted(expected)}"
        for item in freed:
            assert item.slot_id not in self.freed, f"slot {item.slot_id} freed twice"
            slot = self.slots.pop(item.slot_id)
            assert item.location is slot.location
            assert (item.kind, item.pinned, item.total_len) == (
                slot.kind,
                slot.pinned,
                slot.total_len,
            )
            assert item.why
            for lease_id in slot.leases:
                del self.model_leases[lease_id]
            self.freed[item.slot_id] = item
            self.counters.slots_freed += 1

    def drop_lease(self, lease: ModelLease) -> None:
        del self.model_leases[lease.lease_id]
        self.slots[lease.slot_id].leases.discard(lease.lease_id)

    def unref(self, slot: ModelSlot) -> bool:
        """Drop one reference; True when the slot should now be freed."""
        slot.refcount = max(0, slot.refcount - 1)
        return slot.refcount == 0 and not slot.leases

    def live(self, handle: DataHandle) -> ModelSlot | None:
        return self.slots.get(handle.slot_id)

    def pick_handle(self, drawn: DataHandle, data: st.DataObject) -> DataHandle:
        """Half the time a live handle (if any), else the drawn one, possibly stale."""
        if not self.slots:
            return drawn
        if data.draw(st.booleans(), label="live handle"):
            slot_id = data.draw(st.sampled_from(sorted(self.slots)), label="slot")
            return self.slots[slot_id].handle
        return drawn

    def pick_lease(
        self, held: tuple[DataHandle, int], other: DataHandle, data: st.DataObject
    ) -> tuple[DataHandle, int]:
        """A held lease with its own handle most of the time; else the drawn (maybe stale)
        lease, sometimes named with a handle it is not on."""
        live = bool(self.model_leases) and data.draw(st.booleans(), label="held lease")
        if live:
            lease_id = data.draw(st.sampled_from(sorted(self.model_leases)), label="lease")
            return self.slots[self.model_leases[lease_id].slot_id].handle, lease_id
        if data.draw(st.booleans(), label="wrong handle"):
            return other, held[1]
        return held

    def expect_lease_on(self, handle: DataHandle, lease_id: int) -> type[Exception] | None:
        """The error the store must raise for ``(handle, lease_id)``, or None if valid."""
        slot = self.live(handle)
        if slot is None:
            return HandleNotFound
        lease = self.model_leases.get(lease_id)
        if lease is None or lease.slot_id != handle.slot_id:
            return LeaseNotFound
        return None

    # --- staging ---------------------------------------------------------------------

    @rule(
        target=handles,
        total_len=st.integers(0, 1 << 20),
        kind=st.sampled_from(["plain", "pooled", "dedicated", "region"]),
        refcount=st.integers(1, 3),
        ttl=st.none() | st.sampled_from([0.5, 1.0, 3.0]),
    )
    def stage(self, total_len: int, kind: SlotKind, refcount: int, ttl: float | None) -> Any:
        location = object()
        pinned = kind != "plain"
        handle = self.store.stage(
            total_len,
            TypeHeader(),
            location,
            kind=kind,
            pinned=pinned,
            now=self.now,
            ttl=ttl,
            refcount=refcount,
        )
        assert handle.worker_id == WORKER
        assert handle.slot_id not in self.slots and handle.slot_id not in self.freed
        self.slots[handle.slot_id] = ModelSlot(
            handle,
            total_len,
            kind,
            pinned,
            location,
            refcount,
            None if ttl is None else self.now + ttl,
        )
        self.counters.slots_staged += 1
        self.counters.bytes_staged += total_len
        return handle

    @rule(drawn=handles, data=st.data())
    def ref(self, drawn: DataHandle, data: st.DataObject) -> None:
        handle = self.pick_handle(drawn, data)
        slot = self.live(handle)
        if slot is None:
            with pytest.raises(HandleNotFound):
                self.store.ref(handle)
            return
        slot.refcount += 1
        assert self.store.ref(handle) == slot.refcount

    @rule(drawn=handles, data=st.data())
    def relocate(self, drawn: DataHandle, data: st.DataObject) -> None:
        """Drain demotes a pinned slot to plain memory; its lease and refs stay."""
        handle = self.pick_handle(drawn, data)
        slot = self.live(handle)
        new = object()
        if slot is None:
            with pytest.raises(HandleNotFound):
                self.store.relocate(handle, new, kind="plain", pinned=False)
            return
        old = self.store.relocate(handle, new, kind="plain", pinned=False)
        assert old is slot.location
        slot.location, slot.kind, slot.pinned = new, "plain", False

    # --- leases ----------------------------------------------------------------------

    @rule(
        target=leases,
        drawn=handles,
        kind=st.sampled_from(["rdma", "chunked", "local"]),
        timeout=st.none() | st.sampled_from([0.25, 1.0, 2.0]),
        holder_pid=st.sampled_from(PIDS),
        pause=PAUSES,
        data=st.data(),
    )
    def acquire(
        self,
        drawn: DataHandle,
        kind: LeaseKind,
        timeout: float | None,
        holder_pid: int,
        pause: float,
        data: st.DataObject,
    ) -> Any:
        self.now += pause
        handle = self.pick_handle(drawn, data)
        slot = self.live(handle)
        if slot is None:
            with pytest.raises(HandleNotFound):
                self.store.acquire(
                    handle, self.now, kind=kind, timeout=timeout, holder_pid=holder_pid
                )
            return multiple()
        if kind == "rdma" and timeout is None:
            with pytest.raises(ProtocolError):
                self.store.acquire(handle, self.now, kind=kind, timeout=None)
            return multiple()
        lease = self.store.acquire(
            handle, self.now, kind=kind, timeout=timeout, holder_pid=holder_pid
        )
        assert lease.lease_id not in self.model_leases
        assert lease.slot_id == handle.slot_id
        deadline = None if timeout is None else self.now + timeout
        assert lease.deadline == deadline
        self.model_leases[lease.lease_id] = ModelLease(
            lease.lease_id, slot.handle.slot_id, kind, timeout, deadline, holder_pid
        )
        slot.leases.add(lease.lease_id)
        self.counters.leases_granted += 1
        return (handle, lease.lease_id)

    @rule(held=leases, other=handles, pause=PAUSES, data=st.data())
    def renew(
        self, held: tuple[DataHandle, int], other: DataHandle, pause: float, data: st.DataObject
    ) -> None:
        """``_rv_lease_renew`` ``pause`` after the last step (maybe past the deadline, before
        the reaper ran), sometimes for a stale lease or naming another handle."""
        self.now += pause
        handle, lease_id = self.pick_lease(held, other, data)
        error = self.expect_lease_on(handle, lease_id)
        if error is not None:
            with pytest.raises(error):
                self.store.renew(handle, lease_id, self.now)
            return
        self.store.renew(handle, lease_id, self.now)
        lease = self.model_leases[lease_id]
        if lease.timeout is not None:
            lease.deadline = self.now + lease.timeout

    @rule(held=leases, pause=PAUSES, data=st.data())
    def pull(self, held: tuple[DataHandle, int], pause: float, data: st.DataObject) -> None:
        """A chunk pull renews a chunked (or local) lease; RDMA leases are not pulled."""
        self.now += pause
        _, lease_id = self.pick_lease(held, held[0], data)
        lease = self.model_leases.get(lease_id)
        if lease is None or lease.kind == "rdma":
            with pytest.raises(LeaseNotFound):
                self.store.pull(lease_id, self.now)
            return
        slot = self.store.pull(lease_id, self.now)
        assert slot.slot_id == lease.slot_id
        if lease.timeout is not None:
            lease.deadline = self.now + lease.timeout

    @rule(held=leases, other=handles, data=st.data())
    def detach(self, held: tuple[DataHandle, int], other: DataHandle, data: st.DataObject) -> None:
        """``_rv_detach``: the lock goes, the reference stays."""
        handle, lease_id = self.pick_lease(held, other, data)
        error = self.expect_lease_on(handle, lease_id)
        if error is not None:
            with pytest.raises(error):
                self.store.detach(handle, lease_id)
            return
        lease = self.model_leases[lease_id]
        slot = self.slots[lease.slot_id]
        self.drop_lease(lease)
        expected = {slot.handle.slot_id} if slot.refcount == 0 and not slot.leases else set()
        freed = self.store.detach(handle, lease_id)
        self.collect([] if freed is None else [freed], expected)

    @rule(held=leases, other=handles, data=st.data())
    def release(self, held: tuple[DataHandle, int], other: DataHandle, data: st.DataObject) -> None:
        """``_rv_release``: the lock and one reference go."""
        handle, lease_id = self.pick_lease(held, other, data)
        error = self.expect_lease_on(handle, lease_id)
        if error is not None:
            with pytest.raises(error):
                self.store.release(handle, lease_id)
            return
        lease = self.model_leases[lease_id]
        slot = self.slots[lease.slot_id]
        self.drop_lease(lease)
        expected = {slot.handle.slot_id} if self.unref(slot) else set()
        freed = self.store.release(handle, lease_id)
        self.collect([] if freed is None else [freed], expected)

    @rule(drawn=handles, data=st.data())
    def release_without_lease(self, drawn: DataHandle, data: st.DataObject) -> None:
        """``release(handle, 0)``: a consumer that read a copy it had drops its reference."""
        handle = self.pick_handle(drawn, data)
        slot = self.live(handle)
        if slot is None:
            with pytest.raises(HandleNotFound):
                self.store.release(handle, 0)
            return
        expected = {slot.handle.slot_id} if self.unref(slot) else set()
        freed = self.store.release(handle, 0)
        self.collect([] if freed is None else [freed], expected)

    # --- time ------------------------------------------------------------------------

    @rule(dt=st.sampled_from([0.0, 0.125, 0.25, 0.5, 1.0, 2.5]))
    def sweep(self, dt: float) -> None:
        """The reaper runs ``dt`` after the last step: TTLs first, then lease deadlines."""
        self.sweep_at(self.now + dt)

    @precondition(lambda self: self.store.next_deadline() is not None)
    @rule()
    def sweep_when_due(self) -> None:
        """The agent's ticker runs the sweep exactly at ``next_deadline()``: a deadline that
        equals ``now`` is due (the boundary every timer lands on)."""
        due = self.store.next_deadline()
        if due is not None:
            self.sweep_at(max(self.now, due))

    def sweep_at(self, now: float) -> None:
        self.now = now
        expected: set[int] = set()
        expired = 0
        for slot in list(self.slots.values()):
            if slot.ttl_deadline is not None and slot.ttl_deadline <= self.now:
                expected.add(slot.handle.slot_id)
                expired += 1
        rdma = chunked = 0
        for lease in list(self.model_leases.values()):
            if lease.slot_id in expected:
                continue  # gone with its slot's TTL
            if lease.deadline is None or lease.deadline > self.now:
                continue
            slot = self.slots[lease.slot_id]
            self.drop_lease(lease)
            if lease.kind == "rdma":
                rdma += 1
            else:
                chunked += 1
            if self.unref(slot):
                expected.add(slot.handle.slot_id)
        result = self.store.sweep(self.now)
        assert isinstance(result, SweepResult)
        assert (result.slots_expired, result.rdma_leases_reaped, result.chunked_leases_expired) == (
            expired,
            rdma,
            chunked,
        )
        self.counters.slots_expired += expired
        self.counters.rdma_leases_reaped += rdma
        self.counters.chunked_leases_expired += chunked
        self.collect(result.freed, expected)

    @precondition(lambda self: any(lease.holder_pid for lease in self.model_leases.values()))
    @rule(dead=st.sets(st.sampled_from(PIDS[1:]), min_size=1))
    def reap_holders(self, dead: set[int]) -> None:
        """Local reader processes died: their leases and references go."""
        expected: set[int] = set()
        for lease in list(self.model_leases.values()):
            if lease.holder_pid not in dead:
                continue
            slot = self.slots[lease.slot_id]
            self.drop_lease(lease)
            self.counters.local_leases_reaped += 1
            if self.unref(slot):
                expected.add(slot.handle.slot_id)
        self.collect(self.store.reap_holders(dead), expected)

    @rule(drawn=handles, data=st.data())
    def evict(self, drawn: DataHandle, data: st.DataObject) -> None:
        """A region was deregistered under the slot: it goes now, leases and all."""
        handle = self.pick_handle(drawn, data)
        slot = self.live(handle)
        if slot is None:
            with pytest.raises(HandleNotFound):
                self.store.evict(handle, "its region was deregistered")
            return
        self.collect(
            [self.store.evict(handle, "its region was deregistered")], {slot.handle.slot_id}
        )

    # --- invariants ------------------------------------------------------------------

    @invariant()
    def store_validates(self) -> None:
        self.store.validate()

    @invariant()
    def staged_is_live_plus_freed(self) -> None:
        """Never lost, never twice."""
        assert self.counters.slots_staged == self.store.live_slots + len(self.freed)
        assert self.store.live_slots == len(self.slots)
        assert {s.slot_id for s in self.store.slots()} == set(self.slots)
        assert not set(self.slots) & set(self.freed)

    @invariant()
    def a_slot_exists_iff_referenced_or_leased(self) -> None:
        for slot_id, slot in self.slots.items():
            assert slot.refcount > 0 or slot.leases, f"model keeps dead slot {slot_id}"
            meta = self.store.metadata(slot.handle)
            assert (meta.size, meta.refcount, meta.pinned) == (
                slot.total_len,
                slot.refcount,
                slot.pinned,
            )
        for slot_id in self.freed:
            with pytest.raises(HandleNotFound, match="not found"):
                self.store.metadata(DataHandle(WORKER, slot_id))

    @invariant()
    def leases_agree(self) -> None:
        assert self.store.live_leases == len(self.model_leases)
        for lease_id, model in self.model_leases.items():
            lease = self.store.lease(lease_id)
            assert (lease.slot_id, lease.kind, lease.timeout, lease.deadline) == (
                model.slot_id,
                model.kind,
                model.timeout,
                model.deadline,
            )
            assert lease_id in self.slots[model.slot_id].leases
        assert self.store.holder_pids() == {
            lease.holder_pid for lease in self.model_leases.values() if lease.holder_pid
        }

    @invariant()
    def next_deadline_is_the_earliest(self) -> None:
        """The driver arms a timer only while something is timed, for the earliest time."""
        deadlines = [lease.deadline for lease in self.model_leases.values()]
        deadlines += [slot.ttl_deadline for slot in self.slots.values()]
        timed = [d for d in deadlines if d is not None]
        assert self.store.next_deadline() == (min(timed) if timed else None)

    @invariant()
    def counters_agree(self) -> None:
        c, m = self.store.counters, self.counters
        assert (
            c.slots_staged,
            c.slots_freed,
            c.bytes_staged,
            c.leases_granted,
            c.rdma_leases_reaped,
            c.chunked_leases_expired,
            c.local_leases_reaped,
            c.slots_expired,
        ) == (
            m.slots_staged,
            m.slots_freed,
            m.bytes_staged,
            m.leases_granted,
            m.rdma_leases_reaped,
            m.chunked_leases_expired,
            m.local_leases_reaped,
            m.slots_expired,
        )

    def teardown(self) -> None:
        """Shutdown frees what is left, each slot once."""
        store = getattr(self, "store", None)
        if store is None:
            return
        self.collect(store.clear(), set(self.slots))
        store.validate()
        assert store.live_slots == 0 and store.live_leases == 0
        assert store.next_deadline() is None
        assert self.counters.slots_staged == len(self.freed)


SlotStoreMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSlotStoreMachine = SlotStoreMachine.TestCase
