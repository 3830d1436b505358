"""The driver of ``ray-velo bench --two-host --shapes`` and of the CI speed guard: runs on host
a of the testbed, times the shapes we sell end to end beside Ray's object store, round by round
and interleaved, and prints ``RESULT <json>`` last (docs/benchmarks.md "The shapes we sell").

Run as a script (``python .../shapes_driver.py``), it uses only ray_velo's public API, so the
same measurement runs against an older checkout put first on ``PYTHONPATH``: that is how a
sitting compares commits.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

MiB = 1 << 20
RESULT_PREFIX = "RESULT "
#: GPT-2 small's parameters (148 float32 tensors, 498 MB; 98 of them 3-12 KiB): the state
#: dict a trainer hands its rollout workers.
GPT2_LAYERS = 12
GPT2_WIDTH = 768


def gpt2_state_dict() -> dict[str, np.ndarray[Any, Any]]:
    """GPT-2 small's state dict shapes, filled with a cheap pattern."""
    d = GPT2_WIDTH
    shapes: dict[str, tuple[int, ...]] = {"wte": (50257, d), "wpe": (1024, d)}
    for i in range(GPT2_LAYERS):
        for name, shape in (
            ("ln_1.weight", (d,)), ("ln_1.bias", (d,)),
            ("attn.c_attn.weight", (d, 3 * d)), ("attn.c_attn.bias", (3 * d,)),
            ("attn.c_proj.weight", (d, d)), ("attn.c_proj.bias", (d,)),
            ("ln_2.weight", (d,)), ("ln_2.bias", (d,)),
            ("mlp.c_fc.weight", (d, 4 * d)), ("mlp.c_fc.bias", (4 * d,)),
            ("mlp.c_proj.weight", (4 * d, d)), ("mlp.c_proj.bias", (d,)),
        ):  # fmt: skip
            shapes[f"h.{i}.{name}"] = shape
    shapes["ln_f.weight"], shapes["ln_f.bias"] = (d,), (d,)
    return {name: np.full(shape, 0.5, dtype=np.float32) for name, shape in shapes.items()}


def touch(value: Any) -> int:
    """Read every page of an array, or of each array in a dict."""
    if isinstance(value, dict):
        return sum(touch(v) for v in value.values())
    flat = np.asarray(value).reshape(-1).view(np.uint8)
    return int(flat[::4096].sum()) + (int(flat[-1]) if flat.size else 0)


def _actors(on_a: dict[str, float], on_b: dict[str, float]) -> dict[str, Any]:
    """The producer on host a and the consumer on host b, plain and under ``@rv.transfer``."""
    import ray

    import ray_velo as rv

    class Producer:
        def make(self, kind: str, nbytes: int) -> bool:
            if kind == "dict":
                self.value: Any = gpt2_state_dict()
            else:  # i % 251 in every byte, without a uint64 temporary 8x the payload
                self.value = np.resize(np.arange(251, dtype=np.uint8), nbytes)
            return True

        def velo_put(self) -> Any:
            return rv.put(self.value)

        def ray_put(self) -> list[Any]:
            return [ray.put(self.value)]

        def value_back(self) -> Any:  # the pipeline's return: a dict, staged when decorated
            return self.value

    class Consumer:
        def velo_fetch(self, handle: Any) -> int:
            value = rv.fetch(handle)
            read = touch(value)
            del value
            return read

        def ray_get(self, refs: list[Any]) -> int:
            value = ray.get(refs[0])
            read = touch(value)
            del value
            return read

        def take(self, value: Any) -> int:  # the pipeline's second stage
            return touch(value)

    def on(resources: dict[str, float], cls: type) -> Any:
        return ray.remote(num_cpus=0, resources=resources)(cls)

    return {
        "producer": on(on_a, Producer).remote(),
        "consumer": on(on_b, Consumer).remote(),
        "pipe_producer": rv.transfer(on(on_a, Producer)).remote(),
        "pipe_consumer": rv.transfer(on(on_b, Consumer)).remote(),
    }


def _columns(actors: dict[str, Any], kind: str) -> dict[str, Callable[[], int]]:
    """The two ways to move a shape, each one call timed from here: ray_velo and Ray."""
    import ray

    p, c = actors["producer"], actors["consumer"]
    if kind in ("dict", "pipe"):  # a method's return handed to another actor, decorated or not
        pp, pc = actors["pipe_producer"], actors["pipe_consumer"]
        return {
            "velo": lambda: ray.get(pc.take.remote(pp.value_back.remote())),
            "ray": lambda: ray.get(c.take.remote(p.value_back.remote())),
        }
    return {
        "velo": lambda: ray.get(c.velo_fetch.remote(p.velo_put.remote())),
        "ray": lambda: ray.get(c.ray_get.remote(p.ray_put.remote())),
    }


def _registered_bytes(node_ip: str) -> int | None:
    """Registered bytes of the agent on the node at ``node_ip`` (None where not known)."""
    try:
        import ray

        from ray_velo.ops import cluster_status

        nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
        node_ids = {n["NodeID"]: n["NodeManagerAddress"] for n in nodes if n.get("Alive")}
        for status in cluster_status():
            if node_ids.get(status["node_id"]) == node_ip and "registered_bytes" in status:
                return int(status["registered_bytes"])
    except Exception:  # an older checkout: no such call
        return None
    return None


def measure_shape(
    actors: dict[str, Any], kind: str, nbytes: int, rounds: int, host_a_ip: str
) -> dict[str, Any]:
    """``rounds`` rounds of one shape, ray_velo and Ray by turns (who goes first alternates):
    each column's seconds per round, what each read (the same in every round), and host a's
    registered bytes before and after."""
    import ray

    makers = ("producer", "pipe_producer") if kind in ("dict", "pipe") else ("producer",)
    ray.get([actors[a].make.remote(kind, nbytes) for a in makers])
    before = _registered_bytes(host_a_ip)
    columns = _columns(actors, kind)
    seconds: dict[str, list[float]] = {name: [] for name in columns}
    reads: dict[str, set[int]] = {name: set() for name in columns}
    for round_ in range(rounds):
        order = list(columns) if round_ % 2 == 0 else list(reversed(columns))
        for name in order:
            started = time.perf_counter()
            reads[name].add(columns[name]())
            seconds[name].append(time.perf_counter() - started)
    ray.get([actors[a].make.remote("array", 1) for a in makers])  # the payload's memory back
    return {
        "seconds": seconds,
        "consistent": len(reads["velo"] | reads["ray"]) == 1,
        "registered_before": before,
        "registered_after": _registered_bytes(host_a_ip),
    }


def measure(shapes: Sequence[tuple[str, str, int, int]], ucx_tcp: bool = False) -> dict[str, Any]:
    """Every ``(name, kind, bytes, rounds)`` in ``shapes``, after one small transfer that
    warms both nodes' pools (as a user's first call would). ``ucx_tcp``: the agents may use
    UCX over TCP (the operator's opt-in; by default the bytes cross over the wire)."""
    import ray

    import ray_velo as rv
    from ray_velo.testbed import connect

    info = connect()
    if ucx_tcp:
        rv.init(rv.VeloConfig(rdma=rv.RdmaConfig(ucx=rv.UcxConfig(tcp=True))))
    else:
        rv.init()
    host_a, host_b = info.hosts[0], info.hosts[1]
    actors = _actors({host_a.resource: 1}, {host_b.resource: 1})
    ray.get(actors["producer"].make.remote("array", 1 * MiB))
    ray.get(actors["consumer"].velo_fetch.remote(actors["producer"].velo_put.remote()))
    out = {}
    for name, kind, nbytes, rounds in shapes:
        sys.stderr.write(f"  {name}: {rounds} rounds, ray_velo and Ray by turns\n")
        out[name] = measure_shape(actors, kind, nbytes, rounds, host_a.address)
    for actor in actors.values():
        ray.kill(getattr(actor, "ray_handle", actor))  # a decorated actor's own handle
    rv.shutdown()
    return {"shapes": out}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shapes_driver.py")
    parser.add_argument("shapes", help="JSON list of [name, kind, bytes, rounds]")
    parser.add_argument("--ucx-tcp", action="store_true", help="agents may use UCX over TCP")
    args = parser.parse_args(argv)
    shapes = [(str(n), str(k), int(b), int(r)) for n, k, b, r in json.loads(args.shapes)]
    result = measure(shapes, args.ucx_tcp)
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
