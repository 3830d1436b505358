"""A process on the cluster's network without Ray's token: what it can get of ray_velo.

``python outsider.py '<json>'`` runs inside a testbed host with no ``RAY_AUTH_TOKEN`` and a
``HOME`` of its own (no ``~/.ray/auth_token``), and tries, as an attacker would:

* Ray itself (``ray.init`` to the head): refused by Ray's token auth;
* every method of an agent's TCP wire, as a peer agent would send it, with a real handle,
  as its first bytes; then again after a handshake with a secret of its own, and after
  replaying a real agent's recorded handshake (``replay``: hello and proof, hex);
* a handshake held half-open, timed until the agent closes it;
* the agent's Unix socket as another user (uid 65534, nobody);
* every TCP port the agent's process listens on (found in /proc, as a scan would find them):
  what each volunteers, a bulk read of the payload as its first bytes, and one after a
  handshake with a secret of its own; none may carry a byte of the payload (``marker``);
* UCX: whether the agent runs a UCX worker at all (an address the driver learnt for it).

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
from ray_velo.protocol.bulk import encode_read
from ray_velo.protocol.frames import WIRE_METHODS, encode_request
from ray_velo.protocol.handshake import NONCE_BYTES, ClientHandshake
from ray_velo.protocol.messages import ReadRequest
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


def listening_ports(pid: int) -> list[tuple[str, int]]:
    """The TCP ports process ``pid`` listens on: (bound address, port), from /proc."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[9] in inodes and fields[3] == "0A":  # LISTEN
                    address, port = fields[1].split(":")
                    ip = ".".join(str(int(address[i : i + 2], 16)) for i in (6, 4, 2, 0))
                    ports.append((ip if width == 8 else "::", int(port, 16)))
    return sorted(set(ports))


def probe_port(host: str, port: int, read: bytes, marker: bytes) -> dict[str, Any]:
    """What one port gives a stranger: what it volunteers, a bulk read of the payload as
    the first bytes, the same after a handshake with a secret of its own."""
    outcome: dict[str, Any] = {}
    own = ClientHandshake(os.urandom(32), os.urandom(NONCE_BYTES)).hello() + os.urandom(32)
    for name, first in (
        ("volunteered", b""),
        ("read", read),
        ("read_after_own_secret", own + read),
    ):
        got = b""
        try:
            with socket.create_connection((host, port), timeout=10) as sock:
                if first:
                    sock.sendall(first)
                sock.settimeout(3.0)
                while len(got) < (1 << 20) and (chunk := sock.recv(65536)):
                    got += chunk
        except (OSError, TimeoutError):
            pass
        outcome[name] = {"bytes": len(got), "payload": marker in got}
    return outcome


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
        "ucx": "worker" if spec["ucx_address"] else "none",
    }
    marker = bytes.fromhex(spec["marker"])
    read = encode_read(1, ReadRequest(handle, spec["lease"], 0, spec["nbytes"]))
    host = spec["wire"].rpartition(":")[0]
    result["ports"] = {
        f"{bound}:{port}": probe_port(host, port, read, marker)
        if bound in ("0.0.0.0", "::", host)
        else "loopback only"
        for bound, port in listening_ports(spec["pid"])
    }
    sys.stdout.write(PREFIX + json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
