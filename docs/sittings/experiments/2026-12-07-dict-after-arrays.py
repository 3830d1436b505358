"""The state dict's rounds after seven 256 MiB rounds, as ``--shapes`` runs them, with each
agent's count of transparent payloads that rode inside the Ray call (no mapped arena) and
its path counts (docs/sittings/2026-12-07-wire-experiments.md). ``--ucx-tcp``: the agents may
use UCX over TCP. Run inside a testbed host, as the shapes driver is."""

from __future__ import annotations

import sys
import time
from typing import Any

import ray

import ray_velo as rv
from ray_velo.bench.shapes_driver import _actors, _columns
from ray_velo.ops import cluster_status
from ray_velo.testbed import connect


def status() -> dict[str, Any]:
    return {
        s["node_id"][:4]: (s["transparent_inline"]["no_mapped_arena"], s["paths"])
        for s in cluster_status()
    }


def main() -> None:
    info = connect()
    ucx_tcp = "--ucx-tcp" in sys.argv
    rv.init(rv.VeloConfig(rdma=rv.RdmaConfig(ucx=rv.UcxConfig(tcp=True))) if ucx_tcp else None)
    actors = _actors({info.hosts[0].resource: 1}, {info.hosts[1].resource: 1})
    ray.get(actors["producer"].make.remote("array", 1 << 20))
    ray.get(actors["consumer"].velo_fetch.remote(actors["producer"].velo_put.remote()))
    for kind, nbytes, rounds in (("array", 256 << 20, 7), ("dict", 0, 6)):
        makers = ("producer", "pipe_producer") if kind == "dict" else ("producer",)
        ray.get([actors[m].make.remote(kind, nbytes) for m in makers])
        columns = _columns(actors, kind)
        for round_ in range(rounds):
            started = time.perf_counter()
            columns["velo"]()
            velo = time.perf_counter() - started
            started = time.perf_counter()
            columns["ray"]()
            ray_s = time.perf_counter() - started
            print(
                f"{kind} round {round_}: velo {velo * 1e3:.0f} ms ray {ray_s * 1e3:.0f} {status()}",
                flush=True,
            )
        ray.get([actors[m].make.remote("array", 1) for m in makers])
    for actor in actors.values():
        ray.kill(getattr(actor, "ray_handle", actor))
    rv.shutdown()


if __name__ == "__main__":
    main()
