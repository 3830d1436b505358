"""The wire path on an owner/consumer pair of real agents in one process, the owner's bulk port
a real socket on 127.0.0.1: the bytes cross exactly and the path says so; a lease that ends
mid-send (its TTL, its release) stops the send, and the reader gets an error or the old bytes,
never the payload staged next in that memory; a read outside its lease is refused; a sender
that stalls ends in the reader's bound and one fallback to chunks; a producer still writing
is sent each piece once written, never sooner. No Ray, no UCX (unless the fake RDMA)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from ray_velo.actors.jobs import JOB_POLL_S
from ray_velo.config import MiB
from ray_velo.errors import HandleNotFound, LeaseNotFound, ProtocolError, VeloError
from ray_velo.protocol import (
    AcquireRequest,
    DataHandle,
    MetadataRequest,
    RdmaOffer,
    ReadRequest,
    ReleaseRequest,
    decode_acquire_response,
    encode,
)
from ray_velo.protocol.bulk import HEADER, decode_sending, encode_read
from ray_velo.testing import AgentPair
from ray_velo.testing.pair import default_config
from tests.unit.test_streamed import Producer, payload, wait_for

WIRE_ONLY = RdmaOffer(("wire",))


@pytest.fixture()
def pair(tmp_path: Path) -> Iterator[AgentPair]:
    with AgentPair(tmp_path / "shm", rdma=False, wire=True) as p:
        yield p
        p.validate()


@pytest.fixture()
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(2) as executor:
        yield executor


def wire_lease(pair: AgentPair, handle: DataHandle) -> int:
    """An acquire as another node's agent makes it, offering the wire only: its lease."""
    request = AcquireRequest(handle, rdma=WIRE_ONLY, consumer_node="node-x", consumer_worker=5)
    answer = decode_acquire_response(pair.owner.owner._rv_acquire(encode(request)))
    assert getattr(answer, "wire", False), answer
    return answer.lease_id


def connect(pair: AgentPair) -> socket.socket:
    assert pair.auth is not None and pair.owner.bulk is not None
    return pair.auth.connect_blocking(pair.owner.bulk.address, 5)


def ask(sock: socket.socket, request: ReadRequest) -> int:
    """Send a read; the size the owner announces (raises what it refused with)."""
    sock.sendall(encode_read(1, request))
    length, status, _ = HEADER.unpack(exactly(sock, HEADER.size))
    return decode_sending(length, status, exactly(sock, length - (HEADER.size - 4)))


def exactly(sock: socket.socket, size: int) -> bytes:
    out = bytearray()
    while len(out) < size:
        chunk = sock.recv(size - len(out))
        if not chunk:
            raise ConnectionResetError("closed")
        out += chunk
    return bytes(out)


def received(sock: socket.socket, limit: int) -> bytes:
    """Whatever arrives until the owner closes (or ``limit`` bytes)."""
    out = bytearray()
    sock.settimeout(10)
    try:
        while len(out) < limit and (chunk := sock.recv(min(1 << 20, limit - len(out)))):
            out += chunk
    except ConnectionResetError:
        pass
    return bytes(out)


def test_the_bytes_cross_the_wire_and_the_path_says_so(pair: AgentPair) -> None:
    data = payload(8 * MiB)
    handle = pair.put(data)
    assert pair.fetch(handle) == data
    assert pair.consumer_paths() == {"wire/ok": 1}
    assert pair.owner_paths() == {"wire/ok": 1}
    moved = pair.consumer.core.metrics.snapshot()["velo_bytes_moved_total"]
    assert moved == {"wire": 8 * MiB}
    assert pair.owner.info()["live_slots"] == 0


def test_with_ucx_too_a_registered_slot_takes_a_get_and_a_plain_one_the_wire(
    tmp_path: Path,
) -> None:
    with AgentPair(tmp_path / "shm", wire=True) as pair:
        pinned, plain = payload(4 * MiB, 1), payload(4 * MiB, 2)
        assert pair.fetch(pair.put(pinned)) == pinned
        assert pair.fetch(pair.put(plain, pinned=False)) == plain
        assert pair.consumer_paths() == {"rdma/ok": 1, "wire/ok": 1}
        assert pair.owner.owner.windowed_leases == 0  # nothing registered for the plain one
        pair.validate()


def test_a_lease_that_ends_mid_send_never_lets_the_next_payload_reach_the_reader(
    pair: AgentPair,
) -> None:
    """The owner is the sender: a reader takes the first bytes of a 64 MiB range and stops
    reading; the handle's TTL fires (its lease ends with it) and a new payload of 0x42 is
    staged. The send stops at its next piece: the reader sees the connection end before the
    range did, and every byte it got is the old payload's."""
    old = np.full(64 * MiB, 0x41, np.uint8)
    handle = pair.put(old, ttl=5.0)
    lease = wire_lease(pair, handle)
    sock = connect(pair)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    assert ask(sock, ReadRequest(handle, lease, 0, 64 * MiB)) == 64 * MiB
    first = exactly(sock, 1 * MiB)
    pair.tick(6.0)  # the TTL fires: the handle and its wire lease end
    with pytest.raises(HandleNotFound):
        pair.owner.owner._rv_metadata(encode(MetadataRequest(handle)))
    fresh = pair.put(np.full(64 * MiB, 0x42, np.uint8))
    rest = received(sock, 64 * MiB)
    sock.close()
    got = first + rest
    assert len(got) < 64 * MiB, "the send went on past the end of its lease"
    assert set(got) == {0x41}, "a byte of the payload staged after the lease ended arrived"
    wait_for(lambda: pair.owner.bulk is not None and pair.owner.bulk.aborted == 1)
    assert pair.fetch(fresh) == bytes(np.full(64 * MiB, 0x42, np.uint8))


def test_a_jobs_end_mid_send_ends_the_send_and_the_reader_falls_back_once(
    pair: AgentPair, pool: ThreadPoolExecutor
) -> None:
    """The consumer's own fetch, its send held after the first piece: the Ray job that
    staged the payload ends meanwhile (its handle and wire lease with it), so the read
    stops, the fetch falls back to chunks once and finds the handle gone. It raises; it
    never returns bytes staged after."""
    job = "0a000000"
    handle = pair.put(payload(32 * MiB), job=job)
    pair.owner.inject_fault("stall_sends_s", 1.0)
    fetched: Future[bytes] = pool.submit(pair.fetch, handle, "detach")
    wait_for(lambda: pair.owner.core.state.counts().wire_leases == 1)
    pair.jobs.end(job)
    pair.tick(JOB_POLL_S)
    assert pair.owner.core.state.counts().wire_leases == 0
    pair.put(payload(32 * MiB, 9))
    with pytest.raises(HandleNotFound, match="job ended"):
        fetched.result(20)
    assert pair.consumer_paths() == {"chunked/get_failed": 1}


def test_a_read_outside_its_lease_is_refused(pair: AgentPair) -> None:
    """Ranges past the payload, another handle's lease, a chunked lease, a lease that never
    was, and a copy this agent does not hold: each refused with the reason, nothing sent."""
    a, b = pair.put(payload(4 * MiB, 1)), pair.put(payload(4 * MiB, 2))
    lease_a = wire_lease(pair, a)
    chunked = decode_acquire_response(
        pair.owner.owner._rv_acquire(encode(AcquireRequest(b, lease_ms=5000)))
    ).lease_id
    sock = connect(pair)
    refused: list[tuple[ReadRequest, type[VeloError]]] = [
        (ReadRequest(a, lease_a, 0, 4 * MiB + 1), ProtocolError),
        (ReadRequest(b, lease_a, 0, 1 * MiB), LeaseNotFound),
        (ReadRequest(b, chunked, 0, 1 * MiB), LeaseNotFound),
        (ReadRequest(a, lease_a ^ 1, 0, 1 * MiB), LeaseNotFound),
        (ReadRequest(a, lease_a, 0, 1 * MiB, copy=True), LeaseNotFound),
    ]
    for request, error in refused:
        with pytest.raises(error):
            ask(sock, request)
    assert ask(sock, ReadRequest(a, lease_a, 0, 1 * MiB)) == 1 * MiB  # the same connection
    assert exactly(sock, 1 * MiB) == payload(4 * MiB, 1)[: 1 * MiB]
    sock.close()
    for handle, lease in ((a, lease_a), (b, chunked)):
        pair.owner.owner._rv_release(encode(ReleaseRequest(handle, lease)))


def test_a_sender_that_stalls_ends_in_the_readers_bound_and_one_fallback(tmp_path: Path) -> None:
    config = default_config().replace(wire_stall_s=0.5)
    with AgentPair(tmp_path / "shm", config=config, rdma=False, wire=True) as pair:
        data = payload(16 * MiB)
        handle = pair.put(data)
        pair.owner.inject_fault("stall_sends_s", 3.0)
        started = time.monotonic()
        assert pair.fetch(handle) == data
        assert time.monotonic() - started < 3.0
        assert pair.consumer_paths() == {"chunked/get_failed": 1}
        assert pair.owner_paths() == {"wire/ok": 1, "chunked/no_offer": 1}
        pair.validate()
        assert pair.owner.info()["live_slots"] == 0


def test_a_failed_read_falls_back_to_chunks_exactly_once(pair: AgentPair) -> None:
    data = payload(8 * MiB)
    pair.consumer.inject_fault("fail_gets", 1)
    assert pair.fetch(pair.put(data)) == data
    assert pair.consumer_paths() == {"chunked/get_failed": 1}


def test_a_producer_still_writing_is_sent_each_piece_once_written(
    pair: AgentPair, pool: ThreadPoolExecutor
) -> None:
    """Streamed staging: the consumer is answered at once (it reads over the wire) and the
    owner sends each piece only once its producer wrote it; the slot's 0xEE filler (what an
    early read would see) never arrives."""
    data = payload(32 * MiB)
    producer = Producer(pair, data)
    fetched: Future[bytes] = pool.submit(pair.fetch, producer.handle, "detach")
    wait_for(lambda: pair.owner.core.state.counts().wire_leases == 1)
    for upto in range(8 * MiB, 33 * MiB, 8 * MiB):
        time.sleep(0.05)
        producer.write(upto)
    assert fetched.result(20) == data
    assert pair.consumer_paths() == {"wire/ok": 1}


def test_an_agent_shutting_down_mid_send_stops_it_and_leaks_nothing(tmp_path: Path) -> None:
    pair = AgentPair(tmp_path / "shm", rdma=False, wire=True)
    try:
        handle = pair.put(payload(32 * MiB))
        lease = wire_lease(pair, handle)
        sock = connect(pair)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        assert ask(sock, ReadRequest(handle, lease, 0, 32 * MiB)) == 32 * MiB
        closing = threading.Thread(target=pair.owner.shutdown, args=(1.0,))
        with pair.clock.passing():  # the drain's bound is on the agent's clock
            closing.start()
            closing.join(20)  # the reader reads nothing meanwhile: the send is stuck
        assert not closing.is_alive()
        assert len(received(sock, 32 * MiB)) < 32 * MiB  # reset mid-range
        sock.close()
    finally:
        pair.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("ray_velo-bulk")]
