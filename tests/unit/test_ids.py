"""Handles are capabilities (ray_velo.protocol.ids, ray_velo.state.store): the slot ids of one
agent are never repeated and not predictable from each other, so knowing one handle gives no
other; lease ids likewise, and neither sequence reveals the other."""

from __future__ import annotations

import itertools
import os
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ray_velo.errors import VeloError
from ray_velo.protocol import (
    AcquireRequest,
    DataHandle,
    DetachRequest,
    LeaseRenewRequest,
    MetadataRequest,
    RdmaOffer,
    RefRequest,
    ReleaseRequest,
    decode_acquire_response,
    encode,
)
from ray_velo.protocol.ids import IdSequence
from ray_velo.protocol.messages import TypeHeader
from ray_velo.state.store import SlotStore
from ray_velo.testing import AgentPair

STAGINGS = 100_000
WORKER = 0x1234_5678_9ABC_DEF1


def staged_slot_ids(count: int, key: bytes | None = None) -> list[int]:
    """The slot ids of ``count`` stagings on one store (each released at once: ids are not
    reused even when their slots are gone)."""
    store = SlotStore(WORKER, id_key=key)
    ids = []
    for _ in range(count):
        handle = store.stage(0, TypeHeader(), None, kind="plain", pinned=False, now=0.0)
        store.release(handle, 0)
        ids.append(handle.slot_id)
    return ids


@pytest.fixture(scope="module")
def slot_ids() -> list[int]:
    return staged_slot_ids(STAGINGS)


def test_no_two_handles_of_an_agent_are_equal(slot_ids: list[int]) -> None:
    """100,000 stagings (each freed before the next): 100,000 distinct, non-zero slot ids."""
    assert len(set(slot_ids)) == STAGINGS
    assert 0 not in slot_ids


def test_a_handle_says_nothing_of_its_neighbours(slot_ids: list[int]) -> None:
    """No arithmetic relation between consecutive ids: their differences are as varied as the
    ids (no counter, no stride), no affine map a*x+b mod 2**64 fitted on two pairs predicts a
    third, the bits are fair coins and consecutive ids differ in about half their bits."""
    mask = (1 << 64) - 1
    differences = {(b - a) & mask for a, b in itertools.pairwise(slot_ids)}
    assert len(differences) > 0.99 * (STAGINGS - 1)
    assert sum(i < 1 << 48 for i in slot_ids) < 50  # a counter would sit near zero
    for start in range(0, 300, 3):
        x0, x1, x2 = slot_ids[start : start + 3]
        # a*x0+b = x1, a*x1+b = x2 mod 2**64: with x1-x0 odd, a = (x2-x1)/(x1-x0)
        step = (x1 - x0) & mask
        if step % 2 == 0:
            continue
        a = ((x2 - x1) * pow(step, -1, 1 << 64)) & mask
        b = (x1 - a * x0) & mask
        x3 = slot_ids[start + 3]
        assert (a * x2 + b) & mask != x3, "an affine map predicts the next slot id"
    for bit in range(64):
        share = sum(i >> bit & 1 for i in slot_ids) / STAGINGS
        assert 0.49 < share < 0.51, f"bit {bit} is set in {share:.3f} of the ids"
    flips = [bin(a ^ b).count("1") for a, b in itertools.pairwise(slot_ids)]
    assert 31.5 < statistics.mean(flips) < 32.5


def test_two_agents_give_unrelated_ids() -> None:
    """Two stores (two incarnations): their sequences share no id and no offset."""
    mask = (1 << 64) - 1
    first, second = staged_slot_ids(1000), staged_slot_ids(1000)
    assert not set(first) & set(second)
    assert len({(b - a) & mask for a, b in zip(first, second, strict=True)}) == 1000


def test_lease_ids_neither_repeat_nor_reveal_slot_ids() -> None:
    """Leases of one store: unique, and no lease id equals a slot id of the same store (the
    two sequences share the store's key)."""
    store = SlotStore(WORKER, id_key=os.urandom(16))
    handles = [
        store.stage(10, TypeHeader(), None, kind="plain", pinned=False, now=0.0)
        for _ in range(2000)
    ]
    leases = [store.acquire(h, 0.0, kind="chunked").lease_id for h in handles]
    assert len(set(leases)) == len(leases)
    assert not {h.slot_id for h in handles} & set(leases)


@given(st.binary(min_size=16, max_size=64), st.integers(0, (1 << 64) - 1))
def test_the_permutation_is_one_to_one(key: bytes, n: int) -> None:
    """The id of counter value n is a 64-bit value that maps back to n alone: running the
    Feistel rounds backwards recovers it (so no two counter values share an id)."""
    ids = IdSequence(key, b"slot")
    value = ids.permute(n)
    assert 0 <= value < 1 << 64
    assert _inverse(ids, value) == n


def _inverse(ids: IdSequence, value: int) -> int:
    import hashlib

    left, right = value >> 32, value & 0xFFFF_FFFF
    for key in reversed(ids._round_keys):
        mixed = hashlib.blake2b(left.to_bytes(4, "big"), digest_size=4, key=key).digest()
        left, right = right ^ int.from_bytes(mixed, "big"), left
    return (left << 32) | right


def _leaves(value: Any) -> Iterator[Any]:
    """Every int and string inside a decoded answer (msgpack inside bytes included)."""
    if isinstance(value, bytes):
        try:
            value = msgpack.unpackb(value, raw=False, strict_map_key=False)
        except Exception:
            return
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(key)
            yield from _leaves(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _leaves(item)
    elif isinstance(value, int | str):
        yield value


def test_no_answer_names_a_handle_or_lease_the_peer_did_not_send(tmp_path: Path) -> None:
    """Thirty live handles on an owner; a peer asks about each one with every handler it may
    call (metadata, chunked and RDMA acquires, renew, ref, detach, release) and about handles
    that do not exist. No answer or error carries another handle's slot id, in any form, nor
    a lease id granted to another request."""
    with AgentPair(tmp_path / "shm") as pair:
        handles = [pair.put(np.full(70_000 + i, i % 251, dtype=np.uint8)) for i in range(30)]
        service = pair.owner.owner
        slots = {h.slot_id for h in handles}
        granted: set[int] = set()

        def ask(handle: DataHandle, method: str, message: Any) -> list[Any]:
            try:
                answer = getattr(service, method)(encode(message))
            except VeloError as exc:
                return [str(exc), *_leaves(exc.fields)]
            return list(_leaves(answer))

        for handle in [
            *handles,
            DataHandle(handles[0].worker_id, 12345),  # never staged
            DataHandle(99, handles[0].slot_id),  # another incarnation's
        ]:
            seen: list[Any] = []
            lease_ids = []
            for offer in (None, RdmaOffer()):
                answer = (
                    service._rv_acquire(encode(AcquireRequest(handle, offer)))
                    if handle in handles
                    else None
                )
                if answer is not None:
                    decoded = decode_acquire_response(answer)
                    lease_ids.append(decoded.lease_id)
                    seen += _leaves(answer)
            seen += ask(handle, "_rv_metadata", MetadataRequest(handle))
            seen += ask(handle, "_rv_ref", RefRequest(handle))
            for lease_id in lease_ids or [424242]:
                seen += ask(handle, "_rv_lease_renew", LeaseRenewRequest(handle, lease_id))
                seen += ask(handle, "_rv_detach", DetachRequest(handle, lease_id))
            seen += ask(handle, "_rv_release", ReleaseRequest(handle, 0))
            assert len(seen) > 10 and (lease_ids or handle not in handles)
            others = (slots | granted) - {handle.slot_id, *lease_ids}
            forms = {*others, *(f"{i:016x}" for i in others), *(str(i) for i in others)}
            for leaf in seen:
                text = leaf if isinstance(leaf, str) else None
                assert leaf not in others, f"an answer about {handle} names {leaf}"
                assert text is None or not any(f in text for f in forms if isinstance(f, str)), text
            granted |= set(lease_ids)
        pair.validate()
