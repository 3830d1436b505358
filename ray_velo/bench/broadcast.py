"""``ray-velo bench --two-host --transport --fan-out K [--hosts N]``: one Ray Direct Transport
ref of a trainer's weights taken by K rollout actors on other hosts at once (the RL
weight-sync shape), VELO beside NIXL and Ray's object store (docs/benchmarks.md, "One
weights ref to many hosts")."""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ray_velo.bench.actors import wait_processes_gone
from ray_velo.bench.fanout import agent_counters, hosts_text, per_round, reader_hosts
from ray_velo.bench.transport import NIXL_WARM_UPS, PAIR_EXIT_BOUND_S, transport_actors

__all__ = ["WEIGHTS", "format_broadcast", "measure_broadcast"]

#: The weights: GPT-2 small's state dict (148 tensors, 498 MB), one RDT object.
WEIGHTS = "state dict"
#: (column, transport name in the table).
_LABELS = (("velo", "VELO"), ("nixl", "NIXL"), ("ray", "Ray's store"))


def measure_broadcast(
    on_a: Mapping[str, float],
    on_readers: Sequence[Mapping[str, float]],
    k: int,
    reps: int,
    tick: Callable[[str], object] = lambda _: None,
) -> dict[str, Any]:
    """Median seconds of one round (the trainer's call to the last rollout actor's answer)
    per column: ``velo``, ``nixl`` and ``ray`` with ``k`` rollout actors (round-robin over
    the hosts of ``on_readers``, :func:`reader_hosts`), ``<column>_one`` with one on
    ``on_readers[0]``; all interleaved round by round after an untimed one. VELO and Ray's
    store use long-lived actors; NIXL a fresh trainer and fresh readers per round (an idle
    NIXL agent spins a core: none outlives its round), warmed up first. Also ``velo_moved``:
    per round, the VELO receivers' transfers over a link and how many of those read another
    receiver host's copy rather than host a's (:func:`per_round`)."""
    import ray

    with_nixl, trainer_of, rollout_of = transport_actors()
    places = [on_readers[i - 1] for i in reader_hosts(k, len(on_readers) + 1)]

    def group(n: int) -> tuple[Any, list[Any]]:
        trainer = trainer_of.options(resources=dict(on_a)).remote()
        rollouts = [rollout_of.options(resources=dict(p)).remote() for p in places[:n]]
        ray.get([trainer.make.remote(0, WEIGHTS), *[r.ready.remote() for r in rollouts]])
        return trainer, rollouts

    trainer, rollouts = group(k)
    tick(f"weights to {k} rollout actors: VELO, Ray's store{', NIXL' if with_nixl else ''}")
    rounds = _Rounds(on_readers)
    for rep in range(reps + 1):
        keep = rep > 0
        for column, method in (("velo", "torch_velo"), ("ray", "torch_plain")):
            for name, readers in ((column, rollouts), (f"{column}_one", rollouts[:1])):
                rounds.long_lived(name, trainer, method, readers, keep)
        if with_nixl and keep:
            for name, n in (("nixl", k), ("nixl_one", 1)):
                rounds.keep(name, *_fresh_nixl_round(group(n)))
        if keep:
            tick(f"  round {rep}: " + _round_text(rounds.seconds))
    for actor in (trainer, *rollouts):
        ray.kill(actor)
    return {
        "seconds": {name: statistics.median(s) for name, s in rounds.seconds.items()},
        "rounds": rounds.seconds,
        "velo_moved": per_round(Counter(), rounds.moved, reps),
        "consistent": len(rounds.values) == 1,
        "size_bytes": _weights_bytes(),
        "reps": reps,
        "nixl": with_nixl,
    }


class _Rounds:
    """Each column's timed rounds, every value any reader read, and what the reader hosts'
    agents moved during VELO's K-reader rounds."""

    def __init__(self, on_readers: Sequence[Mapping[str, float]]) -> None:
        self.on_readers = on_readers
        self.seconds: dict[str, list[float]] = {}
        self.values: set[int] = set()
        self.moved: Counter[str] = Counter()

    def long_lived(
        self, name: str, trainer: Any, method: str, readers: list[Any], keep: bool
    ) -> None:
        """One round through the long-lived actors (timed when ``keep``)."""
        count = keep and name == "velo"
        before = agent_counters(self.on_readers) if count else Counter()
        took, got = _round(trainer, method, readers)
        if count:
            self.moved += agent_counters(self.on_readers) - before
        if keep:
            self.seconds.setdefault(name, []).append(took)
        self.values.update(got)

    def keep(self, name: str, took: float, got: list[int]) -> None:
        self.seconds.setdefault(name, []).append(took)
        self.values.update(got)


def _round(trainer: Any, method: str, readers: list[Any]) -> tuple[float, list[int]]:
    """One round: the trainer's method returns the weights, every reader takes the one ref;
    its seconds and what each reader read."""
    import ray

    started = time.perf_counter()
    ref = getattr(trainer, method).remote()
    got = ray.get([reader.read.remote(ref) for reader in readers], timeout=600)
    return time.perf_counter() - started, got


def _fresh_nixl_round(made: tuple[Any, list[Any]]) -> tuple[float, list[int]]:
    """A timed NIXL round through actors made for it (warmed up first), ended after it
    (their processes gone before the next round)."""
    import ray

    trainer, rollouts = made
    actors = [trainer, *rollouts]
    processes = ray.get([actor.process.remote() for actor in actors])
    try:
        for _ in range(NIXL_WARM_UPS):
            _round(trainer, "torch_nixl", rollouts)
        return _round(trainer, "torch_nixl", rollouts)
    finally:
        for actor in actors:
            ray.kill(actor)
        wait_processes_gone(processes, PAIR_EXIT_BOUND_S)


def _weights_bytes() -> int:
    from ray_velo.bench.shapes_driver import gpt2_state_dict

    return sum(v.nbytes for v in gpt2_state_dict().values())


def _round_text(seconds: dict[str, list[float]]) -> str:
    return ", ".join(f"{name} {s[-1] * 1e3:.0f} ms" for name, s in seconds.items())


def format_broadcast(rows: dict[str, dict[str, Any]], k: int, hosts: int) -> str:
    """Per link, one line per transport: one rollout actor's time, K's, and K's over one's
    (1.00x: K hosts cost what one does); under VELO's, what its receivers moved."""
    any_row = next(iter(rows.values()))
    placed = hosts_text(reader_hosts(k, hosts))
    head = f"{'link':>8} {'transport':>12} {'1 reader':>10} {f'{k} readers':>11} {'K / 1':>7}"
    lines = [
        f"one weights ref (GPT-2 small's state dict, {any_row['size_bytes'] / 1e6:.0f} MB, 148 "
        f"tensors) from host a to {k} rollout actors on {placed}, median of "
        f"{any_row['reps']} rounds:",
        head,
        "-" * len(head),
    ]
    for link, row in rows.items():
        s = row["seconds"]
        for column, label in _LABELS:
            if column not in s:
                continue
            lines.append(
                f"{link:>8} {label:>12} {s[f'{column}_one'] * 1e3:>8.0f}ms "
                f"{s[column] * 1e3:>9.0f}ms {s[column] / s[f'{column}_one']:>6.2f}x"
            )
            link = ""
        if row.get("raw_one") and row.get("raw_chain"):
            one, chain = row["raw_one"], row["raw_chain"]
            lines.append(
                f"{'':>8} {'raw link':>12} {one * 1e3:>8.0f}ms {chain * 1e3:>9.0f}ms "
                f"{chain / one:>6.2f}x  (TCP streams a->b, and a chain of {k} at once)"
            )
        m = row["velo_moved"]
        lines.append(
            f"{'':>8} per round, VELO's receivers moved the weights over a link "
            f"{m['transfers']:.1f} times, {m['relayed']:.1f} of them from another receiver's "
            f"copy (host a's link carried them {m['transfers'] - m['relayed']:.1f} times)"
        )
        if not row["consistent"]:
            lines.append("  WARNING: the rollout actors read different values")
        if not row["nixl"]:
            lines.append("  NIXL: not installed here: no NIXL rows")
    lines.append(
        "K / 1: K rollout actors' time over one's on host b. VELO and Ray's store: long-lived "
        "actors; NIXL: a fresh trainer and readers per round, warmed up first; raw link: plain "
        "TCP streams, one, then one per hop of a relay chain at once (what this machine's "
        "CPUs allow the chain)."
    )
    return "\n".join(lines)
