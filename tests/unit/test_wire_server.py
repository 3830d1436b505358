"""The agents' TCP wire (ray_velo.wire.server, ray_velo.wire.auth): no handler runs for a peer
that has not proved it holds the cluster's secret; a silent or failed peer is closed within
the handshake's bound and counted; a flood of silent connections does not starve a real
peer; under TLS the wire uses the cluster's certificates, mutually verified.

Real TCP sockets on loopback and a server on an event loop thread of this process; the
handlers are a recording stand-in (the fuzz of the real owner's handlers is in
test_wire_fuzz.py). No Ray."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ray_velo.consumer.relay import RelayLink
from ray_velo.errors import HandleNotFound, WireAuthError
from ray_velo.protocol.entry import BY_NAME, RV_METADATA
from ray_velo.protocol.frames import WIRE_METHODS, encode_request
from ray_velo.protocol.handshake import CHALLENGE_BYTES, MAGIC, NONCE_BYTES, ClientHandshake
from ray_velo.testbed.security import make_tls_files
from ray_velo.wire.auth import TlsFiles, WireAuth
from ray_velo.wire.server import WireServer
from tests.strangers import wire_outcome

SECRET = os.urandom(32)
#: A short handshake bound, so the tests of silent peers finish quickly.
BOUND_S = 0.3


class LoopThread:
    """An event loop on a thread of its own, as the agent's."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 20.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class Owner:
    """A wire server whose handlers record what ran; its refusals by reason."""

    def __init__(
        self,
        loop: LoopThread,
        secret: bytes = SECRET,
        tls: TlsFiles | None = None,
        max_pending: int = 64,
    ) -> None:
        self.loop = loop
        self.ran: list[str] = []
        self.refused: list[str] = []
        self.auth = WireAuth(secret, tls, self.refused.append)

        async def dispatch(method: str, message: bytes) -> Any:
            self.ran.append(method)
            if message == b"missing":
                raise HandleNotFound(handle="h", reason="released by its last consumer")
            return message

        self.server = WireServer(
            "127.0.0.1", dispatch, self.auth, handshake_timeout_s=BOUND_S, max_pending=max_pending
        )
        loop.run(self.server.start())

    @property
    def address(self) -> str:
        return self.server.address

    def close(self) -> None:
        self.loop.run(self.server.close())


@pytest.fixture()
def loop() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.stop()


@pytest.fixture()
def owner(loop: LoopThread) -> Iterator[Owner]:
    served = Owner(loop)
    yield served
    served.close()


def raw(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=5)


def closed_without_answer(sock: socket.socket, within_s: float) -> bool:
    """Whether the owner closes ``sock`` within ``within_s`` with no answer frame."""
    return wire_outcome(sock, within_s) == "closed"


def wait_for(condition: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def call(link: RelayLink, method: str, message: bytes) -> Any:
    return link.call(BY_NAME[method], message, 5.0)


# --- the door is closed to strangers -----------------------------------------------------


def test_an_agent_of_the_cluster_is_served(owner: Owner) -> None:
    """A consumer with the cluster's secret: its calls run and come back, errors included."""
    link = RelayLink(owner.address, WireAuth(SECRET))
    try:
        assert call(link, "_rv_metadata", b"hi") == b"hi"
        with pytest.raises(HandleNotFound):
            call(link, "_rv_release", b"missing")
    finally:
        link.close()
    assert owner.ran == ["_rv_metadata", "_rv_release"]
    assert owner.refused == []
    assert owner.server.peers == 1


@pytest.mark.parametrize("method", WIRE_METHODS)
def test_every_method_sent_without_a_handshake_is_closed_unanswered(
    owner: Owner, method: str
) -> None:
    """A process without the secret sends a well-formed request frame of each wire method as
    its first bytes: closed within the bound, no handler ran, counted as malformed (the
    frame's first bytes are not the handshake's) or silent (it is shorter than a hello)."""
    sock = raw(owner.address)
    try:
        sock.sendall(encode_request(method, 1, b"\x81\xa6handle\x82\xa2hi\x01\xa2lo\x01"))
        assert closed_without_answer(sock, 2 + BOUND_S)
    finally:
        sock.close()
    wait_for(lambda: len(owner.refused) == 1)
    assert owner.ran == []
    assert owner.refused[0] in ("malformed", "silent")


def test_frames_after_a_failed_handshake_are_never_read(owner: Owner) -> None:
    """A peer with the wrong secret completes the handshake's shape (hello, a proof) and then
    sends every wire method: the owner closes it after the proof, no handler ran."""
    sock = raw(owner.address)
    try:
        client = ClientHandshake(os.urandom(32), os.urandom(NONCE_BYTES))
        sock.sendall(client.hello())
        challenge = _receive(sock, CHALLENGE_BYTES)
        assert challenge.startswith(MAGIC)
        frames = b"".join(encode_request(m, i + 1, b"\x80") for i, m in enumerate(WIRE_METHODS))
        sock.sendall(os.urandom(32) + frames)
        assert closed_without_answer(sock, 2 + BOUND_S)
    finally:
        sock.close()
    wait_for(lambda: owner.refused == ["bad_proof"])
    assert owner.ran == []


def test_a_peer_that_says_nothing_is_closed_within_the_bound(owner: Owner) -> None:
    """A connection that sends nothing, and one that sends its hello and then nothing (a
    half-open handshake held open): both are closed about one bound later, counted silent."""
    quiet, half = raw(owner.address), raw(owner.address)
    try:
        half.sendall(ClientHandshake(SECRET, os.urandom(NONCE_BYTES)).hello())
        started = time.monotonic()
        assert closed_without_answer(quiet, 5.0)
        assert closed_without_answer(half, 5.0)
        assert time.monotonic() - started < BOUND_S + 2.0
    finally:
        quiet.close()
        half.close()
    wait_for(lambda: len(owner.refused) == 2)
    assert owner.refused == ["silent", "silent"]
    assert owner.ran == []


def test_a_fake_owner_gets_no_frame(loop: LoopThread) -> None:
    """An owner that does not hold the cluster's secret: the consumer refuses it at its
    challenge and sends it nothing but the hello; the refusal is counted on the consumer."""
    fake = Owner(loop, secret=os.urandom(32))
    consumer_refused: list[str] = []
    link = RelayLink(fake.address, WireAuth(SECRET, on_refusal=consumer_refused.append))
    try:
        with pytest.raises(WireAuthError) as info:
            call(link, "_rv_release", b"a handle")
        assert info.value.fields["reason"] == "bad_proof"
    finally:
        link.close()
        fake.close()
    assert consumer_refused == ["bad_proof"]
    assert fake.ran == []


def test_a_flood_of_silent_connections_does_not_starve_a_real_peer(loop: LoopThread) -> None:
    """200 connections that never speak, opened at once against an owner that holds at most
    16 handshakes pending (with the real 2 s bound): each real consumer that connects
    meanwhile is served at once (the oldest silent ones are dropped for it), never more than
    16 wait, and every silent one is closed and counted."""
    owner = Owner(loop, max_pending=16)
    owner.server._handshake_timeout_s = 2.0
    flood = [raw(owner.address) for _ in range(200)]
    try:
        wait_for(lambda: owner.server.pending_handshakes == 16)
        for _ in range(5):
            link = RelayLink(owner.address, WireAuth(SECRET))
            started = time.monotonic()
            try:
                assert call(link, "_rv_metadata", b"real") == b"real"
            finally:
                link.close()
            assert time.monotonic() - started < 1.0, "a real peer waited on the flood"
            assert owner.server.pending_handshakes <= 16
        for sock in flood:
            assert closed_without_answer(sock, 5.0)
    finally:
        for sock in flood:
            sock.close()
        wait_for(lambda: len(owner.refused) == 200)
        assert owner.server.pending_handshakes == 0
        owner.close()
    assert set(owner.refused) == {"dropped", "silent"}
    assert owner.refused.count("silent") <= 16 + 5
    assert owner.ran == ["_rv_metadata"] * 5


def test_a_refused_address_is_logged_once(owner: Owner, caplog: pytest.LogCaptureFixture) -> None:
    """Three failures from one address: three counted, one warning naming it."""
    for _ in range(3):
        sock = raw(owner.address)
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(16))
        assert closed_without_answer(sock, 2 + BOUND_S)
        sock.close()
    wait_for(lambda: len(owner.refused) == 3)
    warnings = [r for r in caplog.records if "wire handshake" in r.getMessage()]
    assert len(warnings) == 1 and "127.0.0.1" in warnings[0].getMessage()


# --- TLS where Ray uses TLS --------------------------------------------------------------


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> tuple[TlsFiles, TlsFiles]:
    """Two throwaway CAs: a node certificate of the cluster's, and one of a stranger's."""
    ours = make_tls_files(str(tmp_path_factory.mktemp("ours")), ["127.0.0.1"])[0]
    theirs = make_tls_files(str(tmp_path_factory.mktemp("theirs")), ["127.0.0.1"])[0]
    return ours, theirs


def test_under_tls_agents_of_the_cluster_are_served(
    loop: LoopThread, certificates: tuple[TlsFiles, TlsFiles]
) -> None:
    """Both ends with the cluster's certificates and secret: the call is served over TLS."""
    ours, _ = certificates
    owner = Owner(loop, tls=ours)
    link = RelayLink(owner.address, WireAuth(SECRET, ours))
    try:
        assert call(link, "_rv_metadata", b"over tls") == b"over tls"
        assert isinstance(link._sock, ssl.SSLSocket)
        assert link._sock.version() in ("TLSv1.2", "TLSv1.3")
    finally:
        link.close()
        owner.close()
    assert owner.ran == ["_rv_metadata"] and owner.refused == []


def test_under_tls_plain_and_foreign_peers_are_refused(
    loop: LoopThread, certificates: tuple[TlsFiles, TlsFiles]
) -> None:
    """An owner under TLS: a plain-TCP peer (even with the secret) and a peer whose
    certificate another CA signed are closed at TLS, no handler ran; and a consumer refuses
    an owner whose certificate it cannot verify."""
    ours, theirs = certificates
    owner = Owner(loop, tls=ours)
    try:
        for auth in (WireAuth(SECRET), WireAuth(SECRET, theirs)):
            with pytest.raises((WireAuthError, OSError)):
                RelayLink(owner.address, auth).call(RV_METADATA, b"x", 5.0)
        wait_for(lambda: len(owner.refused) == 2)
        assert owner.refused == ["tls", "tls"]
    finally:
        owner.close()
    stranger = Owner(loop, tls=theirs)
    refused: list[str] = []
    try:
        with pytest.raises(WireAuthError) as info:
            RelayLink(stranger.address, WireAuth(SECRET, ours, refused.append)).call(
                RV_METADATA, b"x", 5.0
            )
        assert info.value.fields["reason"] == "tls"
        assert refused == ["tls"]
    finally:
        stranger.close()
    assert owner.ran == [] and stranger.ran == []


def test_tls_files_that_do_not_load_are_a_config_error(tmp_path: Path) -> None:
    """RAY_USE_TLS=1 with a missing variable or an unreadable file: a ConfigError naming it."""
    from ray_velo.errors import ConfigError

    with pytest.raises(ConfigError, match="RAY_TLS_SERVER_KEY"):
        WireAuth.from_environment(
            SECRET, {"RAY_USE_TLS": "1", "RAY_TLS_SERVER_CERT": "c", "RAY_TLS_CA_CERT": "a"}
        )
    missing = TlsFiles(str(tmp_path / "c"), str(tmp_path / "k"), str(tmp_path / "a"))
    with pytest.raises(ConfigError, match="RAY_TLS_SERVER_CERT"):
        WireAuth(SECRET, missing)
    assert WireAuth.from_environment(SECRET, {"RAY_USE_TLS": "0"}).tls is None


# --- the consumer's asyncio link ---------------------------------------------------------


def test_the_consumers_owner_link_uses_ray_calls_after_a_fake_owner(loop: LoopThread) -> None:
    """WireOwnerLink to an owner that fails the handshake: it is never called there again
    (the link is disabled: Ray calls from then on) and the refusal is counted."""
    from ray_velo.agent.clock import Clock
    from ray_velo.consumer.links import WireOwnerLink

    fake = Owner(loop, secret=os.urandom(32))
    refused: list[str] = []
    link = WireOwnerLink(_NoRay(), fake.address, WireAuth(SECRET, on_refusal=refused.append))  # type: ignore[arg-type]
    try:
        connected = loop.run(link._connected(Clock().deadline(5.0)))
        assert connected is False and link.disabled
    finally:
        fake.close()
    assert refused == ["bad_proof"] and fake.ran == []


class _NoRay:
    node = "node-a"


def _receive(sock: socket.socket, size: int) -> bytes:
    out = b""
    while len(out) < size:
        chunk = sock.recv(size - len(out))
        assert chunk, "closed early"
        out += chunk
    return out


def test_under_rays_tls_an_agent_says_ucx_tcp_payloads_travel_in_clear() -> None:
    """Ray's TLS covers Ray's traffic and the wire, not UCX's TCP transport: an agent whose
    UCX the operator let use tcp says so at start; one without TLS, or whose UCX uses no tcp
    (the default), does not."""
    from ray_velo.actors.agent import _warn_cleartext_payloads

    assert not _warn_cleartext_payloads(False, {"RAY_USE_TLS": "1"})
    assert not _warn_cleartext_payloads(True, {})
    assert _warn_cleartext_payloads(True, {"RAY_USE_TLS": "1"})
    assert _warn_cleartext_payloads(True, {"RAY_USE_TLS": "true"})
