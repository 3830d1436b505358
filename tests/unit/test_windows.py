"""Registered windows (payloads the budget cannot take whole): the window set's books against
the budget under any sequence of calls, the fetch machine's windowed steps, and windowed
transfers between two real agents in one process (ray_velo.testing): the bytes, the paths,
the budget never exceeded while they move, every fallback, and the order that keeps bytes
sacred (a lease's windows are unregistered before its slot's bytes go back to the pool)."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_velo.config import MiB, VeloConfig
from ray_velo.errors import HandleNotFound, LeaseNotFound, ProtocolError
from ray_velo.memory.pool import NoopRegistrar, RegistrationBudget
from ray_velo.memory.windows import WindowSet
from ray_velo.protocol import (
    AcquireRequest,
    DataHandle,
    MetadataRequest,
    MetadataResponse,
    Rdma,
    RdmaOffer,
    ReleaseRequest,
    WindowAnswer,
    WindowRequest,
    decode,
    decode_acquire_response,
    encode,
)
from ray_velo.state.fetch import (
    Acquire,
    Allocate,
    Allocated,
    Answered,
    Count,
    Done,
    EndLease,
    Fail,
    FetchFacts,
    FetchMachine,
    Get,
    GetOk,
    Stage,
)
from ray_velo.testing import AgentPair
from ray_velo.testing.pair import default_config

PAGE = 4096
BASE = 1 << 30  # a page-aligned fake address: a NoopRegistrar never touches it


# --- the window set's books -------------------------------------------------------------


def test_a_window_set_charges_its_depth_once_and_gives_it_back() -> None:
    budget, registrar = RegistrationBudget(64 * PAGE), NoopRegistrar()
    windows = WindowSet(registrar, budget, BASE, 10 * PAGE + 1, 4 * PAGE)
    assert (windows.count, windows.depth, windows.charge_bytes()) == (3, 2, 8 * PAGE)
    assert windows.open() and budget.registered_bytes == 8 * PAGE
    registration, address, nbytes = windows.window(2)  # the short last window
    assert (address, nbytes) == (BASE + 8 * PAGE, 2 * PAGE + 1)
    assert registration.effective_range == (BASE + 8 * PAGE, BASE + 11 * PAGE)
    windows.window(0)
    with pytest.raises(RuntimeError, match="2 windows registered already"):
        windows.window(1)
    windows.done_through(0)
    windows.window(1)
    assert budget.registered_bytes == 8 * PAGE  # registering never charges again
    windows.close()
    assert (budget.registered_bytes, registrar.live_registrations) == (0, 0)
    with pytest.raises(LeaseNotFound):
        windows.window(0)
    windows.close()  # idempotent


def test_a_window_set_the_budget_cannot_take_charges_nothing() -> None:
    budget = RegistrationBudget(7 * PAGE)
    windows = WindowSet(NoopRegistrar(), budget, BASE, 100 * PAGE, 4 * PAGE)
    assert not windows.open() and budget.registered_bytes == 0


def test_an_abandoned_window_stays_registered_and_charged() -> None:
    budget, registrar = RegistrationBudget(64 * PAGE), NoopRegistrar()
    windows = WindowSet(registrar, budget, BASE, 8 * PAGE, 4 * PAGE, depth=1)
    assert windows.open()
    windows.window(0)
    kept = windows.abandon()
    assert len(kept) == 1 and registrar.live_registrations == 1
    assert budget.registered_bytes == 4 * PAGE  # UCX may still write it: never reused
    windows.close()  # after abandon: nothing to unregister twice
    assert registrar.live_registrations == 1


@settings(max_examples=150)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.sampled_from(["open", "window", "done", "close"]),
                  st.integers(0, 9)),
        max_size=60,
    )
)  # fmt: skip
def test_registered_bytes_never_pass_the_budget(steps: list[tuple[int, str, int]]) -> None:
    """Four transfers' window sets sharing one budget, driven in any order: the budget is
    never exceeded, no set registers past its charge, and closing them all leaves nothing."""
    budget, registrar = RegistrationBudget(20 * PAGE), NoopRegistrar()
    sets = [
        WindowSet(registrar, budget, BASE + n * (1 << 24), (n + 1) * 7 * PAGE + n, 3 * PAGE)
        for n in range(4)
    ]
    opened = [False] * 4
    for which, action, index in steps:
        windows = sets[which]
        if action == "open" and not opened[which]:
            opened[which] = windows.open()
        elif action == "open":  # again: refused (open), or charges nothing (closed)
            with contextlib.suppress(RuntimeError):
                assert not windows.open()
        elif action == "window" and opened[which]:
            with contextlib.suppress(RuntimeError, LeaseNotFound):
                windows.window(index % windows.count)
        elif action == "done":
            windows.done_through(index % windows.count)
        elif action == "close":
            windows.close()
        assert budget.registered_bytes <= budget.budget_bytes
        registered = sum(w.live * 3 * PAGE for w in sets)
        assert registered <= budget.registered_bytes
    for windows in sets:
        windows.close()
    assert (budget.registered_bytes, registrar.live_registrations) == (0, 0)


# --- the fetch machine ----------------------------------------------------------------------

HANDLE = DataHandle(0xAB, 7, "node-a")
WINDOWED = Rdma(lease_id=11, lease_timeout_ms=2000, total_len=4096, window_bytes=1024)
FACTS = FetchFacts(has_registry=True, rdma_enabled=True, peer_registered=True, windows=True)


def test_a_windowed_answer_skips_the_descriptor_and_gets_into_registered_memory() -> None:
    m = FetchMachine(HANDLE, "node-a", "release", FACTS)
    assert m.start() == [Acquire(RdmaOffer(("ucx",), windows=True), True, True)]
    assert m.on(Answered(WINDOWED)) == [Allocate(4096, registered=True)]
    assert m.on(Allocated(True)) == [Get(WINDOWED, None)]
    assert m.on(GetOk())[:2] == [Count("rdma", "ok"), EndLease(11, release=True, claim=True)]


def test_no_registered_destination_takes_a_windowed_plain_one() -> None:
    m = FetchMachine(HANDLE, "node-a", "detach", FACTS)
    m.start()
    m.on(Answered(WINDOWED))
    assert m.on(Allocated(False)) == [Allocate(4096, registered=False, windows=True)]
    assert m.on(Allocated(True)) == [Get(WINDOWED, None)]
    assert (m.dest, m.dest_registered) == ("fetch", False)
    out = m.on(GetOk())
    assert out[0] == Count("rdma", "ok") and Stage(WINDOWED) in out
    assert isinstance(out[-1], Done) and m.dest == "slot"


def test_no_window_either_falls_back_as_pool_exhausted() -> None:
    m = FetchMachine(HANDLE, "node-a", "detach", FACTS)
    m.start()
    m.on(Answered(WINDOWED))
    m.on(Allocated(False))
    out = m.on(Allocated(False))
    assert out[0] == Count("chunked", "pool_exhausted") and isinstance(out[-1], Acquire)
    assert out[-1].offer is None and m.dest is None


def test_windows_to_an_offer_without_them_are_a_protocol_error() -> None:
    m = FetchMachine(HANDLE, "node-a", "detach", dataclasses.replace(FACTS, windows=False))
    m.start()
    out = m.on(Answered(WINDOWED))
    assert isinstance(out[-1], Fail) and isinstance(out[-1].error, ProtocolError)
    assert out[0] == EndLease(11, release=False, claim=False)


# --- two agents in one process --------------------------------------------------------------


def budgets(owner_mib: int, consumer_mib: int) -> tuple[VeloConfig, VeloConfig]:
    """The pair's test config with these budgets and 1 MiB windows (arenas stay small, so a
    20 MiB payload fits no budget below 16 MiB whole)."""
    base = default_config()

    def with_budget(mib: int) -> VeloConfig:
        pool = dataclasses.replace(
            base.rdma.pool,
            registered_bytes_budget=mib * MiB,
            window_bytes=1 * MiB,
            warm_dedicated_bytes=0,
        )
        return base.replace(rdma=dataclasses.replace(base.rdma, pool=pool))

    return with_budget(owner_mib), with_budget(consumer_mib)


class WatchedRegistrar(NoopRegistrar):
    """A NoopRegistrar that checks the budget at every registration and logs the order of
    registrations, unregistrations and (through :func:`watch_frees`) pool frees."""

    def __init__(self, budget: RegistrationBudget, log: list[tuple[str, int]]) -> None:
        super().__init__()
        self.budget, self.log, self.peak = budget, log, 0

    def register(self, address: int, nbytes: int) -> Any:
        assert self.budget.registered_bytes <= self.budget.budget_bytes
        self.peak = max(self.peak, self.budget.registered_bytes)
        self.log.append(("register", address))
        return super().register(address, nbytes)

    def unregister(self, registration: Any) -> None:
        self.log.append(("unregister", registration.address))
        super().unregister(registration)


def watch(agent: Any, log: list[tuple[str, int]]) -> WatchedRegistrar:
    """Put a WatchedRegistrar in ``agent``'s memory (what window sets register with) and
    log each buffer its memory frees."""
    memory = agent.core.memory
    watched = WatchedRegistrar(memory.budget, log)
    memory.registrar = watched
    free = memory.free

    def logged_free(placement: Any, registered: bool, now: float) -> None:
        log.append(("free", placement.address))
        free(placement, registered, now)

    memory.free = logged_free
    return watched


def payload(nbytes: int) -> np.ndarray:
    return np.resize(np.arange(251, dtype=np.uint8), nbytes)


@pytest.fixture()
def windowed(tmp_path: Path) -> Iterator[AgentPair]:
    owner, consumer = budgets(8, 8)
    with AgentPair(tmp_path / "shm", owner, consumer_config=consumer) as pair:
        yield pair
        pair.validate()


def test_a_payload_above_both_budgets_moves_by_get_through_windows(windowed: AgentPair) -> None:
    log: list[tuple[str, int]] = []
    owner_registrar, consumer_registrar = watch(windowed.owner, log), watch(windowed.consumer, log)
    data = payload(20 * MiB + 123)
    handle = windowed.put(data)
    assert windowed.owner_paths() == {"chunked/budget": 1}  # staged in plain memory
    assert windowed.fetch(handle) == data.tobytes()
    assert windowed.owner_paths() == {"chunked/budget": 1, "rdma/ok": 1}
    assert windowed.consumer_paths() == {"rdma/ok": 1}
    owner, consumer = windowed.owner.info(), windowed.consumer.info()
    assert (owner["windowed_leases"], owner["windows_registered"]) == (1, 21)
    assert consumer["windowed_gets"] == 1
    assert 0 < owner_registrar.peak <= 8 * MiB and 0 < consumer_registrar.peak <= 8 * MiB
    # nothing stays registered or charged once the lease ended
    assert owner_registrar.live_registrations == consumer_registrar.live_registrations == 0
    assert owner["registered_bytes"] == consumer["registered_bytes"] == 0
    assert owner["live_slots"] == 0


def test_a_plain_put_by_choice_stays_on_the_chunked_path(windowed: AgentPair) -> None:
    handle = windowed.put(payload(20 * MiB), pinned=False)
    assert windowed.fetch(handle) == payload(20 * MiB).tobytes()
    assert windowed.owner_paths() == {"chunked/not_pinned": 1}
    assert windowed.owner.info()["windowed_leases"] == 0


def test_an_owner_whose_budget_takes_no_window_serves_chunks(tmp_path: Path) -> None:
    owner, consumer = budgets(1, 8)  # two 1 MiB windows do not fit 1 MiB
    with AgentPair(tmp_path / "shm", owner, consumer_config=consumer) as pair:
        handle = pair.put(payload(20 * MiB))
        assert pair.fetch(handle) == payload(20 * MiB).tobytes()
        assert pair.owner_paths() == {"chunked/budget": 1, "chunked/not_pinned": 1}
        assert pair.consumer_paths() == {}  # the owner's refusal, counted there
        assert pair.owner.info()["registered_bytes"] == 0
        pair.validate()


def test_a_consumer_whose_budget_takes_no_window_falls_back_with_its_reason(
    tmp_path: Path,
) -> None:
    owner, consumer = budgets(8, 8)
    with AgentPair(tmp_path / "shm", owner, consumer_config=consumer) as pair:
        pair.consumer.core.memory.budget.reserve(8 * MiB)  # someone else holds it all
        handle = pair.put(payload(20 * MiB))
        assert pair.fetch(handle) == payload(20 * MiB).tobytes()
        assert pair.consumer_paths() == {"chunked/pool_exhausted": 1}
        # the owner's windows closed with the lease the consumer detached
        assert pair.owner.info()["registered_bytes"] == 0
        pair.consumer.core.memory.budget.release(8 * MiB)
        pair.validate()


def test_a_get_that_may_still_write_keeps_its_window_registered(windowed: AgentPair) -> None:
    """The quarantine case through a window: the destination is quarantined, its window
    stays registered (UCX may still write through it), and the fetch still arrives."""
    assert windowed.consumer_rdma is not None
    windowed.consumer_rdma.unsafe_gets = 1
    handle = windowed.put(payload(20 * MiB))
    assert windowed.fetch(handle) == payload(20 * MiB).tobytes()
    assert windowed.consumer_paths() == {"chunked/get_failed": 1}
    consumer = windowed.consumer.core
    assert consumer.memory.registrar.live_registrations == 1
    assert consumer.memory.budget.registered_bytes == 1 * MiB
    assert consumer.state.ledger.quarantined_bytes >= 20 * MiB


def test_a_leases_windows_are_unregistered_before_its_slot_goes_back(
    windowed: AgentPair,
) -> None:
    """Bytes are sacred: a window left registered over a freed slot would let a late GET
    read the next payload staged there. The owner's window is unregistered, then freed."""
    log: list[tuple[str, int]] = []
    watch(windowed.owner, log)
    handle = windowed.put(payload(20 * MiB))
    slot_address = windowed.owner.core.state.slot(handle).location.address
    offer = RdmaOffer(("ucx",), windows=True)
    request = AcquireRequest(handle, rdma=offer, claim=True, consumer_node="node-b",
                             consumer_worker=windowed.consumer.worker_id)  # fmt: skip
    answer = decode_acquire_response(windowed.owner.owner._rv_acquire(encode(request)))
    assert isinstance(answer, Rdma) and answer.window_bytes == 1 * MiB and not answer.descriptor
    window = WindowRequest(handle, answer.lease_id, 3, -1)
    got = decode(WindowAnswer, windowed.owner.owner._rv_window(encode(window)))
    descriptor = windowed.owner_rdma.decode(got.descriptor, 1 * MiB)  # type: ignore[union-attr]
    assert descriptor.addr == slot_address + 3 * MiB
    windowed.owner.owner._rv_release(encode(ReleaseRequest(handle, answer.lease_id, claim=True)))
    events = [event for event, _ in log]
    assert events.index("unregister") < events.index("free"), log
    assert ("free", slot_address) in log
    with pytest.raises(HandleNotFound):  # the handle ended: nothing more registers for it
        windowed.owner.owner._rv_window(encode(WindowRequest(handle, answer.lease_id, 4, -1)))
    assert windowed.owner.core.memory.budget.registered_bytes == 0


def test_a_reaped_lease_closes_its_windows(windowed: AgentPair) -> None:
    handle = windowed.put(payload(20 * MiB))
    offer = RdmaOffer(("ucx",), windows=True)
    request = AcquireRequest(handle, rdma=offer, consumer_node="node-b",
                             consumer_worker=windowed.consumer.worker_id)  # fmt: skip
    answer = decode_acquire_response(windowed.owner.owner._rv_acquire(encode(request)))
    windowed.owner.owner._rv_window(encode(WindowRequest(handle, answer.lease_id, 0, -1)))
    assert windowed.owner.core.memory.budget.registered_bytes == 2 * MiB
    windowed.tick(3.0)  # past the 2 s lease with no renewal (the timer maps a warm arena)
    memory = windowed.owner.core.memory
    assert memory.pinned_pool is not None
    assert memory.budget.registered_bytes == memory.pinned_pool.registered_bytes
    assert memory.registrar.live_registrations == memory.pinned_pool.arenas  # type: ignore[union-attr]
    with pytest.raises(HandleNotFound, match="RDMA lease was reaped"):  # the spec's force-release
        windowed.fetch(handle)
    assert windowed.owner.info()["live_slots"] == 0


def test_a_held_lease_keeps_no_window_registered(windowed: AgentPair) -> None:
    """The get family keeps the owner's lease after the bytes moved: its windows are
    unregistered at once (the charge stays with the lease until it ends)."""
    log: list[tuple[str, int]] = []
    registrar = watch(windowed.owner, log)
    handle = windowed.put(payload(20 * MiB))
    lease = windowed.lease(handle, mode="hold")
    assert windowed.read(lease) == payload(20 * MiB).tobytes()
    assert registrar.live_registrations == 0
    assert windowed.owner.core.memory.budget.registered_bytes == 2 * MiB  # the lease's charge
    windowed.end(lease)
    # the get family's release: the owner's lease it kept, and the reference
    release = encode(ReleaseRequest(handle, lease.remote_lease_id))
    windowed.consumer.consumer.route(handle, "_rv_release", release, 10.0)
    assert windowed.owner.core.memory.budget.registered_bytes == 0


def test_an_acquire_evicting_arenas_for_its_windows_holds_up_no_other_call(
    windowed: AgentPair,
) -> None:
    """Opening a plain slot's windows charges the budget, which may unmap idle warm arenas
    (slow: a deregistration, a munmap). That happens before the agent's lock: while one
    acquire waits in the eviction, another consumer's calls on another handle are answered,
    and the stalled acquire still gets its windows once the eviction ends."""
    owner = windowed.owner
    big, small = windowed.put(payload(20 * MiB)), windowed.put(payload(64 * 1024))
    budget = owner.core.memory.budget
    squatter = budget.available_bytes  # idle warm memory, as the reclaimer sees it
    assert budget.reserve(squatter)
    in_eviction, evicted = threading.Event(), threading.Event()

    def slow_reclaimer(short: int) -> int:
        in_eviction.set()
        assert evicted.wait(10.0), "the eviction was never let go"
        budget.release(squatter)
        return squatter

    budget.set_reclaimer(slow_reclaimer)
    offer = RdmaOffer(("ucx",), windows=True)
    request = AcquireRequest(big, rdma=offer, consumer_node="node-b",
                             consumer_worker=windowed.consumer.worker_id)  # fmt: skip
    answers: list[Any] = []
    stalled = threading.Thread(
        target=lambda: answers.append(owner.owner._rv_acquire(encode(request)))
    )
    stalled.start()
    try:
        assert in_eviction.wait(10.0)
        started = time.monotonic()
        other = owner.owner._rv_metadata(encode(MetadataRequest(small)))
        assert time.monotonic() - started < 2.0
        assert decode(MetadataResponse, other).size == 64 * 1024
        assert not answers, "the eviction had not ended: the acquire cannot have answered"
    finally:
        evicted.set()
        stalled.join(10.0)
    answer = decode_acquire_response(answers[0])
    assert isinstance(answer, Rdma) and answer.window_bytes == 1 * MiB
    owner.owner._rv_release(encode(ReleaseRequest(big, answer.lease_id)))
    assert windowed.fetch(small) == payload(64 * 1024).tobytes()
