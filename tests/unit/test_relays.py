"""Copies other nodes read as they fill, on their own (no Ray, no UCX, no clock): the owner's
list of copies (chain order, never the reader's own node, forgotten when the handle ends or
the node's agent is replaced) and a copy's bytes on its node, which never go back to a pool
while another node's reader may still GET them (a failed fetch, a copy that ended, the agent
shutting down), with validate() after every step."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from ray_velo.errors import HandleNotFound, LeaseNotFound
from ray_velo.protocol import DataHandle, TypeHeader
from ray_velo.state.agent import AgentStates
from ray_velo.state.consumer import KEPT_IDLE_S
from ray_velo.state.ledger import QUARANTINE, Holder
from ray_velo.state.owner import Effects
from ray_velo.state.relays import CopySources, Relay
from tests.unit.test_owner_state import (
    PID,
    WORKER,
    Buf,
    freed,
    ledger_matches,
    nothing_held_but_quarantine,
    staged,
)

RAW = TypeHeader()
REMOTE = DataHandle(0xABC, 7)
OTHER = DataHandle(0xABC, 8)
LEASE_S = 1.0


# --- the owner's copies ---------------------------------------------------------------


def test_consumers_arriving_together_form_a_chain() -> None:
    sources = CopySources()
    assert sources.pick(1, "b", 11) is None  # nobody has a copy: read the owner's
    sources.announce(1, "b", 11)
    c = sources.pick(1, "c", 12)
    sources.announce(1, "c", 12)
    d = sources.pick(1, "d", 13)
    sources.announce(1, "d", 13)
    assert (c and c.node, d and d.node) == ("b", "c")  # a -> b -> c -> d


def test_a_second_receiver_on_a_node_reads_its_own_agents_copy_first() -> None:
    """Another receiver on the same node fills a copy: read it there (a copy in memory, the
    link crossed once per node), before any other node's; never a copy of another agent on
    the node (an earlier incarnation's)."""
    sources = CopySources()
    sources.announce(1, "c", 12)
    sources.announce(1, "b", 11)
    own = sources.pick(1, "b", 11)
    assert own is not None and (own.node, own.worker) == ("b", 11)
    other = sources.pick(1, "b", 99)  # another agent of node b: never node b's copy
    assert other is not None and other.node == "c"
    sources.gone(1, "c", 12)
    assert sources.pick(1, "b", 99) is None


def test_copies_are_forgotten_when_gone_replaced_or_their_handle_ends() -> None:
    sources = CopySources()
    for node, worker in (("b", 11), ("c", 12), ("d", 13)):
        sources.announce(1, node, worker)
    sources.gone(1, "b", 11)
    sources.superseded("c", 99)  # node c's agent restarted: its copies died with it
    assert sources.count() == 1
    assert sources.ended(1) == [("d", 13)]  # whom the owner tells
    assert sources.count() == 0 and sources.pick(1, "e", 14) is None


def test_the_end_of_a_handle_with_copies_tells_their_agents() -> None:
    state = AgentStates.new(WORKER)
    handle = staged(state, Buf(1))
    state.owner.sources.grant(handle.slot_id, "b", 11, pick=False, announce=True)
    fx = Effects()
    state.owner.end_lease(handle, 0, True, 1.0, fx)
    assert fx.copy_ends == [(handle, "b", 11)]
    assert freed(fx) == [Buf(1)]


# --- a copy on its node ---------------------------------------------------------------


def filling(state: AgentStates, remote: DataHandle = REMOTE, n: int = 1) -> int:
    fid = state.consumer.fetch_take(Buf(n), True)
    assert state.consumer.relay_open(remote, fid, 4096)
    return fid


def test_a_failed_fetch_keeps_its_bytes_for_the_node_reading_them() -> None:
    state = AgentStates.new(WORKER)
    fid = filling(state)
    state.consumer.relay_landed(REMOTE, 2048)
    lease_id, relay = state.consumer.relay_join(REMOTE, 0.0, LEASE_S)
    assert relay.landed == 2048
    fx = Effects()
    state.consumer.fetch_give_back(fid, fx)  # its GET failed
    assert freed(fx) == [] and state.owner.ledger.holder_of(Buf(1)) == Holder("relayed", fid)
    state.validate()
    with pytest.raises(HandleNotFound):  # no new reader of a failed copy
        state.consumer.relay_join(REMOTE, 0.0, LEASE_S)
    state.consumer.relay_leave(REMOTE, lease_id, 0.5, fx)
    assert freed(fx) == [Buf(1)]
    assert state.consumer.relay(REMOTE) is None
    state.validate()


def test_a_copy_that_ends_while_read_keeps_its_bytes_until_the_read_ends() -> None:
    state = AgentStates.new(WORKER)
    fid = filling(state)
    lease_id, _ = state.consumer.relay_join(REMOTE, 0.0, LEASE_S)
    slot = state.consumer.fetch_stage(fid, 4096, RAW, "pooled", 0.0, Effects(), copy_of=REMOTE)
    fx = Effects()
    state.consumer.copy_ended(REMOTE, 0.1, fx)  # the owner ended the handle: the copy ends now
    assert freed(fx) == [] and state.owner.ledger.holder_of(Buf(1)) == Holder(
        "parked", slot.slot_id
    )
    state.validate()
    state.consumer.relay_leave(REMOTE, lease_id, 0.2, fx)
    assert freed(fx) == [Buf(1)]
    state.validate()


def test_a_reader_that_stops_renewing_lets_the_bytes_go_a_lease_later() -> None:
    state = AgentStates.new(WORKER)
    fid = filling(state)
    lease_id, _ = state.consumer.relay_join(REMOTE, 0.0, LEASE_S)
    fx = Effects()
    state.consumer.fetch_give_back(fid, fx)
    assert state.next_due() == LEASE_S
    state.sweep(LEASE_S / 2, fx)
    assert freed(fx) == []
    state.consumer.relay_renew(REMOTE, lease_id, LEASE_S / 2, LEASE_S)
    state.sweep(LEASE_S, fx)
    assert freed(fx) == []  # renewed
    state.sweep(1.5 * LEASE_S, fx)
    assert freed(fx) == [Buf(1)]
    with pytest.raises(LeaseNotFound):
        state.consumer.relay_renew(REMOTE, lease_id, 2.0, LEASE_S)
    state.validate()


def test_a_quarantined_copy_is_read_to_its_landed_bytes_and_never_given_back() -> None:
    state = AgentStates.new(WORKER)
    fid = filling(state)
    state.consumer.relay_landed(REMOTE, 1024)
    lease_id, _ = state.consumer.relay_join(REMOTE, 0.0, LEASE_S)
    state.consumer.fetch_quarantine(fid)  # a GET into it timed out: it may still be written
    fx = Effects()
    state.consumer.relay_leave(REMOTE, lease_id, 0.1, fx)
    assert freed(fx) == [] and state.owner.ledger.holder_of(Buf(1)) == QUARANTINE
    state.validate()


def test_a_copy_the_owner_counts_outlives_its_readers_until_the_handle_ends() -> None:
    state = AgentStates.new(WORKER)
    fid = filling(state)
    slot = state.consumer.fetch_stage(fid, 4096, RAW, "pooled", 0.0, Effects(), copy_of=REMOTE)
    local = DataHandle(WORKER, slot.slot_id)
    lease = state.owner.local_acquire(local, PID, "detach", 0.0)[1]
    fx = Effects()
    state.owner.end_lease(local, lease.lease_id, False, 0.1, fx)
    assert state.consumer.copy_for(REMOTE) is not None and freed(fx) == []  # kept for the owner
    state.consumer.copy_ended(REMOTE, 0.2, fx)
    assert state.consumer.copy_for(REMOTE) is None and freed(fx) == [Buf(1)]
    state.validate()


def test_a_kept_copy_nobody_reads_ends_after_its_idle_bound() -> None:
    """The owner's word may never come (its agent died): an unread kept copy goes anyway."""
    state = AgentStates.new(WORKER)
    slot = state.consumer.fetch_stage(
        filling(state), 4096, RAW, "pooled", 0.0, Effects(), copy_of=REMOTE
    )
    local = DataHandle(WORKER, slot.slot_id)
    fx = Effects()
    for start in (0.0, 30.0):  # read twice: the bound counts from the last reader's end
        lease = state.owner.local_acquire(local, PID, "detach", start)[1]
        state.owner.end_lease(local, lease.lease_id, False, start + 1.0, fx)
    assert state.next_due() == 31.0 + KEPT_IDLE_S
    state.sweep(30.0 + KEPT_IDLE_S, fx)
    assert freed(fx) == [] and state.consumer.copy_for(REMOTE) is not None
    state.sweep(31.0 + KEPT_IDLE_S, fx)
    assert freed(fx) == [Buf(1)] and state.consumer.copy_for(REMOTE) is None
    state.validate()


def test_a_copy_whose_handle_ended_while_it_filled_goes_with_its_last_reader() -> None:
    state = AgentStates.new(WORKER)
    fid = filling(state)
    fx = Effects()
    state.consumer.copy_ended(REMOTE, 0.0, fx)  # before the copy is complete
    slot = state.consumer.fetch_stage(fid, 4096, RAW, "pooled", 0.0, Effects(), copy_of=REMOTE)
    local = DataHandle(WORKER, slot.slot_id)
    lease = state.owner.local_acquire(local, PID, "detach", 0.0)[1]
    state.owner.end_lease(local, lease.lease_id, False, 0.1, fx)
    assert state.consumer.copy_for(REMOTE) is None and freed(fx) == [Buf(1)]


def test_shutdown_gives_every_copy_back_readers_or_not() -> None:
    state = AgentStates.new(WORKER)
    fid = filling(state)
    state.consumer.relay_join(REMOTE, 0.0, LEASE_S)
    fx = Effects()
    state.consumer.fetch_give_back(fid, fx)
    fid2 = filling(state, OTHER, 2)
    state.consumer.relay_join(OTHER, 0.0, LEASE_S)
    state.clear(0.1, fx)
    assert sorted(b.n for b in freed(fx)) == [1, 2]
    assert fid2 and not state.owner.ledger.held()
    state.validate()


def test_a_copy_in_a_pinned_writer_serves_while_it_fills_and_its_readers_finish_after() -> None:
    """A fetch into a PinnedWriter relays its buffer (never the ledger's: the writer's
    reservation owns it). Once the fetch returned (sealed) nobody new joins, the readers on
    it go on renewing and reading what landed; the writer is its process's again only when
    no reader may still GET it."""
    state = AgentStates.new(WORKER)
    relay = state.consumer.relay_open_lent(REMOTE, Buf(5), 4096)
    assert relay is not None
    assert state.consumer.relay_open_lent(REMOTE, Buf(6), 4096) is None  # one copy at a time
    state.consumer.relay_landed(REMOTE, 4096)
    lease_id, joined = state.consumer.relay_join(REMOTE, 0.0, LEASE_S)
    assert joined is relay and state.consumer.relay_buffer(relay) == Buf(5)
    assert not state.owner.ledger.held()
    state.consumer.relay_seal(relay)
    with pytest.raises(HandleNotFound):
        state.consumer.relay_join(REMOTE, 0.1, LEASE_S)
    assert state.consumer.relay_renew(REMOTE, lease_id, 0.5, LEASE_S).landed == 4096
    assert state.consumer.relay_reading(relay, 1.0)  # its lease runs to 1.5
    state.consumer.relay_leave(REMOTE, lease_id, 1.0, Effects())
    assert not state.consumer.relay_reading(relay, 1.0)
    state.consumer.relay_close_lent(relay)
    assert state.consumer.relay(REMOTE) is None and state.consumer.relay_readers == 0
    state.validate()


def test_a_failed_fetch_into_a_pinned_writer_sends_its_readers_to_the_owner() -> None:
    """Sealed short of its last byte: its readers' next renewal says the copy failed (they
    read the rest from the owner); a reader that stops renewing frees it a lease later."""
    state = AgentStates.new(WORKER)
    relay = state.consumer.relay_open_lent(REMOTE, Buf(5), 4096)
    assert relay is not None
    state.consumer.relay_landed(REMOTE, 1024)
    state.consumer.relay_join(REMOTE, 0.0, LEASE_S)
    state.consumer.relay_seal(relay)
    assert relay.failed and relay.landed == 1024
    assert state.consumer.relay_reading(relay, 0.9)
    assert not state.consumer.relay_reading(relay, LEASE_S)  # its lease ran out unrenewed
    state.consumer.relay_close_lent(relay)
    assert state.consumer.relay(REMOTE) is None
    # a new copy of the handle may open now
    assert state.consumer.relay_open_lent(REMOTE, Buf(6), 4096) is not None


class RelayMachine(RuleBasedStateMachine):
    """Fetches filling copies, other nodes' readers joining, renewing, leaving and expiring,
    local readers, the owner ending handles, sweeps, in any order: the ledger matches, no
    buffer comes back twice, and no buffer comes back while a live reader may GET it."""

    def __init__(self) -> None:
        super().__init__()
        # a fixed id key: hypothesis replays a run step for step, lease ids included
        self.state = AgentStates.new(WORKER, id_key=bytes(16))
        self.now = 0.0
        self.next_buf = 0
        self.returned: set[tuple[str, int]] = set()
        self.filling: dict[int, DataHandle] = {}  # fid -> remote
        self.readers: dict[tuple[DataHandle, int], tuple[tuple[str, int], float]] = {}
        self.locals: list[tuple[DataHandle, int]] = []
        self.lent: list[Relay] = []  # copies in PinnedWriters, filling or sealed

    def _apply(self, fx: Effects) -> None:
        live = {key for key, due in self.readers.values() if due > self.now}
        for buffer, _ in fx.free:
            assert buffer.key not in self.returned, f"{buffer.key} given back twice"
            assert buffer.key not in live, f"{buffer.key} given back while a node reads it"
            self.returned.add(buffer.key)

    @rule(remote=st.sampled_from([REMOTE, OTHER]))
    def fill(self, remote: DataHandle) -> None:
        self.next_buf += 1
        fid = self.state.consumer.fetch_take(Buf(self.next_buf), True)
        if self.state.consumer.relay_open(remote, fid, 4096):
            self.filling[fid] = remote
        else:
            fx = Effects()
            self.state.consumer.fetch_give_back(fid, fx)
            self._apply(fx)

    @rule(remote=st.sampled_from([REMOTE, OTHER]))
    def lend(self, remote: DataHandle) -> None:
        self.next_buf += 1
        relay = self.state.consumer.relay_open_lent(remote, Buf(self.next_buf), 4096)
        if relay is not None:
            self.lent.append(relay)

    @rule(data=st.data())
    def seal_or_close(self, data: st.DataObject) -> None:
        """A fetch into a PinnedWriter returns (sealed); the writer goes back to its process
        once no reader may still GET it (the driver waits for that)."""
        if not self.lent:
            return
        relay = self.lent[data.draw(st.integers(0, len(self.lent) - 1))]
        consumer = self.state.consumer
        if not relay.sealed:
            consumer.relay_seal(relay)
        elif not consumer.relay_reading(relay, self.now):
            key = consumer.relay_buffer(relay).key
            live = {k for k, due in self.readers.values() if due > self.now}
            assert key not in live, f"{key} handed back while a node reads it"
            consumer.relay_close_lent(relay)
            self.lent.remove(relay)

    @rule(data=st.data(), landed=st.integers(0, 4096))
    def land(self, data: st.DataObject, landed: int) -> None:
        if self.filling:
            fid = data.draw(st.sampled_from(sorted(self.filling)))
            self.state.consumer.relay_landed(self.filling[fid], landed)
        for relay in self.lent:
            self.state.consumer.relay_landed(relay.remote, landed)

    @rule(data=st.data(), outcome=st.sampled_from(["stage", "give_back", "quarantine"]))
    def finish(self, data: st.DataObject, outcome: str) -> None:
        if not self.filling:
            return
        fid = data.draw(st.sampled_from(sorted(self.filling)))
        remote = self.filling.pop(fid)
        fx = Effects()
        if outcome == "stage":
            slot = self.state.consumer.fetch_stage(
                fid, 4096, RAW, "pooled", self.now, Effects(), copy_of=remote
            )
            local = DataHandle(WORKER, slot.slot_id)
            lease = self.state.owner.local_acquire(local, PID, "detach", self.now)[1]
            self.locals.append((local, lease.lease_id))
        elif outcome == "give_back":
            self.state.consumer.fetch_give_back(fid, fx)
        else:
            self.state.consumer.fetch_quarantine(fid)
        self._apply(fx)

    @rule(remote=st.sampled_from([REMOTE, OTHER]))
    def join(self, remote: DataHandle) -> None:
        with contextlib.suppress(HandleNotFound):
            lease_id, relay = self.state.consumer.relay_join(remote, self.now, LEASE_S)
            buffer = self.state.consumer.relay_buffer(relay)
            self.readers[(remote, lease_id)] = (buffer.key, self.now + LEASE_S)

    @rule(data=st.data(), leave=st.booleans())
    def reader_step(self, data: st.DataObject, leave: bool) -> None:
        if not self.readers:
            return
        remote, lease_id = data.draw(st.sampled_from(sorted(self.readers)))
        key, due = self.readers[(remote, lease_id)]
        fx = Effects()
        if leave:
            del self.readers[(remote, lease_id)]
            self.state.consumer.relay_leave(remote, lease_id, self.now, fx)
        else:
            try:
                self.state.consumer.relay_renew(remote, lease_id, self.now, LEASE_S)
                self.readers[(remote, lease_id)] = (key, self.now + LEASE_S)
            except LeaseNotFound:
                assert due <= self.now, "a live relay lease was lost"
                del self.readers[(remote, lease_id)]
        self._apply(fx)

    @rule(data=st.data())
    def local_reader_ends(self, data: st.DataObject) -> None:
        if self.locals:
            local, lease_id = self.locals.pop(data.draw(st.integers(0, len(self.locals) - 1)))
            fx = Effects()
            with contextlib.suppress(HandleNotFound):
                self.state.owner.end_lease(local, lease_id, False, self.now, fx)
            self._apply(fx)

    @rule(remote=st.sampled_from([REMOTE, OTHER]))
    def owner_ends_handle(self, remote: DataHandle) -> None:
        fx = Effects()
        self.state.consumer.copy_ended(remote, self.now, fx)
        self._apply(fx)

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0]))
    def sweep(self, dt: float) -> None:
        self.now += dt
        fx = Effects()
        self.state.sweep(self.now, fx)
        self._apply(fx)
        self.readers = {k: v for k, v in self.readers.items() if v[1] > self.now}

    @invariant()
    def ledger_matches(self) -> None:
        ledger_matches(self.state, self.returned)

    def teardown(self) -> None:
        fx = Effects()
        self.state.clear(self.now, fx)
        assert self.state.consumer.relay_readers == 0
        self.readers.clear()
        self._apply(fx)
        nothing_held_but_quarantine(self.state)


TestRelayMachine = RelayMachine.TestCase
TestRelayMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
