"""The agent's state objects on their own (no Ray, no UCX, no clock): the buffer ledger, the
read gate, the pull grace, the quarantine, node-local copies and claims, with validate() after
every step."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from ray_velo.errors import HandleNotFound, HandleReleased, StagingError
from ray_velo.protocol import DataHandle, TypeHeader
from ray_velo.state.agent import AgentStates
from ray_velo.state.ledger import Holder
from ray_velo.state.owner import Effects, RegionSlot

WORKER = 0xC0FFEE
RAW = TypeHeader()
PID = 4242


@dataclass(frozen=True)
class Buf:
    """A stand-in for a pool Placement: the ledger needs only its key and size."""

    n: int
    nbytes: int = 4096

    @property
    def key(self) -> tuple[str, int]:
        return ("arena", self.n)


def staged(state: AgentStates, buf: Buf, **commit: Any) -> DataHandle:
    rid, _ = state.reservations.reserve(buf, "pooled", True, PID)
    fx = Effects()
    handle = state.reservations.commit(
        rid, buf.nbytes, RAW, commit.get("ttl"), commit.get("refs", 1), 0.0, fx
    )
    state.validate()
    return handle


def freed(fx: Effects) -> list[Buf]:
    return [buffer for buffer, _ in fx.free]  # type: ignore[misc]


def holder(state: AgentStates, buf: Buf) -> str | None:
    found = state.owner.ledger.holder_of(buf)
    return None if found is None else str(found)  # "kind:id"


def test_a_buffer_moves_reservation_slot_pool_once() -> None:
    state = AgentStates.new(WORKER)
    buf = Buf(1)
    rid, pending = state.reservations.reserve(buf, "pooled", True, PID)
    assert holder(state, buf) == f"reservation:{rid}"
    fx = Effects()
    handle = state.reservations.commit(rid, 4096, RAW, None, 1, 0.0, fx)
    assert holder(state, buf) == f"slot:{pending.slot_id}"
    state.owner.end_lease(handle, 0, True, 1.0, fx)  # the last reference
    assert freed(fx) == [buf] and holder(state, buf) is None
    state.validate()


def test_a_double_give_back_is_caught() -> None:
    state = AgentStates.new(WORKER)
    buf = Buf(2)
    fid = state.consumer.fetch_take(buf, True)
    fx = Effects()
    state.consumer.fetch_give_back(fid, fx)
    state.owner.ledger.hold(buf, Holder("slot", 99))  # someone else now holds the same memory
    with pytest.raises(AssertionError, match=r"double free|given back"):
        state.owner.ledger.give_back(buf, Holder("fetch", fid), True, fx)


def test_quarantined_memory_never_goes_back() -> None:
    """A timed-out GET may still write a fetch's buffer: quarantined, it is in no effect,
    and shutdown leaves it to its pool's close."""
    state = AgentStates.new(WORKER)
    buf = Buf(3)
    fid = state.consumer.fetch_take(buf, True)
    state.consumer.fetch_quarantine(fid)
    assert holder(state, buf) == "quarantine"
    fx = Effects()
    state.clear(0.0, fx)
    assert freed(fx) == []
    state.validate()
    assert state.owner.counts().quarantined_bytes == 4096


def test_a_pinned_writer_filled_by_a_fetch_waits_for_it() -> None:
    """Closing a PinnedWriter while a fetch writes into it frees it only when the fetch
    ends; an unsafe GET withdraws it into the quarantine instead."""
    state = AgentStates.new(WORKER)
    writers = state.reservations
    buf = Buf(4)
    rid, _ = writers.reserve(buf, "pooled", True, PID)
    writers.fill_begin(rid)
    fx = Effects()
    writers.abort(rid, "closed", fx)
    assert freed(fx) == []
    with pytest.raises(StagingError):
        writers.fill_begin(rid)  # a closed writer takes no new fetch
    writers.fill_end(rid, fx)
    assert freed(fx) == [buf]
    state.validate()
    other = Buf(5)
    rid, _ = writers.reserve(other, "pooled", True, PID)
    writers.fill_begin(rid)
    writers.fill_withdraw(rid)
    fx = Effects()
    writers.fill_end(rid, fx)
    writers.abort(rid, "closed", fx)
    assert freed(fx) == [] and holder(state, other) == "quarantine"
    state.validate()


def test_a_ttl_under_a_view_keeps_the_bytes_until_the_view_ends() -> None:
    state = AgentStates.new(WORKER)
    buf = Buf(6)
    handle = staged(state, buf, ttl=1.0)
    _, lease = state.owner.local_acquire(handle, PID, "detach", 0.5)
    fx = Effects()
    state.sweep(1.0, fx)
    assert freed(fx) == [] and holder(state, buf) == f"slot:{handle.slot_id}"
    with pytest.raises(HandleNotFound, match="TTL"):
        state.owner.local_acquire(handle, PID, "detach", 1.1)
    state.owner.end_lease(handle, lease.lease_id, False, 2.0, fx)
    assert freed(fx) == [buf]
    state.validate()


def test_a_read_in_progress_parks_the_bytes() -> None:
    """A region chunk is being copied out when the slot's last reference goes: its bytes
    (here, its region anchor) are released only when the copy ends."""
    state = AgentStates.new(WORKER)
    owner, fx = state.owner, Effects()
    region = RegionSlot("region", "anchor", 0)  # type: ignore[arg-type]
    slot = owner.stage(region, None, 8192, RAW, 0.0, fx, kind="region", pinned=True)
    handle = DataHandle(WORKER, slot.slot_id)
    lease = owner.grant(handle, 0.0, kind="chunked")
    plan = owner.pull(lease.lease_id, 0, 4096, 0.0)
    assert not plan.view
    owner.end_lease(handle, lease.lease_id, True, 0.1, fx)
    assert fx.anchors == []
    state.validate()
    owner.end_read(handle.slot_id, 0.2, fx)
    assert fx.anchors == ["anchor"]
    state.validate()


def test_an_abandoned_slot_waits_out_the_pull_grace() -> None:
    """A chunk went out as a view just before the TTL ended the slot: its memory stays out
    of the pool for the grace (Ray may still be serializing the view), then goes."""
    state = AgentStates.new(WORKER, pull_grace_s=1.0)
    buf = Buf(7)
    handle = staged(state, buf, ttl=2.0)
    lease = state.owner.grant(handle, 0.0, kind="chunked")
    assert state.owner.pull(lease.lease_id, 0, 4096, 1.8).view
    fx = Effects()
    state.sweep(2.0, fx)
    assert freed(fx) == [] and holder(state, buf) == f"grace:{handle.slot_id}"
    assert state.next_due() == pytest.approx(2.8)
    state.validate()
    state.sweep(2.8, fx)
    assert freed(fx) == [buf]
    state.validate()


def test_a_node_local_copy_ends_with_its_last_reader() -> None:
    state = AgentStates.new(WORKER)
    owner, copies, fx = state.owner, state.consumer, Effects()
    remote = DataHandle(0xBEEF, 3, "node-a")
    fid = copies.fetch_take(Buf(8), True)
    slot = copies.fetch_stage(fid, 4096, RAW, "pooled", 0.0, fx, copy_of=remote)
    local = DataHandle(WORKER, slot.slot_id)
    assert copies.copy_for(remote) is slot
    _, first = owner.local_acquire(local, PID, "detach", 0.0)
    _, second = owner.local_acquire(local, PID, "detach", 0.0)
    owner.end_lease(local, first.lease_id, False, 0.1, fx)
    assert copies.copy_for(remote) is slot and freed(fx) == []
    owner.end_lease(local, second.lease_id, False, 0.2, fx)
    assert copies.copy_for(remote) is None and freed(fx) == [Buf(8)]
    state.validate()


def test_two_copies_of_one_payload_each_end_with_their_reader() -> None:
    """Two fetches of one handle ran at once and each made a copy: the newer serves later
    fetches, and the older still ends (and frees) when its own reader goes."""
    state = AgentStates.new(WORKER)
    owner, consumer, fx = state.owner, state.consumer, Effects()
    remote = DataHandle(0xBEEF, 4, "node-a")
    copies = []
    for n in (10, 11):
        fid = consumer.fetch_take(Buf(n), True)
        slot = consumer.fetch_stage(fid, 4096, RAW, "pooled", 0.0, fx, copy_of=remote)
        local = DataHandle(WORKER, slot.slot_id)
        copies.append((local, owner.local_acquire(local, PID, "detach", 0.0)[1]))
    assert consumer.copy_for(remote) is not None
    assert consumer.copy_for(remote).slot_id == copies[1][0].slot_id  # type: ignore[union-attr]
    for local, lease in copies:
        owner.end_lease(local, lease.lease_id, False, 1.0, fx)
    assert sorted(b.n for b in freed(fx)) == [10, 11]
    assert owner.counts().live_slots == 0
    state.validate()


def test_claims_of_a_dead_process_are_handed_back() -> None:
    state = AgentStates.new(WORKER)
    owner, consumer = state.owner, state.consumer
    handle = staged(state, Buf(9), refs=2)
    owner.local_acquire(handle, PID, "claim", 0.0)
    consumer.claim_held(PID, handle)
    remote = DataHandle(0xBEEF, 1, "node-a")
    consumer.claim_held(PID, remote)
    owner.local_acquire(handle, 77, "claim", 0.0)
    consumer.claim_held(77, handle)
    with pytest.raises(HandleReleased):  # two references, two claims held
        owner.local_acquire(handle, 78, "claim", 0.0)
    fx = Effects()
    reaped = state.reap({PID}, 1.0, fx)
    assert sorted(map(str, reaped.unclaim)) == sorted([str(handle), str(remote)])
    assert consumer.claim_pids() == {77}
    state.validate()


def test_a_handle_that_follows_its_producer_ends_when_it_dies() -> None:
    """A tensor-transport object is staged to follow its producer: when that process dies
    its handle ends (a later acquire names why), a reader's view keeps the bytes until it
    ends, and a handle released before the death is simply gone."""
    state = AgentStates.new(WORKER)
    owner, writers = state.owner, state.reservations
    rid, _ = writers.reserve(Buf(11), "pooled", True, PID)
    fx = Effects()
    followed = writers.commit(rid, 4096, RAW, None, 1, 0.0, fx, follow_producer=True)
    rid, _ = writers.reserve(Buf(12), "pooled", True, PID)
    released = writers.commit(rid, 4096, RAW, None, 1, 0.0, fx, follow_producer=True)
    plain = staged(state, Buf(13))  # same producer, not following it
    _, view = owner.local_acquire(followed, 77, "detach", 0.0)
    owner.end_lease(released, 0, True, 0.5, fx)  # Ray freed it before the death
    assert PID in state.watched_pids()
    fx = Effects()
    state.reap({PID}, 1.0, fx)
    state.validate()
    with pytest.raises(HandleNotFound, match="the process that staged it died"):
        owner.local_acquire(followed, 78, "detach", 1.0)
    assert freed(fx) == []  # the reader still holds the bytes
    owner.end_lease(followed, view.lease_id, False, 2.0, fx)
    assert freed(fx) == [Buf(11)]
    owner.local_acquire(plain, 78, "detach", 2.0)  # untouched
    assert state.watched_pids() == {78}
    state.validate()


# --- random traffic ----------------------------------------------------------------------


class OwnerStateMachine(RuleBasedStateMachine):
    """Reservations, commits, aborts, fetch buffers, leases, reads, sweeps and deaths in any
    order: the ledger always matches the tables, and no buffer comes back twice."""

    def __init__(self) -> None:
        super().__init__()
        # a fixed id key: hypothesis replays a run step for step, slot ids included
        self.state = AgentStates.new(WORKER, pull_grace_s=0.5, id_key=bytes(16))
        self.now = 0.0
        self.next_buf = 0
        self.returned: set[tuple[str, int]] = set()
        self.handles: list[DataHandle] = []
        self.leases: list[tuple[DataHandle, int]] = []
        self.reservations: list[int] = []
        self.fetches: list[int] = []
        self.reads: list[int] = []

    def _buf(self) -> Buf:
        self.next_buf += 1
        return Buf(self.next_buf)

    def _apply(self, fx: Effects) -> None:
        for buffer, _ in fx.free:
            assert buffer.key not in self.returned, f"{buffer.key} given back twice"
            self.returned.add(buffer.key)

    @rule(
        ttl=st.none() | st.sampled_from([0.25, 1.0]), refs=st.integers(1, 2), commit=st.booleans()
    )
    def reserve(self, ttl: float | None, refs: int, commit: bool) -> None:
        rid, _ = self.state.reservations.reserve(self._buf(), "pooled", True, PID)
        if not commit:
            self.reservations.append(rid)
            return
        fx = Effects()
        handle = self.state.reservations.commit(rid, 4096, RAW, ttl, refs, self.now, fx)
        self.handles.append(handle)
        self._apply(fx)

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        if self.reservations:
            rid = self.reservations.pop(data.draw(st.integers(0, len(self.reservations) - 1)))
            fx = Effects()
            self.state.reservations.abort(rid, "aborted", fx)
            self._apply(fx)

    @rule(data=st.data(), mode=st.sampled_from(["release", "detach", "claim"]))
    def read(self, data: st.DataObject, mode: str) -> None:
        if not self.handles:
            return
        handle = data.draw(st.sampled_from(self.handles))
        try:
            _, lease = self.state.owner.local_acquire(handle, PID, mode, self.now)  # type: ignore[arg-type]
        except (HandleNotFound, HandleReleased):
            return
        self.leases.append((handle, lease.lease_id))

    @rule(data=st.data(), release=st.booleans())
    def end(self, data: st.DataObject, release: bool) -> None:
        if not self.leases:
            return
        handle, lease_id = self.leases.pop(data.draw(st.integers(0, len(self.leases) - 1)))
        fx = Effects()
        with contextlib.suppress(HandleNotFound):  # its slot was freed with the TTL
            self.state.owner.end_lease(handle, lease_id, release, self.now, fx)
        self._apply(fx)

    @rule(data=st.data())
    def copy_out(self, data: st.DataObject) -> None:
        if self.handles:
            handle = data.draw(st.sampled_from(self.handles))
            if self.state.owner.held_slot(handle.slot_id) is not None:
                self.state.owner.reads.begin(handle.slot_id)
                self.reads.append(handle.slot_id)

    @rule()
    def copy_done(self) -> None:
        if self.reads:
            fx = Effects()
            self.state.owner.end_read(self.reads.pop(), self.now, fx)
            self._apply(fx)

    @rule(outcome=st.sampled_from(["stage", "give_back", "quarantine"]))
    def fetch(self, outcome: str) -> None:
        consumer = self.state.consumer
        fid = consumer.fetch_take(self._buf(), True)
        fx = Effects()
        if outcome == "stage":
            slot = consumer.fetch_stage(fid, 4096, RAW, "pooled", self.now, fx)
            self.handles.append(DataHandle(WORKER, slot.slot_id))
        elif outcome == "give_back":
            consumer.fetch_give_back(fid, fx)
        else:
            consumer.fetch_quarantine(fid)
        self._apply(fx)

    @rule(dt=st.sampled_from([0.0, 0.25, 0.5, 1.0]))
    def sweep(self, dt: float) -> None:
        self.now += dt
        fx = Effects()
        self.state.sweep(self.now, fx)
        self._apply(fx)

    @rule()
    def reader_dies(self) -> None:
        fx = Effects()
        self.state.reap({PID}, self.now, fx)
        self.leases.clear()
        self.reservations.clear()
        self._apply(fx)

    @invariant()
    def ledger_matches(self) -> None:
        ledger_matches(self.state, self.returned)

    def teardown(self) -> None:
        fx = Effects()
        self.state.clear(self.now, fx)
        self._apply(fx)
        nothing_held_but_quarantine(self.state)


def ledger_matches(state: AgentStates, returned: set[tuple[str, int]]) -> None:
    """The machines' invariant: the ledger matches, and nothing returned is held."""
    state.validate()
    assert not returned & state.owner.ledger.held(), "a buffer both returned and held"


def nothing_held_but_quarantine(state: AgentStates) -> None:
    """After clear(): every buffer went back but the quarantined ones."""
    ledger = state.owner.ledger
    assert ledger.held() == {b.key for b, _ in ledger.quarantined}


OwnerStateMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None
)
TestOwnerStateMachine = OwnerStateMachine.TestCase
