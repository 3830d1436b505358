"""``ray-velo bench --two-host --fan-out K [--hosts N]``: one payload, K readers at once
(docs/benchmarks.md, "One payload, K readers")."""

from __future__ import annotations

import statistics
import string
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "agent_counters",
    "format_fan_out",
    "hosts_text",
    "measure_fan_out",
    "per_round",
    "reader_hosts",
]

#: Uncounted rounds first: each staging miss of a new size warms one more arena up (three
#: left 10-30% of the measured rounds on the two-host testbed missing, six 0-14%).
_WARM_UP_ROUNDS = 6
#: The key :func:`agent_counters` adds beside the fetch paths (rdma, chunked, cache), and the
#: agent metric it counts: fetches whose bytes came from another consumer node's copy.
_RELAYED = "relayed"
_RELAYED_METRIC = "velo_relay_fetches_total"
#: And the producer's payloads that rode inside Ray's call (no arena was free to stage it).
_INLINE = "inline"
_INLINE_METRIC = "velo_transparent_inline_total"


def reader_hosts(k: int, hosts: int) -> list[int]:
    """The testbed host index (1 = b, 2 = c, ...) of each of ``k`` readers: round-robin over
    every host but a (index 0, the producer's), so ``reader_hosts(3, 3) == [1, 2, 1]``.

    Raises:
        ValueError: ``hosts`` below 2 (no host for a reader) or ``k`` below 1.
    """
    if hosts < 2:
        raise ValueError(f"hosts={hosts}: a fan-out needs at least 2 (a and a reader host)")
    if k < 1:
        raise ValueError(f"k={k}: a fan-out needs at least 1 reader")
    return [1 + i % (hosts - 1) for i in range(k)]


def hosts_text(indices: Sequence[int]) -> str:
    """``"host b"`` or ``"hosts b, c"``: the distinct hosts of ``indices``, in order."""
    names = [string.ascii_lowercase[i] for i in sorted(set(indices))]
    return ("host " if len(names) == 1 else "hosts ") + ", ".join(names)


def agent_counters(on_readers: Sequence[Mapping[str, float]]) -> Counter[str]:
    """The fetch counters (by path: rdma, wire, chunked, cache) and the relayed fetches
    (``"relayed"``) of every reader host's agent, summed over those hosts."""
    import ray

    from ray_velo.client import session

    def counters() -> dict[str, int]:
        metrics = ray.get(session.current().agent.info.remote())["metrics"]
        # velo_relay_fetches_total is new in the agent: an agent without it relayed nothing.
        return {
            **metrics["velo_fetches_total"],
            _RELAYED: int(metrics.get(_RELAYED_METRIC, 0)),
            _INLINE: int(metrics.get(_INLINE_METRIC, 0)),
        }

    task = ray.remote(num_cpus=0)(counters)
    total: Counter[str] = Counter()
    for per_host in ray.get([task.options(resources=dict(on)).remote() for on in on_readers]):
        total.update(per_host)
    return total


def per_round(before: Counter[str], after: Counter[str], reps: int) -> dict[str, float]:
    """Per measured round: transfers over a link (rdma, wire, chunked), of which relayed (from
    another reader's copy rather than host a), node-local copies read, and payloads
    that rode inside Ray's call (``inline``: no transfer of ours)."""
    moved = after - before  # Counter subtraction keeps the positive deltas only
    return {
        "transfers": (moved["rdma"] + moved["wire"] + moved["chunked"]) / reps,
        "relayed": moved[_RELAYED] / reps,
        "copies": moved["cache"] / reps,
        "inline": moved[_INLINE] / reps,
    }


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
    on_readers: Sequence[Mapping[str, float]],
    size: int,
    k: int,
    reps: int,
    tick: Callable[[str], object] = lambda _: None,
) -> dict[str, float]:
    """Median seconds of one round (the producer's call to the last reader's answer) for
    ``ray`` and ``velo`` with ``k`` readers, and ``velo_one`` with one reader on
    ``on_readers[0]`` (host b), the three interleaved round by round after their warm-up
    rounds; for the ray_velo columns also ``<column>_transfers``, ``_relayed``, ``_copies``
    and ``_inline`` per round (see :func:`per_round`), and ``velo_slowest_round_speed``:
    the lowest of Ray's time over ray_velo's in the same round.

    ``on_readers`` holds the resources that place a task on each reader host (b, c, ...);
    the ``k`` readers go round-robin over them (:func:`reader_hosts`).
    """
    import ray

    import ray_velo as rv

    producer_cls, reader_cls = _classes()
    a = ray.remote(num_cpus=0, resources=dict(on_a))
    agents = [*on_readers, on_a]  # the counters: the readers' fetches, the producer's inline
    on = [on_readers[i - 1] for i in reader_hosts(k, len(on_readers) + 1)]

    def readers_on(places: Sequence[Mapping[str, float]], velo: bool) -> list[Any]:
        classes: list[Any] = [ray.remote(num_cpus=0, resources=dict(p))(reader_cls) for p in places]
        return [rv.transfer(c) for c in classes] if velo else classes

    setups = {
        "ray": (a(producer_cls), readers_on(on, velo=False)),
        "velo": (rv.transfer(a(producer_cls), consumers=k), readers_on(on, velo=True)),
        "velo_one": (rv.transfer(a(producer_cls)), readers_on(on[:1], velo=True)),
    }
    live: dict[str, tuple[Any, list[Any]]] = {}
    for column, (producer_of, reader_ofs) in setups.items():
        live[column] = (producer_of.remote(size), [reader_of.remote() for reader_of in reader_ofs])
    ray.get([p.ready.remote() for p, _ in live.values()])
    ray.get([r.ready.remote() for _, readers in live.values() for r in readers])
    tick(f"fan-out {k}: {', '.join(live)} interleaved round by round")
    times, moved = _interleaved_rounds(live, agents, reps)
    out: dict[str, float] = {}
    for column, seconds in times.items():
        tick(f"  {column} rounds: " + " ".join(f"{t * 1e3:.0f}" for t in seconds) + " ms")
        out[column] = statistics.median(seconds)
        if column != "ray":
            counts = per_round(Counter(), moved[column], reps)
            out.update({f"{column}_{name}": value for name, value in counts.items()})
    speeds = [r / v for r, v in zip(times["ray"], times["velo"], strict=True)]
    tick("  velo/Ray speed round by round: " + " ".join(f"{x:.2f}x" for x in speeds))
    out["velo_slowest_round_speed"] = min(speeds)
    for producer, readers in live.values():
        for actor in (producer, *readers):
            ray.kill(getattr(actor, "ray_handle", actor))
    return out


def _interleaved_rounds(
    live: Mapping[str, tuple[Any, list[Any]]], agents: Sequence[Mapping[str, float]], reps: int
) -> tuple[dict[str, list[float]], dict[str, Counter[str]]]:
    """Each column's round in turn, ``reps`` counted rounds after the warm-up ones: the
    seconds of each counted round, and what the agents counted during a column's rounds."""
    import ray

    times: dict[str, list[float]] = {column: [] for column in live}
    moved: dict[str, Counter[str]] = {column: Counter() for column in live}
    # Uncounted warm-up rounds: transparent staging never maps in a send, so the first
    # rounds of a new size ride inside Ray's call while the agents warm arenas up.
    for rep in range(reps + _WARM_UP_ROUNDS):
        counted = rep >= _WARM_UP_ROUNDS
        for column, (producer, readers) in live.items():
            agents_count = counted and column != "ray"  # undecorated: the agents take no part
            before = agent_counters(agents) if agents_count else Counter()
            started = time.perf_counter()
            ref = producer.batch.remote()
            ray.get([r.read.remote(ref) for r in readers])
            if counted:
                times[column].append(time.perf_counter() - started)
            del ref
            if agents_count:
                moved[column] += agent_counters(agents) - before
    return times, moved


def format_fan_out(
    rows: dict[str, dict[str, float]], k: int, size: int, reps: int, hosts: int = 2
) -> str:
    """One line per link: seconds per round, and ray_velo's speed over Ray's; under it, what
    the reader hosts' agents moved per round. ``hosts``: the testbed's, a included."""
    placed_on = set(reader_hosts(k, hosts))
    placed = hosts_text(sorted(placed_on))
    head = (
        f"{'link':>8} {'Ray x' + str(k):>9} {'velo x' + str(k):>9} {'velo x1':>9} "
        f"{'velo/Ray speed':>15} {'velo xK / x1':>13}"
    )
    lines = [
        f"{size >> 20} MiB to {k} readers on {placed} at once, median of {reps} rounds:",
        head,
        "-" * len(head),
    ]
    agents = f"{placed}'s agent" if len(placed_on) == 1 else f"the agents of {placed}"
    for link, row in rows.items():
        lines.append(
            f"{link:>8} {row['ray'] * 1e3:>8.0f}ms {row['velo'] * 1e3:>8.0f}ms "
            f"{row['velo_one'] * 1e3:>8.0f}ms {row['ray'] / row['velo']:>14.2f}x "
            f"{row['velo'] / row['velo_one']:>12.2f}x"
        )
        lines.append(
            f"{'':>8} per round, {agents} moved the bytes over a link "
            f"{row.get('velo_transfers', 0):.1f} times for {k} readers "
            f"({row.get('velo_relayed', 0):.1f} relayed from another reader's copy, "
            f"not host a's; {row.get('velo_copies', 0):.1f} read a node-local copy; "
            f"{row.get('velo_inline', 0):.1f} rounds rode inside Ray's call); the slowest "
            f"round's velo/Ray speed {row.get('velo_slowest_round_speed', 0):.2f}x"
        )
    lines.append(
        "velo/Ray speed = Ray's time over ray_velo's (above 1.00x: ray_velo is faster); "
        "velo xK / x1 = K readers' time over one reader's on host b "
        "(1.00x: K readers cost what one does)."
    )
    return "\n".join(lines)
