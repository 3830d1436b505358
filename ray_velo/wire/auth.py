"""Who may use the agents' TCP wire: the handshake's I/O, and TLS where Ray uses TLS
(docs/deployment.md §8, docs/architecture.md §13)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import ssl
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from ray_velo.errors import ConfigError, WireAuthError
from ray_velo.protocol.handshake import (
    ACCEPTED_BYTES,
    CHALLENGE_BYTES,
    HELLO_BYTES,
    NONCE_BYTES,
    PROOF_BYTES,
    ClientHandshake,
    ServerHandshake,
)
from ray_velo.wire.io import PeerClosed, receive_exactly

__all__ = [
    "HANDSHAKE_TIMEOUT_S",
    "TLS_ENV",
    "TlsFiles",
    "WireAuth",
    "keep_alive",
    "peer_address",
]

_log = logging.getLogger(__name__)

#: The longest a peer may take to complete the handshake (TLS included) before it is closed.
HANDSHAKE_TIMEOUT_S = 2.0
#: Ray's TLS settings, read as Ray reads them (``ray._common.tls_utils``).
TLS_ENV = ("RAY_USE_TLS", "RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT")
#: Peer addresses already warned about (a bounded memory: an old one is forgotten first).
_WARNED_ADDRESSES = 1024
#: TCP keepalive on the wire's connections: probes after this many idle seconds, every
#: interval, and the connection is dead after that many unanswered (a vanished peer is
#: noticed in about 25 s instead of the kernel's two hours).
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 10, 5, 3
#: Unacknowledged data older than this fails the connection (TCP_USER_TIMEOUT): a peer
#: whose host vanished mid-send is noticed in this time, not the ~15 minutes of retransmits.
USER_TIMEOUT_S = 30


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """Ray's TLS files: this node's certificate and key (both directions, as Ray uses them),
    and the CA that signs every node's certificate."""

    cert: str
    key: str
    ca: str

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> TlsFiles | None:
        """Ray's TLS files when ``RAY_USE_TLS`` is on (as Ray reads it), else None.

        Raises:
            ConfigError: TLS is on but a file's variable is unset.
        """
        if environ.get("RAY_USE_TLS", "0").lower() not in ("1", "true"):
            return None
        for name in TLS_ENV[1:]:
            if not environ.get(name):
                raise ConfigError(
                    field=name, value=None, rule="must name a file when RAY_USE_TLS=1 (as for Ray)"
                )
        return cls(
            environ["RAY_TLS_SERVER_CERT"],
            environ["RAY_TLS_SERVER_KEY"],
            environ["RAY_TLS_CA_CERT"],
        )


def _contexts(tls: TlsFiles) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) contexts: each side presents the node's certificate and requires the
    other's, signed by the cluster's CA; the client also checks the owner's certificate names
    the address it dialled, as Ray's gRPC does."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # check_hostname, CERT_REQUIRED
    for context in (server, client):
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(tls.cert, tls.key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                field="RAY_TLS_SERVER_CERT", value=tls.cert, rule=f"must load with its key: {exc}"
            ) from exc
        try:
            context.load_verify_locations(tls.ca)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                field="RAY_TLS_CA_CERT", value=tls.ca, rule=f"must be a readable CA: {exc}"
            ) from exc
    server.verify_mode = ssl.CERT_REQUIRED
    return server, client


class WireAuth:
    """One agent's credentials for the wire.

    Args:
        secret: the cluster's secret (``ray_velo.protocol.handshake.SECRET_BYTES``).
        tls: Ray's TLS files, or None when Ray runs without TLS.
        on_refusal: called with the reason of every failed handshake (the metric).

    Raises:
        ConfigError: a TLS file does not load, or this Python cannot upgrade a connection to
            TLS (3.11 and newer can).
    """

    def __init__(
        self,
        secret: bytes,
        tls: TlsFiles | None = None,
        on_refusal: Callable[[str], None] = lambda reason: None,
    ) -> None:
        ServerHandshake(secret, bytes(NONCE_BYTES))  # checks the secret's size
        self._secret = secret
        self.tls = tls
        self._server_ssl: ssl.SSLContext | None = None
        self._client_ssl: ssl.SSLContext | None = None
        if tls is not None:
            if not hasattr(asyncio.StreamWriter, "start_tls"):
                raise ConfigError(
                    field="RAY_USE_TLS", value="1", rule="the TCP wire under TLS needs Python 3.11+"
                )
            self._server_ssl, self._client_ssl = _contexts(tls)
        self._on_refusal = on_refusal
        self._warned: OrderedDict[str, None] = OrderedDict()
        self._warned_lock = threading.Lock()

    @classmethod
    def from_environment(
        cls,
        secret: bytes,
        environ: Mapping[str, str] = os.environ,
        on_refusal: Callable[[str], None] = lambda reason: None,
    ) -> WireAuth:
        """Credentials with Ray's TLS settings from ``environ``. Raises ConfigError."""
        return cls(secret, TlsFiles.from_environment(environ), on_refusal)

    # --- the owner's side --------------------------------------------------------------

    async def accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The owner's side of the handshake on a fresh connection: TLS first where Ray uses
        TLS, then the challenge and response. The caller bounds it in time.

        Raises:
            WireAuthError: the peer failed (``reason``: tls, malformed, bad_proof, closed).
        """
        peer = peer_address(writer)
        if self._server_ssl is not None:
            try:
                await writer.start_tls(self._server_ssl)
            except (ssl.SSLError, OSError) as exc:
                raise WireAuthError(reason="tls", peer=peer) from exc
        server = ServerHandshake(self._secret, secrets.token_bytes(NONCE_BYTES))
        try:
            writer.write(server.challenge(await _read(reader, HELLO_BYTES, peer)))
            writer.write(server.accept(await _read(reader, PROOF_BYTES, peer)))
        except WireAuthError as exc:
            raise WireAuthError(reason=exc.fields["reason"], peer=peer) from None

    def accept_blocking(self, sock: socket.socket, timeout_s: float) -> socket.socket:
        """:meth:`accept` for a thread, on a fresh blocking connection: TLS first where Ray
        uses TLS, then the challenge and response, all within ``timeout_s``. Returns the
        socket to use from then on (the TLS one under TLS).

        Raises:
            WireAuthError: the peer failed (``reason``: tls, malformed, bad_proof, closed,
                silent).
        """
        peer = _peername(sock)
        sock.settimeout(timeout_s)
        _nodelay(sock)
        try:
            if self._server_ssl is not None:
                sock = self._server_ssl.wrap_socket(sock, server_side=True)
            server = ServerHandshake(self._secret, secrets.token_bytes(NONCE_BYTES))
            sock.sendall(server.challenge(_receive(sock, HELLO_BYTES)))
            sock.sendall(server.accept(_receive(sock, PROOF_BYTES)))
        except ssl.SSLError as exc:  # before OSError: it is one
            raise WireAuthError(reason="tls", peer=peer) from exc
        except TimeoutError:
            raise WireAuthError(reason="silent", peer=peer) from None
        except WireAuthError as exc:
            raise WireAuthError(reason=exc.fields["reason"], peer=peer) from None
        except OSError:
            raise WireAuthError(reason="closed", peer=peer) from None
        return sock

    # --- the consumer's side -----------------------------------------------------------

    async def connect(
        self, host: str, port: int
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """An authenticated connection to the owner at ``host:port``. The handshake is
        bounded by :data:`HANDSHAKE_TIMEOUT_S`; the caller bounds the connection.

        Raises:
            WireAuthError: the owner failed the handshake (a fake owner, another cluster's).
            OSError: no connection.
        """
        peer = f"{host}:{port}"
        with _handshake_failures(peer, lambda: None):
            reader, writer = await asyncio.open_connection(
                host, port, ssl=self._client_ssl, server_hostname=host if self._client_ssl else None
            )
        with _handshake_failures(peer, writer.close):
            _nodelay(writer.get_extra_info("socket"))
            await asyncio.wait_for(self._prove(reader, writer, peer), HANDSHAKE_TIMEOUT_S)
        return reader, writer

    async def _prove(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str
    ) -> None:
        client = ClientHandshake(self._secret, secrets.token_bytes(NONCE_BYTES))
        writer.write(client.hello())
        writer.write(client.prove(await _read(reader, CHALLENGE_BYTES, peer)))
        client.accepted(await _read(reader, ACCEPTED_BYTES, peer))

    def connect_blocking(self, address: str, timeout_s: float) -> socket.socket:
        """:meth:`connect` for a thread: a blocking socket to ``host:port``, authenticated.

        Raises:
            WireAuthError: the owner failed the handshake (or said nothing in time).
            OSError: no connection.
        """
        host, _, port = address.rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        with _handshake_failures(address, lambda: sock.close()):  # the TLS socket once wrapped
            sock.settimeout(min(timeout_s, HANDSHAKE_TIMEOUT_S))
            _nodelay(sock)
            if self._client_ssl is not None:
                sock = self._client_ssl.wrap_socket(sock, server_hostname=host)
            client = ClientHandshake(self._secret, secrets.token_bytes(NONCE_BYTES))
            sock.sendall(client.hello())
            sock.sendall(client.prove(_receive(sock, CHALLENGE_BYTES)))
            client.accepted(_receive(sock, ACCEPTED_BYTES))
            sock.settimeout(timeout_s)
        return sock

    # --- failures ----------------------------------------------------------------------

    def refused(self, error: WireAuthError) -> None:
        """Count a failed handshake; warn about its peer's address the first time."""
        reason = str(error.fields.get("reason"))
        self._on_refusal(reason)
        address = str(error.fields.get("peer", "")).rpartition(":")[0] or "?"
        with self._warned_lock:
            first = address not in self._warned
            self._warned[address] = None
            self._warned.move_to_end(address)
            while len(self._warned) > _WARNED_ADDRESSES:
                self._warned.popitem(last=False)
        if first:
            _log.warning("ray_velo: %s (further failures from %s are counted only)", error, address)


@contextlib.contextmanager
def _handshake_failures(peer: str, close: Callable[[], None]) -> Iterator[None]:
    """A consumer's handshake with ``peer``: on any failure ``close()`` the connection, and
    say what went wrong as a WireAuthError naming the peer (a failed TLS handshake ``tls``,
    no answer in time ``silent``); a connection that could not be made stays an OSError."""
    try:
        yield
    except ssl.SSLError as exc:  # before OSError: it is one
        close()
        raise WireAuthError(reason="tls", peer=peer) from exc
    except (TimeoutError, asyncio.TimeoutError):
        close()
        raise WireAuthError(reason="silent", peer=peer) from None
    except WireAuthError as exc:
        close()
        raise WireAuthError(reason=exc.fields["reason"], peer=peer) from None
    except BaseException:
        close()
        raise


def peer_address(writer: asyncio.StreamWriter) -> str:
    """``host:port`` of the other end of ``writer``'s connection (for errors and logs)."""
    name = writer.get_extra_info("peername")
    if isinstance(name, tuple) and len(name) >= 2:
        return f"{name[0]}:{name[1]}"
    return str(name or "?")


def keep_alive(sock: socket.socket) -> None:
    """TCP keepalive and a user timeout on a wire connection (where the platform has them),
    so a peer that vanished (its host gone, a half-open link) ends the connection in tens of
    seconds."""
    options = [
        (socket.SOL_SOCKET, getattr(socket, "SO_KEEPALIVE", None), 1),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPIDLE", None), KEEPALIVE_IDLE_S),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPINTVL", None), KEEPALIVE_INTERVAL_S),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPCNT", None), KEEPALIVE_PROBES),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_USER_TIMEOUT", None), USER_TIMEOUT_S * 1000),
    ]
    for level, name, value in options:
        if name is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(level, name, value)


def _peername(sock: socket.socket) -> str:
    try:
        name = sock.getpeername()
    except OSError:
        return "?"
    return f"{name[0]}:{name[1]}" if isinstance(name, tuple) and len(name) >= 2 else str(name)


def _nodelay(sock: socket.socket | None) -> None:
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _read(reader: asyncio.StreamReader, size: int, peer: str) -> bytes:
    try:
        return await reader.readexactly(size)
    except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
        raise WireAuthError(reason="closed", peer=peer) from None


def _receive(sock: socket.socket, size: int) -> bytes:
    try:
        return receive_exactly(sock, size)
    except PeerClosed:
        raise WireAuthError(reason="closed") from None
