"""``ray-velo``: the demo, the benchmarks, the soak, and a look at (or the end of) a cluster's
agents (docs/deployment.md §9, docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from ray_velo.bench.command import add_bench_command

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


class CliRefused(Exception):
    """A command cannot run as asked (the message says why and what to do, in one line)."""


class _Parser(argparse.ArgumentParser):
    """Usage mistakes in one line, not a usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _connect(address: str) -> None:
    import ray

    try:
        ray.init(address=address, log_to_driver=False)
    except Exception as exc:  # Ray's own error for "no cluster there", whatever its type
        where = "a running cluster" if address == "auto" else f"the cluster at {address}"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CliRefused(
            f"cannot reach {where} ({first}); start one with `ray start --head` or pass "
            "--address HOST:PORT"
        ) from None


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
    except CliRefused:  # no cluster: this machine only, unless one was named
        if args.address != "auto":
            raise
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

    if args.minutes <= 0 or args.consumers < 1:
        raise CliRefused(
            f"--minutes {args.minutes:g} --consumers {args.consumers}: needs a positive "
            "duration and at least one consumer"
        )
    result = run_soak(
        args.minutes,
        args.consumers,
        address=args.address,
        seed=args.seed,
        progress=lambda line: print(line, file=sys.stderr if args.json else sys.stdout, flush=True),
    )
    print(json.dumps(result.as_dict(), indent=2) if args.json else format_soak(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result.as_dict(), f, indent=2)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0 if result.ok else 1


def _grafana(args: argparse.Namespace) -> int:
    from ray_velo.ops import dashboard_dir, install_dashboard

    directory = args.dir or dashboard_dir(args.session_dir)
    path = install_dashboard(directory)
    print(f"installed the ray_velo dashboard: {path}")
    print("Grafana started from Ray's provisioning config picks it up (Dashboards > ray_velo)")
    return 0


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
    soak = sub.add_parser(
        "soak", help="mixed traffic across two nodes; fails if anything grows past its slack"
    )
    soak.add_argument("--minutes", type=float, default=10.0, help="how long (default 10)")
    soak.add_argument("--consumers", type=int, default=8, help="consumer actors (default 8)")
    soak.add_argument("--address", help="an existing cluster (default: an embedded one)")
    soak.add_argument("--seed", type=int, default=0, help="the traffic's random seed")
    soak.add_argument(
        "--json", action="store_true", help="print the samples and verdict as JSON instead"
    )
    soak.add_argument("--out", metavar="FILE", help="also write the samples and verdict as JSON")
    soak.set_defaults(run=_soak)


def _add_doctor_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    doctor = sub.add_parser(
        "doctor",
        help="which Ray (auth, TLS), UCX and torch ray_velo runs with, and what each allows",
    )
    doctor.add_argument("--json", action="store_true", help="as one JSON object")
    doctor.set_defaults(run=_doctor)


def _add_grafana_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    grafana = sub.add_parser("grafana", help="install the Grafana dashboard for Ray's Grafana")
    grafana.add_argument("--dir", help="install here (default: where Ray's Grafana reads)")
    grafana.add_argument(
        "--session-dir", help="the Ray session directory (default: /tmp/ray/session_latest)"
    )
    grafana.set_defaults(run=_grafana)


def build_parser() -> argparse.ArgumentParser:
    """``ray-velo``'s parser: every command and its options."""
    from ray_velo import __version__

    parser = _Parser(prog="ray-velo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"ray-velo {__version__}")
    sub: Any = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="producer/consumer across two local Ray nodes")
    demo.add_argument("--size-mib", type=int, default=256)
    demo.set_defaults(run=_demo)
    add_bench_command(sub)
    _add_cluster_commands(sub)
    _add_soak_command(sub)
    _add_grafana_command(sub)
    _add_doctor_command(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except CliRefused as exc:
        print(f"ray-velo {args.command}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`| head`): nothing more to say
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
