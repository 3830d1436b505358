"""The two-host bench's driver: runs inside host a of the testbed, measures every column, and
prints ``RESULT <json>`` last (docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ray_velo.bench.actors import LATENCY_REPS

MiB = 1 << 20
RESULT_PREFIX = "RESULT "
#: ``PROBE <size>``: the driver asks the parent to probe the link now, and waits for ``go``.
PROBE_PREFIX = "PROBE "
#: Only chunks: no GET (the kill switch) and no wire (the owner then has no bulk port).
CHUNKS_ONLY = {"VELO_RDMA_RENDEZVOUS_DISABLE": "1", "VELO_PEER_WIRE_DISABLE": "1"}

__all__ = ["PROBE_PREFIX", "RESULT_PREFIX", "main", "measure"]


def _say(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def ask_for_probe(size: int) -> None:
    """Have the bench's parent probe the link (raw socket, bare UCX GET) for ``size`` bytes
    now, between two rounds, so each round's ratio to the link is measured side by side."""
    sys.stdout.write(f"{PROBE_PREFIX}{size}\n")
    sys.stdout.flush()
    if sys.stdin.readline().strip() != "go":
        raise RuntimeError("the bench's parent went away during a link probe")


def _moved(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def _pair(producer_cls: Any, consumer_cls: Any, hosts: Sequence[Any]) -> tuple[Any, Any]:
    import ray

    producer = producer_cls.options(resources={hosts[0].resource: 1}).remote()
    consumer = consumer_cls.options(resources={hosts[1].resource: 1}).remote()
    ray.get([producer.ready.remote(), consumer.ready.remote()], timeout=120)
    return producer, consumer


def _restart_agents(config: Any, env: dict[str, str]) -> None:
    """Stop every agent and start new ones with ``env`` (the kill switch)."""
    import ray_velo as rv
    from ray_velo.actors.directory import (
        alive_node_ids,
        ensure_agents,
        find_agent,
        store_cluster_config,
    )

    rv.shutdown(stop_ray=False)
    deadline = time.monotonic() + 60
    for node_id in alive_node_ids():
        while time.monotonic() < deadline:  # a killed actor's name frees a moment later
            try:
                find_agent(node_id)
            except ValueError:
                break
            time.sleep(0.05)
    store_cluster_config(config)
    ensure_agents(config, env=env)


def measure(
    sizes: Sequence[int],
    reps: int,
    config: Any = None,
    *,
    transfers_only: bool = False,
    probe_rounds: bool = False,
) -> dict[str, Any]:
    """Every column for every size (docs/benchmarks.md), medians in seconds, and
    each transfer round's seconds (``samples``); ``transfers_only``: Ray, velo and the
    chunked path only (no pipelines, no mid-size latency table: for payloads of GiBs);
    ``probe_rounds``: the parent probes the link after every counted transfer round."""
    import ray

    import ray_velo as rv
    from ray_velo.bench.actors import bench_actors, measure_latency
    from ray_velo.config import VeloConfig
    from ray_velo.testbed import connect

    config = config or VeloConfig()
    info = connect()
    rv.init(config)
    producer_cls, consumer_cls = bench_actors()
    producer, consumer = _pair(producer_cls, consumer_cls, info.hosts)
    paths: dict[str, dict[str, int]] = {}
    before = ray.get(consumer.path_counts.remote())
    on_a, on_b = {info.hosts[0].resource: 1}, {info.hosts[1].resource: 1}
    rows, samples = _measure_sizes(
        (producer, consumer), (on_a, on_b), sizes, reps, transfers_only=transfers_only,
        probe_rounds=probe_rounds,
    )  # fmt: skip
    latency: dict[int, Any] = {}
    if not transfers_only:
        _say("  mid-size payloads: median time per transfer")
        latency = measure_latency(producer, consumer, on_a, on_b, LATENCY_REPS)
    consumer_info = ray.get(consumer.agent_info.remote())
    paths["velo"] = _moved(before, ray.get(consumer.path_counts.remote()))
    transports = consumer_info["ucx_transports"]
    for actor in (producer, consumer):
        ray.kill(actor)

    paths["chunked"] = _measure_chunked(config, (producer_cls, consumer_cls), info, rows, reps)
    rv.shutdown()
    return {
        "rows": {str(size): row for size, row in rows.items()},
        "samples": {str(size): columns for size, columns in samples.items()},
        "latency": {str(size): row for size, row in latency.items()},
        "paths": paths,
        "transports": transports,
    }


def _measure_sizes(
    actors: tuple[Any, Any],
    places: tuple[Mapping[str, float], Mapping[str, float]],
    sizes: Sequence[int],
    reps: int,
    *,
    transfers_only: bool,
    probe_rounds: bool,
) -> tuple[dict[int, dict[str, float | None]], dict[int, dict[str, list[float]]]]:
    """The transfer rounds (and pipelines) of every size: (medians, each round's samples)."""
    import ray

    from ray_velo.bench.actors import medians, rounds, transfer_round
    from ray_velo.bench.actors import pipelines as bench_pipelines

    producer, consumer = actors
    rows: dict[int, dict[str, float | None]] = {}
    samples: dict[int, dict[str, list[float]]] = {}
    turns = itertools.cycle([False, True])  # Ray first, then ray_velo first, by turns
    for size in sizes:
        _say(f"  {size // MiB} MiB: Ray object store vs rv.put/rv.fetch vs rv.empty/seal")
        ray.get(producer.make.remote(size))

        def after_round(rep: int, size: int = size) -> None:
            if probe_rounds and rep:
                ask_for_probe(size)

        samples[size] = rounds(
            reps,
            lambda: transfer_round(producer, consumer, built=True, velo_first=next(turns)),
            after_round,
        )
        rows[size] = {column: statistics.median(v) for column, v in samples[size].items()}
        if not transfers_only:
            _say(f"  {size // MiB} MiB: the @rv.transfer pipeline vs the same on Ray")
            pipelines, producers = bench_pipelines(size, *places)
            rows[size].update(medians(reps, pipelines, lambda _: None))
            for actor in producers:
                ray.kill(getattr(actor, "ray_handle", actor))
        ray.get(producer.drop.remote())
    return rows, samples


def _measure_chunked(
    config: Any, classes: tuple[Any, Any], info: Any, rows: dict[int, dict[str, Any]], reps: int
) -> dict[str, int]:
    """The chunked column of every row (agents restarted with the kill switch and no wire);
    the path decisions it counted."""
    import ray

    from ray_velo.bench.actors import medians, transfer_round

    _say("  the chunked path: agents restarted with the kill switch and no wire")
    _restart_agents(config, CHUNKS_ONLY)
    producer, consumer = _pair(*classes, info.hosts)
    before = ray.get(consumer.path_counts.remote())
    for size, row in rows.items():
        ray.get(producer.make.remote(size))
        chunked = medians(
            reps, lambda: transfer_round(producer, consumer, ray_store=False), lambda _: None
        )
        row["chunked"] = chunked["velo"]
        ray.get(producer.drop.remote())
    return _moved(before, ray.get(consumer.path_counts.remote()))


def _from_host_a(measure: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``measure(on_a, on_others, *args, tick=...)`` on this driver's testbed: the resources
    that place work on host a, then those of every other host (b, c, ...)."""
    import ray_velo as rv
    from ray_velo.testbed import connect

    info = connect()
    rv.init()
    result = measure(
        {info.hosts[0].resource: 1},
        [{host.resource: 1} for host in info.hosts[1:]],
        *args,
        tick=lambda text: _say(f"  {text}"),
    )
    rv.shutdown()
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ray_velo.bench.hostdriver")
    parser.add_argument("--sizes", required=True, help="payload sizes in bytes, comma separated")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--transport", action="store_true", help="the tensor transports")
    parser.add_argument(
        "--fan-out", type=int, default=0, help="K readers of one payload, on hosts b, c, ..."
    )
    parser.add_argument("--budget-mib", type=int, help="the agents' registered_bytes_budget")
    parser.add_argument("--transfers-only", action="store_true", help="no pipelines, no latency")
    parser.add_argument(
        "--probe-rounds", action="store_true", help="ask the parent to probe after each round"
    )
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.fan_out and args.transport:  # one RDT weights ref to K rollout actors on b, c, ...
        from ray_velo.bench.broadcast import measure_broadcast

        result = _from_host_a(measure_broadcast, args.fan_out, args.reps)
    elif args.fan_out:  # one payload to K readers round-robin over b, c, ...
        from ray_velo.bench.fanout import measure_fan_out

        result = _from_host_a(measure_fan_out, sizes[0], args.fan_out, args.reps)
    elif args.transport:  # the tensor transports, host a to host b
        from ray_velo.bench.transport import measure_transports

        result = _from_host_a(
            lambda on_a, on_others, tick: measure_transports(
                {"resources": on_a}, {"resources": on_others[0]}, sizes, args.reps, tick=tick
            )
        )
    else:
        from ray_velo.config import RdmaConfig, RdmaPoolConfig, VeloConfig

        config = VeloConfig()
        if args.budget_mib:
            pool = RdmaPoolConfig(registered_bytes_budget=args.budget_mib * MiB)
            config = config.replace(rdma=RdmaConfig(pool=pool))
        result = measure(
            sizes,
            args.reps,
            config,
            transfers_only=args.transfers_only,
            probe_rounds=args.probe_rounds,
        )
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
