"""The link's ceilings: a plain TCP socket and a bare UCX GET between two testbed hosts; run as
``python -m ray_velo.testbed.probes ROLE``."""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from collections.abc import Mapping
from typing import Any, Final

import numpy as np

from ray_velo.testbed.errors import TestbedError

__all__ = ["raw_tcp", "raw_ucx_get"]

_PORT: Final = 7470
_SHM: Final = "/dev/shm"
BUFFER_MAX: Final = 256 << 20


def _read_json(process: Any, who: str) -> dict[str, Any]:
    line = process.stdout.readline()
    if not line:
        process.wait(30)
        err = process.stderr.read() if process.stderr else ""
        raise TestbedError(
            step=f"probe {who}",
            detail=f"exited ({process.returncode}) without an answer: {err[-800:]}",
        )
    return json.loads(line)  # type: ignore[no-any-return]


def _finish(process: Any, who: str, timeout_s: float = 60.0) -> None:
    try:
        process.wait(timeout_s)
    except Exception:
        process.kill()
        process.wait(10)
    if process.returncode not in (0, None):
        err = process.stderr.read() if process.stderr else ""
        raise TestbedError(step=f"probe {who}", detail=f"exit {process.returncode}: {err[-500:]}")


def _start(testbed: Any, host: int, role: str, *args: object) -> Any:
    import subprocess

    argv = [sys.executable, "-m", "ray_velo.testbed.probes", role, *map(str, args)]
    pipe = subprocess.PIPE
    return testbed.popen(argv, host=host, stdin=pipe, stdout=pipe, stderr=pipe)


def raw_tcp(testbed: Any, nbytes: int, reps: int = 5, *, src: int = 0, dst: int = 1) -> float:
    """Median seconds to move ``nbytes`` over one TCP socket from host ``src`` to ``dst``."""
    receiver = _start(testbed, dst, "tcp-receive", nbytes, reps)
    try:
        _read_json(receiver, "tcp-receive")  # listening
        sender = _start(testbed, src, "tcp-send", testbed.hosts[dst].address, nbytes, reps)
        result = _read_json(receiver, "tcp-receive")
        _finish(sender, "tcp-send")
    finally:
        _finish(receiver, "tcp-receive")
    return float(result["median_s"])


def raw_ucx_get(
    testbed: Any,
    nbytes: int,
    reps: int = 5,
    *,
    src: int = 0,
    dst: int = 1,
    options: Mapping[str, str] | None = None,
) -> float:
    """Median seconds of a bare UCX GET of ``nbytes`` by host ``dst`` from host ``src``.

    ``options``: UCX settings for both contexts (over the library's defaults).
    """
    opts = json.dumps(dict(options or {}))
    owner = _start(testbed, src, "ucx-owner", nbytes, opts)
    try:
        offer = _read_json(owner, "ucx-owner")
        consumer = _start(testbed, dst, "ucx-consumer", nbytes, reps, opts)
        consumer.stdin.write(json.dumps(offer) + "\n")
        consumer.stdin.flush()
        result = _read_json(consumer, "ucx-consumer")
        _finish(consumer, "ucx-consumer")
    finally:
        if owner.stdin:
            owner.stdin.write("done\n")
            owner.stdin.flush()
        _finish(owner, "ucx-owner")
    if not result["ok"]:
        raise TestbedError(step="raw UCX GET", detail="the bytes read back wrong")
    return float(result["median_s"])


# --- the processes ---------------------------------------------------------------------


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _tcp_receive(nbytes: int, reps: int) -> None:
    server = socket.create_server(("0.0.0.0", _PORT))
    _say({"listening": _PORT})
    conn, _ = server.accept()
    view = memoryview(bytearray(min(nbytes, BUFFER_MAX)))
    times = []
    with conn:
        for _ in range(reps + 1):  # the first moves the window up; not counted
            started = time.perf_counter()
            conn.sendall(b"g")
            got = 0
            while got < nbytes:
                at = got % len(view)
                n = conn.recv_into(view[at : at + min(len(view) - at, nbytes - got)])
                if n == 0:
                    raise ConnectionError("sender closed early")
                got += n
            times.append(time.perf_counter() - started)
    server.close()
    _say({"median_s": statistics.median(times[1:])})


def _tcp_send(address: str, nbytes: int, reps: int) -> None:
    payload = memoryview(bytes(min(nbytes, BUFFER_MAX)))
    deadline = time.monotonic() + 30
    while True:
        try:
            conn = socket.create_connection((address, _PORT), timeout=30)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with conn:
        for _ in range(reps + 1):
            if conn.recv(1) != b"g":
                raise ConnectionError("receiver went away")
            for at in range(0, nbytes, len(payload)):
                conn.sendall(payload[: min(len(payload), nbytes - at)])


def _ucx_owner(nbytes: int, options: dict[str, str]) -> None:
    from ray_velo.memory.arena import ShmArena
    from ray_velo.ucx.binding import MemoryRegistration, UcxContext, UcxWorker

    context = UcxContext(options)
    worker = UcxWorker(context, progress_thread=True, blocking=True)
    held = min(nbytes, BUFFER_MAX)
    arena = ShmArena(_SHM, held, 0xBE7C, prefault=True)
    np.frombuffer(arena.view(0, held), dtype=np.uint8)[:] = 7
    registration = MemoryRegistration.from_address(context, arena.address, held, keepalive=None)
    _say(
        {
            "worker": worker.address.hex(),
            "addr": arena.address,
            "rkey": registration.packed_rkey.hex(),
        }
    )
    sys.stdin.readline()  # the consumer is done
    registration.close()
    worker.close()
    context.close()
    arena.close()


def _ucx_consumer(nbytes: int, reps: int, options: dict[str, str]) -> None:
    from ray_velo.memory.arena import ShmArena
    from ray_velo.ucx.binding import (
        Endpoint,
        MemoryRegistration,
        RemoteKey,
        UcxContext,
        UcxWorker,
        get,
    )

    offer = json.loads(sys.stdin.readline())
    context = UcxContext(options)
    worker = UcxWorker(context, progress_thread=True, blocking=True)
    held = min(nbytes, BUFFER_MAX)
    arena = ShmArena(_SHM, held, 0xBE7D, prefault=True)
    local = MemoryRegistration.from_address(context, arena.address, held, keepalive=None)
    endpoint = Endpoint(worker, bytes.fromhex(offer["worker"]))
    rkey = RemoteKey(endpoint, bytes.fromhex(offer["rkey"]))
    times = []
    for _ in range(reps + 1):  # the first wires up and warms; not counted
        started = time.perf_counter()
        for at in range(0, nbytes, held):  # one GET per buffer, back to back
            piece = min(held, nbytes - at)
            get(endpoint, arena.address, piece, offer["addr"], rkey, 120.0, local_memh=local)
        times.append(time.perf_counter() - started)
    ok = bool(np.frombuffer(arena.view(0, held), dtype=np.uint8)[:: 1 << 12].min() == 7)
    rkey.close()
    endpoint.close()
    local.close()
    worker.close()
    context.close()
    arena.close()
    _say({"median_s": statistics.median(times[1:]), "ok": ok})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ray_velo.testbed.probes")
    parser.add_argument("role", choices=["tcp-receive", "tcp-send", "ucx-owner", "ucx-consumer"])
    parser.add_argument("rest", nargs="*")
    args = parser.parse_args(argv)
    rest = args.rest
    if args.role == "tcp-receive":
        _tcp_receive(int(rest[0]), int(rest[1]))
    elif args.role == "tcp-send":
        _tcp_send(rest[0], int(rest[1]), int(rest[2]))
    elif args.role == "ucx-owner":
        _ucx_owner(int(rest[0]), json.loads(rest[1]))
    else:
        _ucx_consumer(int(rest[0]), int(rest[1]), json.loads(rest[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
