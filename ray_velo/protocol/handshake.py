"""The bytes of the agents' TCP wire handshake, by which both ends prove they hold the cluster's
secret; pure, raising only ``WireAuthError`` (docs/architecture.md §13)."""

from __future__ import annotations

import hashlib
import hmac

from ray_velo.errors import WireAuthError

__all__ = [
    "ACCEPTED_BYTES",
    "CHALLENGE_BYTES",
    "HELLO_BYTES",
    "MAGIC",
    "NONCE_BYTES",
    "PROOF_BYTES",
    "SECRET_BYTES",
    "WIRE_AUTH_REASONS",
    "ClientHandshake",
    "ServerHandshake",
]

#: The first bytes either side sends: "RVW" and the handshake's version.
MAGIC = b"RVW\x01"
NONCE_BYTES = 32
PROOF_BYTES = 32  # an HMAC-SHA256
#: The cluster secret's size (an HMAC key as long as its hash).
SECRET_BYTES = 32
HELLO_BYTES = len(MAGIC) + NONCE_BYTES
CHALLENGE_BYTES = len(MAGIC) + NONCE_BYTES + PROOF_BYTES
ACCEPTED_BYTES = len(MAGIC)
_SERVER_LABEL = b"ray_velo wire v1 server"
_CLIENT_LABEL = b"ray_velo wire v1 client"

#: Why a handshake failed (the ``reason`` label of ``velo_wire_auth_failures``):
#: ``malformed`` the bytes are not this handshake (another protocol, another version);
#: ``bad_proof`` a proof that does not verify (another secret, a replayed transcript);
#: ``silent`` the peer said nothing (or not enough) within the bound; ``closed`` it closed
#: mid-handshake; ``tls`` the TLS handshake failed (no certificate, an untrusted one, not TLS);
#: ``dropped`` the owner had too many handshakes pending and dropped the oldest.
WIRE_AUTH_REASONS = ("malformed", "bad_proof", "silent", "closed", "tls", "dropped")


def _proof(secret: bytes, label: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.digest(secret, label + client_nonce + server_nonce, hashlib.sha256)


class _Side:
    """What either side holds: the cluster secret and its own nonce."""

    def __init__(self, secret: bytes, nonce: bytes) -> None:
        if len(secret) < 16:
            raise ValueError(f"the wire secret must be at least 16 bytes, got {len(secret)}")
        if len(nonce) != NONCE_BYTES:
            raise ValueError(f"a handshake nonce is {NONCE_BYTES} bytes, got {len(nonce)}")
        self._secret = secret
        self._nonce = nonce


class ServerHandshake(_Side):
    """The owner's side: :meth:`challenge` answers the hello, :meth:`accept` the proof."""

    _client_nonce: bytes | None = None  # the consumer's, once its hello came

    def challenge(self, hello: bytes) -> bytes:
        """The CHALLENGE for a consumer's HELLO.

        Raises:
            WireAuthError: ``malformed``: not a HELLO of this version.
        """
        if len(hello) != HELLO_BYTES or not hello.startswith(MAGIC):
            raise WireAuthError(reason="malformed")
        self._client_nonce = bytes(hello[len(MAGIC) :])
        proof = _proof(self._secret, _SERVER_LABEL, self._client_nonce, self._nonce)
        return MAGIC + self._nonce + proof

    def accept(self, proof: bytes) -> bytes:
        """ACCEPTED, for a PROOF that verifies.

        Raises:
            WireAuthError: ``bad_proof``: the consumer does not hold the secret (or replays
                another connection's proof); ``malformed``: no challenge was made yet.
        """
        if self._client_nonce is None:
            raise WireAuthError(reason="malformed")
        expected = _proof(self._secret, _CLIENT_LABEL, self._client_nonce, self._nonce)
        if len(proof) != PROOF_BYTES or not hmac.compare_digest(expected, bytes(proof)):
            raise WireAuthError(reason="bad_proof")
        return MAGIC


class ClientHandshake(_Side):
    """The consumer's side: :meth:`hello`, then :meth:`prove` on the owner's challenge, then
    :meth:`accepted` on its last answer."""

    def hello(self) -> bytes:
        """The HELLO that opens the handshake."""
        return MAGIC + self._nonce

    def prove(self, challenge: bytes) -> bytes:
        """The PROOF answering the owner's CHALLENGE, once the owner proved it holds the
        secret.

        Raises:
            WireAuthError: ``malformed`` (not a CHALLENGE) or ``bad_proof`` (the owner does not
                hold the secret: a fake owner, or another cluster's agent).
        """
        if len(challenge) != CHALLENGE_BYTES or not challenge.startswith(MAGIC):
            raise WireAuthError(reason="malformed")
        server_nonce = bytes(challenge[len(MAGIC) : len(MAGIC) + NONCE_BYTES])
        got = bytes(challenge[len(MAGIC) + NONCE_BYTES :])
        expected = _proof(self._secret, _SERVER_LABEL, self._nonce, server_nonce)
        if not hmac.compare_digest(expected, got):
            raise WireAuthError(reason="bad_proof")
        return _proof(self._secret, _CLIENT_LABEL, self._nonce, server_nonce)

    def accepted(self, answer: bytes) -> None:
        """Check the owner's last answer.

        Raises:
            WireAuthError: ``malformed``: not ACCEPTED.
        """
        if bytes(answer) != MAGIC:
            raise WireAuthError(reason="malformed")
