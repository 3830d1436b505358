"""A process on the cluster's network without Ray's token: what it can get of ray_velo.

``python outsider.py '<json>'`` runs inside a testbed host with no ``RAY_AUTH_TOKEN`` and a
``HOME`` of its own (no ``~/.ray/auth_token``), and tries, as an attacker would:

* Ray itself (``ray.init`` to the head): refused by Ray's token auth;
* every method of an agent's TCP wire, as a peer agent would send it, with a real handle,
  as its first bytes; then again after a handshake with a secret of its own, and after
  replaying a real agent's recorded handshake (``replay``: hello and proof, hex);
* a handshake held half-open, timed until the agent closes it;
* the agent's Unix socket as another user (uid 65534, nobody).

It prints one ``OUTSIDER <json>`` line: for each attempt, what came back (``closed``: the
connection closed with no answer frame; ``answered``: an answer frame; ``denied``...).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: tests.*

from ray_velo.protocol import (
    AcquireRequest,
    CopyNotice,
    DataHandle,
    DetachRequest,
    LeaseRenewRequest,
    MetadataRequest,
    RefRequest,
    RelayEnd,
    RelayRequest,
    ReleaseRequest,
    WindowRequest,
    encode,
)
from ray_velo.protocol.frames import WIRE_METHODS, encode_request
from ray_velo.protocol.handshake import NONCE_BYTES, ClientHandshake
from tests.strangers import NOBODY, unix_socket_as, wire_outcome

PREFIX = "OUTSIDER "


def requests(handle: DataHandle) -> dict[str, bytes]:
    """Every wire method's message about ``handle``, as a peer agent sends it."""
    return {
        "_rv_metadata": encode(MetadataRequest(handle)),
        "_rv_acquire": encode(AcquireRequest(handle)),
        "_rv_ref": encode(RefRequest(handle)),
        "_rv_detach": encode(DetachRequest(handle, 1)),
        "_rv_release": encode(ReleaseRequest(handle, 0)),
        "_rv_lease_renew": encode(LeaseRenewRequest(handle, 1)),
        "_rv_copy": encode(CopyNotice(handle, "node", 1)),
        "_rv_relay": encode(RelayRequest(handle, 0, 1)),
        "_rv_relay_end": encode(RelayEnd(handle, 1)),
        "_rv_window": encode(WindowRequest(handle, 1, 0)),
    }


def connect(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=10)


def unauthenticated(address: str, messages: dict[str, bytes]) -> dict[str, str]:
    """Each method's frame as the first bytes of a connection of its own."""
    out = {}
    for index, method in enumerate(WIRE_METHODS):
        with connect(address) as sock:
            sock.sendall(encode_request(method, index + 1, messages[method]))
            out[method] = wire_outcome(sock, 10.0)
    return out


def after_handshake(address: str, messages: dict[str, bytes], opening: bytes) -> str:
    """``opening`` (a hello and a proof: of a secret of its own, or a real agent's recorded
    ones replayed), then every method's frame on the same connection."""
    with connect(address) as sock:
        frames = b"".join(encode_request(m, i + 1, messages[m]) for i, m in enumerate(WIRE_METHODS))
        try:
            sock.sendall(opening + frames)
        except (BrokenPipeError, ConnectionResetError):
            return "closed"
        return wire_outcome(sock, 10.0)


def half_open(address: str) -> dict[str, Any]:
    """A hello and then nothing: how long until the agent closes it."""
    with connect(address) as sock:
        sock.sendall(ClientHandshake(os.urandom(32), os.urandom(NONCE_BYTES)).hello())
        started = time.monotonic()
        result = wire_outcome(sock, 10.0)
        return {"outcome": result, "closed_after_s": round(time.monotonic() - started, 2)}


def ray_access(address: str) -> str:
    """Whether Ray itself lets this process in."""
    import ray

    try:
        ray.init(address=address, log_to_driver=False)
    except Exception as exc:  # AuthenticationError, as Ray raises it
        return f"refused: {type(exc).__name__}"
    ray.shutdown()
    return "admitted"


def main() -> int:
    spec = json.loads(sys.argv[1])
    handle = DataHandle(spec["handle"][0], spec["handle"][1])
    messages = requests(handle)
    replay = bytes.fromhex(spec["replay"])
    own = ClientHandshake(os.urandom(32), os.urandom(NONCE_BYTES)).hello() + os.urandom(32)
    result = {
        "token_in_env": "RAY_AUTH_TOKEN" in os.environ,
        "before": unauthenticated(spec["wire"], messages),
        "wrong_secret": after_handshake(spec["wire"], messages, own),
        "replayed": after_handshake(spec["wire"], messages, replay),
        "half_open": half_open(spec["wire"]),
        "unix_socket_as_nobody": unix_socket_as(NOBODY, spec["socket"], b"\x00\x00\x00\x05hello"),
        "ray": ray_access(spec["head"]),
    }
    sys.stdout.write(PREFIX + json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
