"""Streamed staging on an owner/consumer pair of real agents in one process: a slot committed
before its producer wrote its bytes (``session.stage_streamed``, what the VELO tensor transport
uses) is read by window as each is written, never sooner, and its memory outlives every end
of the handle until the producer stopped writing. No Ray, no UCX (the fake backend's GET is a
memmove, so a GET of unwritten bytes would hand the reader stale ones)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ray_velo.client.payload import as_bytes_view
from ray_velo.config import MiB
from ray_velo.errors import HandleNotFound
from ray_velo.owner.service import WRITTEN_WINDOW_MIN, written_window_bytes
from ray_velo.protocol import DataHandle
from ray_velo.testing import AgentPair
from tests.unit.conftest import velo_threads

DEAD_PID = 999_999_999  # a pid that cannot exist
BOUND_S = 10.0


@pytest.fixture()
def pair(tmp_path: Path) -> Iterator[AgentPair]:
    with AgentPair(tmp_path / "shm") as p:
        yield p
        p.validate()


@pytest.fixture()
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(2) as executor:
        yield executor


def payload(nbytes: int, seed: int = 1) -> bytes:
    return ((np.arange(nbytes, dtype=np.uint64) * 31 + seed) % 251).astype(np.uint8).tobytes()


class Producer:
    """A producer that committed its slot first and writes its bytes when the test says,
    as ``session.stage_streamed``'s writer thread does."""

    def __init__(self, pair: AgentPair, data: bytes, pid: int | None = None) -> None:
        self.pair, self.data = pair, data
        header, view = as_bytes_view(data)
        owner = pair.owner
        reservation = owner.producers.reserve(view.nbytes, True, pid or os.getpid())
        assert reservation is not None
        self.dest = np.frombuffer(
            pair.segments.view(reservation.path, reservation.offset, view.nbytes), np.uint8
        )
        self.dest[:] = 0xEE  # what a reader must never see
        self.handle = owner.producers.commit(
            reservation.reservation_id, view.nbytes, header, None, 1, True, "", False, True
        )
        self.key = (reservation.path, reservation.offset)
        self.written = 0

    def write(self, upto: int) -> None:
        source = np.frombuffer(self.data, np.uint8)
        self.dest[self.written : upto] = source[self.written : upto]
        self.written = upto
        self.pair.owner.producers.written(self.handle, upto)


def wait_for(ready: Callable[[], bool]) -> None:
    until = threading.Event()
    for _ in range(int(BOUND_S / 0.01)):
        if ready():
            return
        until.wait(0.01)
    raise AssertionError("condition not met in time")


def gets_checked(pair: AgentPair, producer: Producer) -> list[tuple[int, int]]:
    """Every GET the consumer makes, checked against what the producer had written."""
    assert pair.consumer_rdma is not None
    rdma, real_get = pair.consumer_rdma, pair.consumer_rdma.get
    (slot,) = [s for s in pair.owner.core.state.slots() if s.slot_id == producer.handle.slot_id]
    base = slot.location.address  # where the owner's own mapping has the slot
    seen: list[tuple[int, int]] = []

    def get(node: str, descriptor: Any, dest: int, timeout_s: float, *a: Any, **k: Any) -> None:
        start = descriptor.addr - base + k.get("start", 0)
        stop = descriptor.addr - base + (k.get("stop") or descriptor.length)
        seen.append((start, stop))
        assert stop <= producer.written, f"GET of [{start}, {stop}) with {producer.written} written"
        real_get(node, descriptor, dest, timeout_s, *a, **k)

    rdma.get = get  # type: ignore[method-assign]
    return seen


def test_a_reader_gets_each_window_once_written_and_never_sooner(
    pair: AgentPair, pool: ThreadPoolExecutor
) -> None:
    """A 64 MiB tensor returned through the VELO transport: the consumer on another node
    starts while its producer is still copying it into the slot. It GETs window by window as
    the producer says each is written; a GET of a window not yet written would hand it the
    slot's stale bytes."""
    data = payload(64 * MiB)
    producer = Producer(pair, data)
    seen = gets_checked(pair, producer)
    size = written_window_bytes(len(data))
    assert size == WRITTEN_WINDOW_MIN == 4 * MiB
    fetched: Future[bytes] = pool.submit(pair.fetch, producer.handle, "detach")
    for window in range(len(data) // size):
        producer.write((window + 1) * size)
        wait_for(lambda window=window: len(seen) == window + 1)  # type: ignore[misc]
    assert fetched.result(BOUND_S) == data
    assert len(seen) == 16
    assert pair.consumer_paths() == {"rdma/ok": 1}


def test_one_get_takes_all_that_is_written(pair: AgentPair, pool: ThreadPoolExecutor) -> None:
    """A copy that outruns the link: each GET takes every byte written by the time the
    consumer asks, so 64 MiB moves in a few GETs, not sixteen."""
    data = payload(64 * MiB)
    producer = Producer(pair, data)
    seen = gets_checked(pair, producer)
    producer.write(40 * MiB)
    fetched = pool.submit(pair.fetch, producer.handle, "detach")
    wait_for(lambda: len(seen) == 1)
    producer.write(64 * MiB)
    assert fetched.result(BOUND_S) == data
    assert seen == [(0, 40 * MiB), (40 * MiB, 64 * MiB)]


def test_a_handle_ended_mid_write_keeps_its_memory_until_the_writer_stops(
    pair: AgentPair,
) -> None:
    """Ray garbage-collects the object while its producer's writer thread still copies the
    tensor: the handle ends at once, but its memory goes back to the pool only once the
    writer stopped, so the next payload is never written over by the old one."""
    producer = Producer(pair, payload(16 * MiB))
    producer.write(4 * MiB)
    pair.owner.consumer.release_quietly(producer.handle)
    with pytest.raises(HandleNotFound):
        pair.fetch(producer.handle, "detach")
    second = pair.put(payload(16 * MiB, 2))
    reused = [s.location for s in pair.owner.core.state.slots() if s.slot_id == second.slot_id]
    assert reused and (reused[0].arena.path, reused[0].offset_bytes) != producer.key
    producer.write(16 * MiB)  # the writer finishes: now its memory may go
    assert pair.fetch(second) == payload(16 * MiB, 2)
    pair.validate()
    assert pair.owner.info()["live_slots"] == 0


def test_a_producer_dying_mid_write_ends_the_handle_and_its_waiting_reader(
    pair: AgentPair, pool: ThreadPoolExecutor
) -> None:
    """The source actor is killed while its tensor is being copied: a reader waiting for
    the next window hears that the process that staged it died, and the memory goes back."""
    producer = Producer(pair, payload(16 * MiB), pid=DEAD_PID)
    producer.write(4 * MiB)
    fetched = pool.submit(pair.fetch, producer.handle, "detach")
    wait_for(lambda: pair.consumer_rdma is not None and pair.consumer_rdma.gets == 1)
    pair.tick(0.0)  # the liveness check finds the producer gone
    with pytest.raises(HandleNotFound, match="died"):
        fetched.result(BOUND_S)
    pair.validate()
    assert pair.owner.info()["live_slots"] == 0


def test_a_producer_failing_to_write_ends_the_handle(pair: AgentPair) -> None:
    producer = Producer(pair, payload(16 * MiB))
    producer.write(8 * MiB)
    pair.owner.producers.written(producer.handle, -1)
    with pytest.raises(HandleNotFound, match="failed to write its bytes"):
        pair.fetch(producer.handle, "detach")
    pair.validate()
    assert pair.owner.info()["live_slots"] == 0


def test_a_reader_on_the_owners_node_waits_for_every_byte(
    pair: AgentPair, pool: ThreadPoolExecutor
) -> None:
    """A same-node reader gets a view of the slot itself: it is answered only once the
    producer wrote it all."""
    data = payload(16 * MiB)
    producer = Producer(pair, data)
    leased = pool.submit(pair.owner.readers.acquire, producer.handle, os.getpid(), "detach")
    producer.write(12 * MiB)
    assert not leased.done()
    producer.write(16 * MiB)
    lease = leased.result(BOUND_S)
    assert pair.segments.view(lease.path, lease.offset, lease.total_len) == data
    pair.owner.readers.end_lease(lease.handle, lease.lease_id, False)


def test_a_consumer_without_windows_is_answered_once_all_is_written(
    pair: AgentPair, pool: ThreadPoolExecutor
) -> None:
    """A consumer that cannot GET by window (no registrar for a plain destination) is
    answered with the whole slot's descriptor only once every byte is there."""
    data = payload(16 * MiB)
    producer = Producer(pair, data)
    seen = gets_checked(pair, producer)
    pair.consumer.core.memory.registrar = None  # no windows to offer
    fetched = pool.submit(pair.fetch, producer.handle, "detach")
    producer.write(8 * MiB)
    producer.write(16 * MiB)
    assert fetched.result(BOUND_S) == data
    assert seen == [(0, 16 * MiB)]


def test_the_window_size_follows_the_payload() -> None:
    assert written_window_bytes(8 * MiB) == 4 * MiB
    assert written_window_bytes(256 * MiB) == 16 * MiB
    assert written_window_bytes(1024 * MiB + 1) == 65 * MiB


def test_a_handle_staged_whole_is_read_as_before(pair: AgentPair) -> None:
    """Nothing changes for a payload written before its commit: one GET of it all."""
    data = payload(16 * MiB)
    handle: DataHandle = pair.put(data)
    assert pair.fetch(handle) == data
    assert pair.consumer_rdma is not None and pair.consumer_rdma.gets == 1


def test_a_failed_write_is_told_and_the_writer_goes_on() -> None:
    """A streamed payload whose copy fails tells its agent (-1, the handle ends) and the
    producer's writer thread writes the next payload all the same."""
    from ray_velo.client import session

    notices: list[tuple[DataHandle, int]] = []

    class Agent:
        def stage_written(self, handle: DataHandle, upto: int) -> None:
            notices.append((handle, upto))

    first, second = DataHandle(1, 1), DataHandle(1, 2)
    source = memoryview(payload(6 * MiB))
    writer = session._BackgroundWriter()
    broken = memoryview(bytearray(1 * MiB))  # too small: the copy raises
    writer.write(Agent(), first, broken, [(0, source)])  # type: ignore[arg-type]
    target = bytearray(6 * MiB)
    writer.write(Agent(), second, memoryview(target), [(0, source)])  # type: ignore[arg-type]
    wait_for(lambda: (second, 6 * MiB) in notices)
    assert notices[0] == (first, -1)
    assert bytes(target) == bytes(source)
    writer.close()  # what a session's end does: the thread is joined, not left to idle out
    assert not velo_threads()


@given(st.lists(st.integers(0, 300), max_size=12))
def test_a_packed_layout_aligns_each_part_and_overlaps_none(sizes: list[int]) -> None:
    from ray_velo.client.session import PACK_ALIGN, pack_layout

    offsets, total = pack_layout(sizes)
    assert len(offsets) == len(sizes)
    end = 0
    for offset, size in zip(offsets, sizes, strict=True):
        assert offset % PACK_ALIGN == 0 and end <= offset < end + PACK_ALIGN
        end = offset + size
    assert total == end


def test_packed_pieces_land_at_their_offsets_and_the_gaps_are_zeroed() -> None:
    """Many parts streamed into one slot: each at its offset, the padding between them
    zeroed (no stale bytes of the slot's last payload reach a reader), the agent told a
    growing count of bytes ending at the slot's size."""
    from ray_velo.client import session

    notices: list[int] = []

    class Agent:
        def stage_written(self, handle: DataHandle, upto: int) -> None:
            notices.append(upto)

    parts = [np.full(n, i + 1, np.uint8) for i, n in enumerate([3, 5 * MiB, 0, 70, 4 * MiB + 1])]
    offsets, total = session.pack_layout([p.nbytes for p in parts])
    dest = bytearray(b"\xff" * total)
    pieces = list(zip(offsets, parts, strict=True))
    session._write_streamed(Agent(), DataHandle(1, 1), memoryview(dest), pieces)  # type: ignore[arg-type]
    written = np.frombuffer(dest, np.uint8)
    expected = np.zeros(total, np.uint8)
    for offset, part in zip(offsets, parts, strict=True):
        expected[offset : offset + part.nbytes] = part
    assert np.array_equal(written, expected)
    assert notices == sorted(notices) and notices[-1] == total and len(notices) >= 2
