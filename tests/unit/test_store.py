"""Owner store scenarios with a fake clock: leases, deadlines, TTLs, references."""

from __future__ import annotations

import pytest

from ray_velo.errors import HandleNotFound, HandleReleased, LeaseNotFound, ProtocolError
from ray_velo.protocol.handle import DataHandle
from ray_velo.protocol.messages import TypeHeader
from ray_velo.state.store import SlotStore

WORKER = 0xABCDEF
RAW = TypeHeader()


def new_store() -> SlotStore:
    return SlotStore(WORKER, node="node-a")


def stage(store: SlotStore, now: float = 0.0, **kw: object) -> DataHandle:
    handle = store.stage(1024, RAW, "loc", kind="pooled", pinned=True, now=now, **kw)  # type: ignore[arg-type]
    store.validate()
    return handle


def reap_until(store: SlotStore, start: float, stop: float, period: float) -> float | None:
    """Drive the sweep like the agent's reaper (every ``period``); when was a lease reaped?"""
    now = start
    while now <= stop:
        result = store.sweep(now)
        store.validate()
        if result.rdma_leases_reaped:
            return now
        now += period
    return None


def test_unrenewed_rdma_lease_is_reaped_between_one_and_one_and_a_half_timeouts() -> None:
    """A consumer crashes mid-GET: its lease is force-released within 1-1.5 lease timeouts."""
    timeout = 1.0
    for offset in (0.0, 0.13, 0.37, 0.49):  # reaper phase relative to the acquire
        store = new_store()
        handle = stage(store)
        store.acquire(handle, now=offset, kind="rdma", timeout=timeout)
        reaped_at = reap_until(store, start=0.0, stop=5.0, period=timeout / 2)
        assert reaped_at is not None
        assert timeout <= reaped_at - offset <= 1.5 * timeout
        # force-released: lock and reference, so the single-reference slot is freed
        with pytest.raises(HandleNotFound, match="reaped"):
            store.metadata(handle)


def test_renewed_rdma_lease_is_not_reaped() -> None:
    """A long GET renews every timeout/2: the reaper never touches its lease."""
    store = new_store()
    handle = stage(store)
    lease = store.acquire(handle, now=0.0, kind="rdma", timeout=1.0)
    now = 0.0
    while now < 10.0:
        now += 0.5
        store.renew(handle, lease.lease_id, now)
        assert store.sweep(now).rdma_leases_reaped == 0
        store.validate()
    store.release(handle, lease.lease_id)
    assert store.live_slots == 0


def test_rdma_lease_without_deadline_is_refused() -> None:
    store = new_store()
    handle = stage(store)
    with pytest.raises(ProtocolError):
        store.acquire(handle, now=0.0, kind="rdma", timeout=None)


def test_ttl_frees_a_slot_under_a_live_lease() -> None:
    """The caller gave up: past the TTL the slot goes, even while someone reads it."""
    store = new_store()
    handle = stage(store, ttl=2.0)
    store.acquire(handle, now=0.5, kind="chunked")
    assert store.next_deadline() == 2.0
    assert store.sweep(1.9).freed == []
    result = store.sweep(2.0)
    store.validate()
    assert [f.why for f in result.freed] == ["its TTL expired"]
    assert result.slots_expired == 1
    assert store.live_leases == 0
    assert store.next_deadline() is None
    with pytest.raises(HandleNotFound, match="TTL"):
        store.metadata(handle)


def test_acquire_without_chunked_deadline_gets_none() -> None:
    """A public get (no lease_ms) holds its chunked lease as long as it likes."""
    store = new_store()
    handle = stage(store)
    lease = store.acquire(handle, now=0.0, kind="chunked")
    assert lease.deadline is None
    assert store.next_deadline() is None
    assert store.sweep(1e9).chunked_leases_expired == 0
    store.validate()


def test_chunked_deadline_is_renewed_by_pulls_and_expires_without_them() -> None:
    """A bounded fetch asked for lease_ms: pulls keep it alive; silence ends it."""
    store = new_store()
    handle = stage(store)
    lease = store.acquire(handle, now=0.0, kind="chunked", timeout=1.0)
    store.pull(lease.lease_id, now=0.8)
    assert store.sweep(1.5).chunked_leases_expired == 0
    result = store.sweep(1.8)
    assert result.chunked_leases_expired == 1
    assert len(result.freed) == 1  # the fetch's reference went with it
    store.validate()
    with pytest.raises(LeaseNotFound):
        store.pull(lease.lease_id, now=2.0)


def test_refcount_reaches_zero_only_after_last_release() -> None:
    """Two consumers (ref_handle): the slot survives the first release."""
    store = new_store()
    handle = stage(store)
    assert store.ref(handle) == 2
    first = store.acquire(handle, now=0.0, kind="chunked")
    second = store.acquire(handle, now=0.0, kind="chunked")
    assert store.release(handle, first.lease_id) is None
    store.validate()
    assert store.metadata(handle).refcount == 1
    store.detach(handle, second.lease_id)
    assert store.metadata(handle).refcount == 1
    third = store.acquire(handle, now=1.0, kind="chunked")
    freed = store.release(handle, third.lease_id)
    assert freed is not None and freed.location == "loc"
    store.validate()
    assert store.live_slots == 0


def test_slot_with_zero_refs_waits_for_its_last_lease() -> None:
    """A release while another reader still holds a lease frees at that lease's end."""
    store = new_store()
    handle = stage(store)
    reader = store.acquire(handle, now=0.0, kind="chunked")
    other = store.acquire(handle, now=0.0, kind="chunked")
    assert store.release(handle, other.lease_id) is None  # refcount 0, one lease left
    store.validate()
    freed = store.detach(handle, reader.lease_id)
    assert freed is not None
    store.validate()
    assert store.live_slots == 0


def test_dead_local_reader_is_reaped() -> None:
    """A task process reading in place dies: its lease ends (a detach). A reader that
    consumed the reference when it acquired leaves an ended handle, whose bytes go now; a
    reader that did not leaves the handle usable."""
    store = new_store()
    consumed = stage(store)
    store.acquire(consumed, now=0.0, kind="local", holder_pid=4242, claim=True)
    store.release(consumed, 0, claim=True)  # fetch(release=True) on the owner's node
    kept = stage(store)
    store.acquire(kept, now=0.0, kind="local", holder_pid=4242)
    assert store.holder_pids() == {4242}
    freed = store.reap_holders([4242])
    store.validate()
    assert [f.slot_id for f in freed] == [consumed.slot_id]
    assert store.metadata(kept).refcount == 1
    with pytest.raises(HandleNotFound, match="released by its last consumer"):
        store.metadata(consumed)


def test_ttl_ends_the_handle_but_a_view_keeps_its_bytes() -> None:
    """A same-node view (local lease) outlives the TTL: the handle is refused from then on,
    naming the TTL, and the bytes go only when the view's lease ends."""
    store = new_store()
    handle = stage(store, ttl=1.0)
    view = store.acquire(handle, now=0.0, kind="local", holder_pid=7)
    result = store.sweep(1.0)
    store.validate()
    assert result.freed == [] and result.slots_expired == 1
    with pytest.raises(HandleNotFound, match="TTL"):
        store.acquire(handle, now=1.1, kind="local", holder_pid=8)
    freed = store.detach(handle, view.lease_id)
    store.validate()
    assert freed is not None and freed.location == "loc"
    assert store.live_slots == 0


def test_ttl_keeps_the_bytes_under_a_get_in_flight() -> None:
    """An RDMA GET may still read when the TTL fires: its lease keeps the bytes until it is
    released or reaped; the chunked lease of a consumer that gave up ends with the TTL."""
    store = new_store()
    handle = stage(store, ttl=1.0)
    get = store.acquire(handle, now=0.0, kind="rdma", timeout=5.0)
    store.acquire(handle, now=0.0, kind="chunked")
    assert store.sweep(1.0).freed == []
    store.validate()
    assert store.live_leases == 1
    assert store.release(handle, get.lease_id) is not None
    store.validate()


def test_a_consumed_handle_is_refused_while_its_reader_holds_the_bytes() -> None:
    """fetch() consumes the only reference: from then on every acquire, ref and metadata of
    the handle is refused, while the first reader's lease still holds the bytes."""
    store = new_store()
    handle = stage(store)
    lease = store.acquire(handle, now=0.0, kind="local", holder_pid=1, claim=True)
    assert store.release(handle, 0, claim=True) is None
    for call in (
        lambda: store.acquire(handle, now=0.0, kind="chunked"),
        lambda: store.ref(handle),
        lambda: store.metadata(handle),
    ):
        with pytest.raises(HandleNotFound, match="released by its last consumer"):
            call()
    assert store.live_slots == 1
    assert store.detach(handle, lease.lease_id) is not None
    store.validate()


def test_claims_allow_exactly_as_many_consumers_as_references() -> None:
    """consumers=2: two claims succeed, a third is refused while both are outstanding; a
    claim given back (a retried task) can be taken again; consumed claims end the handle."""
    store = new_store()
    handle = stage(store, refcount=2)
    first = store.acquire(handle, now=0.0, kind="chunked", claim=True)
    second = store.acquire(handle, now=0.0, kind="chunked", claim=True)
    with pytest.raises(HandleReleased, match="ref_handle"):
        store.acquire(handle, now=0.0, kind="chunked", claim=True)
    store.validate()
    store.detach(handle, first.lease_id, claim=True)  # a retried task gives its claim back
    third = store.acquire(handle, now=0.0, kind="chunked", claim=True)
    store.release(handle, second.lease_id, claim=True)
    assert store.release(handle, third.lease_id, claim=True) is not None
    store.validate()
    assert store.counters.claims_refused == 1


def test_a_reaped_claiming_lease_consumes_its_claim() -> None:
    """A consuming fetch whose consumer died mid-GET: the reaper releases the reference
    and the claim together, so no claim is left on a slot that cannot honour it."""
    store = new_store()
    handle = stage(store, refcount=2)
    store.acquire(handle, now=0.0, kind="rdma", timeout=1.0, claim=True)
    store.sweep(1.0)
    store.validate()
    slot = store.slot(handle)
    assert (slot.refcount, slot.claimed) == (1, 0)


def test_a_new_consumer_incarnation_supersedes_the_old_ones_leases() -> None:
    """The consumer agent of node b restarted: the first acquire of its new incarnation
    ends the old one's leases and gives their claims back, so the retry can claim."""
    store = new_store()
    handle = stage(store)
    store.supersede("node-b", 1)
    store.acquire(handle, now=0.0, kind="rdma", timeout=30.0, claim=True, consumer=("node-b", 1))
    with pytest.raises(HandleReleased):
        store.acquire(handle, now=0.1, kind="rdma", timeout=30.0, claim=True)
    freed, rdma = store.supersede("node-b", 2)
    assert (freed, rdma) == ([], 1)
    store.acquire(handle, now=0.2, kind="rdma", timeout=30.0, claim=True, consumer=("node-b", 2))
    store.validate()
    assert store.counters.leases_superseded == 1
    assert store.supersede("node-b", 2) == ([], 0)  # the same incarnation again: nothing


def test_handles_of_another_incarnation_are_not_found() -> None:
    store = new_store()
    with pytest.raises(HandleNotFound, match="another agent incarnation"):
        store.metadata(DataHandle(WORKER + 1, 1))


def test_release_without_lease_drops_a_reference() -> None:
    store = new_store()
    handle = stage(store, refcount=2)
    assert store.release(handle, 0) is None
    assert store.release(handle, 0) is not None
    store.validate()
