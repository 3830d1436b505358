"""The owner store under random traffic: a hypothesis state machine against a small model.

Consumers stage, ref, acquire (chunked, RDMA, local; with and without deadlines; claiming
or not), renew, pull, detach and release (with and without claims) in any order, also with
stale handles and lease ids; the reaper sweeps while time advances; local reader processes
die; a consumer agent restarts; the Ray job that staged some slots ends. After every step the store's own ``validate()`` holds and the
store agrees with the model:

* a handle lives until its refcount reaches 0, its TTL fires, its job ends (unless it is
  detached), or it is evicted; from then on
  every acquire, ref and metadata is refused, while its slot stays as long as it has leases;
* claims never outnumber references, and a claim beyond them is refused;
* every slot comes back exactly once as a ``FreedSlot``, from the step the model predicts,
  with the location it was staged (or relocated) to: staged == held + freed, always;
* leases, deadlines, refcounts, claims and counters match.
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

from ray_velo.errors import HandleNotFound, HandleReleased, LeaseNotFound, ProtocolError
from ray_velo.protocol.handle import DataHandle
from ray_velo.protocol.messages import TypeHeader
from ray_velo.state.store import FreedSlot, LeaseKind, SlotKind, SlotStore, SweepResult

WORKER = 0x5EED
PIDS = (0, 101, 102)
JOBS = ("", "01000000", "02000000")  # "": staged outside a Ray job
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
    claimed: bool = False
    consumer: tuple[str, int] | None = None


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
    claimed: int = 0
    ended: bool = False
    job: str = ""
    detached: bool = False


@dataclass
class ModelCounters:
    slots_staged: int = 0
    slots_freed: int = 0
    bytes_staged: int = 0
    leases_granted: int = 0
    leases_superseded: int = 0
    claims_refused: int = 0
    rdma_leases_reaped: int = 0
    chunked_leases_expired: int = 0
    local_leases_reaped: int = 0
    slots_expired: int = 0
    slots_job_ended: int = 0


class SlotStoreMachine(RuleBasedStateMachine):
    """Random owner traffic against a model of refcounts, leases, deadlines and TTLs."""

    handles = Bundle("handles")
    leases = Bundle("leases")

    @initialize()
    def start(self) -> None:
        # a fixed id key: hypothesis replays a run step for step, slot ids included
        self.store = SlotStore(WORKER, node="node-a", id_key=bytes(16))
        self.now = 0.0
        self.slots: dict[int, ModelSlot] = {}  # live, by slot id
        self.model_leases: dict[int, ModelLease] = {}  # held, by lease id
        self.freed: dict[int, FreedSlot] = {}  # every FreedSlot the store returned
        self.counters = ModelCounters()
        self.consumers: dict[str, int] = {}  # consumer node -> latest incarnation

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

    def end(self, slot: ModelSlot) -> None:
        slot.ended = True
        slot.claimed = 0

    def done(self, slot: ModelSlot) -> bool:
        """Whether the slot's bytes go now: its handle ended and no lease is left."""
        return slot.ended and not slot.leases

    def unref(self, slot: ModelSlot, claim: bool = False) -> bool:
        """Drop one reference (a claimed one with ``claim``); True when the slot goes."""
        if not slot.ended:
            slot.refcount = max(0, slot.refcount - 1)
            if claim and slot.claimed > 0:
                slot.claimed -= 1
            slot.claimed = min(slot.claimed, slot.refcount)
            if slot.refcount == 0:
                self.end(slot)
        return self.done(slot)

    def live(self, handle: DataHandle) -> ModelSlot | None:
        """The slot while its bytes are held (ended handle or not)."""
        return self.slots.get(handle.slot_id)

    def alive(self, handle: DataHandle) -> ModelSlot | None:
        """The slot of a live handle."""
        slot = self.slots.get(handle.slot_id)
        return None if slot is None or slot.ended else slot

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
        job=st.sampled_from(JOBS),
        detached=st.booleans(),
    )
    def stage(
        self,
        total_len: int,
        kind: SlotKind,
        refcount: int,
        ttl: float | None,
        job: str,
        detached: bool,
    ) -> Any:
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
            job=job,
            detached=detached,
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
            job=job,
            detached=detached,
        )
        self.counters.slots_staged += 1
        self.counters.bytes_staged += total_len
        return handle

    @rule(drawn=handles, data=st.data())
    def ref(self, drawn: DataHandle, data: st.DataObject) -> None:
        handle = self.pick_handle(drawn, data)
        slot = self.alive(handle)
        if slot is None:
            with pytest.raises(HandleNotFound):
                self.store.ref(handle)
            return
        slot.refcount += 1
        assert self.store.ref(handle) == slot.refcount

    @rule(drawn=handles, data=st.data())
    def relocate(self, drawn: DataHandle, data: st.DataObject) -> None:
        """Shutdown demotes a registered slot to plain memory; its leases and refs stay."""
        handle = self.pick_handle(drawn, data)
        slot = self.live(handle)
        new = object()
        if handle.worker_id != WORKER:
            return  # relocate takes the owner's own slot ids
        if slot is None:
            assert self.store.relocate(handle.slot_id, new, kind="plain", pinned=False) is None
            return
        old = self.store.relocate(handle.slot_id, new, kind="plain", pinned=False)
        assert old is slot.location
        slot.location, slot.kind, slot.pinned = new, "plain", False

    # --- leases ----------------------------------------------------------------------

    @rule(
        target=leases,
        drawn=handles,
        kind=st.sampled_from(["rdma", "chunked", "local"]),
        timeout=st.none() | st.sampled_from([0.25, 1.0, 2.0]),
        holder_pid=st.sampled_from(PIDS),
        claim=st.booleans(),
        consumer=st.none() | st.sampled_from([("node-b", 1), ("node-b", 2), ("node-c", 1)]),
        pause=PAUSES,
        data=st.data(),
    )
    def acquire(
        self,
        drawn: DataHandle,
        kind: LeaseKind,
        timeout: float | None,
        holder_pid: int,
        claim: bool,
        consumer: tuple[str, int] | None,
        pause: float,
        data: st.DataObject,
    ) -> Any:
        self.now += pause
        handle = self.pick_handle(drawn, data)
        slot = self.alive(handle)
        kwargs: dict[str, Any] = {
            "kind": kind, "timeout": timeout, "holder_pid": holder_pid, "claim": claim,
            "consumer": consumer,
        }  # fmt: skip
        if slot is None:
            with pytest.raises(HandleNotFound):
                self.store.acquire(handle, self.now, **kwargs)
            return multiple()
        if kind == "rdma" and timeout is None:
            with pytest.raises(ProtocolError):
                self.store.acquire(handle, self.now, kind=kind, timeout=None)
            return multiple()
        if claim and slot.refcount - slot.claimed < 1:
            with pytest.raises(HandleReleased):
                self.store.acquire(handle, self.now, **kwargs)
            self.counters.claims_refused += 1
            return multiple()
        lease = self.store.acquire(handle, self.now, **kwargs)
        assert lease.lease_id not in self.model_leases
        assert lease.slot_id == handle.slot_id
        deadline = None if timeout is None else self.now + timeout
        assert lease.deadline == deadline
        self.model_leases[lease.lease_id] = ModelLease(
            lease.lease_id, slot.handle.slot_id, kind, timeout, deadline, holder_pid, claim,
            consumer,
        )  # fmt: skip
        slot.claimed += claim
        slot.leases.add(lease.lease_id)
        self.counters.leases_granted += 1
        return (handle, lease.lease_id)

    @rule(node=st.sampled_from(["node-b", "node-c"]), worker=st.sampled_from([1, 2, 3]))
    def supersede(self, node: str, worker: int) -> None:
        """A consumer agent's incarnation acquires: an older one's leases end (detached,
        their claims given back)."""
        previous = self.consumers.get(node)
        self.consumers[node] = worker
        expected: set[int] = set()
        rdma = 0
        if previous is not None and previous != worker:
            for lease in list(self.model_leases.values()):
                if lease.consumer != (node, previous):
                    continue
                slot = self.slots[lease.slot_id]
                self.drop_lease(lease)
                self.counters.leases_superseded += 1
                rdma += lease.kind == "rdma"
                if lease.claimed and not slot.ended and slot.claimed > 0:
                    slot.claimed -= 1
                if self.done(slot):
                    expected.add(slot.handle.slot_id)
        freed, ended_rdma = self.store.supersede(node, worker)
        assert ended_rdma == rdma
        self.collect(freed, expected)

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

    @rule(held=leases, other=handles, claim=st.booleans(), data=st.data())
    def detach(
        self, held: tuple[DataHandle, int], other: DataHandle, claim: bool, data: st.DataObject
    ) -> None:
        """``_rv_detach``: the lock goes, the reference stays (``claim``: a claim goes back)."""
        handle, lease_id = self.pick_lease(held, other, data)
        error = self.expect_lease_on(handle, lease_id)
        if error is not None:
            with pytest.raises(error):
                self.store.detach(handle, lease_id, claim=claim)
            return
        lease = self.model_leases[lease_id]
        slot = self.slots[lease.slot_id]
        self.drop_lease(lease)
        if claim and slot.claimed > 0 and not slot.ended:
            slot.claimed -= 1
        expected = {slot.handle.slot_id} if self.done(slot) else set()
        freed = self.store.detach(handle, lease_id, claim=claim)
        self.collect([] if freed is None else [freed], expected)

    @rule(held=leases, other=handles, claim=st.booleans(), data=st.data())
    def release(
        self, held: tuple[DataHandle, int], other: DataHandle, claim: bool, data: st.DataObject
    ) -> None:
        """``_rv_release``: the lock and one reference (a claimed one with ``claim``) go."""
        handle, lease_id = self.pick_lease(held, other, data)
        error = self.expect_lease_on(handle, lease_id)
        if error is not None:
            with pytest.raises(error):
                self.store.release(handle, lease_id, claim=claim)
            return
        lease = self.model_leases[lease_id]
        slot = self.slots[lease.slot_id]
        self.drop_lease(lease)
        expected = {slot.handle.slot_id} if self.unref(slot, claim) else set()
        freed = self.store.release(handle, lease_id, claim=claim)
        self.collect([] if freed is None else [freed], expected)

    @rule(drawn=handles, claim=st.booleans(), data=st.data())
    def release_without_lease(self, drawn: DataHandle, claim: bool, data: st.DataObject) -> None:
        """``release(handle, 0)``: a consumer that read a copy it had drops its reference."""
        handle = self.pick_handle(drawn, data)
        slot = self.live(handle)
        if slot is None:
            with pytest.raises(HandleNotFound):
                self.store.release(handle, 0, claim=claim)
            return
        expected = {slot.handle.slot_id} if self.unref(slot, claim) else set()
        freed = self.store.release(handle, 0, claim=claim)
        self.collect([] if freed is None else [freed], expected)

    @rule(drawn=handles, data=st.data())
    def unclaim(self, drawn: DataHandle, data: st.DataObject) -> None:
        """``detach(handle, 0, claim=True)``: a retried resolution gives its claim back."""
        handle = self.pick_handle(drawn, data)
        slot = self.live(handle)
        if slot is None:
            with pytest.raises(HandleNotFound):
                self.store.detach(handle, 0, claim=True)
            return
        if not slot.ended and slot.claimed > 0:
            slot.claimed -= 1
        assert self.store.detach(handle, 0, claim=True) is None

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
            if slot.ended or slot.ttl_deadline is None or slot.ttl_deadline > self.now:
                continue
            self.end(slot)  # the handle ends; its chunked leases with it
            expired += 1
            for lease_id in sorted(slot.leases):
                if self.model_leases[lease_id].kind == "chunked":
                    self.drop_lease(self.model_leases[lease_id])
            if self.done(slot):
                expected.add(slot.handle.slot_id)
        rdma = chunked = 0
        for lease in list(self.model_leases.values()):
            if lease.slot_id in expected:
                continue
            if lease.deadline is None or lease.deadline > self.now:
                continue
            slot = self.slots[lease.slot_id]
            self.drop_lease(lease)
            if lease.kind == "rdma":
                rdma += 1
            else:
                chunked += 1
            if self.unref(slot, lease.claimed):
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
        """Local reader processes died: their leases end (a detach)."""
        expected: set[int] = set()
        for lease in list(self.model_leases.values()):
            if lease.holder_pid not in dead:
                continue
            slot = self.slots[lease.slot_id]
            self.drop_lease(lease)
            self.counters.local_leases_reaped += 1
            if self.done(slot):
                expected.add(slot.handle.slot_id)
        self.collect(self.store.reap_holders(dead), expected)

    @rule(job=st.sampled_from(JOBS[1:]))
    def end_job(self, job: str) -> None:
        """The Ray job ``job`` ended: its live, non-detached handles end as at a TTL (their
        chunked leases with them); the bytes go once no other lease holds them."""
        ended: set[int] = set()
        expected: set[int] = set()
        for slot in list(self.slots.values()):
            if slot.ended or slot.job != job or slot.detached:
                continue
            self.end(slot)
            ended.add(slot.handle.slot_id)
            for lease_id in sorted(slot.leases):
                if self.model_leases[lease_id].kind == "chunked":
                    self.drop_lease(self.model_leases[lease_id])
            if self.done(slot):
                expected.add(slot.handle.slot_id)
        ended_ids, freed = self.store.end_job(job)
        assert sorted(ended_ids) == sorted(ended)
        self.counters.slots_job_ended += len(ended)
        self.collect(freed, expected)

    @rule(drawn=handles, data=st.data())
    def evict(self, drawn: DataHandle, data: st.DataObject) -> None:
        """A region was deregistered under the slot: it goes now, leases and all."""
        handle = self.pick_handle(drawn, data)
        slot = self.live(handle)  # an ended handle's bytes go too
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
    def a_slot_is_held_iff_its_handle_lives_or_it_is_leased(self) -> None:
        for slot_id, slot in self.slots.items():
            assert not slot.ended or slot.leases, f"model keeps dead slot {slot_id}"
            if slot.ended:
                with pytest.raises(HandleNotFound):
                    self.store.metadata(slot.handle)
                continue
            meta = self.store.metadata(slot.handle)
            assert (meta.size, meta.refcount, meta.pinned) == (
                slot.total_len,
                slot.refcount,
                slot.pinned,
            )
            assert self.store.slot(slot.handle).claimed == slot.claimed <= slot.refcount
        for slot_id in self.freed:
            with pytest.raises(HandleNotFound, match="not found"):
                self.store.metadata(DataHandle(WORKER, slot_id))

    @invariant()
    def followed_jobs_are_those_of_live_attached_handles(self) -> None:
        live = {s.job for s in self.slots.values() if s.job and not s.detached and not s.ended}
        assert self.store.followed_jobs() == live

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
        deadlines += [slot.ttl_deadline for slot in self.slots.values() if not slot.ended]
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
            c.leases_superseded,
            c.claims_refused,
            c.rdma_leases_reaped,
            c.chunked_leases_expired,
            c.local_leases_reaped,
            c.slots_expired,
            c.slots_job_ended,
        ) == (
            m.slots_staged,
            m.slots_freed,
            m.bytes_staged,
            m.leases_granted,
            m.leases_superseded,
            m.claims_refused,
            m.rdma_leases_reaped,
            m.chunked_leases_expired,
            m.local_leases_reaped,
            m.slots_expired,
            m.slots_job_ended,
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
