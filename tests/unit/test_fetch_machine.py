"""The consumer's fetch as a pure machine: the exact instructions for every path, fallback
reason and failure, and who owns the destination after each step."""

from __future__ import annotations

import pytest

from ray_velo.errors import (
    OwnerDied,
    PayloadTooLarge,
    ProtocolError,
    StagingError,
    TransferTimeout,
)
from ray_velo.protocol import DataHandle, Rdma, RdmaOffer, Ready
from ray_velo.state.fetch import (
    Acquire,
    Allocate,
    Allocated,
    Answered,
    CheckDescriptor,
    Count,
    Decoded,
    DecodeFailed,
    Done,
    EndLease,
    Fail,
    Failed,
    FetchFacts,
    FetchMachine,
    Get,
    GetExpired,
    GetFailed,
    GetOk,
    GiveBack,
    Pull,
    Pulled,
    Quarantine,
    Stage,
    WithdrawWriter,
)

HANDLE = DataHandle(0xAB, 7, "node-a")
RDMA = Rdma(lease_id=11, descriptor=b"d", lease_timeout_ms=2000, total_len=4096)
READY = Ready(lease_id=12, transfer_id=12, chunk_size=1024, chunk_count=4, total_len=4096)
OFFER = RdmaOffer(("ucx",))
FACTS = FetchFacts(has_registry=True, rdma_enabled=True, peer_registered=True)


def machine(mode: str = "release", facts: FetchFacts = FACTS) -> FetchMachine:
    return FetchMachine(HANDLE, "node-a", mode, facts)  # type: ignore[arg-type]


def test_rdma_path_gets_into_its_own_destination_and_releases_with_the_claim() -> None:
    m = machine()
    assert m.start() == [Acquire(OFFER, claim=True, chunked_deadline=True)]
    assert m.on(Answered(RDMA)) == [CheckDescriptor(RDMA)]
    assert m.on(Decoded("desc")) == [Allocate(4096, registered=True)]
    assert m.dest is None
    assert m.on(Allocated(True)) == [Get(RDMA, "desc")]
    assert m.dest == "fetch"
    out = m.on(GetOk())
    assert out == [
        Count("rdma", "ok"),
        EndLease(11, release=True, claim=True),
        Stage(RDMA),
        Done("rdma", RDMA, 0, claimed=False),
    ]
    assert m.dest == "slot"


def test_chunked_answer_pulls_into_plain_memory() -> None:
    m = machine("detach")
    assert m.start() == [Acquire(OFFER, claim=False, chunked_deadline=True)]
    assert m.on(Answered(READY)) == [Allocate(4096, registered=False)]
    assert m.on(Allocated(True)) == [Pull(READY)]
    assert m.on(Pulled()) == [
        EndLease(12, release=False, claim=False),
        Stage(READY),
        Done("chunked", READY, 0, claimed=False),
    ]


@pytest.mark.parametrize(
    ("facts", "reason"),
    [
        (FetchFacts(False, True, True), "not_configured"),
        (FetchFacts(True, False, True), "kill_switch"),
        (FetchFacts(True, True, False), "no_offer"),
    ],
)
def test_no_offer_is_counted_with_its_reason(facts: FetchFacts, reason: str) -> None:
    assert machine(facts=facts).start() == [
        Count("chunked", reason),
        Acquire(None, claim=True, chunked_deadline=True),
    ]


def _to_get(m: FetchMachine) -> None:
    m.start()
    m.on(Answered(RDMA))
    m.on(Decoded("desc"))
    m.on(Allocated(True))


def test_get_failure_falls_back_once_and_reuses_the_destination() -> None:
    """get_failed: detach (the claim stays), acquire with no offer, pull into the same
    (registered) destination; the claim is consumed at the end."""
    m = machine()
    _to_get(m)
    assert m.on(GetFailed()) == [
        Count("chunked", "get_failed"),
        EndLease(11, release=False, claim=False),
        Acquire(None, claim=False, chunked_deadline=True),
    ]
    assert m.on(Answered(READY)) == [Pull(READY)]
    assert m.on(Pulled())[-1] == Done("chunked", READY, 0, claimed=False)


def test_decode_error_falls_back_before_allocating() -> None:
    m = machine()
    m.start()
    m.on(Answered(RDMA))
    assert m.on(DecodeFailed("trailing byte"))[:2] == [
        Count("chunked", "decode_error"),
        EndLease(11, release=False, claim=False),
    ]
    assert m.dest is None
    assert m.on(Answered(READY)) == [Allocate(4096, registered=False)]


def test_pool_exhausted_falls_back_to_plain_memory() -> None:
    m = machine()
    m.start()
    m.on(Answered(RDMA))
    m.on(Decoded("desc"))
    assert m.on(Allocated(False))[0] == Count("chunked", "pool_exhausted")
    assert m.on(Answered(READY)) == [Allocate(4096, registered=False)]


def test_rdma_again_to_the_fallback_acquire_is_a_protocol_error() -> None:
    """The fallback carried no offer: an owner answering RDMA to it is broken. Its lease is
    ended, the claim given back, the destination freed; no second fallback."""
    m = machine()
    _to_get(m)
    m.on(GetFailed())
    out = m.on(Answered(Rdma(lease_id=13, descriptor=b"d", lease_timeout_ms=1, total_len=4096)))
    assert out[:2] == [EndLease(13, release=False, claim=True), GiveBack()]
    assert isinstance(out[-1], Fail) and isinstance(out[-1].error, ProtocolError)
    assert "again" in str(out[-1].error)
    assert m.dest is None


def test_rdma_answer_to_no_offer_is_a_protocol_error() -> None:
    m = machine(facts=FetchFacts(True, True, False))
    m.start()
    out = m.on(Answered(RDMA))
    assert out[0] == EndLease(11, release=False, claim=True)
    assert isinstance(out[-1], Fail) and isinstance(out[-1].error, ProtocolError)


def test_unsafe_get_quarantines_once_and_falls_back_into_fresh_memory() -> None:
    """UCX may still write the destination: it goes to the quarantine, never back to the
    pool, and the chunks land in a new buffer."""
    m = machine()
    _to_get(m)
    out = m.on(GetFailed(unsafe=True))
    assert out[0] == Quarantine() and GiveBack() not in out
    assert m.dest == "quarantine"
    assert m.on(Answered(READY)) == [Allocate(4096, registered=False)]
    m.on(Allocated(True))
    assert m.dest == "fetch"


def test_expired_get_quarantines_and_never_frees() -> None:
    """The bound ran out during an unsafe GET: quarantine, end the lease, fail with the
    timeout; the destination is not freed as well (a double free)."""
    m = machine()
    _to_get(m)
    timeout = TransferTimeout(handle=str(HANDLE), timeout_s=1.0, bound="caller timeout")
    out = m.on(GetExpired(timeout, unsafe=True))
    assert out == [Quarantine(), EndLease(11, release=False, claim=True), Fail(timeout)]


def test_payload_over_the_limit_is_refused_before_allocating() -> None:
    """A consuming fetch releases (the owner frees its copy); a detach-mode one detaches."""
    limited = FetchFacts(True, True, True, payload_max=1024)
    m = machine(facts=limited)
    m.start()
    out = m.on(Answered(RDMA))
    assert out[0] == EndLease(11, release=True, claim=True)
    assert isinstance(out[-1], Fail) and isinstance(out[-1].error, PayloadTooLarge)
    m = machine("detach", limited)
    m.start()
    assert m.on(Answered(READY))[0] == EndLease(12, release=False, claim=False)


def test_the_fallback_answer_is_checked_against_the_limit_too() -> None:
    """An owner that answers a small RDMA payload and then a huge chunked one: the second
    answer is refused before anything of its size is allocated."""
    m = machine(facts=FetchFacts(True, True, True, payload_max=8192))
    _to_get(m)
    m.on(GetFailed())
    huge = Ready(
        lease_id=14, transfer_id=14, chunk_size=1024, chunk_count=1 << 20, total_len=1 << 30
    )
    out = m.on(Answered(huge))
    assert out[:2] == [EndLease(14, release=True, claim=True), GiveBack()]
    assert isinstance(out[-1], Fail) and isinstance(out[-1].error, PayloadTooLarge)


def test_claim_mode_keeps_its_claim_after_the_transfer() -> None:
    m = machine("claim")
    assert m.start()[-1] == Acquire(OFFER, claim=True, chunked_deadline=True)
    m.on(Answered(READY))
    m.on(Allocated(True))
    out = m.on(Pulled())
    assert out[0] == EndLease(12, release=False, claim=False)
    assert out[-1] == Done("chunked", READY, 0, claimed=True)


def test_hold_mode_keeps_the_owners_lease_and_asks_no_chunked_deadline() -> None:
    m = machine("hold")
    assert m.start() == [Acquire(OFFER, claim=False, chunked_deadline=False)]
    m.on(Answered(READY))
    m.on(Allocated(True))
    assert m.on(Pulled()) == [Stage(READY), Done("chunked", READY, 12, claimed=False)]


def test_a_pinned_writer_is_filled_never_freed() -> None:
    """get_into(PinnedWriter): the GET lands in the writer; on an unsafe failure the writer
    is withdrawn (quarantined) and the fetch fails; it is never given back by the fetch."""
    m = machine("hold", FetchFacts(True, True, True, writer_bytes=8192))
    m.start()
    m.on(Answered(RDMA))
    assert m.on(Decoded("desc")) == [Get(RDMA, "desc")]
    assert m.dest == "writer"
    out = m.on(GetFailed(unsafe=True))
    assert out[0] == WithdrawWriter() and GiveBack() not in out
    assert isinstance(out[-1], Fail) and isinstance(out[-1].error, StagingError)
    ok = machine("hold", FetchFacts(True, True, True, writer_bytes=8192))
    ok.start()
    ok.on(Answered(RDMA))
    ok.on(Decoded("desc"))
    assert ok.on(GetOk()) == [Count("rdma", "ok"), Done("rdma", RDMA, 11, claimed=False)]


def test_a_too_small_writer_is_refused_and_its_lease_given_back() -> None:
    m = machine("hold", FetchFacts(True, True, True, writer_bytes=100))
    m.start()
    out = m.on(Answered(READY))
    assert out[0] == EndLease(12, release=False, claim=False)
    assert isinstance(out[-1], Fail) and isinstance(out[-1].error, ValueError)


def test_owner_died_leaves_its_lease_alone_and_frees_the_destination() -> None:
    m = machine()
    m.start()
    m.on(Answered(READY))
    m.on(Allocated(True))
    died = OwnerDied(handle=str(HANDLE), node="node-a")
    assert m.on(Failed(died)) == [GiveBack(), Fail(died)]


def test_an_acquire_that_failed_in_flight_ends_nothing() -> None:
    m = machine()
    m.start()
    timeout = TransferTimeout(handle=str(HANDLE), timeout_s=1.0, bound="caller timeout")
    assert m.on(Failed(timeout)) == [Fail(timeout)]


def test_an_empty_payload_needs_no_destination() -> None:
    m = machine()
    m.start()
    empty = Ready(lease_id=5, transfer_id=5, chunk_size=1024, chunk_count=0, total_len=0)
    assert m.on(Answered(empty)) == [
        EndLease(5, release=True, claim=True),
        Done("chunked", empty, 0, claimed=False),
    ]


def test_events_out_of_order_are_refused() -> None:
    m = machine()
    m.start()
    with pytest.raises(RuntimeError):
        m.on(GetOk())
    with pytest.raises(RuntimeError):
        m.start()
