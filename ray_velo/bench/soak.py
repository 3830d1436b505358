"""``ray-velo soak``: hours of traffic in minutes, and a check that nothing grows
(docs/benchmarks.md, "Soak")."""

from __future__ import annotations

import random
import time
import zlib
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = ["SOAK_SIZES", "Slack", "SoakResult", "format_soak", "run_soak"]

KiB, MiB = 1 << 10, 1 << 20
#: Payload sizes a soak draws from (each round picks one).
SOAK_SIZES = (64 * KiB, 300 * KiB, MiB, 4 * MiB, 16 * MiB, 32 * MiB)
#: Share of payloads staged pinned (registered where UCX runs); the rest are plain.
PINNED_SHARE = 0.7
#: The longest one payload may take end to end before the soak calls it lost (s).
ROUND_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Slack:
    """How much each sampled figure may exceed its warm-up level once traffic drained."""

    registered_bytes: int = 64 * MiB
    segments: int = 2
    fds: int = 16
    threads: int = 8
    rss_anon_bytes: int = 64 * MiB
    rss_share: float = 0.25  # or this share of the warm-up heap, whichever is more

    def allowed(self, name: str, base: int) -> int:
        extra = int(getattr(self, name))
        if name == "rss_anon_bytes":
            extra = max(extra, int(base * self.rss_share))
        if name == "registered_bytes":
            # A pool grows by doubling its newest arena (at most the whole warm-up level) and
            # keeps what it mapped: one more arena after the warm-up is a working set found
            # late, not a leak (which keeps growing past it).
            extra = max(extra, 2 * base)
        return base + extra


#: The figures checked for growth (resident memory in all, rss_bytes, counts the arenas'
#: pages too: it is reported, and the heap is what is checked).
CHECKED = ("registered_bytes", "segments", "fds", "threads", "rss_anon_bytes")


@dataclass
class SoakResult:
    """What a soak did and found."""

    minutes: float
    consumers: int
    rounds: int = 0
    bytes_moved: int = 0
    staged: Counter[str] = field(default_factory=Counter)  # pinned / plain
    paths: dict[str, int] = field(default_factory=dict)  # "owner:rdma/ok": n, ...
    slack: Slack = field(default_factory=Slack)
    errors: list[str] = field(default_factory=list)
    wrong_bytes: int = 0
    samples: dict[str, list[dict[str, int]]] = field(default_factory=dict)
    baseline: dict[str, dict[str, int]] = field(default_factory=dict)  # warm-up highs
    end: dict[str, dict[str, int]] = field(default_factory=dict)  # last third's highs
    final: dict[str, dict[str, int]] = field(default_factory=dict)  # after the drain
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["staged"] = dict(self.staged)
        out["ok"] = self.ok
        return out


def _sample(status: dict[str, Any]) -> dict[str, int]:
    process = status.get("process", {})
    return {
        "registered_bytes": int(status["registered_bytes"]),
        "live_slots": int(status["live_slots"]),
        "live_leases": int(status["live_leases"]),
        **{k: int(v) for k, v in process.items()},
    }


def _actors(pattern_bytes: int) -> tuple[Any, Any]:
    import ray

    import ray_velo as rv

    @ray.remote(num_cpus=0)
    class Producer:
        def __init__(self) -> None:
            self.pattern = (np.arange(pattern_bytes, dtype=np.uint64) * 131 % 251).astype(np.uint8)

        def stage(self, nbytes: int, offset: int, pinned: bool) -> tuple[Any, int]:
            data = self.pattern[offset : offset + nbytes]
            return rv.put(data, pinned=pinned), zlib.crc32(data.data)

    @ray.remote(num_cpus=0)
    class Consumer:
        def fetch_crc(self, handle: Any) -> int:
            return zlib.crc32(np.ascontiguousarray(rv.fetch(handle)).data)

    return Producer, Consumer


def _levels(result: SoakResult) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]:
    """Per node: the highest of each figure in the first third of the samples (the warm-up),
    and in the last third plus the drained final sample."""
    baseline, end = {}, {}
    for node, samples in result.samples.items():
        third = max(1, len(samples) // 3)
        early, late = samples[:third], [*samples[-third:], result.final.get(node, {})]
        names = {k for sample in samples for k in sample if k != "t_s"}
        baseline[node] = {n: max(s.get(n, 0) for s in early) for n in names}
        end[node] = {n: max(s.get(n, 0) for s in late) for n in names}
    return baseline, end


def _paths(agents: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Each agent's path counters, keyed owner (the first node) and consumer."""
    import ray

    owner, consumer = list(agents.values())[:2]
    return {
        "owner": dict(ray.get(owner.status.remote(), timeout=60)["paths"]),
        "consumer": dict(ray.get(consumer.status.remote(), timeout=60)["paths"]),
    }


def _statuses(agents: dict[str, Any]) -> dict[str, dict[str, int]]:
    import ray

    refs = {node: agent.status.remote() for node, agent in agents.items()}
    return {node: _sample(ray.get(ref, timeout=60)) for node, ref in refs.items()}


def _quiesce(agents: dict[str, Any], bound_s: float = 60.0) -> dict[str, dict[str, int]]:
    """Statuses once no slot or lease is left (bounded: the last reads' leases end)."""
    deadline = time.monotonic() + bound_s
    while True:
        statuses = _statuses(agents)
        idle = all(s["live_slots"] == 0 and s["live_leases"] == 0 for s in statuses.values())
        if idle or time.monotonic() > deadline:
            return statuses
        time.sleep(0.5)


def run_soak(
    minutes: float,
    consumers: int,
    *,
    address: str | None = None,
    seed: int = 0,
    slack: Slack | None = None,
    progress: Any = None,
) -> SoakResult:
    """Run the soak on an embedded two-node cluster, or on the
    cluster at ``address`` (its first two alive nodes). ``progress(text)`` hears each sample."""
    import ray

    import ray_velo as rv
    from ray_velo.actors import alive_node_ids, ensure_agents
    from ray_velo.client import session

    result = SoakResult(minutes=minutes, consumers=consumers, slack=slack or Slack())
    cluster = None
    if address is None:
        from ray.cluster_utils import Cluster

        node: dict[str, Any] = {"num_cpus": 2, "object_store_memory": 512 * MiB}
        cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
        cluster.add_node(**node)
        cluster.wait_for_nodes()
        address = cluster.address
    ray.init(address=address, log_to_driver=False)
    started = time.monotonic()
    try:
        rv.init()
        nodes = alive_node_ids()
        if len(nodes) < 2:
            raise RuntimeError(f"the soak needs two nodes, the cluster has {len(nodes)}")
        agents = {n: a for n, a in ensure_agents(session.current().config).items()
                  if n in nodes[:2]}  # fmt: skip
        before = _paths(agents)
        _traffic(result, nodes[0], nodes[1], agents, minutes, consumers, seed, progress)
        result.final = _quiesce(agents)
        result.baseline, result.end = _levels(result)
        after = _paths(agents)
        result.paths = {
            f"{role}:{key}": n - before[role].get(key, 0)
            for role in after for key, n in after[role].items() if n != before[role].get(key, 0)
        }  # fmt: skip
        _check(result, result.slack)
    finally:
        result.seconds = time.monotonic() - started
        rv.shutdown(stop_ray=False)
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()  # type: ignore[no-untyped-call]
    return result


def _traffic(
    result: SoakResult, producer_node: str, consumer_node: str, agents: dict[str, Any],
    minutes: float, consumers: int, seed: int, progress: Any,
) -> None:  # fmt: skip
    """The traffic, sampling every agent as it goes."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    rng = random.Random(seed)
    largest = max(SOAK_SIZES)
    producer_cls, consumer_cls = _actors(2 * largest)

    def on(node: str) -> dict[str, Any]:
        return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}

    producers = [producer_cls.options(**on(producer_node)).remote() for _ in range(2)]
    readers = [consumer_cls.options(**on(consumer_node)).remote() for _ in range(consumers)]
    run_s = minutes * 60.0
    end = time.monotonic() + run_s
    sample_every = min(10.0, max(1.0, run_s / 30))  # at least ~10 samples a third
    next_sample = time.monotonic()
    pending: dict[Any, tuple[int, int, bool]] = {}  # ref -> (reader, crc, pinned)

    def launch(reader: int) -> None:
        size = rng.choice(SOAK_SIZES)
        pinned = rng.random() < PINNED_SHARE
        offset = rng.randrange(0, largest)
        handle, crc = ray.get(
            producers[reader % len(producers)].stage.remote(size, offset, pinned),
            timeout=ROUND_TIMEOUT_S,
        )
        pending[readers[reader].fetch_crc.remote(handle)] = (reader, crc, pinned)
        result.bytes_moved += size

    for reader in range(consumers):
        launch(reader)
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=ROUND_TIMEOUT_S)
        if not done:
            result.errors.append(f"no fetch finished within {ROUND_TIMEOUT_S} s")
            break
        reader, crc, pinned = pending.pop(done[0])
        _count_fetch(result, done[0], crc, pinned)
        now = time.monotonic()
        if now >= next_sample:
            _sample_agents(result, agents, now - end + run_s, progress)
            next_sample = now + sample_every
        if now < end:
            launch(reader)
    for actor in [*producers, *readers]:
        ray.kill(actor)


def _count_fetch(result: SoakResult, ref: Any, crc: int, pinned: bool) -> None:
    """One finished fetch into the result: a round, and its bytes checked against the CRC."""
    import ray

    result.rounds += 1
    result.staged["pinned" if pinned else "plain"] += 1
    try:
        got = ray.get(ref)
        if got != crc:
            result.wrong_bytes += 1
    except Exception as exc:  # every failure is counted and named in the result
        result.errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")


def _sample_agents(result: SoakResult, agents: dict[str, Any], t_s: float, progress: Any) -> None:
    sample = _statuses(agents)
    for node, values in sample.items():
        result.samples.setdefault(node, []).append({"t_s": int(t_s), **values})
    if progress is not None:
        progress(_progress_line(result, t_s))


def _progress_line(result: SoakResult, t_s: float) -> str:
    parts = [f"{t_s:6.0f} s: {result.rounds} payloads, {result.bytes_moved / 1e9:.2f} GB"]
    for node, samples in result.samples.items():
        last = samples[-1]
        parts.append(
            f"{node[:8]} reg={last['registered_bytes'] >> 20}MiB seg={last.get('segments', 0)} "
            f"fds={last.get('fds', 0)} thr={last.get('threads', 0)} "
            f"rss={last.get('rss_bytes', 0) >> 20}MiB"
        )
    return " | ".join(parts)


def _check(result: SoakResult, slack: Slack) -> None:
    """Fill ``result.failures``: growth past the slack, leftovers, wrong bytes, errors."""
    if result.rounds == 0:
        result.failures.append("no payload moved")
    if result.wrong_bytes:
        result.failures.append(f"{result.wrong_bytes} payloads came back with wrong bytes")
    if result.errors:
        result.failures.append(f"{len(result.errors)} fetches failed: {result.errors[:3]}")
    if any(len(samples) < 3 for samples in result.samples.values()) or not result.samples:
        result.failures.append("too few samples to judge growth: run the soak longer")
    for node, final in result.final.items():
        base, end = result.baseline.get(node, {}), result.end.get(node, {})
        for name in CHECKED:
            if name not in base or name not in end:
                continue
            allowed = slack.allowed(name, base[name])
            if end[name] > allowed:
                result.failures.append(
                    f"node {node[:12]}: {name} grew from {base[name]} (warm-up) to {end[name]} "
                    f"(allowed up to {allowed})"
                )
        for name in ("live_slots", "live_leases"):
            if final.get(name, 0):
                result.failures.append(f"node {node[:12]}: {final[name]} {name} left after")


def format_soak(result: SoakResult) -> str:
    """The summary a person reads: traffic, then each agent's figures at warm-up and end."""
    lines = [
        f"soak: {result.minutes:g} min, {result.consumers} consumers, {result.rounds} payloads "
        f"(staged {dict(result.staged)}), {result.bytes_moved / 1e9:.2f} GB in "
        f"{result.seconds:.0f} s; wrong bytes {result.wrong_bytes}, failed fetches "
        f"{len(result.errors)}",
        f"path decisions: {result.paths}",
        f"{'node':14} {'figure':18} {'warm-up high':>14} {'late high':>14} {'allowed':>14} "
        f"{'drained':>14}",
    ]
    for node, final in sorted(result.final.items()):
        base, end = result.baseline.get(node, {}), result.end.get(node, {})
        for name in (*CHECKED, "rss_bytes", "segment_bytes", "live_slots", "live_leases"):
            if name in final:
                allowed = result.slack.allowed(name, base.get(name, 0)) if name in CHECKED else ""
                lines.append(
                    f"{node[:12]:14} {name:18} {base.get(name, ''):>14} {end.get(name, ''):>14} "
                    f"{allowed:>14} {final[name]:>14}"
                )
    lines.append("PASS: nothing grew past its slack" if result.ok else "FAIL:")
    lines += [f"  {f}" for f in result.failures]
    return "\n".join(lines)
