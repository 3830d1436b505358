"""An actor pipeline: a loader actor on node a feeds a trainer actor on node b.

python examples/actor_pipeline.py
"""

import numpy as np
import ray
from _local_cluster import two_nodes

import ray_velo as rv


@rv.transfer
@ray.remote(resources={"a": 1})
class Loader:
    def batch(self, step: int) -> np.ndarray:
        return np.full((4096, 4096), step, dtype=np.float32)  # 64 MiB


@rv.transfer
@ray.remote(resources={"b": 1})
class Trainer:
    def __init__(self) -> None:
        self.seen = 0.0

    def step(self, batch: np.ndarray) -> float:
        self.seen += float(batch[0, 0])
        return self.seen


if __name__ == "__main__":
    with two_nodes():
        loader, trainer = Loader.remote(), Trainer.remote()
        for step in range(5):
            # the loader's staged result goes straight to the trainer, node a -> node b
            print("trainer total:", ray.get(trainer.step.remote(loader.batch.remote(step))))
