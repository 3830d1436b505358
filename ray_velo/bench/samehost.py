"""``ray-velo bench``: ray_velo against Ray's object store and the raw UCX ceiling on two Ray nodes
of this machine (docs/benchmarks.md, "On one machine")."""

from __future__ import annotations

import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ray_velo.bench.actors import (
    LATENCY_REPS,
    bench_actors,
    measure_latency,
    medians,
    pipeline_stages,
    transfer_round,
    transport_text,
)
from ray_velo.bench.progress import Progress

MiB = 1 << 20

__all__ = ["BenchRow", "demo", "format_decorator", "run_bench", "ucx_raw_get"]


@dataclass
class BenchRow:
    """Medians for one payload size (seconds; GB/s derived)."""

    size_bytes: int
    seconds: dict[str, float] = field(default_factory=dict)
    paths: dict[str, str] = field(default_factory=dict)

    def gbps(self, column: str) -> float | None:
        t = self.seconds.get(column)
        return None if not t else self.size_bytes / t / 1e9

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["gbps"] = {c: self.gbps(c) for c in self.seconds}
        return out


# --- the two-node cluster ------------------------------------------------------------------


class _Cluster:
    """An embedded two-node Ray cluster with ray_velo on both nodes."""

    def __init__(self, object_store_bytes: int, config: Any = None) -> None:
        import ray
        from ray.cluster_utils import Cluster

        import ray_velo as rv

        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
        node: dict[str, Any] = {"num_cpus": 2, "object_store_memory": object_store_bytes}
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={**node, "resources": {"node_a": 4}, "include_dashboard": False},
        )
        self.cluster.add_node(**node, resources={"node_b": 4})
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, log_to_driver=False, runtime_env=rv.runtime_env())
        rv.init(config)
        producer, consumer = bench_actors()
        self.producer = producer.options(resources={"node_a": 1}).remote()
        self.consumer = consumer.options(resources={"node_b": 1}).remote()
        ray.get([self.producer.ready.remote(), self.consumer.ready.remote()])

    def close(self) -> None:
        import ray

        import ray_velo as rv

        rv.shutdown()
        ray.shutdown()
        self.cluster.shutdown()  # type: ignore[no-untyped-call]


# --- raw UCX ceiling ---------------------------------------------------------------------


def _raw_owner(conn: Any, nbytes: int, shm_dir: str) -> None:
    from ray_velo.memory.arena import ShmArena
    from ray_velo.ucx.binding import MemoryRegistration, UcxContext, UcxWorker

    context = UcxContext()
    worker = UcxWorker(context)
    arena = ShmArena(shm_dir, nbytes, 0xBE7C, prefault=True)
    np.frombuffer(arena.view(0, nbytes), dtype=np.uint8)[:] = 7
    registration = MemoryRegistration.from_address(context, arena.address, nbytes, keepalive=None)
    conn.send((worker.address, arena.address, registration.packed_rkey))
    conn.recv()  # the consumer is done
    registration.close()
    worker.close()
    context.close()
    arena.close()


def _raw_consumer(conn: Any, nbytes: int, reps: int, shm_dir: str) -> None:
    from ray_velo.memory.arena import ShmArena
    from ray_velo.ucx.binding import Endpoint, RemoteKey, UcxContext, UcxWorker, get

    address, remote_addr, rkey_blob = conn.recv()
    context = UcxContext()
    worker = UcxWorker(context)
    arena = ShmArena(shm_dir, nbytes, 0xBE7D, prefault=True)
    endpoint = Endpoint(worker, address)
    rkey = RemoteKey(endpoint, rkey_blob)
    get(endpoint, arena.address, min(nbytes, 4096), remote_addr, rkey, 30.0)  # wire up
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        get(endpoint, arena.address, nbytes, remote_addr, rkey, 60.0)
        times.append(time.perf_counter() - started)
    ok = bool(np.frombuffer(arena.view(0, nbytes), dtype=np.uint8)[:: 1 << 16].min() == 7)
    rkey.close()
    endpoint.close()
    worker.close()
    context.close()
    arena.close()
    conn.send((statistics.median(times), ok))


def ucx_raw_get(nbytes: int, reps: int = 5, shm_dir: str = "/dev/shm") -> float:
    """Median seconds of a bare UCX GET of ``nbytes`` between two fresh processes, from a
    /dev/shm segment into a /dev/shm segment (what the agents do), same UCX settings."""
    return raw_pair(
        (_raw_owner, (nbytes, shm_dir)),
        (_raw_consumer, (nbytes, reps, shm_dir)),
        "raw UCX GET returned wrong bytes",
    )


def raw_pair(
    owner: tuple[Callable[..., None], tuple[Any, ...]],
    consumer: tuple[Callable[..., None], tuple[Any, ...]],
    wrong: str,
) -> float:
    """Run a bare owner process and a consumer process (each ``(target, args)``, the target
    taking its pipe end first): the owner sends what to GET, the consumer answers (seconds,
    bytes right); both are ended. Raises RuntimeError(``wrong``) when the bytes were wrong."""
    ctx = multiprocessing.get_context("spawn")
    owner_end, owner_conn = ctx.Pipe()
    consumer_end, consumer_conn = ctx.Pipe()
    owner_process = ctx.Process(target=owner[0], args=(owner_conn, *owner[1]))
    consumer_process = ctx.Process(target=consumer[0], args=(consumer_conn, *consumer[1]))
    owner_process.start()
    consumer_process.start()
    try:
        consumer_end.send(owner_end.recv())
        seconds, ok = consumer_end.recv()
        owner_end.send("done")
    finally:
        for process in (owner_process, consumer_process):
            process.join(60)
            if process.is_alive():
                process.kill()
    if not ok:
        raise RuntimeError(wrong)
    return float(seconds)


# --- the runs ----------------------------------------------------------------------------


def default_sizes(shm_free_bytes: int) -> list[int]:
    """1 MiB ... 1 GiB, keeping what fits this machine's /dev/shm several times over."""
    sizes = [MiB * s for s in (1, 4, 16, 64, 256, 1024)]
    return [s for s in sizes if s * 6 < shm_free_bytes]


def run_bench(
    sizes: Sequence[int],
    reps: int = 5,
    *,
    config: Any = None,
    with_ucx_raw: bool = True,
    latency: dict[int, dict[str, float | None]] | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> list[BenchRow]:
    """Measure every column for every size, side by side, in one run; given a ``latency``
    dict, also fill it with the mid-size latency medians (size -> column -> seconds).

    Progress: a :class:`~ray_velo.bench.progress.Progress` on stderr, one step per round (and
    per latency and raw UCX probe); a ``progress(done, total, label)`` callable instead, if
    given."""
    steps = bench_steps(len(sizes), reps, latency=latency is not None, ucx_raw=with_ucx_raw)
    if progress is None:
        with Progress(steps, "same-host bench") as bar:
            return _run_bench(sizes, reps, config, with_ucx_raw, latency, bar.step, bar.write)
    report, done = progress, 0

    def tick(label: str) -> None:
        nonlocal done
        done += 1
        report(min(done, steps), steps, label)

    def warn(text: str) -> None:
        sys.stderr.write(text + "\n")

    return _run_bench(sizes, reps, config, with_ucx_raw, latency, tick, warn)


def bench_steps(sizes: int, reps: int, *, latency: bool, ucx_raw: bool) -> int:
    """How many progress steps :func:`run_bench` counts: a round per rep and warm-up per
    size, the latency probe, a raw UCX probe per size."""
    return sizes * (reps + 1) + int(latency) + (sizes if ucx_raw else 0)


def _run_bench(
    sizes: Sequence[int],
    reps: int,
    config: Any,
    with_ucx_raw: bool,
    latency: dict[int, dict[str, float | None]] | None,
    tick: Callable[[str], None],
    warn: Callable[[str], None],
) -> list[BenchRow]:
    largest = max(sizes)
    cluster = _Cluster(object_store_bytes=max(512 * MiB, 3 * largest), config=config)
    rows: list[BenchRow] = []
    try:
        for size in sizes:
            rows.append(_measure_size(cluster, size, reps, tick))
        if latency is not None:
            latency.update(
                measure_latency(
                    cluster.producer, cluster.consumer, {"node_a": 1}, {"node_b": 1}, LATENCY_REPS
                )
            )
            tick("latency")
    finally:
        cluster.close()
    if with_ucx_raw:
        for row in rows:
            try:
                row.seconds["ucx_raw"] = ucx_raw_get(row.size_bytes, reps)
            except Exception as exc:  # the ceiling is informative, never fatal
                warn(f"raw UCX GET unavailable: {exc}")
            tick(f"raw UCX {row.size_bytes // MiB} MiB")
    return rows


#: transfer_round's column names as this table shows them.
_COLUMN_OF = {"ray": "ray", "velo_plain": "velo_chunked", "velo": "velo_rdma", "get_leg": "get_leg"}


def _measure_size(cluster: _Cluster, size: int, reps: int, tick: Callable[[str], None]) -> BenchRow:
    import ray

    ray.get(cluster.producer.make.remote(size))
    before = ray.get(cluster.consumer.path_counts.remote())
    measured = medians(
        reps,
        lambda: transfer_round(cluster.producer, cluster.consumer, plain=True),
        lambda rep: tick(f"{size // MiB} MiB " + (f"rep {rep}" if rep else "warm-up")),
    )
    row = BenchRow(size)
    for column, name in _COLUMN_OF.items():
        value = measured.get(column)
        if value:
            row.seconds[name] = value
    after = ray.get(cluster.consumer.path_counts.remote())
    row.paths = {k: str(v - before.get(k, 0)) for k, v in after.items() if v != before.get(k, 0)}
    ray.get(cluster.producer.drop.remote())
    return row


COLUMNS = ("ray", "velo_chunked", "velo_rdma", "get_leg", "ucx_raw")


def format_table(rows: Sequence[BenchRow]) -> str:
    """The results as a text table: GB/s per column, then the ratios that matter."""
    head = f"{'size':>9} " + " ".join(f"{c:>13}" for c in COLUMNS)
    head += f" {'chunked/ray':>12} {'rdma/ray':>9} {'leg/raw':>8}"
    lines = [head, "-" * len(head)]
    for row in rows:
        cells = []
        for column in COLUMNS:
            value = row.gbps(column)
            cells.append(f"{value:>8.2f} GB/s" if value is not None else f"{'-':>13}")

        def ratio(a: str, b: str, row: BenchRow = row) -> str:
            x, y = row.gbps(a), row.gbps(b)
            return f"{x / y:.2f}x" if x and y else "-"

        size = f"{row.size_bytes // MiB} MiB"
        lines.append(
            f"{size:>9} "
            + " ".join(cells)
            + f" {ratio('velo_chunked', 'ray'):>12} {ratio('velo_rdma', 'ray'):>9}"
            + f" {ratio('get_leg', 'ucx_raw'):>8}"
        )
    lines.append("")
    lines.append(
        "end to end = put on node a + fetch (or ray.get) and touch on node b; "
        "get_leg = the consumer agent's UCX GET alone; ucx_raw = bare UCX GET between two "
        "processes, same transport and /dev/shm memory."
    )
    return "\n".join(lines)


def plot(rows: Sequence[BenchRow], path: str) -> None:
    """A PNG of GB/s against payload size, one line per column."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for column in COLUMNS:
        points = [(r.size_bytes / MiB, r.gbps(column)) for r in rows if r.gbps(column)]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o", label=column)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("payload (MiB)")
    ax.set_ylabel("throughput (GB/s)")
    ax.set_title("ray_velo vs Ray object store vs raw UCX (one run, two local Ray nodes)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def demo(size_bytes: int = 256 * MiB, rounds: int = 3) -> str:
    """A producer actor on node a hands a large array to a consumer actor on node b,
    through Ray's object store and through ray_velo; bytes verified; a short report.

    Each round times put on the producer plus fetch and a full read on the consumer
    (the array itself is made beforehand, untimed).
    """
    import ray

    cluster = _Cluster(object_store_bytes=max(512 * MiB, 3 * size_bytes))
    lines = []
    try:
        expected = ray.get(cluster.producer.make.remote(size_bytes, True))
        best: dict[str, float] = {}
        verified: dict[str, bool] = {}
        for _ in range(rounds):
            refs, put_s = ray.get(cluster.producer.ray_put.remote())
            get_s, crc = ray.get(cluster.consumer.ray_get_crc.remote(refs))
            del refs
            best["ray"] = min(best.get("ray", 1e9), put_s + get_s)
            verified["ray"] = crc == expected
            handle, vput_s = ray.get(cluster.producer.velo_put.remote(True))
            fetch_s, crc = ray.get(cluster.consumer.velo_fetch_crc.remote(handle))
            best["velo"] = min(best.get("velo", 1e9), vput_s + fetch_s)
            verified["velo"] = crc == expected
        paths = ray.get(cluster.consumer.path_counts.remote())
        transport = transport_text(ray.get(cluster.consumer.agent_info.remote())["ucx_transports"])
        if paths.get("rdma/ok"):
            taken = f"UCX GET over {transport}"
        elif paths.get("wire/ok"):
            taken, transport = "the agents' wire", "none (the owner sent the bytes over TCP)"
        else:
            taken = "chunked Ray calls"
        lines.append(f"payload: {size_bytes / MiB:.0f} MiB numpy array, node a -> node b")
        for through, label in (("ray", "Ray object store"), ("velo", f"ray_velo, {taken}")):
            seconds = best[through]
            lines.append(
                f"  {label:<32} {seconds * 1e3:8.1f} ms  {size_bytes / seconds / 1e9:6.2f} GB/s"
                f"  bytes {'verified' if verified[through] else 'WRONG'}"
            )
        lines.append(
            f"  ray_velo: {best['ray'] / best['velo']:.1f}x Ray's object store "
            f"(best of {rounds}; put on node a + fetch and full read on node b)"
        )
        lines.append(f"  consumer-side path decisions: {paths}; UCX transport: {transport}")
        lines.append(
            "  note: both Ray nodes run on this machine, so the bytes crossed loopback, not a "
            "network: these are not cross-host figures. For those, "
            "`sudo ray-velo bench --two-host --shapes` (two emulated hosts on a shaped link)."
        )
        if not all(verified.values()):
            raise RuntimeError("\n".join(lines))
    finally:
        cluster.close()
    return "\n".join(lines)


def run_decorator_bench(size_bytes: int = 256 * MiB, reps: int = 5) -> dict[str, Any]:
    """A two-stage cross-node pipeline of large arrays, decorated with @ray_velo.transfer
    against the same pipeline undecorated (Ray's object store), in one run: each column's
    seconds per round (``seconds``), and whether every round read the same (``same``).

    Stage 1 is an actor on node a returning a prepared array; stage 2 a task on node b that
    reads all of it. Timed from the driver: submit both stages, get stage 2's small result.
    """
    import ray

    import ray_velo as rv

    cluster = _Cluster(object_store_bytes=max(512 * MiB, 4 * size_bytes))
    try:
        batches, read_all = pipeline_stages(size_bytes)
        plain_actor: Any = ray.remote(num_cpus=0, resources={"node_a": 1})(batches)
        plain_task = ray.remote(num_cpus=0, resources={"node_b": 1})(read_all)
        velo_actor = rv.transfer(plain_actor)
        velo_task = rv.transfer(plain_task)
        producers = {"ray": plain_actor.remote(), "velo": velo_actor.remote()}
        tasks = {"ray": plain_task, "velo": velo_task}
        seconds: dict[str, list[float]] = {"ray": [], "velo": []}
        results: dict[str, set[int]] = {"ray": set(), "velo": set()}
        with Progress(reps + 1, "decorator bench") as progress:
            for rep in range(reps + 1):  # the first round warms up
                took = {}
                for name in ("ray", "velo"):
                    started = time.perf_counter()
                    value = ray.get(tasks[name].remote(producers[name].batch.remote()))
                    took[name] = time.perf_counter() - started
                    if rep:
                        seconds[name].append(took[name])
                    results[name].add(value)
                times = ", ".join(f"{name} {s * 1e3:.0f} ms" for name, s in took.items())
                progress.step(f"{'round ' + str(rep) if rep else 'warm-up'}: {times}")
        same = results["ray"] == results["velo"] and len(results["ray"]) == 1
    finally:
        cluster.close()
    return {"size_bytes": size_bytes, "reps": reps, "seconds": seconds, "same": same}


def format_decorator(result: dict[str, Any]) -> str:
    """:func:`run_decorator_bench`'s result as text."""
    ray_s = statistics.median(result["seconds"]["ray"])
    velo_s = statistics.median(result["seconds"]["velo"])
    return "\n".join(
        [
            f"decorated pipeline, {result['size_bytes'] // MiB} MiB arrays, actor on node a -> "
            f"task on node b (median of {result['reps']}):",
            f"  Ray object store (undecorated) {ray_s * 1e3:8.1f} ms",
            f"  @ray_velo.transfer             {velo_s * 1e3:8.1f} ms",
            f"  speedup {ray_s / velo_s:.1f}x; results "
            f"{'identical' if result['same'] else 'DIFFER'}",
        ]
    )


def run_transport_bench(sizes: list[int], reps: int = 5) -> dict[str, Any]:
    """The tensor transports (``tensor_transport="VELO"`` and ``"VELO_NUMPY"``, NIXL where
    installed) against Ray's object store, actor to actor across the two local nodes
    (:func:`~ray_velo.bench.transport.measure_transports`' result)."""
    from ray_velo.bench.transport import OBJECTS, STEPS_PER_SIZE, measure_transports

    cluster = _Cluster(object_store_bytes=max(1 << 30, 6 * max(sizes)))
    try:
        steps = STEPS_PER_SIZE * len(sizes) + len(OBJECTS)
        with Progress(steps, "transport bench") as progress:
            result = measure_transports(
                {"resources": {"node_a": 1}},
                {"resources": {"node_b": 1}},
                sizes,
                reps,
                tick=progress.step,
            )
    finally:
        cluster.close()
    return result


def shm_free_bytes(directory: str = "/dev/shm") -> int:
    st = os.statvfs(directory if os.path.isdir(directory) else tempfile.gettempdir())
    return st.f_bavail * st.f_frsize
