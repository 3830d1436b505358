"""The actors every benchmark places on its nodes: a producer of arrays and a consumer that reads
every page, each timing itself. Ray is imported on first use."""

from __future__ import annotations

import functools
import os
import statistics
import time
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

__all__ = [
    "LATENCY_REPS",
    "LATENCY_SIZES",
    "bench_actors",
    "cpu_ticks",
    "format_latency",
    "machine_process",
    "measure_latency",
    "medians",
    "pipeline_stages",
    "pipelines",
    "rounds",
    "stolen_since",
    "touch",
    "transfer_round",
    "transport_text",
    "wait_processes_gone",
]


def cpu_ticks(stat_path: str = "/proc/stat") -> tuple[int, int]:
    """(ticks stolen by the hypervisor, all ticks) of this machine so far (``/proc/stat``);
    (0, 0) where there is none. A VM's vCPUs are descheduled in bursts, and a transfer that
    loses a tenth of its CPU time that way runs slower for reasons outside it."""
    try:
        with open(stat_path) as stat:
            fields = [int(f) for f in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def machine_process() -> tuple[str, int]:
    """(this machine's boot id, this process's pid): a pid means something only where the
    boot id is the caller's own."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip(), os.getpid()


def wait_processes_gone(processes: list[tuple[str, int]], bound_s: float) -> None:
    """Wait (bounded) until the processes on this machine have exited: a killed actor's
    process goes on running for a while (NIXL's agent tears down), and the rounds after it
    must not share the cores with it (each column then runs on a machine as quiet)."""
    from ray_velo.testbed.netns import process_running

    boot_id = machine_process()[0]
    pids = [pid for boot, pid in processes if boot == boot_id]
    deadline = time.monotonic() + bound_s
    while any(process_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def stolen_since(start: tuple[int, int]) -> float | None:
    """The share of CPU time stolen since ``start`` (a :func:`cpu_ticks`), or None."""
    steal, total = cpu_ticks()
    return (steal - start[0]) / (total - start[1]) if total > start[1] else None


def touch(array: Any) -> int:
    """Read every page of ``array`` (a materialized fetch, not a lazy view)."""
    flat = np.asarray(array).reshape(-1).view(np.uint8)
    return int(flat[::4096].sum()) + (int(flat[-1]) if flat.size else 0)


def transport_text(transports: dict[str, list[str]]) -> str:
    """An agent's ``ucx_transports`` (peer node -> lanes) as one line: ``"tcp/veth0"``."""
    lanes = sorted({lane for node in transports.values() for lane in node})
    return ", ".join(lanes) or "none (no UCX GET ran)"


def _make(nbytes: int) -> np.ndarray[Any, Any]:
    # i % 251 for every byte i, allocating the payload only (through uint64 it took 16x its
    # size: a 1.5 GiB payload ran a node out of memory)
    return np.resize(np.arange(251, dtype=np.uint8), nbytes)


@functools.cache
def bench_actors() -> tuple[Any, Any]:
    """The (Producer, Consumer) actor classes, made once per process."""
    return _producer_class(), _consumer_class()


def _producer_class() -> Any:
    """The producer: makes the payload once, then puts it by each path, timed."""
    import ray

    import ray_velo as rv

    @ray.remote(num_cpus=0)
    class Producer:
        def ready(self) -> bool:
            return True

        def make(self, nbytes: int, full_crc: bool = False) -> int:
            self.array = _make(nbytes)
            return zlib.crc32((self.array if full_crc else self.array[: 1 << 20]).data)

        def ray_put(self) -> tuple[list[Any], float]:
            started = time.perf_counter()
            ref = ray.put(self.array)
            return [ref], time.perf_counter() - started

        def velo_put(self, pinned: bool) -> tuple[rv.DataHandle, float]:
            started = time.perf_counter()
            handle = rv.put(self.array, pinned=pinned)
            return handle, time.perf_counter() - started

        def velo_build(self) -> tuple[rv.DataHandle, float]:
            """The array built in place (rv.empty, seal): seconds of the staging calls,
            not of the fill, which stands for the producer computing its result there."""
            started = time.perf_counter()
            buf = rv.empty(self.array.shape, self.array.dtype)
            reserved = time.perf_counter()
            np.copyto(buf.array, self.array)
            filled = time.perf_counter()
            handle = buf.seal()
            return handle, (reserved - started) + (time.perf_counter() - filled)

        def drop(self) -> None:
            del self.array

    return Producer


def _consumer_class() -> Any:
    """The consumer: gets the payload by each path and reads every page of it, timed."""
    import ray

    import ray_velo as rv
    from ray_velo.client import session

    @ray.remote(num_cpus=0)
    class Consumer:
        def ready(self) -> bool:
            return True

        def ray_get(self, refs: list[Any]) -> float:
            started = time.perf_counter()
            value = ray.get(refs[0])
            touch(value)
            elapsed = time.perf_counter() - started
            del value
            return elapsed

        def velo_fetch(self, handle: rv.DataHandle) -> tuple[float, float | None]:
            """(fetch + read seconds, the agent's GET seconds or None when no GET ran)."""
            agent = session.current().agent
            before = ray.get(agent.info.remote())["metrics"]
            started = time.perf_counter()
            value = rv.fetch(handle)
            touch(value)
            elapsed = time.perf_counter() - started
            del value
            after = ray.get(agent.info.remote())["metrics"]
            gets = after["velo_rendezvous_rdma_get_duration_seconds"]
            gets0 = before["velo_rendezvous_rdma_get_duration_seconds"]
            leg = gets["sum"] - gets0["sum"] if gets["count"] > gets0["count"] else None
            return elapsed, leg

        def ray_get_crc(self, refs: list[Any]) -> tuple[float, int]:
            started = time.perf_counter()
            value = ray.get(refs[0])
            crc = zlib.crc32(value)
            return time.perf_counter() - started, crc

        def velo_fetch_crc(self, handle: rv.DataHandle) -> tuple[float, int]:
            started = time.perf_counter()
            crc = zlib.crc32(rv.fetch(handle))
            return time.perf_counter() - started, crc

        def agent_info(self) -> dict[str, Any]:
            return ray.get(session.current().agent.info.remote())  # type: ignore[no-any-return]

        def path_counts(self) -> dict[str, int]:
            return dict(self.agent_info()["metrics"]["velo_rendezvous_rdma_path_total"])

    return Consumer


def pipeline_stages(array_bytes: int) -> tuple[type, Any]:
    """A two-stage pipeline: an actor class whose ``batch()`` returns a prepared array,
    and a function that reads all of it (returns a checksum)."""

    class Batches:
        def __init__(self) -> None:
            self.array = _make(array_bytes)

        def batch(self) -> np.ndarray[Any, Any]:
            return self.array

    def read_all(array: np.ndarray[Any, Any]) -> int:
        return touch(array)

    return Batches, read_all


def pipelines(
    size: int, on_a: Mapping[str, float], on_b: Mapping[str, float]
) -> tuple[Callable[[], dict[str, float | None]], list[Any]]:
    """One round of the two-stage pipeline (an actor with resources ``on_a`` returns a
    ``size``-byte array to a task with ``on_b`` that reads it), undecorated (``pipe_ray``) and
    under ``@rv.transfer`` (``pipe_velo``), timed from the driver; and the actors to kill."""
    import ray

    import ray_velo as rv

    batches, read_all = pipeline_stages(size)
    plain_actor: Any = ray.remote(num_cpus=0, resources=dict(on_a))(batches)
    plain_task = ray.remote(num_cpus=0, resources=dict(on_b))(read_all)
    stages = {
        "pipe_ray": (plain_actor.remote(), plain_task),
        "pipe_velo": (rv.transfer(plain_actor).remote(), rv.transfer(plain_task)),
    }

    def one() -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        for column, (actor, task) in stages.items():
            started = time.perf_counter()
            ray.get(task.remote(actor.batch.remote()))
            out[column] = time.perf_counter() - started
        return out

    return one, [actor for actor, _ in stages.values()]


#: Mid-size payloads, where the control plane's round trips are the cost (issue 12).
#: From just above the decorator's 256 KiB threshold (a payload must be above it to be staged)
#: to 4 MiB: where the default threshold is decided (docs/transfer.md, "Why 256 KiB").
LATENCY_SIZES = (300 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20)
#: Rounds per size (medians): a round is ~50 ms here, and 12 left ratios near 1.0 to noise.
LATENCY_REPS = 30


def measure_latency(
    producer: Any,
    consumer: Any,
    on_a: Mapping[str, float],
    on_b: Mapping[str, float],
    reps: int = 12,
    each: Callable[[int], object] = lambda _: None,
) -> dict[int, dict[str, float | None]]:
    """Median seconds per transfer for each of :data:`LATENCY_SIZES`: ``ray`` and ``velo``
    (put on a + fetch and read on b, timed inside the actors), ``pipe_ray`` and
    ``pipe_velo`` (the two-stage pipeline, timed from the driver)."""
    import ray

    rows: dict[int, dict[str, float | None]] = {}
    for size in LATENCY_SIZES:
        ray.get(producer.make.remote(size))
        rows[size] = medians(reps, lambda: transfer_round(producer, consumer), each)
        one, actors = pipelines(size, on_a, on_b)
        rows[size].update(medians(reps, one, each))
        for actor in actors:
            ray.kill(getattr(actor, "ray_handle", actor))
        ray.get(producer.drop.remote())
    return rows


def format_latency(rows: dict[int, dict[str, float | None]], reps: int) -> str:
    """Mid-size payloads: median ms per transfer beside Ray's, and ray_velo's time over
    Ray's (below 1.00x: ray_velo is faster)."""
    head = (
        f"{'size':>8} {'Ray':>8} {'velo':>8} {'velo/Ray':>9} "
        f"{'pipe Ray':>9} {'pipe velo':>10} {'pipe v/R':>9}"
    )
    lines = [f"mid-size payloads, median ms per transfer (of {reps}):", head, "-" * len(head)]

    def ms(value: float | None) -> str:
        return f"{value * 1e3:.2f}" if value else "-"

    def over(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}x" if a and b else "-"

    for size, row in sorted(rows.items()):
        label = f"{size >> 10} KiB" if size < (1 << 20) else f"{size >> 20} MiB"
        lines.append(
            f"{label:>8} {ms(row.get('ray')):>8} {ms(row.get('velo')):>8} "
            f"{over(row.get('velo'), row.get('ray')):>9} {ms(row.get('pipe_ray')):>9} "
            f"{ms(row.get('pipe_velo')):>10} {over(row.get('pipe_velo'), row.get('pipe_ray')):>9}"
        )
    lines.append(
        "velo/Ray = ray_velo's time over Ray's (below 1.00x: faster); Ray and velo are timed "
        "inside the actors (put on a, fetch and read on b), the pipelines from the driver."
    )
    return "\n".join(lines)


def transfer_round(
    producer: Any,
    consumer: Any,
    *,
    ray_store: bool = True,
    plain: bool = False,
    built: bool = False,
    velo_first: bool = False,
) -> dict[str, float | None]:
    """One round of the producer's array to the consumer, seconds per column: ``ray``
    (put + get + read through Ray's object store), ``velo`` (rv.put pinned + rv.fetch +
    read), its ``put`` and ``get_leg`` (the agent's UCX GET, None when none ran), the share
    of CPU time the hypervisor stole meanwhile (``velo_stolen``); with ``plain`` also
    ``velo_plain`` (staged in plain memory: the chunked path), with ``built`` also
    ``velo_built``, ``seal`` and ``built_get_leg`` (the array built in place with rv.empty
    and sealed: no staging copy). ``velo_first``: ray_velo's transfers before Ray's, and
    the built one before the put one (alternate it between rounds: what one column leaves
    to clean up, a GiB object freed in the background, then burdens each by turns)."""
    import ray

    out: dict[str, float | None] = {}

    def through_ray() -> None:
        if ray_store:
            refs, put_s = ray.get(producer.ray_put.remote())
            get_s = ray.get(consumer.ray_get.remote(refs))
            del refs
            out["ray"] = put_s + get_s

    def through_velo(method: str, arg: tuple[Any, ...], total: str, staging: str, leg: str) -> None:
        handle, stage_s = ray.get(getattr(producer, method).remote(*arg))
        fetch_s, leg_s = ray.get(consumer.velo_fetch.remote(handle))
        out[total], out[staging], out[leg] = stage_s + fetch_s, stage_s, leg_s

    if not velo_first:
        through_ray()
    if plain:
        through_velo("velo_put", (False,), "velo_plain", "put_plain", "plain_leg")
    start = cpu_ticks()
    turns: list[tuple[str, tuple[Any, ...], str, str, str]] = [
        ("velo_put", (True,), "velo", "put", "get_leg")
    ]
    if built:
        by_build = ("velo_build", (), "velo_built", "seal", "built_get_leg")
        turns.insert(0 if velo_first else 1, by_build)
    for turn in turns:
        through_velo(*turn)
    out["velo_stolen"] = stolen_since(start)
    if velo_first:
        through_ray()
    return out


def rounds(
    reps: int, one: Callable[[], dict[str, float | None]], each: Callable[[int], object] = print
) -> dict[str, list[float]]:
    """``one()``'s columns over ``reps`` rounds after one uncounted warm-up, in round order;
    ``each(rep)`` after every round (progress; rep 0 is the warm-up)."""
    samples: dict[str, list[float]] = {}
    for rep in range(reps + 1):
        for column, value in one().items():
            if rep and value is not None:
                samples.setdefault(column, []).append(value)
        each(rep)
    return samples


def medians(
    reps: int, one: Callable[[], dict[str, float | None]], each: Callable[[int], object] = print
) -> dict[str, float | None]:
    """Medians of :func:`rounds`."""
    samples = rounds(reps, one, each)
    return {column: statistics.median(values) for column, values in samples.items()}
