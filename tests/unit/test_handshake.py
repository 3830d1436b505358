"""The wire handshake's bytes (ray_velo.protocol.handshake): both ends prove they hold the
cluster's secret over both fresh nonces, and nothing but WireAuthError ever escapes it."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ray_velo.errors import WireAuthError
from ray_velo.protocol.handshake import (
    ACCEPTED_BYTES,
    CHALLENGE_BYTES,
    HELLO_BYTES,
    MAGIC,
    NONCE_BYTES,
    PROOF_BYTES,
    ClientHandshake,
    ServerHandshake,
)

SECRET = bytes(range(32))
OTHER = bytes(range(1, 33))


def nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def run(client_secret: bytes, server_secret: bytes) -> tuple[bytes, bytes, bytes, bytes]:
    """A whole handshake; its four messages."""
    client, server = (
        ClientHandshake(client_secret, nonce()),
        ServerHandshake(server_secret, nonce()),
    )
    hello = client.hello()
    challenge = server.challenge(hello)
    proof = client.prove(challenge)
    accepted = server.accept(proof)
    client.accepted(accepted)
    return hello, challenge, proof, accepted


def test_agents_of_one_cluster_complete_it() -> None:
    """Two agents with the same secret: four fixed-size messages, and neither holds back."""
    messages = run(SECRET, SECRET)
    assert [len(m) for m in messages] == [HELLO_BYTES, CHALLENGE_BYTES, PROOF_BYTES, ACCEPTED_BYTES]


def test_the_secret_never_crosses_the_wire() -> None:
    """No message carries the secret, or any 8-byte piece of it."""
    wire = b"".join(run(SECRET, SECRET))
    assert all(SECRET[i : i + 8] not in wire for i in range(len(SECRET) - 7))


def test_a_consumer_without_the_secret_is_refused_by_the_owner() -> None:
    """A peer outside the cluster (another secret) gets a challenge, and its proof fails."""
    client, server = ClientHandshake(OTHER, nonce()), ServerHandshake(SECRET, nonce())
    challenge = server.challenge(client.hello())
    with pytest.raises(WireAuthError) as info:
        client.prove(challenge)  # the consumer sees first that the owner is not its cluster's
    assert info.value.fields["reason"] == "bad_proof"
    forged = ClientHandshake(OTHER, nonce())
    server = ServerHandshake(SECRET, nonce())
    server.challenge(forged.hello())
    with pytest.raises(WireAuthError) as info:
        server.accept(os.urandom(PROOF_BYTES))
    assert info.value.fields["reason"] == "bad_proof"


def test_a_fake_owner_is_never_trusted() -> None:
    """An owner without the secret answers the hello with a challenge of its own making: the
    consumer refuses it before it sends its proof (or any frame)."""
    client = ClientHandshake(SECRET, nonce())
    fake = ServerHandshake(OTHER, nonce())
    with pytest.raises(WireAuthError) as info:
        client.prove(fake.challenge(client.hello()))
    assert info.value.fields["reason"] == "bad_proof"


def test_a_replayed_transcript_fails() -> None:
    """A recorded hello and proof, replayed to the owner: its nonce is new, the proof fails."""
    hello, _, proof, _ = run(SECRET, SECRET)
    server = ServerHandshake(SECRET, nonce())
    server.challenge(hello)
    with pytest.raises(WireAuthError) as info:
        server.accept(proof)
    assert info.value.fields["reason"] == "bad_proof"


def test_the_owners_proof_cannot_be_reflected_as_the_consumers() -> None:
    """A peer that sends back the owner's own proof as its proof is refused (the proofs carry
    different labels), even with the owner's nonce echoed as its own."""
    server_nonce = nonce()
    server = ServerHandshake(SECRET, server_nonce)
    challenge = server.challenge(MAGIC + server_nonce)
    with pytest.raises(WireAuthError) as info:
        server.accept(challenge[len(MAGIC) + NONCE_BYTES :])
    assert info.value.fields["reason"] == "bad_proof"


def test_a_proof_before_any_challenge_is_malformed() -> None:
    with pytest.raises(WireAuthError) as info:
        ServerHandshake(SECRET, nonce()).accept(bytes(PROOF_BYTES))
    assert info.value.fields["reason"] == "malformed"


def test_secrets_and_nonces_of_the_wrong_size_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 16 bytes"):
        ServerHandshake(b"short", nonce())
    with pytest.raises(ValueError, match="32 bytes"):
        ClientHandshake(SECRET, b"nonce")


@given(st.binary(max_size=2 * CHALLENGE_BYTES))
def test_any_bytes_from_a_peer_raise_only_wire_auth_errors(data: bytes) -> None:
    """Whatever a peer sends in place of each message: a WireAuthError or (only for the real
    message) success; never another exception."""
    server = ServerHandshake(SECRET, nonce())
    client = ClientHandshake(SECRET, nonce())
    for step in (server.challenge, server.accept, client.prove, client.accepted):
        try:
            step(data)
        except WireAuthError as exc:
            assert exc.fields["reason"] in ("malformed", "bad_proof")


@given(st.integers(0, HELLO_BYTES - 1), st.integers(1, 255))
def test_a_hello_with_any_byte_changed_still_gets_a_challenge_only_if_its_magic_holds(
    index: int, flip: int
) -> None:
    """The hello's nonce is the consumer's to choose; its magic is not."""
    hello = bytearray(ClientHandshake(SECRET, nonce()).hello())
    hello[index] ^= flip
    server = ServerHandshake(SECRET, nonce())
    if index < len(MAGIC):
        with pytest.raises(WireAuthError):
            server.challenge(bytes(hello))
    else:
        assert len(server.challenge(bytes(hello))) == CHALLENGE_BYTES
