"""``ray-velo``: the demo, the benchmarks, the soak, and a look at (or the end of) a cluster's
agents (docs/deployment.md §9, docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

MiB = 1 << 20


def _demo(args: argparse.Namespace) -> int:
    from ray_velo.bench import demo

    print(
        f"ray_velo demo: two local Ray nodes, a {args.size_mib} MiB array from a producer "
        "task on node a to a consumer task on node b",
        flush=True,
    )
    print(demo(args.size_mib * MiB))
    return 0


#: The testbed names its hosts a..z.
_MAX_HOSTS = 26


def _hosts_refusal(args: argparse.Namespace) -> str | None:
    """Why ``--hosts`` cannot be used as given, or None (not given, or fine)."""
    if args.hosts is None:
        return None
    if not (args.two_host and args.fan_out):
        return "--hosts needs --two-host --fan-out K (the K readers go to hosts b, c, ...)"
    if not 2 <= args.hosts <= _MAX_HOSTS:
        return (
            f"--hosts {args.hosts}: needs 2 to {_MAX_HOSTS} hosts "
            "(host a for the producer, at least one for the readers)"
        )
    return None


def _large_refusal(args: argparse.Namespace) -> str | None:
    """Why ``--budget-mib`` / ``--transfers-only`` cannot be used as given, or None."""
    if args.budget_mib is None and not args.transfers_only:
        return None
    if not args.two_host or args.fan_out or args.transport:
        return "--budget-mib and --transfers-only go with --two-host (not --fan-out, --transport)"
    if args.budget_mib is not None and args.budget_mib <= 0:
        return f"--budget-mib {args.budget_mib}: needs a positive number of MiB"
    return None


def _bench_one_kind(args: argparse.Namespace) -> int | None:
    """The bench modes that measure one thing (``--two-host``, ``--decorator``,
    ``--calls``, ``--transport``): their exit status, or None for the default bench."""
    size = int(float(args.sizes.split(",")[0]) * MiB) if args.sizes else 256 * MiB
    refusal = _hosts_refusal(args) or _large_refusal(args)
    if refusal:
        print(f"ray-velo bench: {refusal}", file=sys.stderr)
        return 2
    if args.two_host:
        return _bench_two_host(args)
    if args.fan_out:
        print(
            "ray-velo bench: --fan-out needs --two-host (readers on another host)", file=sys.stderr
        )
        return 2
    if args.decorator:
        from ray_velo.bench import run_decorator_bench

        print(run_decorator_bench(size, args.reps))
        return 0
    if args.calls:
        from ray_velo.bench.calls import format_calls, run_calls_bench

        reps = max(args.reps, 40) if args.reps == 5 else args.reps  # 5 (the default) is few
        print(format_calls(run_calls_bench(reps), reps))
        return 0
    if args.scale:
        from ray_velo.bench.scale import format_scale, run_scale_bench

        samples = 200 if args.reps == 5 else args.reps  # 5 (the default) is few
        print(format_scale(run_scale_bench(samples=samples), samples))
        return 0
    if args.transport:
        from ray_velo.bench.samehost import run_transport_bench

        sizes = [int(float(s) * MiB) for s in (args.sizes or "256").split(",")]
        print(run_transport_bench(sizes, args.reps))
        return 0
    return None


def _bench(args: argparse.Namespace) -> int:
    from ray_velo.bench import default_sizes, format_table, plot, run_bench, shm_free_bytes

    status = _bench_one_kind(args)
    if status is not None:
        return status
    if args.sizes:
        sizes = [int(float(s) * MiB) for s in args.sizes.split(",")]
    else:
        sizes = default_sizes(shm_free_bytes())
    from ray_velo.config import VeloConfig

    config = VeloConfig()
    if args.chunk_mib:
        config = config.replace(chunk_size=int(args.chunk_mib * MiB))
    if args.in_flight:
        config = config.replace(pulls_in_flight=args.in_flight)
    from ray_velo.bench.actors import LATENCY_REPS, format_latency

    latency: dict[int, dict[str, float | None]] = {}
    rows = run_bench(
        sizes, args.reps, config=config, with_ucx_raw=not args.no_ucx_raw, latency=latency
    )
    print(format_table(rows))
    print()
    print(format_latency(latency, LATENCY_REPS))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([row.as_dict() for row in rows], f, indent=2)
        print(f"wrote {args.json}")
    if args.plot:
        try:
            plot(rows, args.plot)
        except ImportError:
            print("--plot needs matplotlib: pip install 'ray-velo[plot]'", file=sys.stderr)
            return 1
        print(f"wrote {args.plot}")
    return 0


def _bench_two_host(args: argparse.Namespace) -> int:
    from ray_velo.bench.twohost import format_two_host, run_two_host
    from ray_velo.testbed import check_privileges
    from ray_velo.testbed.errors import TestbedUnavailable
    from ray_velo.testbed.security import Security

    try:
        check_privileges()
    except TestbedUnavailable as exc:
        print(f"ray-velo bench --two-host: {exc}", file=sys.stderr)
        return 2
    sizes = [int(float(s) * MiB) for s in (args.sizes or "256").split(",")]
    links = [link.strip() for link in args.link.split(",") if link.strip()]
    security: Security = {"auth": args.auth, "tls": args.tls}
    print(f"Ray on the testbed: auth {args.auth}, TLS {'on' if args.tls else 'off'}")
    if args.fan_out:
        from ray_velo.bench.twohost import run_two_host_fan_out

        hosts = args.hosts or 2
        print(run_two_host_fan_out(links, sizes[0], args.fan_out, args.reps, hosts, security))
        return 0
    if args.transport:
        from ray_velo.bench.twohost import run_two_host_transport

        print(run_two_host_transport(links, sizes, args.reps, security))
        return 0
    results = run_two_host(
        links,
        sizes,
        args.reps,
        with_raw=not args.no_ucx_raw,
        budget_mib=args.budget_mib,
        transfers_only=args.transfers_only,
        security=security,
    )
    print(format_two_host(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.as_dict() for r in results], f, indent=2)
        print(f"wrote {args.json}")
    return 0


def _connect(address: str) -> None:
    import ray

    ray.init(address=address, log_to_driver=False)


def _status(args: argparse.Namespace) -> int:
    from ray_velo.ops import cluster_status, format_runtime, runtime_report

    _connect(args.address)
    statuses = cluster_status()
    if args.json:
        print(json.dumps(statuses, indent=2, sort_keys=True))
        return 0
    print(format_runtime(runtime_report()))
    for status in statuses:
        if "error" in status:
            print(f"{status['node_id']}: {status['error']}")
            continue
        print(
            f"{status['node_id']}: worker {status['worker_id']} transport {status['transport']}"
            f"\n    slots={status['live_slots']} leases={status['live_leases']} "
            f"staged={status['staged_bytes']} B registered={status['registered_bytes']} B "
            f"of {status['budget_bytes']} B{' (draining)' if status['draining'] else ''}"
            f" jobs_followed={status.get('jobs_followed', 0)}"
        )
        for key, count in sorted(status["paths"].items()):
            print(f"    path {key}: {count}")
        for slot in status.get("detached", []):
            ttl = slot["ttl_left_s"]
            print(
                f"    detached slot {slot['slot']}: {slot['bytes']} B from job {slot['job'] or '?'}"
                f", refcount {slot['refcount']}, "
                + ("no TTL" if ttl is None else f"TTL in {ttl:.0f} s")
            )
    return 0


def _doctor(args: argparse.Namespace) -> int:
    """What this machine runs ray_velo with (Ray, its auth and TLS, UCX, torch) and which
    features each allows; needs no cluster."""
    from ray_velo.ops import format_runtime, runtime_report

    report = runtime_report()
    print(json.dumps(report, indent=2) if args.json else format_runtime(report))
    return 0


def _cleanup(args: argparse.Namespace) -> int:
    from ray_velo.ops import cleanup_cluster, cleanup_local, default_shm_dir

    results = []
    connected = False
    try:
        _connect(args.address)
        connected = True
    except Exception as exc:  # no cluster: this machine only
        if args.address != "auto":
            print(f"ray-velo cleanup: cannot reach the cluster at {args.address}: {exc}",
                  file=sys.stderr)  # fmt: skip
            return 1
    shm_dir = args.shm_dir or default_shm_dir()
    results.append(cleanup_local(shm_dir))
    if connected:
        results += cleanup_cluster(shm_dir)
    seen: set[str] = set()
    total = 0
    for result in results:
        fresh = [(p, n) for p, n in result.removed if p not in seen]  # one host, several nodes
        seen.update(p for p, _ in fresh)
        nbytes = sum(n for _, n in fresh)
        total += nbytes
        if result.error:
            print(f"{result.node_id}: cleanup failed ({result.error})")
            continue
        print(f"{result.node_id} (via {result.via}): removed {len(fresh)} segments, {nbytes} B")
        for path, n in fresh:
            print(f"    {path} ({n} B)")
    print(f"removed {len(seen)} segments of dead processes, {total} B in all")
    return 0


def _stop(args: argparse.Namespace) -> int:
    import ray_velo as rv

    _connect(args.address)
    rv.shutdown(stop_ray=False)
    print("ray_velo agents stopped")
    return 0


def _soak(args: argparse.Namespace) -> int:
    from ray_velo.bench.soak import format_soak, run_soak

    result = run_soak(
        args.minutes,
        args.consumers,
        address=args.address,
        seed=args.seed,
        progress=lambda line: print(line, flush=True),
    )
    print(format_soak(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.as_dict(), f, indent=2)
        print(f"wrote {args.json}")
    return 0 if result.ok else 1


def _grafana(args: argparse.Namespace) -> int:
    from ray_velo.ops import dashboard_dir, install_dashboard

    directory = args.dir or dashboard_dir(args.session_dir)
    path = install_dashboard(directory)
    print(f"installed the ray_velo dashboard: {path}")
    print("Grafana started from Ray's provisioning config picks it up (Dashboards > ray_velo)")
    return 0


def _add_bench_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``ray-velo bench`` and its options (sizes, columns, the two-host testbed)."""
    bench = sub.add_parser("bench", help="ray_velo vs Ray's object store vs raw UCX")
    bench.add_argument("--sizes", help="payload sizes in MiB, comma separated (default 1..1024)")
    bench.add_argument("--reps", type=int, default=5, help="repetitions per size (median)")
    bench.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    bench.add_argument("--plot", metavar="FILE", help="also write a PNG plot")
    bench.add_argument(
        "--no-ucx-raw", action="store_true", help="skip the raw ceilings (UCX GET, TCP socket)"
    )
    bench.add_argument(
        "--decorator",
        action="store_true",
        help="a @ray_velo.transfer pipeline vs the same pipeline on Ray's object store",
    )
    bench.add_argument(
        "--transport",
        action="store_true",
        help='tensor_transport="VELO"/"VELO_NUMPY" (and NIXL) vs Ray\'s object store, actor to actor',
    )
    bench.add_argument(
        "--fan-out",
        type=int,
        default=0,
        metavar="K",
        help="with --two-host: one payload from host a to K readers at once (on host b, or "
        "round-robin over b, c, ... with --hosts), Ray vs ray_velo",
    )
    bench.add_argument(
        "--hosts",
        type=int,
        metavar="N",
        help="with --two-host --fan-out: emulate N hosts (default 2): the producer on a, "
        "the K readers round-robin over b, c, ...",
    )
    bench.add_argument(
        "--calls",
        action="store_true",
        help="each call on a transfer's path: over Ray vs over the agents' socket and TCP wire",
    )
    bench.add_argument(
        "--scale",
        action="store_true",
        help="per-operation cost (put, fetch, release, cross-node fetch) at 1k, 10k and 100k "
        "live handles on a node, beside Ray's put+get, and the agent's memory per handle",
    )
    _add_two_host_options(bench)
    bench.add_argument("--chunk-mib", type=float, help="chunked path: chunk size in MiB")
    bench.add_argument("--in-flight", type=int, help="chunked path: pulls in flight")
    bench.set_defaults(run=_bench)


def _add_two_host_options(bench: argparse.ArgumentParser) -> None:
    """``ray-velo bench --two-host`` and the options that go with it."""
    bench.add_argument(
        "--two-host",
        action="store_true",
        help="across two emulated hosts (network namespaces, shaped veth, UCX over tcp; root)",
    )
    bench.add_argument(
        "--link",
        default="10gbit",
        help="with --two-host: link rates, comma separated: 10gbit, 25gbit, none (unshaped)",
    )
    bench.add_argument(
        "--budget-mib",
        type=int,
        help="with --two-host: the agents' registered_bytes_budget in MiB (a payload above it "
        "moves through registered windows)",
    )
    bench.add_argument(
        "--transfers-only",
        action="store_true",
        help="with --two-host: Ray, ray_velo and the chunked path only (no pipelines, no "
        "mid-size latency table): for payloads of GiBs",
    )
    _add_security_options(bench)


def _add_security_options(bench: argparse.ArgumentParser) -> None:
    """``--auth`` and ``--tls``: Ray's security settings on the two-host testbed."""
    bench.add_argument(
        "--auth",
        choices=("token", "disabled"),
        default="token",
        help="with --two-host: Ray's auth mode on every node and driver (default token, Ray's "
        "coming default, with a fresh token per testbed; disabled to compare)",
    )
    bench.add_argument(
        "--tls",
        action="store_true",
        help="with --two-host: run Ray with RAY_USE_TLS=1 (certificates of a throwaway CA)",
    )


def _add_cluster_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``status``, ``stop`` and ``cleanup``: each takes a running cluster's ``--address``."""
    commands: dict[str, argparse.ArgumentParser] = {}
    for name, run, text in (
        ("status", _status, "each node's agent: transport, memory, slots, leases, paths"),
        ("stop", _stop, "stop every agent of a running cluster (the protocol's shutdown order)"),
        ("cleanup", _cleanup, "remove the shared-memory segments dead processes left"),
    ):
        command = sub.add_parser(name, help=text)
        command.add_argument("--address", default="auto", help="Ray cluster address")
        command.set_defaults(run=run)
        commands[name] = command
    commands["status"].add_argument(
        "--json", action="store_true", help="a JSON list, one object per node agent"
    )
    commands["cleanup"].add_argument(
        "--shm-dir", help="the segments' directory (default: the cluster's, else /dev/shm)"
    )


def _add_soak_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``ray-velo soak``: duration, consumers, cluster and seed."""
    soak = sub.add_parser(
        "soak", help="mixed traffic across two nodes; fails if anything grows past its slack"
    )
    soak.add_argument("--minutes", type=float, default=10.0, help="how long (default 10)")
    soak.add_argument("--consumers", type=int, default=8, help="consumer actors (default 8)")
    soak.add_argument("--address", help="an existing cluster (default: an embedded one)")
    soak.add_argument("--seed", type=int, default=0, help="the traffic's random seed")
    soak.add_argument("--json", metavar="FILE", help="also write the samples and verdict")
    soak.set_defaults(run=_soak)


def _add_doctor_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``ray-velo doctor``: this machine's Ray, UCX and torch, and what each allows."""
    doctor = sub.add_parser(
        "doctor",
        help="which Ray (auth, TLS), UCX and torch ray_velo runs with, and what each allows",
    )
    doctor.add_argument("--json", action="store_true", help="as one JSON object")
    doctor.set_defaults(run=_doctor)


def _add_grafana_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``ray-velo grafana``: where to install the dashboard."""
    grafana = sub.add_parser("grafana", help="install the Grafana dashboard for Ray's Grafana")
    grafana.add_argument("--dir", help="install here (default: where Ray's Grafana reads)")
    grafana.add_argument(
        "--session-dir", help="the Ray session directory (default: /tmp/ray/session_latest)"
    )
    grafana.set_defaults(run=_grafana)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ray-velo", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="producer/consumer across two local Ray nodes")
    demo.add_argument("--size-mib", type=int, default=256)
    demo.set_defaults(run=_demo)
    _add_bench_command(sub)
    _add_cluster_commands(sub)
    _add_soak_command(sub)
    _add_grafana_command(sub)
    _add_doctor_command(sub)
    args = parser.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
