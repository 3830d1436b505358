"""The README's first example, as a file: ``python examples/quickstart.py``.

On this machine it starts an embedded Ray; on a cluster (``RAY_ADDRESS`` set, or run on a
node of one) it joins it, and ``consume`` may run on another node than ``produce``.
tests/unit/test_examples.py keeps it equal to the README's block.
"""

import numpy as np
import ray
import ray_velo as rv

rv.init()  # ray.init() if Ray is not running, then one ray_velo agent per node


@ray.remote
def produce(n: int) -> rv.DataHandle:
    big = np.random.default_rng(0).standard_normal(n)  # n float64 values
    return rv.put(big, ttl=600)  # staged on this node; the handle ends within 600 s


@ray.remote
def consume(h: rv.DataHandle) -> float:
    arr = rv.fetch(h, timeout=60)  # read-only array; consumes the handle (release=True)
    return float(arr.sum())


h = ray.get(produce.remote(32 << 20))  # 32 Mi float64 = 256 MiB; h pickles to ~130 bytes
print(ray.get(consume.remote(h)))  # the handle travels as a normal Ray argument
rv.shutdown()
