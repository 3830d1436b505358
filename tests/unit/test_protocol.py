"""Control messages, the owner's eight checks, the consumer's offer and the kill switch."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
from dataclasses import dataclass

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ray_velo.errors import ProtocolError
from ray_velo.protocol import (
    AcquireRequest,
    DataHandle,
    DetachRequest,
    LeaseRenewRequest,
    MetadataRequest,
    MetadataResponse,
    OwnerFacts,
    PullRequest,
    Rdma,
    RdmaOffer,
    Ready,
    RefRequest,
    ReleaseRequest,
    TypeHeader,
    build_offer,
    decide_path,
    decode,
    decode_acquire_response,
    encode,
    kill_switch_engaged,
)
from ray_velo.protocol.messages import NULL_HANDLE

H = DataHandle(0x1122334455667788, 42)
MESSAGES = [
    MetadataRequest(H),
    MetadataResponse(size=10, refcount=2, pinned=True),
    AcquireRequest(H, rdma=RdmaOffer(), lease_ms=250, budget_ms=1000, holder_pid=7),
    PullRequest(transfer_id=3, index=9),
    RefRequest(H),
    DetachRequest(H, 5),
    ReleaseRequest(H, 5),
    LeaseRenewRequest(H, 5),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message: object) -> None:
    assert decode(type(message), encode(message)) == message


def test_acquire_answers_round_trip_with_their_kind() -> None:
    ready = Ready(1, 1, 16, 4, 60, TypeHeader("numpy", "<f8", (3, 2)))
    rdma = Rdma(2, b"\x01" * 30, 30000, 64, TypeHeader())
    assert decode_acquire_response(encode(ready)) == ready
    assert decode_acquire_response(encode(rdma)) == rdma


def test_handle_travels_as_hi_lo() -> None:
    wire = msgpack.unpackb(encode(RefRequest(H)))
    assert wire == {"handle": {"hi": 0x1122334455667788, "lo": 42}}
    assert DataHandle.from_int(H.value) == H


def test_missing_fields_mean_the_old_behaviour() -> None:
    """An old consumer omits the offer, lease and budget: no RDMA, no deadline, no bound."""
    old = msgpack.packb({"handle": {"hi": 1, "lo": 2}})
    request = decode(AcquireRequest, old)
    assert request == AcquireRequest(DataHandle(1, 2))
    assert request.rdma is None and request.lease_ms == 0 and request.budget_ms == 0
    # a future owner that omits lease_timeout_ms: 0 means no deadline (the old behaviour)
    answer = decode_acquire_response(msgpack.packb({"kind": "rdma", "lease_id": 1}))
    assert isinstance(answer, Rdma) and answer.lease_timeout_ms == 0
    # an owner from before the kind field answered Ready
    assert isinstance(decode_acquire_response(msgpack.packb({"lease_id": 1})), Ready)


@dataclass(frozen=True, slots=True)
class AcquireBeforeClaims:
    """_rv_acquire as an owner from before claims and consumer incarnations decodes it."""

    handle: DataHandle = NULL_HANDLE
    rdma: RdmaOffer | None = None
    lease_ms: int = 0
    budget_ms: int = 0
    holder_pid: int = 0


def test_claims_and_consumer_incarnations_are_additive() -> None:
    """Version skew both ways: an old consumer's acquire (no claim, no incarnation) means
    no claim and nothing superseded; an old owner reads a new consumer's acquire as the
    acquire it knew, and a release or detach with ``claim`` as the plain one."""
    old = msgpack.packb({"handle": {"hi": 1, "lo": 2}, "lease_ms": 5})
    request = decode(AcquireRequest, old)
    assert (request.claim, request.consumer_node, request.consumer_worker) == (False, "", 0)
    new = AcquireRequest(
        DataHandle(1, 2), rdma=RdmaOffer(), lease_ms=5, claim=True, consumer_node="b",
        consumer_worker=9,
    )  # fmt: skip
    assert decode(AcquireBeforeClaims, encode(new)) == AcquireBeforeClaims(
        DataHandle(1, 2), RdmaOffer(), 5
    )
    assert (
        decode(ReleaseRequest, msgpack.packb({"handle": {"hi": 1, "lo": 2}, "lease_id": 3})).claim
        is False
    )
    assert decode(DetachRequest, encode(DetachRequest(DataHandle(1, 2), 3, claim=True))).claim


def test_unknown_fields_are_ignored() -> None:
    wire = msgpack.unpackb(encode(MESSAGES[2]))
    wire["from_the_future"] = [1, 2, 3]
    wire["rdma"]["version"] = 9
    assert decode(AcquireRequest, msgpack.packb(wire)) == MESSAGES[2]


@given(st.binary(max_size=64))
def test_garbage_raises_only_protocol_error(blob: bytes) -> None:
    for cls in (AcquireRequest, PullRequest, MetadataResponse):
        with contextlib.suppress(ProtocolError):
            decode(cls, blob)
    with contextlib.suppress(ProtocolError):
        decode_acquire_response(blob)


def test_wrong_field_type_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match=r"PullRequest\.index"):
        decode(PullRequest, msgpack.packb({"index": "nine"}))
    with pytest.raises(ProtocolError, match=r"MetadataResponse\.pinned"):
        decode(MetadataResponse, msgpack.packb({"pinned": 1}))


# --- the owner's eight checks -----------------------------------------------------------

PASSING = OwnerFacts(
    offer=RdmaOffer(),
    has_registry=True,
    rdma_enabled=True,
    slot_pinned=True,
    total_len=1 << 20,
    rdma_min_bytes=64 << 10,
    draining=False,
)


def descriptor() -> bytes:
    return b"descriptor"


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"offer": None}, "no_offer"),
        ({"has_registry": False}, "not_configured"),
        ({"rdma_enabled": False}, "kill_switch"),
        ({"slot_pinned": False}, "not_pinned"),
        ({"total_len": 1000}, "below_min"),
        ({"offer": RdmaOffer(backends=("libfabric",))}, "no_offer"),
        ({"draining": True}, "draining"),
    ],
)
def test_each_check_refuses_with_its_label(change: dict[str, object], reason: str) -> None:
    decision = decide_path(dataclasses.replace(PASSING, **change), descriptor)
    assert (decision.path, decision.reason, decision.descriptor) == ("chunked", reason, b"")


def test_checks_run_in_order() -> None:
    """A heap slot on a draining owner counts not_pinned, not draining (check 4 before 7)."""
    facts = dataclasses.replace(PASSING, slot_pinned=False, draining=True)
    assert decide_path(facts, descriptor).reason == "not_pinned"
    facts = dataclasses.replace(PASSING, offer=None, has_registry=False, rdma_enabled=False)
    assert decide_path(facts, descriptor).reason == "no_offer"
    facts = dataclasses.replace(PASSING, has_registry=False, rdma_enabled=False)
    assert decide_path(facts, descriptor).reason == "not_configured"


def test_check_eight_staging_gone() -> None:
    """A region deregistered under the slot: the descriptor no longer builds."""
    assert decide_path(PASSING, lambda: None).reason == "not_pinned"
    calls: list[int] = []

    def counting() -> bytes:
        calls.append(1)
        return b"d"

    decide_path(dataclasses.replace(PASSING, draining=True), counting)
    assert calls == []  # built only when checks 1-7 pass
    decision = decide_path(PASSING, counting)
    assert (decision.path, decision.reason, decision.descriptor) == ("rdma", "ok", b"d")


def test_consumer_offer_from_three_local_facts() -> None:
    assert build_offer(False, True, True).reason == "not_configured"
    assert build_offer(True, False, True).reason == "kill_switch"
    assert build_offer(True, True, False).reason == "no_offer"  # cold start: unknown owner
    offer = build_offer(True, True, True)
    assert offer.offer == RdmaOffer(("ucx",)) and offer.reason is None


@pytest.mark.parametrize(
    ("value", "engaged"),
    [
        ("1", True),
        ("true", True),
        ("TRUE", True),
        ("Yes", True),
        ("on", True),
        (" on ", True),
        ("0", False),
        ("off", False),
        ("ture", False),
        ("", False),
        (None, False),
    ],
)
def test_kill_switch_values(value: str | None, engaged: bool) -> None:
    environ = {} if value is None else {"VELO_RDMA_RENDEZVOUS_DISABLE": value}
    assert kill_switch_engaged(environ) is engaged


def test_protocol_imports_neither_ray_nor_ucx() -> None:
    """The protocol core and the agent's states are pure: importing them pulls in no Ray, UCX,
    numpy or threads."""
    code = (
        "import sys\n"
        "import ray_velo.protocol, ray_velo.memory.allocator\n"
        "import ray_velo.state.agent, ray_velo.state.fetch\n"
        "import ray_velo.state.progress\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('ray', 'libucx', 'numpy', 'cffi', 'threading_extra') or 'ucx._ucx' in m]\n"
        "assert not bad, bad\n"
    )
    env = dict(os.environ)
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
