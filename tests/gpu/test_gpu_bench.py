"""The issue's GPU benchmark, run once small as a smoke test: every column runs and moves
the right bytes. Not a timed test (DESIGN.md §8): the bars are read off the command's table
(``python -m ray_velo.bench.gpu --size-mib 256 --reps 5``), which docs/gpu.md quotes."""

from __future__ import annotations

import pytest

from tests.gpu.conftest import require_cuda

require_cuda("the GPU benchmark (ray_velo vs bare UCX cuda_ipc GET vs Ray's object store)")

pytestmark = [pytest.mark.gpu, pytest.mark.ray, pytest.mark.slow]


def test_gpu_bench_runs_every_column() -> None:
    """16 MiB, twice each: ray_velo, a bare CUDA-to-CUDA UCX GET, Ray's object store; the
    bytes are checked inside each column; the table names the issue's bars."""
    import ray

    if ray.is_initialized():
        pytest.skip("the benchmark starts its own Ray: run this module on its own")
    from ray_velo.bench.gpu import format_gpu_bench, run_gpu_bench

    result = run_gpu_bench(16 << 20, reps=2)
    assert result.velo_s > 0 and result.ray_s > 0 and (result.ucx_raw_s or 0) > 0
    table = format_gpu_bench(result)
    assert "bar >= 0.8x" in table and "bar >= 5x" in table
    print(table)
