"""``ray-velo bench --scale``: the cost of one operation as the live handles on a node grow
(docs/tuning.md, "Many live handles")."""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ray_velo.bench.progress import Progress

__all__ = ["ScaleRow", "format_scale", "run_scale_bench"]

#: Live handle counts measured.
COUNTS = (1_000, 10_000, 100_000)
#: The timed operations' payload, and the fillers' (their count is what matters).
OP_BYTES = 64 << 10
FILL_BYTES = 4 << 10
COLUMNS = ("put", "fetch", "release", "ray", "remote")


@dataclass
class ScaleRow:
    """Medians at one live-handle count (seconds) and the agent's heap per live handle."""

    live_handles: int
    seconds: dict[str, float] = field(default_factory=dict)
    heap_bytes_per_handle: float | None = None


def _worker_class() -> Any:
    import ray

    import ray_velo as rv

    @ray.remote(num_cpus=0)
    class ScaleWorker:
        """Fills its node with live handles and times operations among them."""

        def __init__(self) -> None:
            self.fillers: list[Any] = []
            self.array = np.arange(OP_BYTES, dtype=np.uint8)

        def ready(self) -> str:
            """Warms the agent, its socket and a mapped arena; this worker's node id."""
            rv.release(rv.put(self.array), 0)
            return str(ray.get_runtime_context().get_node_id())

        def fill_to(self, count: int) -> int:
            filler = np.zeros(FILL_BYTES, dtype=np.uint8)
            while len(self.fillers) < count:
                self.fillers.append(rv.put(filler))
            return len(self.fillers)

        def stage(self, count: int) -> list[Any]:
            """``count`` fresh 64 KiB handles (for a worker on the other node to fetch)."""
            return [rv.put(self.array) for _ in range(count)]

        def time_local(self, samples: int) -> dict[str, float]:
            """Medians of put, same-node fetch, release and Ray's put + get, interleaved."""
            times: dict[str, list[float]] = {c: [] for c in ("put", "fetch", "release", "ray")}
            clock = time.perf_counter
            for _ in range(samples):
                started = clock()
                handle = rv.put(self.array)
                times["put"].append(clock() - started)
                started = clock()
                view = rv.fetch(handle, release=False)
                times["fetch"].append(clock() - started)
                del view
                started = clock()
                rv.release(handle, 0)
                times["release"].append(clock() - started)
                started = clock()
                ray.get(ray.put(self.array))
                times["ray"].append(clock() - started)
            gc.collect()
            return {name: statistics.median(values) for name, values in times.items()}

        def time_fetches(self, handles: list[Any]) -> float:
            """The median of fetching each of ``handles`` (from another node)."""
            times = []
            for handle in handles:
                started = time.perf_counter()
                value = rv.fetch(handle)
                times.append(time.perf_counter() - started)
                del value
            return statistics.median(times)

    return ScaleWorker


def _agent_heap(node_id: str) -> int:
    import ray

    from ray_velo.actors import ensure_agent

    status = ray.get(ensure_agent(node_id).status.remote())
    return int(status["process"]["rss_anon_bytes"])


def run_scale_bench(counts: tuple[int, ...] = COUNTS, samples: int = 200) -> list[ScaleRow]:
    """Measure every column at each live-handle count."""
    import ray

    from ray_velo.bench.samehost import _Cluster

    cluster = _Cluster(object_store_bytes=512 << 20)
    try:
        worker = _worker_class()
        on_a = worker.options(resources={"node_a": 1}).remote()
        on_b = worker.options(resources={"node_b": 1}).remote()
        node_a, _ = ray.get([on_a.ready.remote(), on_b.ready.remote()])
        base_heap = _agent_heap(node_a)
        rows = []
        with Progress(len(counts), "scale bench") as progress:
            for count in counts:
                progress.working(f"filling node a to {count:,} live handles")
                ray.get(on_a.fill_to.remote(count), timeout=3600)
                gc.collect()
                row = ScaleRow(count)
                row.seconds = ray.get(on_a.time_local.remote(samples), timeout=600)
                handles = ray.get(on_a.stage.remote(samples), timeout=600)
                row.seconds["remote"] = ray.get(on_b.time_fetches.remote(handles), timeout=600)
                row.heap_bytes_per_handle = (_agent_heap(node_a) - base_heap) / count
                rows.append(row)
                progress.step(f"{count:,} live handles")
        return rows
    finally:
        cluster.close()


def format_scale(rows: list[ScaleRow], samples: int) -> str:
    """The table: per-operation medians (ms) at each count, their ratio to the smallest
    count, the targets' checks, and the agent's heap per live handle."""
    lines = [
        f"Per-operation cost vs live handles on the node (medians of {samples}, ms; "
        f"{OP_BYTES >> 10} KiB payloads; live handles of {FILL_BYTES >> 10} KiB)",
        "| live handles | " + " | ".join(COLUMNS) + " | agent heap / handle |",
        "|---|" + "---|" * (len(COLUMNS) + 1),
    ]
    for row in rows:
        cells = [f"{row.seconds[c] * 1e3:.3f}" for c in COLUMNS]
        heap = "" if row.heap_bytes_per_handle is None else f"{row.heap_bytes_per_handle:.0f} B"
        lines.append(f"| {row.live_handles:,} | " + " | ".join(cells) + f" | {heap} |")
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        ratios = ", ".join(
            f"{c} {last.seconds[c] / first.seconds[c]:.2f}x" for c in COLUMNS if c != "ray"
        )
        lines.append(
            f"\n{last.live_handles:,} vs {first.live_handles:,}: {ratios} (target <= 1.3x)"
        )
    for row in rows:
        put, fetch, release, ray = (row.seconds[c] for c in ("put", "fetch", "release", "ray"))
        lines.append(
            f"{row.live_handles:,}: release/put {release / put:.2f} (target <= 1), "
            f"(put+fetch)/Ray's put+get {(put + fetch) / ray:.2f} (target <= 1)"
        )
    return "\n".join(lines)
