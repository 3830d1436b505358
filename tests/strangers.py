"""What a stranger meets at ray_velo's doors: shared by the unit tests of the wire and the
socket and by the testbed's outsider (tests/twohost/outsider.py)."""

from __future__ import annotations

import os
import socket

from ray_velo.protocol.handshake import CHALLENGE_BYTES, MAGIC

#: The uid of ``nobody``: a user that is not Ray's.
NOBODY = 65534


def unix_socket_as(uid: int, path: str, frame: bytes) -> str:
    """What a process of user ``uid`` meets at the Unix socket ``path``: ``denied`` (it cannot
    connect), ``closed`` (it connected and sent ``frame``, and the agent closed it
    unanswered) or ``answered``. Forked, not exec'd: this interpreter may live where that user
    cannot enter (under /root)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only system calls, then _exit
        outcome = b"?"
        try:
            os.setgid(uid)
            os.setuid(uid)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(5)
            try:
                sock.connect(path)
            except PermissionError:
                outcome = b"denied"
            else:
                try:
                    sock.sendall(frame)
                    outcome = b"closed" if sock.recv(100) == b"" else b"answered"
                # the agent closed first: the frame met a closed socket, or left unread
                except (BrokenPipeError, ConnectionResetError):
                    outcome = b"closed"
        except BaseException as exc:
            outcome = repr(exc).encode()[:200]
        finally:
            os.write(write_end, outcome)
            os._exit(0)
    os.close(write_end)
    try:
        return os.read(read_end, 300).decode()
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)


def wire_outcome(sock: socket.socket, timeout_s: float) -> str:
    """What an agent's TCP wire sends back on ``sock`` until it closes: ``closed`` (nothing,
    or only the handshake's challenge), ``answered (...)`` (anything more: an answer frame),
    or ``open`` (still open after ``timeout_s``)."""
    sock.settimeout(timeout_s)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except TimeoutError:
        return "open"
    except ConnectionResetError:
        pass
    if got.startswith(MAGIC) and len(got) >= CHALLENGE_BYTES:
        got = got[CHALLENGE_BYTES:]
    return "closed" if not got else f"answered ({len(got)} bytes, {got[:13].hex()})"
