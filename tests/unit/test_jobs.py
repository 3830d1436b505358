"""Staged data follows its Ray job (issue 15), without Ray: the store and the owner state on
an injected clock, then a pair of real agents whose job table is a FakeJobs.

A slot records the job that staged it; the job's end ends that job's handles (never a
detached one's, never another job's) as a TTL does: leases, reads in progress and the pull
grace keep the bytes until nothing may touch them, and a later fetch is told "its job ended".
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import ray_velo as rv
from ray_velo.actors.jobs import JOB_END_BOUND_S, JOB_POLL_S, JobWatch
from ray_velo.config import MiB, check_lifetime
from ray_velo.errors import ConfigError, HandleNotFound, LeaseNotFound
from ray_velo.protocol import DataHandle, TypeHeader
from ray_velo.staging.tree import TransferOptions
from ray_velo.state.agent import AgentStates
from ray_velo.state.consumer import KEPT_IDLE_S
from ray_velo.state.ledger import Holder
from ray_velo.state.owner import Effects
from ray_velo.state.store import JOB_ENDED, TTL_EXPIRED, SlotStore
from ray_velo.testing import AgentPair, FakeJobs
from tests.unit.test_owner_state import Buf

WORKER = 0xFACADE
RAW = TypeHeader()
PID = 4242
JOB_A, JOB_B = "01000000", "02000000"


def new_store() -> SlotStore:
    return SlotStore(WORKER, node="node-a")


def stage(store: SlotStore, job: str = JOB_A, **kw: object) -> DataHandle:
    handle = store.stage(1024, RAW, "loc", kind="pooled", pinned=True, now=0.0, job=job, **kw)  # type: ignore[arg-type]
    store.validate()
    return handle


# --- the store -------------------------------------------------------------------------


def test_a_slot_records_its_job_and_only_followed_jobs_are_watched() -> None:
    store = new_store()
    a = stage(store, JOB_A)
    stage(store, JOB_B, detached=True)
    stage(store, "")  # staged outside Ray (or by an older client): follows nothing
    assert store.held(a).job == JOB_A
    assert store.followed_jobs() == {JOB_A}
    store.release(a, 0)  # released before its job ended: nothing left to watch
    assert store.followed_jobs() == set()
    store.validate()


def test_a_jobs_end_frees_only_its_own_non_detached_slots() -> None:
    """Two jobs share a node: job A ends; its two slots go, naming why; job B's slot, A's
    detached slot and a slot of no job stay."""
    store = new_store()
    a1, a2 = stage(store, JOB_A), stage(store, JOB_A)
    b = stage(store, JOB_B)
    shared = stage(store, JOB_A, detached=True)
    orphan = stage(store, "")
    ended, freed = store.end_job(JOB_A)
    store.validate()
    assert sorted(ended) == sorted([a1.slot_id, a2.slot_id])
    assert sorted(f.slot_id for f in freed) == sorted(ended)
    assert all(f.why == JOB_ENDED and f.abandoned for f in freed)
    for handle in (a1, a2):
        with pytest.raises(HandleNotFound, match="its job ended"):
            store.metadata(handle)
    for handle in (b, shared, orphan):
        assert store.is_live(handle)
    assert store.followed_jobs() == {JOB_B}
    assert store.counters.slots_job_ended == 2
    assert store.end_job(JOB_A) == ([], [])  # a second word of the same end: nothing


def test_a_jobs_end_keeps_the_bytes_under_a_get_and_a_view_not_under_pulls() -> None:
    """Job A ends while another job reads its slot three ways: the chunked lease ends with
    the handle (its pulls are refused), the RDMA GET and the zero-copy view keep the bytes
    until both end; new acquires are refused at once, naming the job's end."""
    store = new_store()
    handle = stage(store, JOB_A, refcount=3)
    pulls = store.acquire(handle, 0.0, kind="chunked", timeout=5.0)
    get = store.acquire(handle, 0.0, kind="rdma", timeout=2.0)
    store.acquire(handle, 0.0, kind="local", holder_pid=PID)  # a view
    ended, freed = store.end_job(JOB_A)
    store.validate()
    assert ended == [handle.slot_id] and freed == []
    with pytest.raises(LeaseNotFound):
        store.pull(pulls.lease_id, 0.5)
    with pytest.raises(HandleNotFound, match="its job ended"):
        store.acquire(handle, 0.5, kind="local", holder_pid=PID)
    assert store.release(handle, get.lease_id) is None  # the GET finished: the view remains
    done = store.reap_holders([PID])  # the viewing process died
    store.validate()
    assert [f.slot_id for f in done] == [handle.slot_id]
    with pytest.raises(HandleNotFound, match="its job ended"):
        store.held(handle)


def test_a_get_that_never_ends_is_reaped_after_its_jobs_end() -> None:
    store = new_store()
    handle = stage(store, JOB_A)
    store.acquire(handle, 0.0, kind="rdma", timeout=2.0)
    assert store.end_job(JOB_A)[1] == []
    assert store.sweep(1.9).freed == []
    assert [f.slot_id for f in store.sweep(2.0).freed] == [handle.slot_id]
    store.validate()


def test_a_detached_slot_lives_until_its_ttl_or_release() -> None:
    store = new_store()
    ttl = stage(store, JOB_A, detached=True, ttl=30.0)
    held = stage(store, JOB_A, detached=True)
    assert store.followed_jobs() == set()
    assert store.end_job(JOB_A) == ([], [])
    assert [f.why for f in store.sweep(30.0).freed] == [TTL_EXPIRED]
    with pytest.raises(HandleNotFound, match="TTL"):
        store.metadata(ttl)
    assert store.release(held, 0) is not None
    store.validate()


# --- the owner state ---------------------------------------------------------------------


def committed(state: AgentStates, buf: Buf, job: str, fx: Effects, **kw: bool) -> DataHandle:
    rid, _ = state.reservations.reserve(buf, "pooled", True, PID)
    return state.reservations.commit(rid, buf.nbytes, RAW, None, 1, 0.0, fx, job=job, **kw)


def test_a_new_job_wakes_the_timer_once() -> None:
    state = AgentStates.new(WORKER)
    for n, (job, poked) in enumerate([(JOB_A, True), (JOB_A, False), (JOB_B, True), ("", False)]):
        fx = Effects()
        committed(state, Buf(n), job, fx)
        assert fx.poke is poked, (job, n)
    fx = Effects()
    committed(state, Buf(9), JOB_B, fx, detached=True)
    assert not fx.poke
    assert state.owner.followed_jobs() == {JOB_A, JOB_B}
    state.validate()


def test_a_jobs_memory_goes_back_after_the_pull_grace_and_reads_in_progress() -> None:
    """A chunk view went out just before job A ended: the bytes wait out the pull grace.
    A region-style copy out of job A's other slot is in progress: its bytes wait for it."""
    state = AgentStates.new(WORKER, pull_grace_s=1.0)
    owner, ledger = state.owner, state.owner.ledger
    fx = Effects()
    pulled_buf, read_buf = Buf(1), Buf(2)
    pulled = committed(state, pulled_buf, JOB_A, fx)
    read = committed(state, read_buf, JOB_A, fx)
    lease = owner.grant(pulled, 0.0, kind="chunked", timeout=10.0)
    owner.pull(lease.lease_id, 0, 1024, now=5.0)
    owner.reads.begin(read.slot_id)
    fx = Effects()
    assert owner.end_job(JOB_A, 5.2, fx) == 2
    state.validate()
    assert fx.free == []
    assert ledger.holder_of(pulled_buf) == Holder("grace", pulled.slot_id)
    assert ledger.holder_of(read_buf) == Holder("parked", read.slot_id)
    fx = Effects()
    owner.end_read(read.slot_id, 5.5, fx)
    assert [b for b, _ in fx.free] == [read_buf]
    fx = Effects()
    state.sweep(6.0, fx)
    assert [b for b, _ in fx.free] == [pulled_buf]
    state.validate()
    assert ledger.held() == set()


def test_the_copies_of_a_jobs_handle_hear_of_its_end_at_once() -> None:
    """Other nodes keep copies of job A's handle: they are told when the handle ends, even
    while a GET still holds the owner's bytes (no later reader can come)."""
    state = AgentStates.new(WORKER)
    fx = Effects()
    handle = committed(state, Buf(1), JOB_A, fx)
    state.owner.sources.grant(handle.slot_id, "node-b", 7, pick=False, announce=True)
    state.owner.grant(handle, 0.0, kind="rdma", timeout=2.0)
    fx = Effects()
    state.owner.end_job(JOB_A, 0.1, fx)
    assert fx.copy_ends == [(DataHandle(WORKER, handle.slot_id), "node-b", 7)]
    assert fx.free == []  # the GET's lease keeps the bytes
    state.validate()


def test_a_node_local_copy_whose_reader_died_goes() -> None:
    """A reader on the consumer node was killed with its job while it read a copy nobody
    else can find: the copy ends when the reader's death is seen, not never."""
    state = AgentStates.new(WORKER)
    remote = DataHandle(0xBEEF, 3)
    buf = Buf(1)
    fid = state.consumer.fetch_take(buf, True)
    copy = state.consumer.fetch_stage(fid, 4096, RAW, "pooled", 0.0, Effects(), copy_of=remote)
    state.owner.local_acquire(DataHandle(WORKER, copy.slot_id), PID, "detach", 0.0)
    fx = Effects()
    state.reap({PID}, 1.0, fx)
    assert [b for b, _ in fx.free] == [buf]
    assert state.consumer.copies == 0
    state.validate()


def test_a_kept_copy_whose_reader_died_keeps_its_idle_bound() -> None:
    state = AgentStates.new(WORKER)
    owner, consumer = state.owner, state.consumer
    remote = DataHandle(0xBEEF, 3)
    fid = consumer.fetch_take(Buf(1), True)
    assert consumer.relay_open(remote, fid, 4096)
    fx = Effects()
    copy = consumer.fetch_stage(fid, 4096, RAW, "pooled", 0.0, fx, copy_of=remote)
    local = DataHandle(WORKER, copy.slot_id)
    _, lease = owner.local_acquire(local, PID, "detach", 0.0)
    owner.end_lease(local, lease.lease_id, False, 1.0, fx)  # read, then idle from t=1
    owner.local_acquire(local, PID + 1, "detach", 2.0)
    state.reap({PID + 1}, 3.0, fx)  # its second reader died: idle from t=3
    assert consumer.copies == 1 and state.next_due() == 3.0 + KEPT_IDLE_S
    state.reap({PID + 2}, 50.0, fx)  # an unrelated death does not push the bound on
    assert state.next_due() == 3.0 + KEPT_IDLE_S
    fx = Effects()
    state.sweep(3.0 + KEPT_IDLE_S, fx)
    assert consumer.copies == 0 and len(fx.free) == 1
    state.validate()


# --- lifetime validation -------------------------------------------------------------------


@pytest.mark.parametrize("lifetime", ["Detached", "forever", "", 1, True])
def test_a_lifetime_other_than_none_or_detached_is_refused(lifetime: object) -> None:
    with pytest.raises(ConfigError, match=r"lifetime.*detached"):
        check_lifetime(lifetime)
    with pytest.raises(ConfigError, match="lifetime"):
        TransferOptions(lifetime=lifetime)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="lifetime"):
        rv.put(b"x", lifetime=lifetime)  # type: ignore[arg-type]


def test_the_decorator_takes_the_lifetime() -> None:
    assert check_lifetime(None) is False and check_lifetime("detached") is True
    assert TransferOptions(lifetime="detached").lifetime == "detached"
    with pytest.raises(ConfigError, match="lifetime"):
        rv.transfer(lifetime="weekly")


# --- two agents and the job table ------------------------------------------------------


@pytest.fixture()
def pair(tmp_path: Path) -> Iterator[AgentPair]:
    with AgentPair(tmp_path / "shm") as p:
        yield p
        p.validate()


def payload(nbytes: int) -> bytes:
    return (np.arange(nbytes, dtype=np.uint64) % 251).astype(np.uint8).tobytes()


def test_an_agent_looks_at_the_job_table_only_while_it_follows_a_job(pair: AgentPair) -> None:
    """Idle, or holding only detached data, an agent never asks; holding a job's data it
    asks about that job once a period; once the data is released it stops."""
    pair.tick(5.0)
    shared = pair.put(payload(MiB), job=JOB_B, lifetime="detached")
    pair.tick(5.0)
    assert pair.jobs.asked == []
    handle = pair.put(payload(MiB), job=JOB_A)
    pair.tick(0.0)
    assert pair.jobs.asked == [{JOB_A}]
    pair.tick(JOB_POLL_S / 2)
    assert len(pair.jobs.asked) == 1
    pair.tick(JOB_POLL_S / 2)
    assert pair.jobs.asked == [{JOB_A}, {JOB_A}]
    assert pair.fetch(handle) == payload(MiB)
    pair.tick(10 * JOB_POLL_S)
    assert len(pair.jobs.asked) == 2
    assert pair.owner.info()["job_watch"]["looks"] == 2
    assert pair.fetch(shared) == payload(MiB)


def test_a_jobs_end_frees_the_owner_slot_and_the_consumer_copy(pair: AgentPair) -> None:
    """Job A staged 2 MiB on node a; node b fetched it without consuming it and keeps a
    copy its owner counts. Job A ends: within one poll the owner's slot and node b's copy
    are gone, and a fetch is told why. Job B's data, staged beside it, stays fetchable."""
    pair.consumer.core.serves_copies = True  # node b keeps copies (it has the wire)
    a = pair.put(payload(2 * MiB), job=JOB_A)
    b = pair.put(payload(2 * MiB), job=JOB_B)
    assert pair.fetch(a, "detach") == payload(2 * MiB)
    assert pair.consumer.info()["copies"] == 1
    pair.tick(0.0)
    pair.jobs.end(JOB_A)
    pair.tick(JOB_POLL_S)
    assert pair.owner.info()["live_slots"] == 1  # job B's
    assert pair.consumer.info()["copies"] == 0
    assert pair.consumer.info()["live_slots"] == 0
    with pytest.raises(HandleNotFound, match="its job ended"):
        pair.fetch(a)
    assert pair.fetch(b) == payload(2 * MiB)
    assert pair.owner.info()["live_slots"] == 0
    assert pair.owner.info()["counters"]["slots_job_ended"] == 1


def test_a_view_of_a_jobs_data_outlives_the_job(pair: AgentPair) -> None:
    """A reader on node b holds a view of job A's data when A ends: it keeps reading its
    bytes; they go when the view does."""
    handle = pair.put(payload(2 * MiB), job=JOB_A)
    lease = pair.lease(handle, "detach")
    pair.jobs.end(JOB_A)
    pair.tick(JOB_POLL_S)
    with pytest.raises(HandleNotFound, match="its job ended"):
        pair.fetch(handle)
    assert pair.read(lease) == payload(2 * MiB)
    pair.end(lease)
    pair.tick(JOB_POLL_S)
    for agent in (pair.owner, pair.consumer):
        assert agent.info()["live_slots"] == 0


def test_an_unreadable_job_table_keeps_the_data_and_asks_again(pair: AgentPair) -> None:
    handle = pair.put(payload(MiB), job=JOB_A)
    pair.jobs.end(JOB_A)
    pair.jobs.fail = 1
    pair.tick(0.0)
    assert pair.owner.info()["live_slots"] == 1
    assert pair.owner.info()["job_watch"]["failures"] == 1
    pair.tick(JOB_POLL_S)
    with pytest.raises(HandleNotFound, match="its job ended"):
        pair.fetch(handle)


def test_the_stated_bound_is_one_period_and_one_look() -> None:
    assert JOB_END_BOUND_S <= 3.0 and JOB_POLL_S == 1.0
    watch = JobWatch(FakeJobs(), period_s=JOB_POLL_S)
    assert watch.look({JOB_A}, 10.0) == set()
    assert watch.due_at == 10.0 + JOB_POLL_S


def test_status_lists_the_detached_slots_with_their_job(pair: AgentPair) -> None:
    """``ray-velo status`` shows what outlives its job: the detached slots, with the job that
    staged them and their TTL; a job's own slots are counted as followed, not listed."""
    shared = pair.put(payload(MiB), job=JOB_A, lifetime="detached", ttl=30.0)
    own = pair.put(payload(MiB), job=JOB_A)
    status = pair.owner.status()
    assert status["jobs_followed"] == 1
    assert status["detached"] == [
        {"slot": shared.slot_id, "bytes": MiB, "job": JOB_A, "refcount": 1, "ttl_left_s": 30.0}
    ]
    for handle in (shared, own):
        assert pair.fetch(handle) == payload(MiB)
    assert pair.owner.status()["detached"] == []
