"""The bulk port and its reader (ray_velo.wire.bulk, ray_velo.consumer.bulk) on real loopback
sockets: bytes move exactly, whole or striped; a peer without the secret, a silent one, a
flood of them and a stream of garbage are closed with nothing read or sent; a refusal
reaches the reader as the owner's error; a sender that stops or stalls mid-range ends the
read within its bound, and nothing of it is used; under TLS the same holds. The sends here
come from a stand-in opener (the owner's real one is in test_pair_wire.py). No Ray."""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ray_velo.consumer.bulk import BulkReader, stripes
from ray_velo.errors import LeaseNotFound, WireAuthError, WireReadError
from ray_velo.protocol import DataHandle, ReadRequest
from ray_velo.protocol.bulk import HEADER
from ray_velo.protocol.handshake import ClientHandshake
from ray_velo.testbed.security import make_tls_files
from ray_velo.wire.auth import TlsFiles, WireAuth
from ray_velo.wire.bulk import BulkServer
from tests.strangers import wire_outcome

SECRET = os.urandom(32)
HANDLE = DataHandle(0xAB, 7, "node-a")
PAYLOAD = bytes((i * 7) % 251 for i in range(9 << 20))
BOUND_S = 0.3


class Served:
    """A send of PAYLOAD's range in 1 MiB pieces; ``stop_after``: raise after that many
    pieces (the lease ended); ``stall_after``: sleep that long after the first piece."""

    def __init__(self, request: ReadRequest, owner: Owner) -> None:
        self.request, self.owner = request, owner

    def pieces(self) -> Iterator[memoryview]:
        view = memoryview(PAYLOAD)
        for index, at in enumerate(range(self.request.start, self.request.stop, 1 << 20)):
            if index == self.owner.stop_after:
                raise LeaseNotFound(handle=str(HANDLE), lease_id=self.request.lease_id)
            if index == 1 and self.owner.stall_s:
                time.sleep(self.owner.stall_s)
            yield view[at : min(self.request.stop, at + (1 << 20))]

    def close(self) -> None:
        self.owner.closed += 1


class Owner:
    """A bulk port serving PAYLOAD to lease 21; records refusals and closed sends."""

    def __init__(self, secret: bytes = SECRET, tls: TlsFiles | None = None, **bounds: float):
        self.refusals: list[str] = []
        self.auth = WireAuth(secret, tls, self.refusals.append)
        self.stop_after: int | None = None
        self.stall_s = 0.0
        self.closed = 0
        self.opened = 0
        self.server = BulkServer(
            "127.0.0.1", self.auth, self.open, handshake_timeout_s=BOUND_S, **bounds
        )  # type: ignore[arg-type]

    def open(self, request: ReadRequest) -> Served:
        self.opened += 1
        if request.lease_id != 21 or request.stop > len(PAYLOAD):
            raise LeaseNotFound(handle=str(request.handle), lease_id=request.lease_id)
        return Served(request, self)


@pytest.fixture()
def owner() -> Iterator[Owner]:
    served = Owner()
    yield served
    served.server.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("ray_velo-bulk")]


def eventually(condition: object, timeout_s: float = 5.0) -> None:
    """Wait (bounded) for ``condition()``: the owner counts a send once its thread ends it,
    a moment after the reader has its bytes."""
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "not within the bound"
        time.sleep(0.01)


def read(reader: BulkReader, owner: Owner, start: int, stop: int, lease: int = 21) -> bytes:
    dest = bytearray(stop - start)
    reader.read(owner.server.address, ReadRequest(HANDLE, lease, start, stop), memoryview(dest), 5)
    return bytes(dest)


def test_a_range_arrives_exactly_and_the_connection_is_kept(owner: Owner) -> None:
    reader = BulkReader(WireAuth(SECRET))
    try:
        assert read(reader, owner, 0, len(PAYLOAD)) == PAYLOAD
        assert read(reader, owner, 12345, 3 << 20) == PAYLOAD[12345 : 3 << 20]
        assert owner.server.connections == 1  # the second read reused the first connection
        eventually(lambda: owner.server.reads == 2)
        assert owner.server.bytes_sent == len(PAYLOAD) + (3 << 20) - 12345
        assert owner.closed == 2
    finally:
        reader.close()


def test_a_striped_read_reassembles_over_several_connections(owner: Owner) -> None:
    reader = BulkReader(WireAuth(SECRET), streams=3, stripe_min_bytes=1 << 20)
    try:
        assert read(reader, owner, 1000, len(PAYLOAD)) == PAYLOAD[1000:]
        eventually(lambda: owner.server.reads == 3)
        assert owner.server.connections == 3
    finally:
        reader.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("ray_velo-bulk-read")]


@pytest.mark.parametrize(("start", "stop", "count"), [(0, 9 << 20, 3), (5, 3 << 20, 8), (0, 10, 4)])
def test_stripes_cover_the_range_at_aligned_cuts(start: int, stop: int, count: int) -> None:
    parts = stripes(start, stop, count)
    assert parts[0][0] == start and parts[-1][1] == stop and len(parts) <= count
    assert all(a[1] == b[0] for a, b in itertools.pairwise(parts))
    assert all((a - start) % (1 << 20) == 0 for a, _ in parts)


def test_a_refused_read_raises_the_owners_error_and_keeps_the_connection(owner: Owner) -> None:
    reader = BulkReader(WireAuth(SECRET))
    try:
        with pytest.raises(LeaseNotFound):
            read(reader, owner, 0, 1 << 20, lease=99)
        with pytest.raises(LeaseNotFound):  # a range past the payload
            read(reader, owner, 0, len(PAYLOAD) + 1)
        assert read(reader, owner, 0, 1 << 20) == PAYLOAD[: 1 << 20]
        assert owner.server.connections == 1
    finally:
        reader.close()


def test_a_sender_that_stops_mid_range_fails_the_read_and_the_next_one_works(
    owner: Owner,
) -> None:
    """The owner's lease ended after two pieces: it resets the connection, the reader gets
    fewer bytes than announced and says so; the connection is not reused."""
    reader = BulkReader(WireAuth(SECRET))
    owner.stop_after = 2
    try:
        with pytest.raises(WireReadError) as caught:
            read(reader, owner, 0, len(PAYLOAD))
        assert caught.value.fields["got"] <= 2 << 20 and "stopped coming" in str(caught.value)
        eventually(lambda: owner.server.aborted == 1 and owner.closed == 1)
        owner.stop_after = None
        assert read(reader, owner, 0, 2 << 20) == PAYLOAD[: 2 << 20]
    finally:
        reader.close()


def test_a_sender_that_stalls_ends_the_read_within_its_stall_bound(owner: Owner) -> None:
    reader = BulkReader(WireAuth(SECRET), stall_s=0.5)
    owner.stall_s = 3.0
    try:
        started = time.monotonic()
        with pytest.raises(WireReadError) as caught:
            read(reader, owner, 0, len(PAYLOAD))
        assert time.monotonic() - started < 2.5
        assert "stopped coming" in str(caught.value)
    finally:
        reader.close()


def test_a_reader_that_stops_reading_is_cut_off_by_the_send_bound() -> None:
    """A consumer that takes the header and reads no further holds the send at most
    ``send_stall_s``: then the owner resets it and the send's bytes go back."""
    owner = Owner(send_stall_s=0.5)
    try:
        sock = authenticated(owner.server.address)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        frame = ReadRequest(HANDLE, 21, 0, len(PAYLOAD))
        from ray_velo.protocol.bulk import encode_read

        sock.sendall(encode_read(1, frame))
        deadline = time.monotonic() + 10
        while owner.closed == 0:
            assert time.monotonic() < deadline, "the stalled send was never cut off"
            time.sleep(0.05)
        assert owner.server.aborted == 1
        sock.close()
    finally:
        owner.server.close()


def test_a_kept_connection_the_owner_closed_is_replaced_once() -> None:
    owner = Owner(idle_s=0.2)
    reader = BulkReader(WireAuth(SECRET))
    try:
        assert read(reader, owner, 0, 1 << 20) == PAYLOAD[: 1 << 20]
        time.sleep(0.6)  # the owner closed the idle connection
        assert read(reader, owner, 0, 1 << 20) == PAYLOAD[: 1 << 20]
    finally:
        reader.close()
        owner.server.close()


# --- strangers -----------------------------------------------------------------------------


def authenticated(address: str, secret: bytes = SECRET) -> socket.socket:
    return WireAuth(secret).connect_blocking(address, 5)


def test_a_peer_without_the_secret_gets_no_byte(owner: Owner) -> None:
    with pytest.raises(WireAuthError):
        BulkReader(WireAuth(os.urandom(32))).read(
            owner.server.address, ReadRequest(HANDLE, 21, 0, 100), memoryview(bytearray(100)), 5
        )
    host, port = owner.server.address.split(":")
    raw = socket.create_connection((host, int(port)))
    hello = ClientHandshake(os.urandom(32), os.urandom(32)).hello()
    raw.sendall(hello + b"\x00" * 32 + struct.pack("!IBQ", 20, 0, 1) + b"x" * 20)
    assert wire_outcome(raw, 5) == "closed"
    raw.close()
    assert owner.opened == 0
    eventually(lambda: "bad_proof" in owner.refusals or "closed" in owner.refusals)


def test_a_silent_peer_is_closed_within_the_handshake_bound(owner: Owner) -> None:
    host, port = owner.server.address.split(":")
    raw = socket.create_connection((host, int(port)))
    started = time.monotonic()
    assert wire_outcome(raw, 5) == "closed"
    assert time.monotonic() - started < 3
    raw.close()
    eventually(lambda: "silent" in owner.refusals)


def test_a_flood_of_silent_connections_drops_the_oldest_not_a_real_peer() -> None:
    owner = Owner(max_pending=4)
    owner.server._handshake_timeout_s = 30.0  # they would wait: only the bound drops them
    host, port = owner.server.address.split(":")
    flood = [socket.create_connection((host, int(port))) for _ in range(8)]
    reader = BulkReader(WireAuth(SECRET))
    try:
        assert read(reader, owner, 0, 1 << 20) == PAYLOAD[: 1 << 20]
        eventually(lambda: owner.refusals.count("dropped") >= 4)
    finally:
        reader.close()
        for sock in flood:
            sock.close()
        owner.server.close()


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.binary(min_size=1, max_size=200))
def test_garbage_after_the_handshake_opens_no_send(owner: Owner, garbage: bytes) -> None:
    before = owner.opened
    sock = authenticated(owner.server.address)
    try:
        with contextlib.suppress(OSError):  # the owner may have reset it already
            sock.sendall(garbage)
            sock.shutdown(socket.SHUT_WR)
        outcome = wire_outcome(sock, 5)
    finally:
        sock.close()
    if owner.opened > before:  # it happened to be a well-formed request: refused or served
        return
    assert outcome == "closed" or outcome.startswith("answered")


def test_a_replayed_or_reflected_handshake_is_closed(owner: Owner) -> None:
    """A recorded consumer transcript replayed on a new connection fails (the owner's nonce
    is fresh); the owner's own proof sent back fails too (the labels differ)."""
    host, port = owner.server.address.split(":")
    first = socket.create_connection((host, int(port)))
    client = ClientHandshake(SECRET, os.urandom(32))
    first.sendall(client.hello())
    challenge = first.recv(68)
    proof = client.prove(challenge)
    first.close()
    replay = socket.create_connection((host, int(port)))
    replay.sendall(client.hello() + proof)
    assert wire_outcome(replay, 5) == "closed"
    replay.close()
    reflect = socket.create_connection((host, int(port)))
    reflect.sendall(client.hello())
    server_proof = reflect.recv(68)[36:]
    reflect.sendall(server_proof)
    assert wire_outcome(reflect, 5) == "closed"
    reflect.close()
    assert owner.opened == 0


def test_no_header_of_a_request_is_read_before_the_handshake(owner: Owner) -> None:
    """A read request sent in place of the handshake is taken as a malformed hello."""
    from ray_velo.protocol.bulk import encode_read

    host, port = owner.server.address.split(":")
    raw = socket.create_connection((host, int(port)))
    raw.sendall(encode_read(1, ReadRequest(HANDLE, 21, 0, 1 << 20)).ljust(64, b"\x00"))
    assert wire_outcome(raw, 5) == "closed"
    raw.close()
    assert owner.opened == 0 and HEADER.size == 13


# --- TLS -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> list[TlsFiles]:
    pytest.importorskip("cryptography", reason="SKIPPED: TLS certificates need cryptography")
    return make_tls_files(str(tmp_path_factory.mktemp("tls")), ["127.0.0.1", "127.0.0.1"])


def test_under_tls_agents_of_the_cluster_read_and_a_plain_peer_is_refused(
    tls: list[TlsFiles], tmp_path: Path
) -> None:
    owner = Owner(tls=tls[0])
    reader = BulkReader(WireAuth(SECRET, tls[1]))
    try:
        assert read(reader, owner, 0, len(PAYLOAD)) == PAYLOAD
        with pytest.raises((WireAuthError, WireReadError)):  # the secret alone, no TLS
            BulkReader(WireAuth(SECRET)).read(
                owner.server.address, ReadRequest(HANDLE, 21, 0, 10), memoryview(bytearray(10)), 5
            )
        assert owner.opened == 1
        eventually(lambda: "tls" in owner.refusals)  # counted by the connection's thread
    finally:
        reader.close()
        owner.server.close()
