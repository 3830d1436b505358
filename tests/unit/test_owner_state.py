"""The owner state on its own (no Ray, no UCX, no clock): the buffer ledger, the read gate,
the pull grace, the quarantine, node-local copies and claims, with validate() after every
step."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from ray_velo.errors import HandleNotFound, HandleReleased, StagingError
from ray_velo.owner.state import Effects, OwnerState, RegionSlot
from ray_velo.protocol import DataHandle, TypeHeader

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


def staged(state: OwnerState, buf: Buf, **commit: Any) -> DataHandle:
    rid, _ = state.reserve(buf, "pooled", True, PID)
    fx = Effects()
    handle = state.commit(rid, buf.nbytes, RAW, commit.get("ttl"), commit.get("refs", 1), 0.0, fx)
    state.validate()
    return handle


def freed(fx: Effects) -> list[Buf]:
    return [buffer for buffer, _ in fx.free]  # type: ignore[misc]


def test_a_buffer_moves_reservation_slot_pool_once() -> None:
    state = OwnerState(WORKER)
    buf = Buf(1)
    rid, pending = state.reserve(buf, "pooled", True, PID)
    assert state.holder_of(buf) == f"reservation:{rid}"
    fx = Effects()
    handle = state.commit(rid, 4096, RAW, None, 1, 0.0, fx)
    assert state.holder_of(buf) == f"slot:{pending.slot_id}"
    state.lease_end(handle, 0, True, 1.0, fx)  # the last reference
    assert freed(fx) == [buf] and state.holder_of(buf) is None
    state.validate()


def test_a_double_give_back_is_caught() -> None:
    state = OwnerState(WORKER)
    buf = Buf(2)
    fid = state.fetch_take(buf, True)
    fx = Effects()
    state.fetch_give_back(fid, fx)
    state._hold(buf, "slot:99")  # someone else now holds the same memory
    with pytest.raises(AssertionError, match=r"double free|given back"):
        state._give_back(buf, f"fetch:{fid}", True, fx)


def test_quarantined_memory_never_goes_back() -> None:
    """A timed-out GET may still write a fetch's buffer: quarantined, it is in no effect,
    and shutdown leaves it to its pool's close."""
    state = OwnerState(WORKER)
    buf = Buf(3)
    fid = state.fetch_take(buf, True)
    state.fetch_quarantine(fid)
    assert state.holder_of(buf) == "quarantine"
    fx = Effects()
    state.clear(0.0, fx)
    assert freed(fx) == []
    state.validate()
    assert state.quarantined_bytes == 4096


def test_a_pinned_writer_filled_by_a_fetch_waits_for_it() -> None:
    """Closing a PinnedWriter while a fetch writes into it frees it only when the fetch
    ends; an unsafe GET withdraws it into the quarantine instead."""
    state = OwnerState(WORKER)
    buf = Buf(4)
    rid, _ = state.reserve(buf, "pooled", True, PID)
    state.fill_begin(rid)
    fx = Effects()
    state.abort(rid, "closed", fx)
    assert freed(fx) == []
    with pytest.raises(StagingError):
        state.fill_begin(rid)  # a closed writer takes no new fetch
    state.fill_end(rid, fx)
    assert freed(fx) == [buf]
    state.validate()
    other = Buf(5)
    rid, _ = state.reserve(other, "pooled", True, PID)
    state.fill_begin(rid)
    state.fill_withdraw(rid)
    fx = Effects()
    state.fill_end(rid, fx)
    state.abort(rid, "closed", fx)
    assert freed(fx) == [] and state.holder_of(other) == "quarantine"
    state.validate()


def test_a_ttl_under_a_view_keeps_the_bytes_until_the_view_ends() -> None:
    state = OwnerState(WORKER)
    buf = Buf(6)
    handle = staged(state, buf, ttl=1.0)
    _, lease = state.local_acquire(handle, PID, "detach", 0.5)
    fx = Effects()
    state.sweep(1.0, fx)
    assert freed(fx) == [] and state.holder_of(buf) == f"slot:{handle.slot_id}"
    with pytest.raises(HandleNotFound, match="TTL"):
        state.local_acquire(handle, PID, "detach", 1.1)
    state.lease_end(handle, lease.lease_id, False, 2.0, fx)
    assert freed(fx) == [buf]
    state.validate()


def test_a_read_in_progress_parks_the_bytes() -> None:
    """A region chunk is being copied out when the slot's last reference goes: its bytes
    (here, its region anchor) are released only when the copy ends."""
    state = OwnerState(WORKER)
    handle = state.store.stage(
        8192, RAW, RegionSlot("region", "anchor", 0), kind="region", pinned=True, now=0.0
    )
    lease = state.store.acquire(handle, 0.0, kind="chunked")
    plan = state.pull(lease.lease_id, 0, 4096, 0.0)
    assert not plan.view
    fx = Effects()
    state.lease_end(handle, lease.lease_id, True, 0.1, fx)
    assert fx.anchors == []
    state.validate()
    state.end_read(handle.slot_id, 0.2, fx)
    assert fx.anchors == ["anchor"]
    state.validate()


def test_an_abandoned_slot_waits_out_the_pull_grace() -> None:
    """A chunk went out as a view just before the TTL ended the slot: its memory stays out
    of the pool for the grace (Ray may still be serializing the view), then goes."""
    state = OwnerState(WORKER, pull_grace_s=1.0)
    buf = Buf(7)
    handle = staged(state, buf, ttl=2.0)
    lease = state.store.acquire(handle, 0.0, kind="chunked")
    assert state.pull(lease.lease_id, 0, 4096, 1.8).view
    fx = Effects()
    state.sweep(2.0, fx)
    assert freed(fx) == [] and state.holder_of(buf) == f"grace:{handle.slot_id}"
    assert state.next_due() == pytest.approx(2.8)
    state.validate()
    state.sweep(2.8, fx)
    assert freed(fx) == [buf]
    state.validate()


def test_a_node_local_copy_ends_with_its_last_reader() -> None:
    state = OwnerState(WORKER)
    remote = DataHandle(0xBEEF, 3, "node-a")
    fid = state.fetch_take(Buf(8), True)
    slot = state.fetch_stage(fid, 4096, RAW, "pooled", 0.0, copy_of=remote)
    local = DataHandle(WORKER, slot.slot_id)
    assert state.copy_for(remote) is slot
    first = state.store.acquire(local, 0.0, kind="local", holder_pid=PID)
    second = state.store.acquire(local, 0.0, kind="local", holder_pid=PID)
    fx = Effects()
    state.lease_end(local, first.lease_id, False, 0.1, fx)
    assert state.copy_for(remote) is slot and freed(fx) == []
    state.lease_end(local, second.lease_id, False, 0.2, fx)
    assert state.copy_for(remote) is None and freed(fx) == [Buf(8)]
    state.validate()


def test_two_copies_of_one_payload_each_end_with_their_reader() -> None:
    """Two fetches of one handle ran at once and each made a copy: the newer serves later
    fetches, and the older still ends (and frees) when its own reader goes."""
    state = OwnerState(WORKER)
    remote = DataHandle(0xBEEF, 4, "node-a")
    copies = []
    for n in (10, 11):
        fid = state.fetch_take(Buf(n), True)
        slot = state.fetch_stage(fid, 4096, RAW, "pooled", 0.0, copy_of=remote)
        local = DataHandle(WORKER, slot.slot_id)
        copies.append((local, state.store.acquire(local, 0.0, kind="local", holder_pid=PID)))
    assert state.copy_for(remote) is not None
    assert state.copy_for(remote).slot_id == copies[1][0].slot_id  # type: ignore[union-attr]
    fx = Effects()
    for local, lease in copies:
        state.lease_end(local, lease.lease_id, False, 1.0, fx)
    assert sorted(b.n for b in freed(fx)) == [10, 11]
    assert state.store.live_slots == 0
    state.validate()


def test_claims_of_a_dead_process_are_handed_back() -> None:
    state = OwnerState(WORKER)
    handle = staged(state, Buf(9), refs=2)
    state.local_acquire(handle, PID, "claim", 0.0)
    remote = DataHandle(0xBEEF, 1, "node-a")
    state.claim_held(PID, remote)
    state.local_acquire(handle, 77, "claim", 0.0)
    with pytest.raises(HandleReleased):  # two references, two claims held
        state.local_acquire(handle, 78, "claim", 0.0)
    fx = Effects()
    reaped = state.reap({PID}, 1.0, fx)
    assert sorted(map(str, reaped.unclaim)) == sorted([str(handle), str(remote)])
    assert state.claim_pids() == {77}
    state.validate()


def test_a_handle_that_follows_its_producer_ends_when_it_dies() -> None:
    """A tensor-transport object is staged to follow its producer: when that process dies
    its handle ends (a later acquire names why), a reader's view keeps the bytes until it
    ends, and a handle released before the death is simply gone."""
    state = OwnerState(WORKER)
    rid, _ = state.reserve(Buf(11), "pooled", True, PID)
    fx = Effects()
    followed = state.commit(rid, 4096, RAW, None, 1, 0.0, fx, follow_producer=True)
    rid, _ = state.reserve(Buf(12), "pooled", True, PID)
    released = state.commit(rid, 4096, RAW, None, 1, 0.0, fx, follow_producer=True)
    plain = staged(state, Buf(13))  # same producer, not following it
    _, view = state.local_acquire(followed, 77, "detach", 0.0)
    state.lease_end(released, 0, True, 0.5, fx)  # Ray freed it before the death
    assert PID in state.watched_pids()
    fx = Effects()
    state.reap({PID}, 1.0, fx)
    state.validate()
    with pytest.raises(HandleNotFound, match="the process that staged it died"):
        state.local_acquire(followed, 78, "detach", 1.0)
    assert freed(fx) == []  # the reader still holds the bytes
    state.lease_end(followed, view.lease_id, False, 2.0, fx)
    assert freed(fx) == [Buf(11)]
    state.local_acquire(plain, 78, "detach", 2.0)  # untouched
    assert state.watched_pids() == {78}
    state.validate()


# --- random traffic ----------------------------------------------------------------------


class OwnerStateMachine(RuleBasedStateMachine):
    """Reservations, commits, aborts, fetch buffers, leases, reads, sweeps and deaths in any
    order: the ledger always matches the tables, and no buffer comes back twice."""

    def __init__(self) -> None:
        super().__init__()
        # a fixed id key: hypothesis replays a run step for step, slot ids included
        self.state = OwnerState(WORKER, pull_grace_s=0.5, id_key=bytes(16))
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
        rid, _ = self.state.reserve(self._buf(), "pooled", True, PID)
        if not commit:
            self.reservations.append(rid)
            return
        fx = Effects()
        self.handles.append(self.state.commit(rid, 4096, RAW, ttl, refs, self.now, fx))
        self._apply(fx)

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        if self.reservations:
            rid = self.reservations.pop(data.draw(st.integers(0, len(self.reservations) - 1)))
            fx = Effects()
            self.state.abort(rid, "aborted", fx)
            self._apply(fx)

    @rule(data=st.data(), mode=st.sampled_from(["release", "detach", "claim"]))
    def read(self, data: st.DataObject, mode: str) -> None:
        if not self.handles:
            return
        handle = data.draw(st.sampled_from(self.handles))
        try:
            _, lease = self.state.local_acquire(handle, PID, mode, self.now)  # type: ignore[arg-type]
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
            self.state.lease_end(handle, lease_id, release, self.now, fx)
        self._apply(fx)

    @rule(data=st.data())
    def copy_out(self, data: st.DataObject) -> None:
        if self.handles:
            handle = data.draw(st.sampled_from(self.handles))
            if any(s.slot_id == handle.slot_id for s in self.state.store.slots()):
                self.state.begin_read(handle.slot_id)
                self.reads.append(handle.slot_id)

    @rule()
    def copy_done(self) -> None:
        if self.reads:
            fx = Effects()
            self.state.end_read(self.reads.pop(), self.now, fx)
            self._apply(fx)

    @rule(outcome=st.sampled_from(["stage", "give_back", "quarantine"]))
    def fetch(self, outcome: str) -> None:
        fid = self.state.fetch_take(self._buf(), True)
        fx = Effects()
        if outcome == "stage":
            slot = self.state.fetch_stage(fid, 4096, RAW, "pooled", self.now)
            self.handles.append(DataHandle(WORKER, slot.slot_id))
        elif outcome == "give_back":
            self.state.fetch_give_back(fid, fx)
        else:
            self.state.fetch_quarantine(fid)
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


def ledger_matches(state: OwnerState, returned: set[tuple[str, int]]) -> None:
    """The machines' invariant: the ledger matches, and nothing returned is held."""
    state.validate()
    assert not returned & set(state.holders), "a buffer both returned and held"


def nothing_held_but_quarantine(state: OwnerState) -> None:
    """After clear(): every buffer went back but the quarantined ones."""
    assert set(state.holders) == {b.key for b, _ in state.quarantined}


OwnerStateMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None
)
TestOwnerStateMachine = OwnerStateMachine.TestCase
