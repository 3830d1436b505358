"""Fan-out: one staged array read by several consumers on another node.

    python examples/fanout.py

consumers=3 lets the staged result be resolved three times; a fourth resolution is refused
with HandleReleased, naming the option to change.
"""

import numpy as np
import ray
from _local_cluster import two_nodes

import ray_velo as rv


@rv.transfer(consumers=3)
@ray.remote(resources={"a": 1})
def embeddings() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((8192, 1024)).astype(np.float32)  # 32 MiB


@rv.transfer
@ray.remote(resources={"b": 1})
def score(table: np.ndarray, row: int) -> float:
    return float(table[row] @ table[row])


if __name__ == "__main__":
    with two_nodes():
        staged = embeddings.remote()
        print("scores:", ray.get([score.remote(staged, row) for row in range(3)]))
        try:
            ray.get(score.remote(staged, 3))
        except rv.HandleReleased as exc:
            print("fourth consumer refused:", getattr(exc, "cause", exc))
