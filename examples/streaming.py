"""A streaming generator: 10 items of 32 MiB from node a, consumed on node b as they come.

python examples/streaming.py
"""

import numpy as np
import ray
from _local_cluster import two_nodes

import ray_velo as rv


@rv.transfer
@ray.remote(num_returns="streaming", resources={"a": 1})
def frames(count: int):
    for i in range(count):
        yield np.full(32 << 20, i, dtype=np.uint8)


@ray.remote(resources={"b": 1})
def consume(count: int) -> list[int]:
    return [int(frame[0]) for frame in rv.resolve_stream(frames.remote(count))]


if __name__ == "__main__":
    with two_nodes():
        print("frames seen on node b:", ray.get(consume.remote(10)))
