"""Fetch scenarios on an owner/consumer pair of real agents in one process (ray_velo.testing):
the paths, every fallback reason, leases and TTLs on a fake clock, the quarantine, claims.
No Ray, no UCX; every scenario ends with both owner states valid and nothing left staged."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ray_velo.config import MiB, RdmaConfig, RdmaPoolConfig
from ray_velo.errors import (
    BudgetExceeded,
    HandleNotFound,
    HandleReleased,
    PayloadTooLarge,
    ProtocolError,
    SharedMemoryTooSmall,
    StagingError,
    TransferTimeout,
)
from ray_velo.protocol import (
    AcquireRequest,
    RdmaOffer,
    ReleaseRequest,
    decode_acquire_response,
    encode,
)
from ray_velo.state.ledger import QUARANTINE
from ray_velo.testing import AgentPair
from ray_velo.testing.pair import default_config


@pytest.fixture()
def pair(tmp_path: Path) -> Iterator[AgentPair]:
    with AgentPair(tmp_path / "shm") as p:
        yield p
        p.validate()


def payload(nbytes: int, seed: int = 1) -> bytes:
    return ((np.arange(nbytes, dtype=np.uint64) * 31 + seed) % 251).astype(np.uint8).tobytes()


def nothing_left(pair: AgentPair) -> None:
    pair.validate()
    for agent in (pair.owner, pair.consumer):
        info = agent.info()
        assert (info["live_slots"], info["live_leases"], info["reservations"]) == (0, 0, 0)


def test_a_pinned_payload_moves_by_one_get(pair: AgentPair) -> None:
    data = payload(3 * MiB)
    handle = pair.put(data)
    assert pair.fetch(handle) == data
    assert pair.consumer_paths() == {"rdma/ok": 1}
    assert pair.owner_paths() == {"rdma/ok": 1}
    with pytest.raises(HandleNotFound, match="released by its last consumer"):
        pair.fetch(handle)
    nothing_left(pair)


def test_the_cold_start_pulls_chunks_then_offers_rdma(tmp_path: Path) -> None:
    with AgentPair(tmp_path / "shm", registered=False) as pair:
        first, second = pair.put(payload(2 * MiB)), pair.put(payload(2 * MiB, 2))
        assert pair.fetch(first) == payload(2 * MiB)
        assert pair.consumer_paths() == {"chunked/no_offer": 1}
        assert pair.fetch(second) == payload(2 * MiB, 2)
        assert pair.consumer_paths() == {"chunked/no_offer": 1, "rdma/ok": 1}
        nothing_left(pair)


def test_plain_memory_and_small_payloads_answer_chunked(pair: AgentPair) -> None:
    plain = pair.put(payload(2 * MiB), pinned=False)
    small = pair.put(payload(1000))
    assert pair.fetch(plain) == payload(2 * MiB) and pair.fetch(small) == payload(1000)
    assert pair.owner_paths() == {"chunked/not_pinned": 1, "chunked/below_min": 1}
    nothing_left(pair)


def test_decode_error_falls_back_exactly_once(pair: AgentPair) -> None:
    pair.owner.inject_fault("corrupt_descriptors", 1)
    handle = pair.put(payload(2 * MiB))
    assert pair.fetch(handle) == payload(2 * MiB)
    assert pair.consumer_paths() == {"chunked/decode_error": 1}
    assert pair.owner_paths() == {"rdma/ok": 1, "chunked/no_offer": 1}
    assert pair.link.sent.count("_rv_detach") == 1  # the RDMA lease, detached once
    nothing_left(pair)


def test_get_failed_falls_back_exactly_once(pair: AgentPair) -> None:
    assert pair.consumer_rdma is not None
    pair.consumer_rdma.fail_gets = 1
    handle = pair.put(payload(2 * MiB))
    assert pair.fetch(handle) == payload(2 * MiB)
    assert pair.consumer_paths() == {"chunked/get_failed": 1}
    assert pair.owner_paths() == {"rdma/ok": 1, "chunked/no_offer": 1}
    nothing_left(pair)


def test_pool_exhausted_falls_back_exactly_once(tmp_path: Path) -> None:
    """The consumer has no registered memory for the payload (its budget is smaller): it
    cannot GET, and pulls the chunks into plain memory instead."""
    base = default_config()
    tiny = base.replace(
        rdma=RdmaConfig(
            rendezvous=base.rdma.rendezvous,
            pool=RdmaPoolConfig(
                initial_arena_bytes=1 * MiB,
                max_arena_bytes=1 * MiB,
                registered_bytes_budget=1 * MiB,
            ),
        )
    )
    with AgentPair(tmp_path / "shm", consumer_config=tiny) as pair:
        handle = pair.put(payload(8 * MiB))
        assert pair.fetch(handle) == payload(8 * MiB)
        assert pair.consumer_paths() == {"chunked/pool_exhausted": 1}
        assert pair.owner_paths() == {"rdma/ok": 1, "chunked/no_offer": 1}
        nothing_left(pair)


def test_an_owner_answering_rdma_again_gets_a_protocol_error(pair: AgentPair) -> None:
    """The fallback acquire carried no offer; an owner that answers it with another
    descriptor is broken: the fetch fails once, with no retry storm, and leaves nothing."""
    assert pair.consumer_rdma is not None
    pair.consumer_rdma.fail_gets = 1
    pair.link.offer_anyway = 1  # a broken owner: RDMA again to the fallback's acquire
    handle = pair.put(payload(2 * MiB), ttl=60.0)
    with pytest.raises(ProtocolError, match="again"):
        pair.fetch(handle)
    assert pair.link.sent.count("_rv_detach") == 2  # both leases ended
    assert pair.owner.info()["live_leases"] == 0
    assert pair.fetch(handle) == payload(2 * MiB)  # the handle is intact for a good consumer
    nothing_left(pair)


def test_an_unsafe_get_quarantines_its_destination_and_falls_back(pair: AgentPair) -> None:
    """UCX may still write the destination of a failed GET: that memory is quarantined,
    never handed to anyone, and the chunks land elsewhere."""
    assert pair.consumer_rdma is not None
    pair.consumer_rdma.unsafe_gets = 1
    handle = pair.put(payload(2 * MiB))
    assert pair.fetch(handle) == payload(2 * MiB)
    ledger = pair.consumer.core.state.ledger
    assert ledger.quarantined_bytes >= 2 * MiB
    quarantined = {buffer.key for buffer, _ in ledger.quarantined}
    for seed in range(4):  # later fetches never land in quarantined memory
        lease = pair.lease(pair.put(payload(2 * MiB, seed)))
        assert (lease.path, lease.offset) not in quarantined
        pair.end(lease)
    assert pair.consumer_paths() == {"chunked/get_failed": 1, "rdma/ok": 4}
    nothing_left(pair)


def test_a_get_past_its_bound_is_quarantined_not_freed(pair: AgentPair) -> None:
    """The fetch's bound runs out during a GET that may still write: TransferTimeout, the
    destination quarantined (and not also freed: the double free of issue 9), the lease
    ended."""
    assert pair.consumer_rdma is not None
    pair.consumer_rdma.stalled_gets = 1
    handle = pair.put(payload(2 * MiB), ttl=7200.0)
    with pytest.raises(TransferTimeout):
        pair.fetch(handle, "detach", timeout=5.0)
    ledger = pair.consumer.core.state.ledger
    assert ledger.quarantined_bytes >= 2 * MiB
    assert any(ledger.holder_of(buffer) == QUARANTINE for buffer, _ in ledger.quarantined)
    assert pair.owner.info()["live_leases"] == 0
    pair.validate()
    assert pair.fetch(handle) == payload(2 * MiB)
    nothing_left(pair)


def test_a_pinned_writer_under_an_unsafe_get_is_withdrawn(pair: AgentPair) -> None:
    assert pair.consumer_rdma is not None
    writer = pair.consumer.producers.reserve(4 * MiB, True, os.getpid())
    pair.consumer_rdma.unsafe_gets = 1
    handle = pair.put(payload(2 * MiB), ttl=60.0)
    with pytest.raises(StagingError, match="withdrawn"):
        pair.consumer.consumer.fetch(
            handle, "hold", None, os.getpid(), "unbounded", writer.reservation_id
        )
    pair.consumer.producers.abort(writer.reservation_id)  # the writer's close frees nothing now
    assert pair.consumer.core.state.ledger.quarantined_bytes >= 4 * MiB
    pair.validate()
    assert pair.fetch(handle) == payload(2 * MiB)
    nothing_left(pair)


def test_get_into_a_pinned_writer_lands_in_it(pair: AgentPair) -> None:
    writer = pair.consumer.producers.reserve(4 * MiB, True, os.getpid())
    handle = pair.put(payload(3 * MiB))
    lease = pair.consumer.consumer.fetch(
        handle, "hold", None, os.getpid(), "unbounded", writer.reservation_id
    )
    view = pair.segments.view(writer.path, writer.offset, 3 * MiB)
    assert bytes(view) == payload(3 * MiB)
    del view
    pair.owner.owner._rv_release(encode(ReleaseRequest(handle, lease.remote_lease_id)))
    pair.consumer.producers.abort(writer.reservation_id)
    nothing_left(pair)


def test_a_detaching_fetch_into_a_pinned_writer_ends_the_owners_lease_itself(
    pair: AgentPair,
) -> None:
    """A tensor-transport receive lands the GET in the receiver's PinnedWriter and ends the
    owner's lease at once (``detach``): the owner holds no lease afterwards, the handle stays
    usable, and the writer holds the bytes until it is given back."""
    writer = pair.consumer.producers.reserve(4 * MiB, True, os.getpid())
    handle = pair.put(payload(3 * MiB), consumers=2)
    lease = pair.consumer.consumer.fetch(
        handle, "detach", None, os.getpid(), "unbounded", writer.reservation_id
    )
    assert lease.remote_lease_id == 0
    assert pair.owner.info()["live_leases"] == 0
    assert pair.consumer_paths().get("rdma/ok") == 1
    view = pair.segments.view(writer.path, writer.offset, 3 * MiB)
    assert bytes(view) == payload(3 * MiB)
    del view
    assert pair.fetch(handle) == payload(3 * MiB)  # still usable
    pair.consumer.producers.abort(writer.reservation_id)
    pair.owner.owner._rv_release(encode(ReleaseRequest(handle, 0)))
    nothing_left(pair)


def test_a_writer_reserved_and_filled_in_one_call_holds_the_bytes(pair: AgentPair) -> None:
    """``fetch_into_writer`` (a tensor transport's receive): the reservation made and the
    bytes GET into it in one call; the owner holds no lease afterwards and the handle stays
    usable; the caller owns the reservation until it gives it back."""
    handle = pair.put(payload(3 * MiB), consumers=2)
    writer, lease = pair.consumer.fetch_into_writer(handle, None, os.getpid(), "unbounded", 3 * MiB)
    assert lease.remote_lease_id == 0
    assert pair.owner.info()["live_leases"] == 0
    assert pair.consumer.info()["reservations"] == 1
    assert pair.consumer_paths().get("rdma/ok") == 1
    view = pair.segments.view(writer.path, writer.offset, 3 * MiB)
    assert bytes(view) == payload(3 * MiB)
    del view
    assert pair.fetch(handle) == payload(3 * MiB)
    pair.consumer.producers.abort(writer.reservation_id)
    pair.owner.owner._rv_release(encode(ReleaseRequest(handle, 0)))
    nothing_left(pair)


@pytest.mark.parametrize("nbytes", [3 * MiB, 2 * MiB])
def test_a_failed_fetch_into_a_new_writer_gives_its_reservation_back(
    pair: AgentPair, nbytes: int
) -> None:
    """The reservation ``fetch_into_writer`` made is the agent's to end when the fetch fails
    (the caller never learns its id): an unknown handle, and a writer smaller than the
    payload, each leave no reservation and no memory behind."""
    handle = pair.put(payload(3 * MiB))
    pair.owner.owner._rv_release(encode(ReleaseRequest(handle, 0)))
    if nbytes == 3 * MiB:  # released: the owner no longer knows it
        with pytest.raises(HandleNotFound):
            pair.consumer.fetch_into_writer(handle, None, os.getpid(), "unbounded", nbytes)
    else:
        handle = pair.put(payload(3 * MiB))
        with pytest.raises(ValueError, match="PinnedWriter holds 2097152 bytes"):
            pair.consumer.fetch_into_writer(handle, None, os.getpid(), "unbounded", nbytes)
        assert pair.fetch(handle) == payload(3 * MiB)  # the handle is not lost to the failure
    assert pair.consumer.core.memory.pinned_used_bytes == 0
    nothing_left(pair)


def test_an_unrenewed_rdma_lease_is_reaped_between_one_and_one_and_a_half_timeouts(
    pair: AgentPair,
) -> None:
    """A consumer that got a descriptor and went silent: the owner's reaper force-releases
    its lease between 1 and 1.5 lease timeouts later (2 s here), counted as reaped."""
    handle = pair.put(payload(2 * MiB))
    answer = decode_acquire_response(
        pair.owner.owner._rv_acquire(encode(AcquireRequest(handle, rdma=RdmaOffer())))
    )
    assert answer.lease_timeout_ms == 2000  # type: ignore[union-attr]
    pair.tick(1.9)
    assert pair.owner.info()["live_leases"] == 1
    pair.tick(1.1)
    metrics = pair.owner.info()["metrics"]
    assert metrics["velo_rendezvous_rdma_leases_reaped_total"] == 1
    with pytest.raises(HandleNotFound, match="reaped"):
        pair.fetch(handle)
    nothing_left(pair)


def test_a_ttl_ends_the_handle_but_not_a_node_local_copy_in_use(pair: AgentPair) -> None:
    """A reader on the consumer node holds the fetched copy when the owner's TTL fires: the
    reader keeps its bytes, a second fetch of the handle is refused naming the TTL."""
    handle = pair.put(payload(2 * MiB), ttl=5.0, consumers=2)
    lease = pair.lease(handle, "detach")
    pair.tick(5.0)
    with pytest.raises(HandleNotFound, match="TTL"):
        pair.fetch(handle)
    assert pair.read(lease) == payload(2 * MiB)
    pair.end(lease)
    nothing_left(pair)


def test_consumers_n_is_exact_with_a_node_local_copy(pair: AgentPair) -> None:
    """consumers=2: two claim-mode resolutions (the second served by the node-local copy,
    but claimed at the owner), a third refused; claims consumed end the handle."""
    handle = pair.put(payload(2 * MiB), consumers=2)
    first = pair.lease(handle, "claim")
    second = pair.lease(handle, "claim")
    assert pair.consumer.info()["metrics"]["velo_fetches_total"]["cache"] == 1
    with pytest.raises(HandleReleased):
        pair.lease(handle, "claim")
    for lease in (first, second):
        pair.end(lease)
    pid = os.getpid()
    pair.consumer.consumer.claim_end(handle, True, pid)
    pair.consumer.consumer.claim_end(handle, True, pid)
    with pytest.raises(HandleNotFound, match="released by its last consumer"):
        pair.fetch(handle)
    nothing_left(pair)


def test_a_claim_given_back_can_be_claimed_again(pair: AgentPair) -> None:
    """A resolution whose task Ray retries gives its claim back; the retry claims it."""
    handle = pair.put(payload(2 * MiB))
    lease = pair.lease(handle, "claim")
    pair.end(lease)
    pair.consumer.consumer.claim_end(handle, False, os.getpid())
    assert pair.fetch(handle) == payload(2 * MiB)
    nothing_left(pair)


def test_a_dead_resolvers_claims_go_back(pair: AgentPair) -> None:
    """A process that claimed a single-use value dies before its body ended: its agent
    sees it gone, ends its lease and gives the claim back, so Ray's retry gets the value."""
    dead = 999_999_999  # a pid that cannot exist
    handle = pair.put(payload(2 * MiB))
    pair.consumer.consumer.fetch(handle, "claim", None, dead, "unbounded")
    with pytest.raises(HandleReleased):
        pair.fetch(handle)
    pair.tick(0.0)  # the liveness check
    assert pair.fetch(handle) == payload(2 * MiB)
    nothing_left(pair)


def test_payload_over_the_limit_releases_the_owners_copy(tmp_path: Path) -> None:
    limited = default_config().replace(staged_payload_max=1 * MiB)
    with AgentPair(tmp_path / "shm", consumer_config=limited) as pair:
        handle = pair.put(payload(2 * MiB))
        with pytest.raises(PayloadTooLarge, match=str(1 * MiB)):
            pair.fetch(handle)
        assert pair.consumer.info()["live_slots"] == 0  # nothing of its size was allocated
        nothing_left(pair)


def test_a_full_shm_directory_says_shared_memory_too_small(pair: AgentPair) -> None:
    free = os.statvfs(pair.config.shm_dir)
    too_much = free.f_bavail * free.f_frsize + (1 << 30)
    with pytest.raises(SharedMemoryTooSmall, match="shared-memory directory"):
        pair.owner.producers.reserve(too_much, False, os.getpid())
    with pytest.raises(SharedMemoryTooSmall):
        pair.owner.producers.reserve(
            too_much, True, os.getpid()
        )  # pinned falls back, then too small
    nothing_left(pair)


def test_idle_warm_arenas_never_refuse_a_region_and_the_gauge_follows(tmp_path: Path) -> None:
    """A 48 MiB dedicated arena stays warm after its payload went; a 200 MiB region still
    fits the 256 MiB budget (the warm arena is evicted first), and the registered-bytes gauge
    equals the budget's own count after every step."""
    with AgentPair(tmp_path / "shm") as pair:
        core = pair.owner.core
        handle = pair.put(payload(48 * MiB))
        assert pair.fetch(handle) == payload(48 * MiB)
        budget = core.memory.budget
        gauge = lambda: core.metrics.snapshot()["velo_rdma_registered_bytes"]  # noqa: E731
        assert budget.registered_bytes >= 48 * MiB and gauge() == budget.registered_bytes
        info = pair.owner.regions.alloc(200 * MiB, os.getpid())
        assert gauge() == budget.registered_bytes <= budget.budget_bytes
        pair.owner.regions.unregister(info.region_id, 1.0)
        assert gauge() == budget.registered_bytes
        with pytest.raises(BudgetExceeded):
            pair.owner.regions.alloc(300 * MiB, os.getpid())
        nothing_left(pair)


def test_an_empty_payload_and_bytes_of_every_size(pair: AgentPair) -> None:
    for size in (0, 1, MiB - 1, MiB, MiB + 1):
        handle = pair.put(payload(size, size))
        assert pair.fetch(handle) == payload(size, size)
    nothing_left(pair)


def test_a_pinned_writer_evicts_idle_warm_memory_before_falling_back(tmp_path: Path) -> None:
    """A 48 MiB dedicated arena stays warm on the owner after its payload went. A producer
    then asks for a 300 MiB pinned writer: that passes the 256 MiB budget even with the warm
    arena gone, so it falls back to plain memory and the warm arena is kept. A 220 MiB writer
    fits only once the warm arena is evicted: it gets registered memory (no fallback), and the
    registered-bytes gauge equals the budget's own count after every step."""
    with AgentPair(tmp_path / "shm") as pair:
        core = pair.owner.core
        budget, pool = core.memory.budget, core.memory.pinned_pool
        assert pool is not None
        gauge = lambda: core.metrics.snapshot()["velo_rdma_registered_bytes"]  # noqa: E731
        handle = pair.put(payload(48 * MiB))
        assert pair.fetch(handle) == payload(48 * MiB)
        assert (pool.arenas, pool.used_bytes) == (1, 0)  # the emptied arena, kept warm
        assert gauge() == budget.registered_bytes == 48 * MiB

        too_big = pair.owner.producers.reserve(300 * MiB, True, os.getpid())
        pending = core.reservations.get(too_big.reservation_id)
        assert pending is not None and (pending.kind, pending.pinned) == ("plain", False)
        assert pair.owner_paths() == {"rdma/ok": 1, "chunked/budget": 1}
        assert pool.arenas == 1 and gauge() == budget.registered_bytes == 48 * MiB
        pair.owner.producers.abort(too_big.reservation_id)

        writer = pair.owner.producers.reserve(220 * MiB, True, os.getpid())
        pending = core.reservations.get(writer.reservation_id)
        assert pending is not None and (pending.kind, pending.pinned) == ("dedicated", True)
        assert pair.owner_paths() == {"rdma/ok": 1, "chunked/budget": 1}  # no new fallback
        assert (pool.arenas, pool.mapped_bytes) == (1, 220 * MiB)  # the warm arena went
        assert gauge() == budget.registered_bytes == 220 * MiB <= budget.budget_bytes
        view = pair.segments.view(writer.path, writer.offset, writer.nbytes)
        view[-1] = 7  # the producer can write all of it
        del view
        pair.owner.producers.abort(writer.reservation_id)  # over warm_dedicated_bytes: unmapped
        assert gauge() == budget.registered_bytes == 0
        nothing_left(pair)


def test_without_warm_memory_a_freed_arena_is_unmapped_and_the_gauge_follows(
    tmp_path: Path,
) -> None:
    """warm_dedicated_bytes=0 (the spec's behaviour): the owner's 48 MiB arena and the
    consumer's GET destination are unmapped as soon as their payload goes, and on both agents
    the registered-bytes gauge drops with the budget's count to zero."""
    base = default_config()
    config = base.replace(
        rdma=dataclasses.replace(
            base.rdma, pool=dataclasses.replace(base.rdma.pool, warm_dedicated_bytes=0)
        )
    )
    with AgentPair(tmp_path / "shm", config) as pair:
        agents = (pair.owner, pair.consumer)

        def registered() -> list[tuple[int, int]]:
            return [
                (a.core.metrics.snapshot()["velo_rdma_registered_bytes"],
                 a.core.memory.budget.registered_bytes)
                for a in agents
            ]  # fmt: skip

        handle = pair.put(payload(48 * MiB))
        assert registered() == [(48 * MiB, 48 * MiB), (0, 0)]
        lease = pair.lease(handle)
        assert pair.consumer_paths() == {"rdma/ok": 1}
        assert registered() == [(0, 0), (48 * MiB, 48 * MiB)]  # the owner's slot went
        assert pair.read(lease) == payload(48 * MiB)
        pair.end(lease)
        assert registered() == [(0, 0), (0, 0)]
        for agent in agents:
            assert agent.core.memory.pinned_pool is not None
            assert agent.core.memory.pinned_pool.arenas == 0
        nothing_left(pair)


def test_transparent_staging_never_maps_and_the_timer_warms_arenas_up(tmp_path: Path) -> None:
    """@ray_velo.transfer stages inside the caller's send, which must never map or register
    an arena (spec). The owner's timer maps the first pooled arena right after the agent
    starts, so a small payload stages from the first call. A payload needing a dedicated
    arena finds none: nothing is reserved or mapped (the decorator leaves it in the Ray
    call, counted velo_transparent_inline), the timer maps one afterwards, and the next
    payload of that size lands in it, registered, and crosses over RDMA."""
    with AgentPair(tmp_path / "shm") as pair:
        pool = pair.owner.core.memory.pinned_pool
        assert pool is not None and pool.arenas == 0
        pair.tick()  # the agent's start: its timer maps the first pooled arena
        assert pool.arenas == 1
        small = pair.put(payload(MiB), transparent=True)
        assert pair.fetch(small) == payload(MiB)

        with pytest.raises(LookupError):
            pair.put(payload(48 * MiB), transparent=True)
        assert pool.arenas == 1 and pair.owner.core.memory.plain_pool.arenas == 0
        inline = pair.owner.core.metrics.snapshot()["velo_transparent_inline_total"]
        assert inline == 1
        pair.tick()  # the timer, outside any send
        assert pool.arenas == 2 and pool.used_bytes == 0
        staged = pair.put(payload(48 * MiB, 2), transparent=True)
        assert pool.arenas == 2 and pool.used_bytes >= 48 * MiB
        before = pair.consumer_paths().get("rdma/ok", 0)
        assert pair.fetch(staged) == payload(48 * MiB, 2)
        assert pair.consumer_paths().get("rdma/ok", 0) == before + 1
        nothing_left(pair)


def test_without_warm_up_transparent_staging_never_maps(tmp_path: Path) -> None:
    """warm_up_after_miss=False is the spec's behaviour: a process whose only staging is
    transparent never maps an arena; one explicit pinned put maps the first, and transparent
    payloads use it afterwards."""
    config = default_config()
    config = config.replace(
        rdma=dataclasses.replace(
            config.rdma, pool=dataclasses.replace(config.rdma.pool, warm_up_after_miss=False)
        )
    )
    with AgentPair(tmp_path / "shm", config) as pair:
        pool = pair.owner.core.memory.pinned_pool
        assert pool is not None
        for seed in range(2):
            with pytest.raises(LookupError):
                pair.put(payload(MiB, seed), transparent=True)
            pair.tick()
        assert pool.arenas == 0
        explicit = pair.put(payload(MiB, 5))
        assert pool.arenas == 1
        transparent = pair.put(payload(MiB, 6), transparent=True)
        assert pool.used_bytes >= 2 * MiB  # in the arena the explicit put mapped
        assert pair.fetch(explicit) == payload(MiB, 5)
        assert pair.fetch(transparent) == payload(MiB, 6)
        nothing_left(pair)


def concurrent_leases(pair: AgentPair, handle: Any, count: int, mode: str = "release") -> list[Any]:
    """``count`` fetches of ``handle`` on the consumer at once, on one event loop (as the
    agent's): each blocking step yields first, so the fetches overlap."""

    async def yielding(fn: Any, *args: Any) -> Any:
        await asyncio.sleep(0)
        return fn(*args)

    async def all_at_once() -> list[Any]:
        service = pair.consumer.consumer
        return await asyncio.gather(
            *(
                service.fetch_async(handle, mode, None, pair.pid, "unbounded", yielding)  # type: ignore[arg-type]
                for _ in range(count)
            ),
            return_exceptions=True,
        )

    return asyncio.run(all_at_once())


def test_overlapping_fetches_of_one_handle_share_one_transfer(pair: AgentPair) -> None:
    """Three tasks of one node take a consumers=3 payload at once: one GET crosses the link,
    the other two read its node-local copy, each claimed at the owner; a fourth is refused."""
    data = payload(3 * MiB)
    handle = pair.put(data, consumers=3)
    leases = concurrent_leases(pair, handle, 3)
    assert all(not isinstance(lease, BaseException) for lease in leases), leases
    assert [pair.read(lease) == data for lease in leases] == [True] * 3
    fetches = pair.consumer.core.metrics.snapshot()["velo_fetches_total"]
    assert fetches == {"rdma": 1, "cache": 2}, fetches
    # the copies' acquires move no bytes (the owner counts them as no_offer decisions)
    assert pair.owner_paths() == {"rdma/ok": 1, "chunked/no_offer": 2}
    for lease in leases:
        pair.end(lease)
    with pytest.raises(HandleNotFound, match="released by its last consumer"):
        pair.fetch(handle)
    nothing_left(pair)


def test_overlapping_fetches_beyond_the_references_are_refused(pair: AgentPair) -> None:
    """consumers=2, three fetches at once: one transfer, one reader of its copy, and the
    third refused by the owner (HandleReleased), never a read of bytes it has no claim on."""
    data = payload(2 * MiB)
    handle = pair.put(data, consumers=2)
    leases = concurrent_leases(pair, handle, 3)
    refused = [lease for lease in leases if isinstance(lease, BaseException)]
    assert len(refused) == 1 and isinstance(refused[0], (HandleReleased, HandleNotFound))
    for lease in leases:
        if not isinstance(lease, BaseException):
            assert pair.read(lease) == data
            pair.end(lease)
    assert pair.consumer.core.metrics.snapshot()["velo_fetches_total"].get("rdma") == 1
    nothing_left(pair)


def test_a_steady_pipeline_stages_every_round_after_the_first(tmp_path: Path) -> None:
    """@rv.transfer on a steady pipeline: each round's 20 MiB result is staged while the
    previous round's is still held (its readers' releases are crossing the link). Only the
    first round rides inside its Ray call (no arena of that size is mapped yet, and none may
    be mapped inside a send); from then on every round finds a warm arena, because taking the
    last warm one of a size asks the timer for a spare. Each inline round is counted, with its
    reason, in the metric and in ``ray-velo status``."""
    with AgentPair(tmp_path / "shm") as pair:
        inline, held = [], None
        for round_ in range(12):
            try:
                handle = pair.put(payload(20 * MiB, round_), transparent=True)
            except LookupError:  # the decorator leaves it in the Ray call
                handle = None
            inline.append(handle is None)
            pair.tick()  # the agent's timer runs between rounds (warm-ups)
            if held is not None:  # the previous round's reader finishes only now
                assert pair.fetch(held) == payload(20 * MiB, round_ - 1)
            held = handle
        assert inline == [True] + [False] * 11
        assert pair.owner.core.metrics.snapshot()["velo_transparent_inline_total"] == 1
        assert pair.owner.status()["transparent_inline"] == {"no_mapped_arena": 1}
        pair.fetch(held)
        nothing_left(pair)


def test_a_size_that_repeats_gets_a_spare_arena_from_its_third_put_on(tmp_path: Path) -> None:
    """Explicit puts of one size while the previous is still held (a Ray Direct Transport
    object lives until Ray frees its ref): the second put of the size within the window shows
    a pipeline, and asks the timer for a spare; from the third on, each put finds the spare
    mapped beforehand instead of mapping (and faulting) one inside the put."""
    with AgentPair(tmp_path / "shm") as pair:
        pool = pair.owner.core.memory.pinned_pool
        assert pool is not None
        held = pair.put(payload(20 * MiB, 0))
        pair.tick()
        for round_ in range(1, 7):
            mapped = pool.arenas
            handle = pair.put(payload(20 * MiB, round_))
            if round_ >= 2:
                assert pool.arenas == mapped, f"round {round_} mapped an arena inside its put"
            pair.tick(0.5)  # the timer maps the spare the put asked for
            assert pair.fetch(held) == payload(20 * MiB, round_ - 1)
            held = handle
        pair.fetch(held)
        nothing_left(pair)


def test_a_one_off_put_maps_no_spare(tmp_path: Path) -> None:
    """Puts of sizes that never repeat (or repeat only after the window) leave no spare
    arena behind: after each put and the timer's turn, the pool holds the put's own arena
    and nothing more."""
    with AgentPair(tmp_path / "shm") as pair:
        pool = pair.owner.core.memory.pinned_pool
        assert pool is not None
        window = pair.config.rdma.pool.spare_repeat_window
        pair.tick()  # the first pooled arena, mapped when the agent starts
        for size in (20 * MiB, 40 * MiB, 20 * MiB):
            before = pool.arenas
            handle = pair.put(payload(size))
            mapped = pool.arenas
            pair.tick(window + 1)
            assert pool.arenas == mapped, f"a spare was mapped for a one-off {size} B put"
            assert mapped <= before + 1
            pair.fetch(handle)
        nothing_left(pair)


def test_no_spare_above_the_size_bound(tmp_path: Path) -> None:
    """A repeating size above spare_arena_max_bytes gets no spare: its puts reuse the one
    warm arena they free, and the node holds no second arena of that size."""
    bounded = dataclasses.replace(default_config().rdma.pool, spare_arena_max_bytes=16 * MiB)
    config = default_config().replace(rdma=RdmaConfig(pool=bounded))
    with AgentPair(tmp_path / "shm", config) as pair:
        pool = pair.owner.core.memory.pinned_pool
        assert pool is not None
        held = pair.put(payload(20 * MiB, 0))
        for round_ in range(1, 4):
            handle = pair.put(payload(20 * MiB, round_))
            pair.tick(0.5)
            assert pool.warm_bytes == 0, "a spare above the bound was mapped"
            pair.fetch(held)
            held = handle
        pair.fetch(held)
        nothing_left(pair)


def test_a_spare_waits_until_no_transfer_is_in_flight(tmp_path: Path) -> None:
    """The timer is asked for a spare while another node GETs from this one (its RDMA lease
    is live): mapping it then would take a core from that transfer, so it waits, and is
    mapped at the first turn of the timer after the lease ends."""
    with AgentPair(tmp_path / "shm") as pair:
        pool = pair.owner.core.memory.pinned_pool
        assert pool is not None
        first = pair.put(payload(20 * MiB, 0))
        pair.fetch(first)
        moving = pair.put(payload(2 * MiB, 9))
        answer = decode_acquire_response(
            pair.owner.owner._rv_acquire(encode(AcquireRequest(moving, rdma=RdmaOffer())))
        )
        assert pair.owner.info()["live_leases"] == 1
        second = pair.put(payload(20 * MiB, 1))  # the size repeats: a spare is wanted
        mapped = pool.arenas
        for _ in range(3):
            pair.tick(0.05)
            assert pool.arenas == mapped, "a spare was mapped during a transfer"
        pair.owner.owner._rv_release(
            encode(ReleaseRequest(moving, answer.lease_id))  # type: ignore[union-attr]
        )
        pair.tick(0.05)
        assert pool.arenas == mapped + 1 and pool.warm_bytes >= 20 * MiB
        pair.fetch(second)
        nothing_left(pair)
