"""Benchmarks, measured side by side in one run: ray_velo against Ray's object store and the
link's own ceiling.

* :mod:`~ray_velo.bench.samehost`: two Ray nodes on this machine (``ray-velo bench``): UCX
  moves bytes through CMA or shared memory here, a path no two real hosts have.
* :mod:`~ray_velo.bench.twohost`: two emulated hosts (``ray-velo bench --two-host``):
  network namespaces joined by a shaped link, UCX over TCP, as between two Ethernet hosts.
"""

from ray_velo.bench.samehost import (
    COLUMNS,
    BenchRow,
    default_sizes,
    demo,
    format_table,
    plot,
    run_bench,
    run_decorator_bench,
    shm_free_bytes,
    ucx_raw_get,
)

__all__ = [
    "COLUMNS",
    "BenchRow",
    "default_sizes",
    "demo",
    "format_table",
    "plot",
    "run_bench",
    "run_decorator_bench",
    "shm_free_bytes",
    "ucx_raw_get",
]
