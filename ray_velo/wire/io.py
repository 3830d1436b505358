"""Reading exactly N bytes from a blocking socket, for every blocking end of the agents' wire
(the handshake, the relay calls, the bulk port and its reader)."""

from __future__ import annotations

import socket

__all__ = ["PeerClosed", "receive_exactly"]


class PeerClosed(ConnectionResetError):
    """The peer closed the connection before all the bytes came."""


def receive_exactly(sock: socket.socket, size: int) -> bytes:
    """``size`` bytes from ``sock`` (its timeout applies to each ``recv``).

    Raises:
        PeerClosed: the peer closed the connection first.
        OSError: the connection failed or timed out.
    """
    out = bytearray()
    while len(out) < size:
        chunk = sock.recv(size - len(out))
        if not chunk:
            raise PeerClosed(f"the peer closed the connection after {len(out)} of {size} bytes")
        out += chunk
    return bytes(out)
