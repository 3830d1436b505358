"""``ray-velo bench --transport``: Ray Direct Transport objects actor to actor, side by side
(docs/benchmarks.md, "Tensor transports")."""

from __future__ import annotations

import importlib
import importlib.util
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from ray_velo.bench.actors import machine_process, wait_processes_gone

MiB = 1 << 20
#: Untimed transfers through a fresh NIXL pair before its timed one (its agents register
#: memory and exchange metadata on first use).
NIXL_WARM_UPS = 2
#: How long the round after a fresh pair waits for that pair's processes to exit.
PAIR_EXIT_BOUND_S = 30.0
#: ``tick`` calls per size in :func:`measure_transports`: the torch columns interleaved, then
#: the numpy and fresh-actor blocks.
STEPS_PER_SIZE = 2
#: Objects of many tensors, after the sizes (one step each): GPT-2 small's state dict (148
#: tensors, 498 MB; 98 of them 3-12 KiB) and a thousand 4 KiB tensors in one list.
OBJECTS = ("state dict", "1000 x 4 KiB")
#: What ``make`` builds for a payload of one tensor.
ONE_TENSOR = "tensor"

__all__ = ["OBJECTS", "format_transport", "measure_transports", "transport_actors"]


def transport_actors() -> tuple[bool, Any, Any]:
    """Whether Ray's NIXL transport is measured here (:func:`nixl_unusable` says none), and
    the producer and consumer as Ray actor classes (defined once the transports are
    registered: Ray checks a tensor_transport name when the class is defined)."""
    import ray
    import torch  # noqa: F401  (imported first: VELO registers only where torch is)

    import ray_velo as rv

    rv.register_transports()
    with_nixl = nixl_unusable() is None
    # NIXL's receiver needs enable_tensor_transport (else its transfer waits out 60 s)
    make_actor: Any = ray.remote(num_cpus=0, enable_tensor_transport=True)  # type: ignore[call-overload]
    return with_nixl, make_actor(_producer_class(with_nixl)), make_actor(_consumer_class())


def _producer_class(with_nixl: bool) -> Any:
    """The producer: makes a payload untimed, then returns it by each transport's method."""
    import numpy as np
    import ray
    import torch

    class Producer:
        def __init__(self) -> None:
            self.tensor = torch.ones(0, dtype=torch.float32)
            self.array = np.ones(0, dtype=np.uint8)

        def process(self) -> tuple[str, int]:
            return machine_process()

        def make(self, nbytes: int, kind: str = ONE_TENSOR) -> int:
            """The payloads of this size, or the object ``kind`` names (made untimed); its
            size in bytes."""
            if kind == ONE_TENSOR:
                self.tensor = torch.ones(nbytes // 4, dtype=torch.float32)
                self.array = np.ones(nbytes, dtype=np.uint8)
                return nbytes
            self.tensor = _many_tensors(kind)
            values = self.tensor.values() if isinstance(self.tensor, dict) else self.tensor
            return sum(v.numel() * v.element_size() for v in values)

        def torch_plain(self) -> Any:
            return self.tensor

        def torch_decorated(self) -> Any:  # an ordinary return: staged in a decorated actor
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
    return Producer


def _consumer_class() -> Any:
    """The consumer: reads every page of what it is handed."""
    import numpy as np
    import torch

    class Consumer:
        def ready(self) -> bool:
            return True

        def process(self) -> tuple[str, int]:
            return machine_process()

        def read(self, value: Any) -> int:
            if isinstance(value, (dict, list)):
                values = value.values() if isinstance(value, dict) else value
                return sum(self.read(v) for v in values)
            array = value.numpy() if isinstance(value, torch.Tensor) else value
            flat = array.reshape(-1).view(np.uint8)
            return int(flat[::4096].sum()) + int(flat[-1])  # touch every page

    return Consumer


def _many_tensors(kind: str) -> Any:
    """One of :data:`OBJECTS`, as torch tensors."""
    import torch

    from ray_velo.bench.shapes_driver import gpt2_state_dict

    if kind == "state dict":
        return {name: torch.from_numpy(v) for name, v in gpt2_state_dict().items()}
    if kind == "1000 x 4 KiB":
        return [torch.full((1024,), float(i % 251)) for i in range(1000)]
    raise ValueError(f"no such object: {kind!r} (one of {', '.join(OBJECTS)})")


class _FreshPair(NamedTuple):
    """A producer and a consumer made for one round, and their (boot id, pid)s."""

    source: Any
    reader: Any
    processes: list[tuple[str, int]]


def nixl_unusable() -> str | None:
    """Why Ray's NIXL transport cannot run in this environment (the ``nixl`` package
    missing, or its backend for this machine's CUDA stack), None when it can: ``import
    nixl`` picks that backend, and Ray's actors fail the same way without it."""
    if importlib.util.find_spec("nixl") is None:
        return "the nixl package is not installed (pip install 'ray-velo[nixl]')"
    try:
        importlib.import_module("nixl")
    except Exception as exc:  # its own ImportError names the wheel that is missing
        return f"import nixl fails: {exc}"
    return None


def measure_transports(
    producer_options: dict[str, Any],
    consumer_options: dict[str, Any],
    sizes: list[int],
    reps: int = 5,
    tick: Callable[[str], None] | None = None,
    objects: Sequence[str] = OBJECTS,
) -> dict[str, Any]:
    """Per size, then per object of many tensors (``objects``, of :data:`OBJECTS`), medians
    (seconds) per column, on the connected Ray cluster (``rv.init`` done):
    ``{"sizes": [{"size_bytes", "seconds", "consistent"}, ...], "objects": [{"object",
    "size_bytes", ...}], "reps", "nixl"}``. ``tick(label)`` after each of a size's
    :data:`STEPS_PER_SIZE` blocks and after each object (progress)."""
    import ray

    import ray_velo as rv

    with_nixl, producer_actor, consumer_actor = transport_actors()
    producer = producer_actor.options(**producer_options).remote()
    fresh = producer_actor.options(**producer_options).remote()
    consumer = consumer_actor.options(**consumer_options).remote()
    pairs: dict[str, Any] = {
        "torch_plain": (producer, consumer),
        "torch_velo": (producer, consumer),
    }
    if with_nixl:

        def nixl_pair(size: int, kind: str) -> _FreshPair:
            source = producer_actor.options(**producer_options).remote()
            reader = consumer_actor.options(**consumer_options).remote()
            made = [
                source.make.remote(size, kind),
                source.process.remote(),
                reader.process.remote(),
            ]
            return _FreshPair(source, reader, ray.get(made)[1:])

        pairs["torch_nixl"] = nixl_pair
    # under @rv.transfer: the producer's ordinary return is staged, the consumer resolves it
    # before its body runs (a pipeline task to task)
    decorated = (
        rv.transfer(producer_actor).options(**producer_options).remote(),
        rv.transfer(consumer_actor).options(**consumer_options).remote(),
    )
    ray.get([consumer.ready.remote(), decorated[1].ready.remote()])
    per_size = []
    for size in sizes:
        ray.get([producer.make.remote(size), fresh.make.remote(size)])
        per_size.append(_measure_size(pairs, fresh, size, reps, tick))
    per_object = []
    for kind in objects:
        nbytes, _ = ray.get([producer.make.remote(0, kind), decorated[0].make.remote(0, kind)])
        row = _interleaved({**pairs, "torch_decorated": decorated}, nbytes, kind, reps)
        per_object.append({"object": kind, **row})
        if tick is not None:
            tick(f"{kind}: torch, {', '.join(pairs)} interleaved")
    for actor in (producer, fresh, consumer, *(a.ray_handle for a in decorated)):
        ray.kill(actor)
    return {"sizes": per_size, "objects": per_object, "reps": reps, "nixl": with_nixl}


def _interleaved(pairs: dict[str, Any], size: int, kind: str, reps: int) -> dict[str, Any]:
    """The torch transports interleaved round by round, each column through its (producer,
    consumer) pair (a callable makes a pair for one round, ended after it; round 0 warms the
    long-lived ones up, untimed): ``{"size_bytes", "failed", "seconds", "consistent"}``."""
    rounds = _Rounds()
    failed: dict[str, int] = {}
    for rep in range(reps + 1):
        for column, pair in pairs.items():
            if not callable(pair):
                rounds.once(column, pair, column, rep > 0)
            elif rep > 0 and not _fresh_pair_round(pair(size, kind), column, rounds.once):
                failed[column] = failed.get(column, 0) + 1
    return {"size_bytes": size, "failed": failed, **rounds.medians()}


class _Rounds:
    """Timed transfers (``reader.read(source.method())``), end to end, per column; and the
    values read, per method (every round of one method must read the same)."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = {}
        self.values: dict[str, set[int]] = {}

    def once(self, name: str, pair: tuple[Any, Any], method: str, keep: bool) -> None:
        import ray

        source, reader = pair
        started = time.perf_counter()
        value = ray.get(reader.read.remote(getattr(source, method).remote()), timeout=600)
        if keep:
            self.seconds.setdefault(name, []).append(time.perf_counter() - started)
        self.values.setdefault(method, set()).add(value)

    def medians(self) -> dict[str, Any]:
        return {
            "seconds": {c: statistics.median(v) for c, v in self.seconds.items()},
            "consistent": all(len(v) == 1 for v in self.values.values()),
        }


def _measure_size(
    pairs: dict[str, Any],
    fresh: Any,
    size: int,
    reps: int,
    tick: Callable[[str], None] | None,
) -> dict[str, Any]:
    """One size: the torch transports interleaved round by round (:func:`_interleaved`),
    then the numpy and the fresh-actor columns each in a block."""
    row = _interleaved(pairs, size, ONE_TENSOR, reps)
    if tick is not None:
        tick(f"{size >> 20} MiB: torch, {', '.join(pairs)} interleaved")
    producer, consumer = pairs["torch_velo"]
    blocks = [
        ("torch_plain_kept", (producer, consumer), "torch_plain"),
        ("numpy_velo", (producer, consumer), "numpy_velo"),
        ("numpy_plain", (producer, consumer), "numpy_plain"),
        ("torch_plain_fresh", (fresh, consumer), "torch_plain"),
        ("numpy_plain_fresh", (fresh, consumer), "numpy_plain"),
    ]
    rounds = _Rounds()
    for name, pair, method in blocks:
        for rep in range(reps + 1):
            rounds.once(name, pair, method, keep=rep > 0)
    if tick is not None:
        tick(f"{size >> 20} MiB: numpy and fresh actors")
    blocked = rounds.medians()
    return {
        **row,
        "seconds": {**row["seconds"], **blocked["seconds"]},
        "consistent": row["consistent"] and blocked["consistent"],
    }


def format_transport(
    result: dict[str, Any], where: str, raw_s: dict[int, float] | None = None
) -> str:
    """The table: per size, ms and GB/s per column, and the ratios the targets name (VELO
    over NIXL and over Ray's object store as speed, VELO over the raw link where probed)."""
    raw_s = raw_s or {}
    lines = [
        f"tensor transports, actor -> actor, {where} (median of {result['reps']}; torch "
        "columns interleaved round by round):",
        "          payload   Ray store      NIXL      VELO   VELO/NIXL  VELO/Ray  VELO/raw link   "
        "numpy: store  VELO_NUMPY   @rv.transfer  transfer/Ray",
    ]
    for row in [*result["sizes"], *result.get("objects", [])]:
        lines.append(_size_line(row, raw_s.get(row["size_bytes"])))
        for column, count in row.get("failed", {}).items():
            lines.append(f"  {column}: {count} of {result['reps']} rounds failed (not timed)")
        if not row["consistent"]:
            lines.append("  WARNING: the consumer read different values across rounds")
    if not result["nixl"]:
        lines.append("  NIXL: not installed here (pip install 'ray-velo[nixl]'): no NIXL column")
    last = result["sizes"][-1]["seconds"]
    lines.append(
        "  ms per transfer; VELO/NIXL and VELO/Ray: their time over VELO's (above 1.00x: VELO "
        "is faster); VELO/raw link: a raw TCP socket's time over VELO's; @rv.transfer: the "
        "same object as an ordinary return of a decorated actor to a decorated one (tensors "
        "above 256 KiB staged). Ordinary returns "
        "after an RDT return vs a fresh actor (largest size): torch "
        f"{_ratio(last, 'torch_plain_kept', 'torch_plain_fresh')}, numpy "
        f"{_ratio(last, 'numpy_plain', 'numpy_plain_fresh')} (1.00x = no cost)"
    )
    return "\n".join(lines)


def _fresh_pair_round(
    fresh: _FreshPair, column: str, once: Callable[[str, tuple[Any, Any], str, bool], None]
) -> bool:
    """One timed round through a pair made for it (warmed up first), ended after (its
    processes gone); False (nothing timed) when a transfer failed: counted, not fatal, the
    other columns go on."""
    import ray

    pair = (fresh.source, fresh.reader)
    try:
        for _ in range(NIXL_WARM_UPS):
            once(column, pair, column, False)
        once(column, pair, column, True)
        return True
    except ray.exceptions.RayError:
        return False
    finally:
        for actor in pair:
            ray.kill(actor)
        wait_processes_gone(fresh.processes, PAIR_EXIT_BOUND_S)


def _size_line(row: dict[str, Any], raw: float | None) -> str:
    size, s = row["size_bytes"], row["seconds"]

    def ms(key: str) -> str:
        return f"{s[key] * 1e3:8.1f}" if key in s else "       -"

    def speedup(key: str, over: str = "torch_velo") -> str:
        return f"{s[key] / s[over]:8.2f}x" if key in s and over in s else "        -"

    to_raw = f"{raw / s['torch_velo']:13.2f}" if raw else "            -"
    name = row.get("object") or _size_text(size)
    return (
        f"  {name:>15s}  {ms('torch_plain')}  {ms('torch_nixl')}  "
        f"{ms('torch_velo')}  {speedup('torch_nixl')}  {speedup('torch_plain')}  {to_raw}"
        f"      {ms('numpy_plain')}    {ms('numpy_velo')}"
        f"       {ms('torch_decorated')}     {speedup('torch_plain', 'torch_decorated')}"
    )


def _ratio(s: dict[str, float], a: str, b: str) -> str:
    return f"{s[b] / s[a]:.2f}x" if a in s and b in s else "-"


def _size_text(size: int) -> str:
    return f"{size >> 30} GiB" if size >= 1 << 30 and size % (1 << 30) == 0 else f"{size >> 20} MiB"
