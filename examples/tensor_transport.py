"""Ray Direct Transport: an actor method's tensors moved by ray_velo, with one word.

    python examples/tensor_transport.py

`@ray.method(tensor_transport="VELO")` on an actor method makes Ray hand the method's torch
tensors to ray_velo: they are staged on the producer's node and fetched by whoever receives
the ObjectRef (a UCX GET across nodes), while Ray ties their lifetime to the ObjectRef.
`"VELO_NUMPY"` does the same for numpy arrays.
"""

import numpy as np
import ray
import torch
from _local_cluster import two_nodes

import ray_velo as rv

# Ray checks tensor_transport names when a class is defined: register them first. (Importing
# ray and torch before ray_velo registers them too; rv.init() does, for classes defined later.)
rv.register_transports()


@ray.remote(resources={"a": 1})
class Trainer:
    def __init__(self) -> None:
        self.weights = torch.randn(64 << 20 >> 2)  # 64 MiB of float32

    @ray.method(tensor_transport="VELO")
    def get_weights(self) -> torch.Tensor:
        return self.weights

    @ray.method(tensor_transport="VELO_NUMPY")
    def get_stats(self) -> np.ndarray:
        return np.arange(1 << 20, dtype=np.float64)


@ray.remote(resources={"b": 1}, enable_tensor_transport=True)  # Ray's receivers need it
class Worker:
    def load(self, weights: torch.Tensor) -> float:  # a private, writable CPU tensor
        weights.mul_(0.5)
        return float(weights.sum())

    def mean(self, stats: np.ndarray) -> float:  # a read-only array, as ray.get gives
        return float(stats.mean())


if __name__ == "__main__":
    with two_nodes():
        trainer, worker = Trainer.remote(), Worker.remote()
        weights = trainer.get_weights.remote()  # stays on node a until someone reads it
        print("half the weights sum to", ray.get(worker.load.remote(weights)))
        print("stats mean", ray.get(worker.mean.remote(trainer.get_stats.remote())))
        print("the driver reads them too:", ray.get(weights).shape)
        del weights  # Ray frees the ObjectRef: ray_velo frees the staged copy
