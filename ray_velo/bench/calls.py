"""``ray-velo bench --calls``: what each call on a transfer's path costs, over Ray and over
ray_velo's own control plane (docs/tuning.md, "The control plane")."""

from __future__ import annotations

import functools
import os
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

from ray_velo.bench.progress import Progress
from ray_velo.config import MiB

__all__ = ["format_calls", "run_calls_bench"]

#: Payload of the calls measured: small enough that the call, not the bytes, is the cost.
CALL_PAYLOAD_BYTES = 1 * MiB
#: :func:`run_calls_bench`'s progress steps: the cluster up, the own agent's calls, the
#: calls across nodes.
CALLS_STEPS = 3


def _median_ms(reps: int, one: Callable[[], object]) -> float:
    one()  # warm: mappings, links, connections
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        one()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def _wire_call(address: str, message: bytes) -> Any:
    """One request on the owner's TCP wire, as an agent's link sends it (a fresh socket is
    opened once per measurement and authenticated, as the link keeps one open)."""
    from ray_velo.actors.directory import wire_secret
    from ray_velo.protocol.entry import RV_METADATA
    from ray_velo.protocol.frames import HEADER, decode_answer, encode_request
    from ray_velo.wire.auth import WireAuth

    sock = WireAuth.from_environment(wire_secret()).connect_blocking(address, 30.0)
    request = encode_request(RV_METADATA.name, 1, message)

    def once() -> Any:
        sock.sendall(request)
        head = sock.recv(HEADER.size, socket.MSG_WAITALL)
        length, status, _ = HEADER.unpack(head)
        body = sock.recv(length - (HEADER.size - 4), socket.MSG_WAITALL)
        ok, value = decode_answer(status, body)
        assert ok, value
        return value

    return sock, once


class _Caller:
    """Runs on one node; measures its calls to its own agent and to a peer owner."""

    def ready(self) -> bool:
        return True

    def put_many(self, count: int) -> list[Any]:
        import ray_velo as rv

        payload = bytes(CALL_PAYLOAD_BYTES)
        return [rv.put(payload) for _ in range(count)]

    def own_calls(self, reps: int) -> dict[str, float]:
        """This process's calls to its own agent, as Ray calls and over the socket."""
        import ray

        import ray_velo as rv
        from ray_velo.client import session

        s, pid = session.current(), os.getpid()
        local = rv.put(bytes(CALL_PAYLOAD_BYTES))

        def reserve(over_socket: bool) -> None:
            if over_socket:
                r = s.stage_reserve(CALL_PAYLOAD_BYTES, True, True)
            else:
                r = ray.get(s.agent.stage_reserve.remote(CALL_PAYLOAD_BYTES, True, pid, True))
            assert r is not None, "a pinned reservation is never refused"
            s.agent.stage_abort.remote(r.reservation_id)

        def acquire(over_socket: bool) -> None:
            if over_socket:
                lease = s.local_acquire(local, "detach")
            else:
                lease = ray.get(s.agent.local_acquire.remote(local, pid, "detach"))
            s.agent.end_lease.remote(lease.handle, lease.lease_id, False)

        out = {"ping": _median_ms(reps, lambda: ray.get(s.agent.ping.remote()))}
        calls: tuple[tuple[str, Callable[[bool], None]], ...] = (
            ("stage_reserve", reserve),
            ("local_acquire", acquire),
        )
        for name, one in calls:
            out[f"{name}/ray"] = _median_ms(reps, functools.partial(one, False))
            out[f"{name}/socket"] = _median_ms(reps, functools.partial(one, True))
        session.release_soon(local)
        return out

    def remote_calls(
        self, handles: list[Any], owner: Any, wire: str, reps: int
    ) -> dict[str, float]:
        """This process's fetches of another node's payloads (Ray call vs socket), and one
        owner handler (Ray call vs the owner's TCP wire)."""
        import ray

        from ray_velo.client import session
        from ray_velo.protocol import MetadataRequest, encode

        s, pid = session.current(), os.getpid()
        spare = iter(handles)

        def fetch(over_socket: bool) -> None:
            handle = next(spare)
            if over_socket:
                lease = s.fetch_remote(handle, "release", None, "unbounded", 0, timeout_s=None)
            else:
                lease = ray.get(
                    s.agent.fetch_remote.remote(handle, "release", None, pid, "unbounded")
                )
            s.agent.end_lease.remote(lease.handle, lease.lease_id, False)

        message = encode(MetadataRequest(handles[-1]))
        out = {
            "fetch_remote/ray": _median_ms(reps, lambda: fetch(False)),
            "fetch_remote/socket": _median_ms(reps, lambda: fetch(True)),
            "owner handler/ray": _median_ms(
                reps, lambda: ray.get(owner._rv_metadata.remote(message))
            ),
        }
        if wire:
            sock, once = _wire_call(wire, message)
            try:
                out["owner handler/wire"] = _median_ms(reps, once)
            finally:
                sock.close()
        for handle in handles[2 * reps + 2 :]:
            session.release_soon(handle)
        return out


def run_calls_bench(reps: int = 40) -> dict[str, float]:
    """Median ms of each call, on a fresh two-node local cluster (torn down after)."""
    import ray
    from ray.cluster_utils import Cluster

    import ray_velo as rv
    from ray_velo.actors.directory import find_agent

    progress = Progress(CALLS_STEPS, "calls bench")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"node_a": 4}, "include_dashboard": False},
    )
    try:
        with progress:
            progress.working("starting two local Ray nodes")
            cluster.add_node(num_cpus=2, resources={"node_b": 4})
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
            rv.init()
            caller: Any = _Caller  # made an actor class below, on each node
            on_a: Any = ray.remote(num_cpus=0, resources={"node_a": 1})(caller).remote()
            on_b: Any = ray.remote(num_cpus=0, resources={"node_b": 1})(caller).remote()
            ray.get([on_a.ready.remote(), on_b.ready.remote()])
            handles = ray.get(on_a.put_many.remote(2 * reps + 3))
            owner = find_agent(handles[0].owner_node)
            wire = ray.get(owner.info.remote())["wire"]
            progress.step(f"two local nodes up, {len(handles)} payloads put")
            results: dict[str, float] = ray.get(on_b.own_calls.remote(reps))
            progress.step("calls to the own agent (ping, stage_reserve, local_acquire)")
            results.update(ray.get(on_b.remote_calls.remote(handles, owner, wire, reps)))
            progress.step("calls across nodes (fetch_remote, the owner's handler)")
        return results
    finally:
        try:
            rv.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()  # type: ignore[no-untyped-call]


def format_calls(results: dict[str, float], reps: int) -> str:
    """The table: each call's median ms over Ray and over ray_velo's control plane."""
    rows = (
        ("producer -> own agent: stage_reserve", "stage_reserve/ray", "stage_reserve/socket"),
        ("reader -> own agent: local_acquire", "local_acquire/ray", "local_acquire/socket"),
        ("consumer -> own agent: fetch_remote", "fetch_remote/ray", "fetch_remote/socket"),
        ("agent -> owner agent: a handler", "owner handler/ray", "owner handler/wire"),
    )
    head = f"{'call (1 MiB payload)':<40} {'Ray call':>9} {'ray_velo':>9} {'saved':>7}"
    lines = [f"median ms per call (of {reps}):", head, "-" * len(head)]
    for label, ray_key, fast_key in rows:
        slow, fast = results.get(ray_key), results.get(fast_key)
        cells = [f"{v:.2f}" if v is not None else "-" for v in (slow, fast)]
        saved = f"{slow - fast:.2f}" if slow is not None and fast is not None else "-"
        lines.append(f"{label:<40} {cells[0]:>9} {cells[1]:>9} {saved:>7}")
    lines.append(
        f"a no-op Ray call to the agent: {results.get('ping', float('nan')):.2f} ms. "
        "ray_velo = the agent's Unix socket (process to its agent) or TCP wire (agent to "
        "agent); fetch_remote includes the acquire (over the wire) and the GET."
    )
    return "\n".join(lines)
