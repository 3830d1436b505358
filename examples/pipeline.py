"""A two-stage pipeline of 100 MB arrays between tasks on different nodes.

    python examples/pipeline.py

Stage 1 (node a) makes a 100 MB array; stage 2 (node b) normalizes it; the driver checks
the result. @ray_velo.transfer stages every array above 256 KiB on its node's agent; the
task bodies only ever see numpy arrays.
"""

import numpy as np
import ray
from _local_cluster import MiB, two_nodes

import ray_velo as rv


@rv.transfer
@ray.remote(resources={"a": 1})
def load(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(100_000_000 // 8)  # 100 MB float64


@rv.transfer
@ray.remote(resources={"b": 1})
def normalize(batch: np.ndarray) -> np.ndarray:
    return (batch - batch.mean()) / batch.std()


if __name__ == "__main__":
    with two_nodes():
        for seed in range(3):
            result = rv.resolve(normalize.remote(load.remote(seed)))
            print(
                f"batch {seed}: {result.nbytes / MiB:.0f} MiB, mean {result.mean():+.1e}, "
                f"std {result.std():.3f}"
            )
