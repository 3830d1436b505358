"""The wire path as pure logic: the owner's decision (the eight checks, then the wire's), the
consumer's offer, the fetch machine's exact instructions, the bulk frames, and the slot
table's wire leases (a TTL or a release ends them at once: the owner is their sender)."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ray_velo.errors import LeaseNotFound, ProtocolError, VeloError
from ray_velo.protocol import (
    DataHandle,
    OwnerFacts,
    PathDecision,
    Rdma,
    RdmaOffer,
    ReadRequest,
    Ready,
    TypeHeader,
    build_offer,
    decide_path,
)
from ray_velo.protocol.bulk import (
    HEADER,
    decode_read,
    decode_sending,
    encode_error,
    encode_read,
    encode_sending,
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
    GetFailed,
    GetOk,
    Pull,
    Pulled,
    Stage,
)
from ray_velo.state.store import SlotStore

HANDLE = DataHandle(0xAB, 7, "node-a")
WIRE = Rdma(lease_id=21, lease_timeout_ms=2000, total_len=8 << 20, wire=True)
READY = Ready(lease_id=22, transfer_id=22, chunk_size=1 << 20, chunk_count=8, total_len=8 << 20)
NO_UCX = FetchFacts(has_registry=False, rdma_enabled=True, peer_registered=False, wire=True)


def facts(**changes: object) -> OwnerFacts:
    base = dict(
        offer=RdmaOffer(("wire",)),
        has_registry=False,
        rdma_enabled=True,
        slot_pinned=False,
        total_len=8 << 20,
        rdma_min_bytes=64 << 10,
        draining=False,
        serves_wire=True,
        slot_in_memory=True,
    )
    base.update(changes)
    return OwnerFacts(**base)  # type: ignore[arg-type]


def no_descriptor() -> bytes | None:
    raise AssertionError("the wire path builds no descriptor")


# --- the owner's decision ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "decision"),
    [
        ({}, PathDecision("wire", "ok")),
        ({"has_registry": True}, PathDecision("wire", "ok")),  # offer names no ucx
        ({"offer": None}, PathDecision("chunked", "no_offer")),
        ({"offer": RdmaOffer(("ucx",))}, PathDecision("chunked", "not_configured")),
        ({"serves_wire": False}, PathDecision("chunked", "not_configured")),
        ({"slot_in_memory": False}, PathDecision("chunked", "not_configured")),
        ({"total_len": 1000}, PathDecision("chunked", "below_min")),
        ({"draining": True}, PathDecision("chunked", "draining")),
        ({"rdma_enabled": False}, PathDecision("wire", "ok")),  # the kill switch is RDMA's
        ({"slot_memory_type": "cuda"}, PathDecision("chunked", "not_configured")),
    ],
)
def test_the_owner_answers_the_wire_where_no_rdma_answer_comes_out(
    changes: dict[str, object], decision: PathDecision
) -> None:
    assert decide_path(facts(**changes), no_descriptor) == decision


def test_a_pinned_slot_offered_both_takes_the_rdma_path() -> None:
    both = facts(offer=RdmaOffer(("ucx", "wire")), has_registry=True, slot_pinned=True)
    assert decide_path(both, lambda: b"desc") == PathDecision("rdma", "ok", b"desc")


def test_a_plain_slot_goes_over_the_wire_rather_than_through_windows() -> None:
    """Windows register a plain slot piece by piece for a GET; over the wire nothing needs
    registering, so an offer naming both never opens them."""
    opened: list[bool] = []

    def open_windows() -> bool:
        opened.append(True)
        return True

    both = facts(offer=RdmaOffer(("ucx", "wire"), windows=True), has_registry=True, windowed=True)
    assert decide_path(both, no_descriptor, open_windows) == PathDecision("wire", "ok")
    assert not opened


@pytest.mark.parametrize(
    ("registry", "enabled", "registered", "wire", "backends", "reason"),
    [
        (True, True, True, True, ("ucx", "wire"), None),
        (True, True, True, False, ("ucx",), None),
        (False, True, False, True, ("wire",), None),
        (True, False, True, True, ("wire",), None),
        (True, True, False, True, ("wire",), None),
        (False, True, True, False, None, "not_configured"),
        (True, False, True, False, None, "kill_switch"),
        (True, True, False, False, None, "no_offer"),
    ],
)
def test_the_consumer_offers_the_wire_whatever_its_ucx_facts(
    registry: bool,
    enabled: bool,
    registered: bool,
    wire: bool,
    backends: tuple[str, ...] | None,
    reason: str | None,
) -> None:
    offer = build_offer(registry, enabled, registered, wire=wire)
    assert offer.reason == reason
    assert (offer.offer.backends if offer.offer else None) == backends


# --- the fetch machine ---------------------------------------------------------------------


def test_a_wire_answer_reads_into_plain_memory_and_counts_the_wire() -> None:
    m = FetchMachine(HANDLE, "node-a", "release", NO_UCX)
    assert m.start() == [Acquire(RdmaOffer(("wire",)), claim=True, chunked_deadline=True)]
    assert m.on(Answered(WIRE)) == [Allocate(8 << 20, registered=False)]
    assert m.on(Allocated(True)) == [Get(WIRE, None)]
    assert m.dest == "fetch"
    assert m.on(GetOk()) == [
        Count("wire", "ok"),
        EndLease(21, release=True, claim=True),
        Stage(WIRE),
        Done("wire", WIRE, 0, claimed=False),
    ]


def test_a_failed_read_falls_back_to_chunks_once_into_the_same_buffer() -> None:
    m = FetchMachine(HANDLE, "node-a", "detach", NO_UCX)
    m.start()
    m.on(Answered(WIRE))
    m.on(Allocated(True))
    assert m.on(GetFailed()) == [
        Count("chunked", "get_failed"),
        EndLease(21, release=False, claim=False),
        Acquire(None, claim=False, chunked_deadline=True),
    ]
    assert m.on(Answered(READY)) == [Pull(READY)]  # the plain buffer serves the chunks
    assert m.on(Pulled())[-1] == Done("chunked", READY, 0, claimed=False)


def test_a_second_wire_answer_to_the_fallback_is_refused() -> None:
    m = FetchMachine(HANDLE, "node-a", "detach", NO_UCX)
    m.start()
    m.on(Answered(WIRE))
    m.on(Allocated(True))
    m.on(GetFailed())
    out = m.on(Answered(WIRE))
    assert isinstance(out[-1], Fail) and isinstance(out[-1].error, ProtocolError)


def test_a_wire_answer_to_an_offer_without_it_is_refused() -> None:
    ucx_only = FetchFacts(has_registry=True, rdma_enabled=True, peer_registered=True)
    m = FetchMachine(HANDLE, "node-a", "detach", ucx_only)
    m.start()
    out = m.on(Answered(WIRE))
    assert out[0] == EndLease(21, release=False, claim=False)
    assert isinstance(out[-1], Fail) and "wire" in str(out[-1].error)


def test_a_pinned_writer_takes_the_read_itself() -> None:
    writer = FetchFacts(
        has_registry=False,
        rdma_enabled=True,
        peer_registered=False,
        wire=True,
        writer_bytes=16 << 20,
    )
    m = FetchMachine(HANDLE, "node-a", "hold", writer)
    m.start()
    assert m.on(Answered(WIRE)) == [Get(WIRE, None)]
    assert m.dest == "writer"
    assert m.on(GetOk())[-1] == Done("wire", WIRE, 21, claimed=False)


# --- the bulk frames -----------------------------------------------------------------------


def test_a_read_request_round_trips() -> None:
    request = ReadRequest(HANDLE, 21, 4096, 1 << 20, copy=True)
    frame = encode_read(9, request)
    length, kind, call_id = HEADER.unpack(frame[: HEADER.size])
    assert call_id == 9
    assert decode_read(length, kind, frame[HEADER.size :]) == request


@pytest.mark.parametrize(("start", "stop"), [(0, 0), (10, 5), (-1, 5)])
def test_an_empty_or_backward_range_is_refused(start: int, stop: int) -> None:
    frame = encode_read(1, ReadRequest(HANDLE, 21, start, stop))
    length, kind, _ = HEADER.unpack(frame[: HEADER.size])
    with pytest.raises(ProtocolError):
        decode_read(length, kind, frame[HEADER.size :])


def test_the_sending_header_and_an_error_answer() -> None:
    frame = encode_sending(3, 12345)
    length, status, call_id = HEADER.unpack(frame[: HEADER.size])
    assert (call_id, decode_sending(length, status, frame[HEADER.size :])) == (3, 12345)
    error = encode_error(3, LeaseNotFound(handle=str(HANDLE), lease_id=21))
    length, status, _ = HEADER.unpack(error[: HEADER.size])
    with pytest.raises(LeaseNotFound):
        decode_sending(length, status, error[HEADER.size :])


@given(st.integers(0, 300), st.binary(max_size=64))
def test_any_request_bytes_give_a_read_or_a_protocol_error(kind: int, body: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        decode_read(HEADER.size - 4 + len(body), kind, body)


@given(st.integers(0, 255), st.binary(max_size=64))
def test_any_answer_bytes_give_a_size_or_a_velo_error(status: int, body: bytes) -> None:
    with contextlib.suppress(VeloError):
        assert decode_sending(HEADER.size - 4 + len(body), status, body) >= 0


# --- wire leases in the slot table ---------------------------------------------------------


def staged(store: SlotStore, ttl: float | None = None) -> DataHandle:
    return store.stage(8 << 20, TypeHeader(), None, kind="pooled", pinned=False, now=0.0, ttl=ttl)


def test_a_wire_lease_always_has_a_deadline() -> None:
    store = SlotStore(0xAB)
    handle = staged(store)
    with pytest.raises(ProtocolError):
        store.acquire(handle, 0.0, kind="wire")


def test_the_owner_sends_only_under_a_live_wire_lease_of_that_handle() -> None:
    store = SlotStore(0xAB)
    handle, other = staged(store), staged(store)
    wire = store.acquire(handle, 0.0, kind="wire", timeout=2.0)
    chunked = store.acquire(handle, 0.0, kind="chunked", timeout=2.0)
    assert store.sending(handle, wire.lease_id, 1.0).slot_id == handle.slot_id
    for bad_handle, lease_id in ((other, wire.lease_id), (handle, chunked.lease_id)):
        with pytest.raises(LeaseNotFound):
            store.sending(bad_handle, lease_id, 1.0)
    with pytest.raises(LeaseNotFound):  # past its deadline, swept or not
        store.sending(handle, wire.lease_id, 2.5)
    store.validate()


def test_a_ttl_ends_the_wire_leases_with_the_handle() -> None:
    """The owner is the sender: its reader gave up when the TTL fired, so the lease ends at
    once and its bytes may go (a piece in flight holds them in the read gate)."""
    store = SlotStore(0xAB)
    handle = staged(store, ttl=1.0)
    wire = store.acquire(handle, 0.0, kind="wire", timeout=30.0)
    rdma = store.acquire(handle, 0.0, kind="rdma", timeout=30.0)
    result = store.sweep(1.5)
    assert not result.freed  # the RDMA lease's GET may still read
    with pytest.raises(LeaseNotFound):
        store.sending(handle, wire.lease_id, 1.5)
    store.release(handle, rdma.lease_id)
    store.validate()


def test_an_unrenewed_wire_lease_expires_and_is_counted() -> None:
    store = SlotStore(0xAB)
    handle = staged(store)
    store.acquire(handle, 0.0, kind="wire", timeout=2.0)
    result = store.sweep(3.0)
    assert (result.wire_leases_expired, result.rdma_leases_reaped) == (1, 0)
    assert store.counters.wire_leases_expired == 1
    store.validate()
