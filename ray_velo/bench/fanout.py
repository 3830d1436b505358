"""``ray-velo bench --two-host --fan-out K``: one payload, K consumers on another host at once.

An actor on host a returns an array; K actors on host b take it at the same moment and read
every page. Ray: the ObjectRef goes to the K readers (Ray pulls the object into host b once).
ray_velo: the producer is ``@rv.transfer(consumers=K)``, the readers decorated; their fetches
overlap, so the node's agent moves the bytes once and the others read its copy (single
flight). Also timed: ray_velo with one reader, the time K readers should come close to.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

__all__ = ["format_fan_out", "measure_fan_out"]

#: Uncounted rounds first: each staging miss of a new size warms one more arena up (three
#: left 10-30% of the measured rounds on the two-host testbed missing, six 0-14%).
_WARM_UP_ROUNDS = 6


def _fetches(on_b: Mapping[str, float]) -> dict[str, int]:
    """The fetch counters of host b's agent (by path: rdma, chunked, cache)."""
    import ray

    from ray_velo import session

    @ray.remote(num_cpus=0, resources=dict(on_b))
    def counters() -> dict[str, int]:
        info = ray.get(session.current().agent.info.remote())
        return dict(info["metrics"]["velo_fetches_total"])

    return ray.get(counters.remote())


def _classes() -> tuple[type, type]:
    class Producer:
        def __init__(self, nbytes: int) -> None:
            self.array = np.ones(nbytes, dtype=np.uint8)

        def ready(self) -> bool:
            return True

        def batch(self) -> np.ndarray[Any, Any]:
            return self.array

    class Reader:
        def ready(self) -> bool:
            return True

        def read(self, array: np.ndarray[Any, Any]) -> int:
            return int(array[::4096].sum())  # a read of every page

    return Producer, Reader


def measure_fan_out(
    on_a: Mapping[str, float],
    on_b: Mapping[str, float],
    size: int,
    k: int,
    reps: int,
    tick: Callable[[str], object] = lambda _: None,
) -> dict[str, float]:
    """Median seconds of one round (the producer's call to the last reader's answer) for
    ``ray`` and ``velo`` with ``k`` readers, and ``velo_one`` with one."""
    import ray

    import ray_velo as rv

    producer_cls, reader_cls = _classes()
    a = ray.remote(num_cpus=0, resources=dict(on_a))
    b = ray.remote(num_cpus=0, resources=dict(on_b))
    setups = {
        "ray": (a(producer_cls), b(reader_cls), k),
        "velo": (rv.transfer(a(producer_cls), consumers=k), rv.transfer(b(reader_cls)), k),
        "velo_one": (rv.transfer(a(producer_cls)), rv.transfer(b(reader_cls)), 1),
    }
    out: dict[str, float] = {}
    for column, (producer_of, reader_of, count) in setups.items():
        tick(f"fan-out {k}: {column}")
        producer = producer_of.remote(size)
        readers = [reader_of.remote() for _ in range(count)]
        ray.get([producer.ready.remote(), *(r.ready.remote() for r in readers)])
        times = []
        # Uncounted warm-up rounds: transparent staging never maps in a send, so the first
        # rounds of a new size ride inside Ray's call while the agents warm arenas up.
        for rep in range(reps + _WARM_UP_ROUNDS):
            if rep == _WARM_UP_ROUNDS:
                fetches = _fetches(on_b)
            started = time.perf_counter()
            ref = producer.batch.remote()
            ray.get([r.read.remote(ref) for r in readers])
            if rep >= _WARM_UP_ROUNDS:
                times.append(time.perf_counter() - started)
            del ref
        out[column] = statistics.median(times)
        moved = {p: n - fetches.get(p, 0) for p, n in _fetches(on_b).items()}
        if column != "ray":  # transfers over the link per round, and copies read
            out[f"{column}_transfers"] = (moved.get("rdma", 0) + moved.get("chunked", 0)) / reps
            out[f"{column}_copies"] = moved.get("cache", 0) / reps
        for actor in (producer, *readers):
            ray.kill(getattr(actor, "ray_handle", actor))
    return out


def format_fan_out(rows: dict[str, dict[str, float]], k: int, size: int, reps: int) -> str:
    """One line per link: seconds per round, and ray_velo's speed over Ray's."""
    head = (
        f"{'link':>8} {'Ray x' + str(k):>9} {'velo x' + str(k):>9} {'velo x1':>9} "
        f"{'velo/Ray speed':>15} {'velo xK / x1':>13}"
    )
    lines = [
        f"{size >> 20} MiB to {k} readers on host b at once, median of {reps} rounds:",
        head,
        "-" * len(head),
    ]
    for link, row in rows.items():
        lines.append(
            f"{link:>8} {row['ray'] * 1e3:>8.0f}ms {row['velo'] * 1e3:>8.0f}ms "
            f"{row['velo_one'] * 1e3:>8.0f}ms {row['ray'] / row['velo']:>14.2f}x "
            f"{row['velo'] / row['velo_one']:>12.2f}x"
        )
        lines.append(
            f"{'':>8} per round, host b's agent moved the bytes over the link "
            f"{row.get('velo_transfers', 0):.1f} times for {k} readers "
            f"({row.get('velo_copies', 0):.1f} read its node-local copy)"
        )
    lines.append(
        "velo/Ray speed = Ray's time over ray_velo's (above 1.00x: ray_velo is faster); "
        "velo xK / x1 = K readers' time over one reader's (1.00x: the bytes crossed once)."
    )
    return "\n".join(lines)
