"""Benchmarks, measured side by side in one run: ray_velo against Ray's object store and the
link's own ceiling (docs/benchmarks.md).

May import: errors, config, protocol, memory, ucx, wire, actors, client, ray_velo, ops, testbed.
"""

from ray_velo.bench.samehost import demo

__all__ = ["demo"]
