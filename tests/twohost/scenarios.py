"""Scenarios that run as a driver inside host a of the two-host testbed.

``python tests/twohost/scenarios.py NAME`` joins the testbed, runs scenario NAME, and prints
``RESULT <json>`` as its last line; the tests in this folder assert on that result. Each
scenario leaves the agents as it found them (default config, no extra environment).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import ray

import ray_velo as rv
from ray_velo.actors.directory import (
    alive_node_ids,
    ensure_agent,
    find_agent,
    register_all_peers,
    store_cluster_config,
    wire_secret,
)
from ray_velo.client import session
from ray_velo.config import MiB, VeloConfig
from ray_velo.protocol.handshake import ACCEPTED_BYTES, CHALLENGE_BYTES, ClientHandshake
from ray_velo.testbed import TestbedInfo, connect

RESULT_PREFIX = "RESULT "
CONFIG = VeloConfig(staged_payload_max=512 * MiB, fault_injection=True, wire_stall_s=2.0)
KILL_SWITCH = {"VELO_RDMA_RENDEZVOUS_DISABLE": "1"}
#: The operator's opt-in: UCX may use TCP between the hosts (a network they trust).
UCX_TCP = {"VELO_UCX_TCP": "1"}


def _array(nbytes: int, seed: int = 0) -> np.ndarray[Any, Any]:
    return ((np.arange(nbytes, dtype=np.uint64) * 7 + seed) % 251).astype(np.uint8)


def _crc(value: Any) -> int:
    if isinstance(value, np.ndarray):
        return zlib.crc32(np.ascontiguousarray(value).view(np.uint8).data)
    return zlib.crc32(value)


@ray.remote(num_cpus=0)
class Host:
    """An actor pinned to one host: stages, fetches and reports its agent's counters."""

    def put(self, kind: str, nbytes: int, seed: int) -> tuple[rv.DataHandle, int]:
        value: Any = _array(nbytes, seed)
        if kind == "bytes":
            value = value.tobytes()
        return rv.put(value), _crc(value)

    def fetch(self, handle: rv.DataHandle) -> tuple[int, str]:
        value = rv.fetch(handle)
        return _crc(value), type(value).__name__

    def agent(self) -> dict[str, Any]:
        return ray.get(session.current().agent.info.remote())  # type: ignore[no-any-return]


def _paths(actor: Any) -> dict[str, int]:
    return dict(ray.get(actor.agent.remote())["metrics"]["velo_rendezvous_rdma_path_total"])


def _moved(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def _on(info: TestbedInfo, index: int) -> Any:
    return Host.options(resources={info.hosts[index].resource: 1}).remote()


def _node_of(info: TestbedInfo, index: int) -> str:
    address = info.hosts[index].address
    return next(n["NodeID"] for n in ray.nodes() if n["NodeManagerAddress"] == address)


def _restart(node_ids: list[str], env: dict[str, str] | None) -> None:
    """Replace the agents of ``node_ids`` with fresh ones (``env`` over their node's)."""
    for node_id in node_ids:
        try:
            old = find_agent(node_id)
        except ValueError:
            continue
        ray.get(old.shutdown.remote(), timeout=60)
        ray.kill(old)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                find_agent(node_id)
            except ValueError:
                break
            time.sleep(0.05)
    for node_id in node_ids:
        ray.get(ensure_agent(node_id, CONFIG, env).ping.remote(), timeout=120)
    register_all_peers()
    session.forget()


def _transfer_all(info: TestbedInfo, cases: list[tuple[str, int]]) -> dict[str, Any]:
    producer, consumer = _on(info, 0), _on(info, 1)
    consumer_before, owner_before = _paths(consumer), _paths(producer)
    checked = []
    for seed, (kind, nbytes) in enumerate(cases):
        handle, crc = ray.get(producer.put.remote(kind, nbytes, seed))
        got, type_name = ray.get(consumer.fetch.remote(handle))
        checked.append({"kind": kind, "nbytes": nbytes, "ok": got == crc, "type": type_name})
    agent = ray.get(consumer.agent.remote())
    owner = ray.get(producer.agent.remote())
    return {
        "checked": checked,
        "consumer_paths": _moved(consumer_before, _paths(consumer)),
        "owner_paths": _moved(owner_before, _paths(producer)),
        "transports": agent["ucx_transports"],
        "consumer_ucx": agent["rdma"],
        "owner_bulk_bytes_sent": owner["bulk_bytes_sent"],
        "owner_live_slots": owner["live_slots"],
    }


# --- the scenarios -------------------------------------------------------------------------


def put_fetch(info: TestbedInfo) -> dict[str, Any]:
    """rv.put on host a, rv.fetch on host b: pooled, dedicated and bytes payloads."""
    return _transfer_all(
        info, [("array", 300 << 10), ("array", 8 * MiB), ("array", 96 * MiB), ("bytes", 4 * MiB)]
    )


def pipeline(info: TestbedInfo) -> dict[str, Any]:
    """@rv.transfer: an actor on host a returns an array to a task on host b, and the driver
    (host a) sends a task on host b a dict of two arrays."""
    a, b = info.hosts[0].resource, info.hosts[1].resource

    @rv.transfer
    @ray.remote(num_cpus=0, resources={a: 1})
    class Source:
        def batch(self, nbytes: int) -> np.ndarray[Any, Any]:
            return _array(nbytes, 3)

    @rv.transfer
    @ray.remote(num_cpus=0, resources={b: 1})
    def checksum(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: _crc(v) for k, v in value.items()}
        return _crc(value)

    probe = _on(info, 1)
    before = _paths(probe)
    source = Source.remote()
    result = ray.get(checksum.remote(source.batch.remote(32 * MiB)))
    arrays = {"x": _array(20 * MiB, 5), "y": _array(3 * MiB, 6)}
    several = ray.get(checksum.remote(arrays))
    return {
        "from_actor_ok": result == _crc(_array(32 * MiB, 3)),
        "dict_ok": several == {k: _crc(v) for k, v in arrays.items()},
        "consumer_paths": _moved(before, _paths(probe)),
    }


def ucx_tcp(info: TestbedInfo) -> dict[str, Any]:
    """Both agents with the operator's opt-in (VELO_UCX_TCP=1): UCX over TCP moves the
    bytes, one GET each, as before the wire carried them. Then host b's UCX is told to use
    only `lo` (UCX_NET_DEVICES=lo): its GET to host a fails, and the fetch falls back to
    chunks, once."""
    nodes, node_b = alive_node_ids(), _node_of(info, 1)
    _restart(nodes, UCX_TCP)
    try:
        opted = _transfer_all(info, [("array", 300 << 10), ("array", 24 * MiB)])
        _restart([node_b], {**UCX_TCP, "UCX_NET_DEVICES": "lo"})
        return {"opt_in": opted, "lo_only": _transfer_all(info, [("array", 24 * MiB)])}
    finally:
        _restart(nodes, None)


def kill_switch(info: TestbedInfo) -> dict[str, Any]:
    """VELO_RDMA_RENDEZVOUS_DISABLE=1 on both agents (UCX over TCP allowed): no GET; the
    bytes cross over the wire, still right."""
    nodes = alive_node_ids()
    _restart(nodes, {**KILL_SWITCH, **UCX_TCP})
    try:
        return _transfer_all(info, [("array", 40 * MiB), ("bytes", 1 * MiB)])
    finally:
        _restart(nodes, None)


def stalled_sender(info: TestbedInfo) -> dict[str, Any]:
    """Host a's sends stop after their first piece, longer than host b's read may wait
    (wire_stall_s, 2 s here): the read fails within that bound, the fetch falls back to
    chunks once, the bytes are right and nothing is left."""
    producer = _on(info, 0)
    agent_a = find_agent(_node_of(info, 0))
    ray.get(agent_a.inject_fault.remote("stall_sends_s", 6.0))
    try:
        started = time.monotonic()
        result = _transfer_all(info, [("array", 24 * MiB)])
        result["seconds"] = time.monotonic() - started
    finally:
        ray.get(agent_a.inject_fault.remote("stall_sends_s", 0.0))
    _wait(
        "the stalled send ends", lambda: ray.get(producer.agent.remote())["bulk_sends_stopped"] >= 1
    )
    return result


def _wait(what: str, ready: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout_s} s: {what}")
        time.sleep(0.05)


def broadcast(info: TestbedInfo) -> dict[str, Any]:
    """One 64 MiB payload from host a to hosts b and c (two consumers): host c, starting once
    host a granted host b its lease, is pointed at host b's copy and reads it as it fills (host
    b pauses 1 s after each 16 MiB piece, so the reads provably overlap); when both consumed
    it, the owner ends the handle and both copies go."""
    owner, on_b, on_c = _on(info, 0), _on(info, 1), _on(info, 2)
    agents = {
        name: ray.get(h.agent.remote()) for name, h in zip("abc", (owner, on_b, on_c), strict=True)
    }
    register_all_peers()
    agent_b = ensure_agent(_node_of(info, 1))
    ray.get(agent_b.inject_fault.remote("copy_piece_pause_s", 1.0))
    try:
        handle, crc = ray.get(owner.put.remote("array", 64 * MiB, 3))
        rv.ref_handle(handle)  # two consumers
        first = on_b.fetch.remote(handle)
        sources = agents["a"]["copy_sources"]
        _wait(
            "host a grants host b", lambda: ray.get(owner.agent.remote())["copy_sources"] > sources
        )
        second = on_c.fetch.remote(handle)
        got = [c for c, _ in ray.get([first, second], timeout=240)]
    finally:
        ray.get(agent_b.inject_fault.remote("copy_piece_pause_s", 0.0))

    def copies() -> list[int]:
        return [ray.get(h.agent.remote())["copies"] for h in (on_b, on_c)]

    _wait("both copies freed", lambda: copies() == [0, 0])
    after_c = ray.get(on_c.agent.remote())
    relayed = "velo_relay_fetches_total"
    return {
        "ok": got == [crc, crc],
        "c_relayed": after_c["metrics"][relayed] - agents["c"]["metrics"][relayed],
        "b_bulk_bytes_sent": ray.get(on_b.agent.remote())["bulk_bytes_sent"]
        - agents["b"]["bulk_bytes_sent"],
        "owner_copy_sources": ray.get(owner.agent.remote())["copy_sources"],
    }


# --- who may use the wire --------------------------------------------------------------

OUTSIDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "outsider.py")


def _dial(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _receive(sock: socket.socket, size: int) -> bytes:
    out = b""
    while len(out) < size:
        chunk = sock.recv(size - len(out))
        if not chunk:
            raise ConnectionError("the agent closed the handshake")
        out += chunk
    return out


def _recorded_handshake(address: str) -> bytes:
    """A real agent's handshake with ``address`` (this driver holds the token, so it reads
    the secret): its hello and proof, as an eavesdropper would record them."""
    client = ClientHandshake(wire_secret(), os.urandom(32))
    with _dial(address) as sock:
        sock.sendall(client.hello())
        proof = client.prove(_receive(sock, CHALLENGE_BYTES))
        sock.sendall(proof)
        _receive(sock, ACCEPTED_BYTES)
    return client.hello() + proof


def _auth_failures(actor: Any) -> dict[str, int]:
    return dict(ray.get(actor.agent.remote())["metrics"]["velo_wire_auth_failures_total"])


def outsider(info: TestbedInfo) -> dict[str, Any]:
    """A process on host a without Ray's token tries host b's agent (its wire, with a real
    handle; its Unix socket as another user; Ray itself), then the legitimate consumer on
    host a fetches that handle."""
    owner, consumer = _on(info, 1), _on(info, 0)
    handle, crc = ray.get(owner.put.remote("array", 8 * MiB, 11))
    agent_b = ray.get(owner.agent.remote())
    before = agent_b["metrics"]["velo_wire_auth_failures_total"]
    node_b = _node_of(info, 1)
    _, ucx_address = ray.get(find_agent(node_b).ucx_address.remote())
    spec = {
        "handle": [handle.worker_id, handle.slot_id],
        "wire": agent_b["wire"],
        "socket": agent_b["socket"],
        "head": info.address,
        "replay": _recorded_handshake(agent_b["wire"]).hex(),
        "pid": agent_b["pid"],
        "ports": {"wire": agent_b["wire"], "bulk": agent_b["bulk"]},
        "ucx_address": (ucx_address or b"").hex(),
        "lease": 1,  # a guess: lease ids are capabilities, none is known outside
        "nbytes": 8 * MiB,
        "marker": _array(8 * MiB, 11)[4096:4160].tobytes().hex(),
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_TOKEN")}
    with tempfile.TemporaryDirectory() as home:  # no ~/.ray/auth_token to fall back on
        done = subprocess.run(
            [sys.executable, OUTSIDER, json.dumps(spec)],
            env={**env, "HOME": home},
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
    lines = [line for line in done.stdout.splitlines() if line.startswith("OUTSIDER ")]
    if not lines:
        raise RuntimeError(f"the outsider exited {done.returncode}: {done.stderr[-2000:]}")
    refcount = rv.metadata(handle).refcount
    got, _ = ray.get(consumer.fetch.remote(handle))
    after = _auth_failures(owner)
    return {
        "outsider": json.loads(lines[0][len("OUTSIDER ") :]),
        "ours": [agent_b["wire"].rpartition(":")[2], agent_b["bulk"].rpartition(":")[2]],
        "wire_tls": agent_b["wire_tls"],
        "refcount_after_outsider": refcount,
        "fetched_ok": got == crc,
        "auth_failures": {
            k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)
        },
        "owner_live_slots": ray.get(owner.agent.remote())["live_slots"],
    }


class _Flood:
    """``count`` connections to ``address`` that never speak, held open: each one the agent
    closes is opened again (at most ``per_s`` a second: a sustained flood, not a busy loop
    on this 2-core machine), until the ``with`` block ends."""

    def __init__(self, address: str, count: int, per_s: float = 200.0) -> None:
        self.address, self.count, self.per_s, self.opened = address, count, per_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Flood:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        import select

        socks: list[socket.socket] = []
        started = time.monotonic()
        try:
            while not self._stop.is_set():
                allowed = self.count + (time.monotonic() - started) * self.per_s
                while len(socks) < self.count and self.opened < allowed:
                    socks.append(_dial(self.address))
                    self.opened += 1
                readable, _, _ = select.select(socks, [], [], 0.02)
                for sock in readable:  # closed by the agent: readable with nothing to read
                    socks.remove(sock)
                    sock.close()
        finally:
            for sock in socks:
                sock.close()


def _fresh_fetches(info: TestbedInfo, owner: Any, rounds: int, seed: int) -> dict[str, Any]:
    """``rounds`` times: a fresh agent on host c (so its fetch opens a new wire connection to
    host b, handshake included), then one 4 MiB payload put on b and fetched on c, timed."""
    times, ok = [], True
    for i in range(rounds):
        _restart([_node_of(info, 2)], None)
        consumer = _on(info, 2)
        ray.get(consumer.agent.remote())
        handle, crc = ray.get(owner.put.remote("array", 4 * MiB, seed + i))
        started = time.monotonic()
        got, _ = ray.get(consumer.fetch.remote(handle))
        times.append(time.monotonic() - started)
        ok = ok and got == crc
        ray.kill(consumer)
    return {"ok": ok, "times_s": times}


def silent_flood(info: TestbedInfo) -> dict[str, Any]:
    """200 connections that never speak held open on host b's wire (each one b closes opened
    again, 200 a second) while freshly started agents on host c fetch from b, each over a new
    wire connection; the same fetches without the flood first, for their normal time."""
    owner = _on(info, 1)
    wire = ray.get(owner.agent.remote())["wire"]
    baseline = _fresh_fetches(info, owner, 4, 100)
    before = _auth_failures(owner)
    with _Flood(wire, 200) as flood:
        _wait("the flood is up", lambda: flood.opened >= 200)
        flooded = _fresh_fetches(info, owner, 4, 200)
    after = _auth_failures(owner)
    return {
        "baseline": baseline,
        "flooded": flooded,
        "opened": flood.opened,
        "auth_failures": {
            k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)
        },
        "owner_live_slots": ray.get(owner.agent.remote())["live_slots"],
    }


def tls(info: TestbedInfo) -> dict[str, Any]:
    """Ray runs with RAY_USE_TLS=1: arrays put on host a are fetched on host b (the acquire
    over the agents' wire, under TLS with Ray's certificates); then a peer that holds the
    secret but speaks plain TCP to a's wire is closed at TLS."""
    owner = _on(info, 0)
    agent_a = ray.get(owner.agent.remote())
    wire_calls, before = agent_a["wire_calls"], agent_a["metrics"]["velo_wire_auth_failures_total"]
    result = _transfer_all(info, [("array", 300 << 10), ("array", 24 * MiB)])
    plain = "answered"
    with _dial(agent_a["wire"]) as sock:
        sock.sendall(ClientHandshake(wire_secret(), os.urandom(32)).hello())
        sock.settimeout(10)
        try:
            plain = "closed" if sock.recv(100) == b"" else "answered"
        except ConnectionResetError:
            plain = "closed"
    after_a = ray.get(owner.agent.remote())
    after = after_a["metrics"]["velo_wire_auth_failures_total"]
    return {
        **result,
        "wire_tls": [agent_a["wire_tls"], ray.get(_on(info, 1).agent.remote())["wire_tls"]],
        "wire_calls": after_a["wire_calls"] - wire_calls,
        "plain_tcp": plain,
        "auth_failures": {
            k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)
        },
    }


SCENARIOS: dict[str, Callable[[TestbedInfo], dict[str, Any]]] = {
    f.__name__: f
    for f in (
        put_fetch,
        pipeline,
        ucx_tcp,
        kill_switch,
        stalled_sender,
        broadcast,
        outsider,
        silent_flood,
        tls,
    )
}


def main() -> int:
    info = connect()
    store_cluster_config(CONFIG)
    rv.init(CONFIG)
    result = SCENARIOS[sys.argv[1]](info)
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
