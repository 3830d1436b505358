"""Where the 256 MiB shape's time goes: ``rv.put`` timed on host a, ``rv.fetch`` and a read of
every page timed on host b, round by round (docs/sittings/2026-12-07-wire-experiments.md).
Run inside a testbed host: ``Testbed(hosts=2, link="10gbit").run([python, this file])``."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import ray

import ray_velo as rv
from ray_velo.testbed import connect

SIZE = 256 << 20


def main() -> None:
    info = connect()
    rv.init()
    on_a, on_b = info.hosts[0].resource, info.hosts[1].resource

    @ray.remote(num_cpus=0, resources={on_a: 1})
    class Producer:
        def make(self, nbytes: int) -> bool:
            self.value = np.resize(np.arange(251, dtype=np.uint8), nbytes)
            return True

        def put(self) -> tuple[Any, float]:
            started = time.perf_counter()
            handle = rv.put(self.value)
            return handle, time.perf_counter() - started

    @ray.remote(num_cpus=0, resources={on_b: 1})
    class Consumer:
        def fetch(self, handle: Any) -> tuple[float, float]:
            started = time.perf_counter()
            value = rv.fetch(handle)
            fetched = time.perf_counter() - started
            started = time.perf_counter()
            int(value.reshape(-1)[::4096].sum())
            return fetched, time.perf_counter() - started

    producer, consumer = Producer.remote(), Consumer.remote()
    ray.get(producer.make.remote(SIZE))
    for round_ in range(8):
        started = time.perf_counter()
        handle, put_s = ray.get(producer.put.remote())
        fetch_s, touch_s = ray.get(consumer.fetch.remote(handle))
        total = time.perf_counter() - started
        print(
            f"round {round_}: total {total * 1e3:.0f} put {put_s * 1e3:.0f} "
            f"fetch {fetch_s * 1e3:.0f} touch {touch_s * 1e3:.1f} ms",
            flush=True,
        )
    rv.shutdown()


if __name__ == "__main__":
    main()
