"""``ray-velo bench --transport``: Ray Direct Transport objects actor to actor, side by side.

One actor on the producer's host returns a 256 MiB payload; one actor on the consumer's host
takes the ObjectRef as an argument and reads every page. Timed from the driver (submit both,
get the consumer's small result), in one run, each column in a block of its own (a warm-up
round, then the timed ones; the median is reported):

* torch: Ray's object store (no transport), ``tensor_transport="NIXL"`` (where the ``nixl``
  package is installed) and ``tensor_transport="VELO"``;
* numpy: Ray's object store and ``tensor_transport="VELO_NUMPY"``;
* ordinary returns after registration: the same plain (object-store) numpy and torch returns
  from an actor that has already returned an RDT object of that type, against one that has
  not (Ray registers a process-wide serializer for the data type at the first RDT return).

The same function runs on the embedded two-node cluster and inside a two-host testbed.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from collections.abc import Callable
from typing import Any

MiB = 1 << 20

__all__ = ["format_transport", "measure_transports"]


def _classes(with_nixl: bool) -> tuple[Any, Any]:
    """The producer and consumer actor classes (defined once the transports are registered:
    Ray checks a tensor_transport name when the class is defined)."""
    import numpy as np
    import ray
    import torch

    class Producer:
        def __init__(self, nbytes: int) -> None:
            self.tensor = torch.ones(nbytes // 4, dtype=torch.float32)
            self.array = np.ones(nbytes, dtype=np.uint8)

        def ready(self) -> bool:
            return True

        def torch_plain(self) -> Any:
            return self.tensor

        @ray.method(tensor_transport="VELO")
        def torch_velo(self) -> Any:
            return self.tensor

        def numpy_plain(self) -> Any:
            return self.array

        @ray.method(tensor_transport="VELO_NUMPY")
        def numpy_velo(self) -> Any:
            return self.array

    if with_nixl:

        @ray.method(tensor_transport="NIXL")
        def torch_nixl(self: Any) -> Any:
            return self.tensor

        Producer.torch_nixl = torch_nixl  # type: ignore[attr-defined]

    class Consumer:
        def ready(self) -> bool:
            return True

        def read(self, value: Any) -> int:
            array = value.numpy() if isinstance(value, torch.Tensor) else value
            flat = array.reshape(-1).view(np.uint8)
            return int(flat[::4096].sum())  # touch every page

    return Producer, Consumer


def _nixl_available() -> bool:
    return importlib.util.find_spec("nixl") is not None


def measure_transports(
    producer_options: dict[str, Any],
    consumer_options: dict[str, Any],
    size_bytes: int = 256 * MiB,
    reps: int = 5,
    tick: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Medians (seconds) per column, on the connected Ray cluster (``rv.init`` done)."""
    import ray

    import ray_velo as rv

    rv.register_transports()
    with_nixl = _nixl_available()
    producer_cls, consumer_cls = _classes(with_nixl)
    # NIXL's receiver needs enable_tensor_transport (else its transfer waits out 60 s)
    make_actor: Any = ray.remote(num_cpus=0, enable_tensor_transport=True)  # type: ignore[call-overload]
    producer_actor, consumer_actor = make_actor(producer_cls), make_actor(consumer_cls)
    producer = producer_actor.options(**producer_options).remote(size_bytes)
    fresh = producer_actor.options(**producer_options).remote(size_bytes)
    consumer = consumer_actor.options(**consumer_options).remote()
    ray.get([producer.ready.remote(), fresh.ready.remote(), consumer.ready.remote()])

    columns = ["torch_plain", "torch_velo", "numpy_plain", "numpy_velo"]
    if with_nixl:
        columns.insert(1, "torch_nixl")
    seconds: dict[str, list[float]] = {c: [] for c in columns}
    seconds.update({"torch_plain_fresh": [], "numpy_plain_fresh": []})
    values: dict[str, set[int]] = {}

    def once(name: str, source: Any, method: str, keep: bool) -> None:
        started = time.perf_counter()
        value = ray.get(consumer.read.remote(getattr(source, method).remote()), timeout=600)
        if keep:
            seconds[name].append(time.perf_counter() - started)
        values.setdefault(method, set()).add(value)

    for name, source, method in _blocks(columns, producer, fresh):
        for rep in range(reps + 1):
            once(name, source, method, keep=rep > 0)
        if tick is not None:
            tick(name)
    for actor in (producer, fresh, consumer):
        ray.kill(actor)
    return {
        "size_bytes": size_bytes,
        "reps": reps,
        "nixl": with_nixl,
        "seconds": {c: statistics.median(v) for c, v in seconds.items() if v},
        "consistent": all(len(v) == 1 for v in values.values()),
    }


def _blocks(columns: list[str], producer: Any, fresh: Any) -> list[tuple[str, Any, str]]:
    """The order the columns run in, as (column, source actor, method) blocks.

    Each column in its own block (a warm-up, then ``reps`` timed rounds): a pipeline uses
    one transport over and over, and on a small machine one column's garbage (a pickled
    256 MiB tensor) would otherwise slow the next. The VELO columns run first, so the plain
    returns of ``producer`` all come after it returned RDT objects of both types; NIXL
    runs last, since its agent stays in both processes once made.
    """
    order = [c for c in columns if c.endswith("_velo")]
    order += [c for c in columns if c not in order and c != "torch_nixl"]
    blocks = [(c, producer, c) for c in order]
    blocks += [
        ("torch_plain_fresh", fresh, "torch_plain"),
        ("numpy_plain_fresh", fresh, "numpy_plain"),
    ]
    blocks += [(c, producer, c) for c in columns if c == "torch_nixl"]
    return blocks


def format_transport(result: dict[str, Any], where: str) -> str:
    """The table: time and GB/s per column, and the ratios the issue's targets name."""
    size = result["size_bytes"]
    s = result["seconds"]
    rows = [
        ("torch, Ray object store", "torch_plain"),
        ("torch, tensor_transport=NIXL", "torch_nixl"),
        ("torch, tensor_transport=VELO", "torch_velo"),
        ("numpy, Ray object store", "numpy_plain"),
        ("numpy, tensor_transport=VELO_NUMPY", "numpy_velo"),
        ("torch, object store, fresh actor", "torch_plain_fresh"),
        ("numpy, object store, fresh actor", "numpy_plain_fresh"),
    ]
    lines = [
        f"tensor transports, {size // MiB} MiB actor -> actor, {where} "
        f"(median of {result['reps']}):"
    ]
    for label, key in rows:
        if key in s:
            lines.append(f"  {label:38s} {s[key] * 1e3:8.1f} ms {size / s[key] / 1e9:6.2f} GB/s")
        elif key == "torch_nixl":
            lines.append(f"  {label:38s}   (nixl not installed: pip install nixl)")

    def ratio(a: str, b: str) -> str:
        return f"{s[b] / s[a]:.2f}x" if a in s and b in s else "-"

    lines.append(
        f"  VELO / NIXL {ratio('torch_velo', 'torch_nixl')}, "
        f"VELO / object store {ratio('torch_velo', 'torch_plain')}, "
        f"VELO_NUMPY / object store {ratio('numpy_velo', 'numpy_plain')}"
    )
    lines.append(
        "  ordinary returns after an RDT return vs a fresh actor: "
        f"torch {ratio('torch_plain', 'torch_plain_fresh')}, "
        f"numpy {ratio('numpy_plain', 'numpy_plain_fresh')} (1.00x = no cost)"
    )
    if not result["consistent"]:
        lines.append("  WARNING: the consumer read different values across rounds")
    return "\n".join(lines)
