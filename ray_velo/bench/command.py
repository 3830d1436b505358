"""``ray-velo bench``: its options, its modes (one per run), and what every mode does with its
result: a table on stdout (``--json``: the sitting as JSON instead), the sitting written to
``--out FILE``; ``--compare A B`` sets two sittings side by side (docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BenchRefused", "Outcome", "add_bench_command"]

MiB = 1 << 20
#: ``{shape: {column: median seconds}}``
Shapes = dict[str, dict[str, float | None]]
#: The testbed names its hosts a..z.
_MAX_HOSTS = 26


class BenchRefused(Exception):
    """The bench's options cannot be used as given (the message says why, in one line)."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a bench mode measured: its table, its whole result, and its ``shapes``
    (``{shape: {column: median seconds}}``: what sittings are compared by)."""

    mode: str
    text: str
    results: Any
    shapes: Shapes
    links: list[str] = field(default_factory=list)
    transport: str | None = None


# --- parsing what was given ---------------------------------------------------------------


def _sizes(args: argparse.Namespace, default: str) -> list[int]:
    text = args.sizes or default
    try:
        sizes = [int(float(s) * MiB) for s in text.split(",")]
    except ValueError:
        raise BenchRefused(
            f"--sizes {text}: payload sizes in MiB, comma separated (e.g. 16,256)"
        ) from None
    if not sizes or min(sizes) < 1:
        raise BenchRefused(f"--sizes {text}: every size must be above 0 MiB")
    return sizes


def _links(args: argparse.Namespace) -> list[str]:
    from ray_velo.testbed.netns import parse_rate

    links = [link.strip() for link in (args.link or "10gbit").split(",") if link.strip()]
    for link in links:
        try:
            parse_rate(link)
        except ValueError as exc:
            raise BenchRefused(f"--link: {exc}") from None
    if not links:
        raise BenchRefused("--link: name at least one link rate (10gbit, 25gbit, none)")
    return links


def _refusal(args: argparse.Namespace) -> str | None:
    """Why the options cannot go together, or None."""
    if args.reps < 1:
        return f"--reps {args.reps}: needs at least 1 repetition"
    if args.hosts is not None:
        if not (args.two_host and args.fan_out):
            return "--hosts needs --two-host --fan-out K (the K readers go to hosts b, c, ...)"
        if not 2 <= args.hosts <= _MAX_HOSTS:
            return (
                f"--hosts {args.hosts}: needs 2 to {_MAX_HOSTS} hosts "
                "(host a for the producer, at least one for the readers)"
            )
    if args.fan_out and not args.two_host:
        return "--fan-out needs --two-host (readers on another host)"
    if args.fan_out and args.shapes:
        return "--fan-out is a mode of its own: not with --shapes"
    if args.shapes and not args.two_host:
        return "--shapes needs --two-host (the shapes we sell, measured across two hosts)"
    if args.ucx_tcp and not args.shapes:
        return "--ucx-tcp goes with --two-host --shapes"
    if args.checkout and not args.shapes:
        return "--checkout goes with --two-host --shapes (the one mode that runs another checkout)"
    if args.checkout and not os.path.isfile(os.path.join(args.checkout, "ray_velo", "__init__.py")):
        return f"--checkout {args.checkout}: no ray_velo package there (a checkout's root)"
    if args.two_host and (args.decorator or args.calls or args.scale):
        return "--decorator, --calls and --scale run on two local nodes: not with --two-host"
    if args.budget_mib is not None or args.transfers_only:
        if not args.two_host or args.fan_out or args.transport or args.shapes:
            return "--budget-mib and --transfers-only go with --two-host alone"
        if args.budget_mib is not None and args.budget_mib <= 0:
            return f"--budget-mib {args.budget_mib}: needs a positive number of MiB"
    if args.plot and (args.decorator or args.calls or args.scale or args.compare or args.fan_out):
        return (
            "--plot draws GB/s against payload size: the default bench, --transport, --two-host "
            "(with --shapes or --transport too) and --ranges have that curve; this mode has none"
        )
    return None


# --- the modes ----------------------------------------------------------------------------


def _same_host(args: argparse.Namespace) -> Outcome:
    from ray_velo.bench.actors import LATENCY_REPS, format_latency
    from ray_velo.bench.samehost import default_sizes, format_table, plot, run_bench, shm_free_bytes
    from ray_velo.config import VeloConfig

    sizes = _sizes(args, "") if args.sizes else default_sizes(shm_free_bytes())
    config = VeloConfig()
    if args.chunk_mib:
        config = config.replace(chunk_size=int(args.chunk_mib * MiB))
    if args.in_flight:
        config = config.replace(pulls_in_flight=args.in_flight)
    latency: dict[int, dict[str, float | None]] = {}
    rows = run_bench(
        sizes, args.reps, config=config, with_ucx_raw=not args.no_ucx_raw, latency=latency
    )
    if args.plot:
        plot(rows, args.plot)
    text = format_table(rows) + "\n\n" + format_latency(latency, LATENCY_REPS)
    shapes: Shapes = {f"{r.size_bytes // MiB} MiB, local nodes": {**r.seconds} for r in rows}
    results = {"rows": [r.as_dict() for r in rows], "latency": latency}
    return Outcome("same-host", text, results, shapes)


def _decorator(args: argparse.Namespace) -> Outcome:
    from ray_velo.bench.samehost import format_decorator, run_decorator_bench

    size = _sizes(args, "256")[0]
    result = run_decorator_bench(size, args.reps)
    medians: dict[str, float | None] = {
        c: statistics.median(v) for c, v in result["seconds"].items()
    }
    shape = f"{size // MiB} MiB decorator, local nodes"
    return Outcome("decorator", format_decorator(result), result, {shape: medians})


def _calls(args: argparse.Namespace) -> Outcome:
    from ray_velo.bench.calls import format_calls, run_calls_bench

    reps = 40 if args.reps == 5 else args.reps  # 5 (the default) is few
    result = run_calls_bench(reps)
    shapes: Shapes = {f"call {name}": {"seconds": ms / 1e3} for name, ms in result.items()}
    return Outcome("calls", format_calls(result, reps), result, shapes)


def _scale(args: argparse.Namespace) -> Outcome:
    import dataclasses

    from ray_velo.bench.scale import format_scale, run_scale_bench

    samples = 200 if args.reps == 5 else args.reps  # 5 (the default) is few
    rows = run_scale_bench(samples=samples)
    shapes: Shapes = {f"{r.live_handles} live handles": {**r.seconds} for r in rows}
    results = [dataclasses.asdict(r) for r in rows]
    return Outcome("scale", format_scale(rows, samples), results, shapes)


def _transport_shapes(
    measured: dict[str, Any], where: str, raw_s: dict[int, float] | None = None
) -> Shapes:
    shapes: Shapes = {}
    for row in [*measured["sizes"], *measured.get("objects", [])]:
        columns: dict[str, float | None] = {**row["seconds"]}
        if raw_s and row["size_bytes"] in raw_s:
            columns["raw_tcp"] = raw_s[row["size_bytes"]]
        name = row.get("object") or f"{row['size_bytes'] // MiB} MiB tensor"
        shapes[f"{name}, {where}"] = columns
    return shapes


def _transport(args: argparse.Namespace) -> Outcome:
    from ray_velo.bench.samehost import run_transport_bench
    from ray_velo.bench.transport import format_transport

    measured = run_transport_bench(_sizes(args, "256"), args.reps)
    text = format_transport(measured, "two local nodes on one host")
    return Outcome("transport", text, measured, _transport_shapes(measured, "local nodes"))


def _two_host(args: argparse.Namespace) -> Outcome:
    from ray_velo.bench.twohost import format_two_host, run_two_host
    from ray_velo.testbed.security import Security

    security: Security = {"auth": args.auth, "tls": args.tls}
    links = _links(args)
    sizes = _sizes(args, "256")
    if args.fan_out and args.transport:
        return _broadcast(args, links, security)
    if args.fan_out:
        return _fan_out(args, links, sizes[0], security)
    if args.transport:
        return _two_host_transport(args, links, sizes, security)
    if args.shapes:
        only = links if args.link else None
        return _shapes(security, args.checkout, args.ucx_tcp, only)
    results = run_two_host(
        links,
        sizes,
        args.reps,
        with_raw=not args.no_ucx_raw,
        budget_mib=args.budget_mib,
        transfers_only=args.transfers_only,
        security=security,
    )
    shapes = {
        f"{size // MiB} MiB @{r.link}": {c: v for c, v in row.items() if not c.endswith("_stolen")}
        for r in results
        for size, row in r.rows.items()
    }
    transport = ", ".join(sorted({r.transport() for r in results}))
    return Outcome(
        "two-host",
        format_two_host(results),
        [r.as_dict() for r in results],
        shapes,
        links,
        transport,
    )


def _fan_out(args: argparse.Namespace, links: list[str], size: int, security: Any) -> Outcome:
    from ray_velo.bench.fanout import format_fan_out
    from ray_velo.bench.twohost import run_two_host_fan_out

    hosts = args.hosts or 2
    rows = run_two_host_fan_out(links, size, args.fan_out, args.reps, hosts, security)
    text = format_fan_out(rows, args.fan_out, size, args.reps, hosts)
    shapes = {
        f"{size // MiB} MiB to {args.fan_out} readers on {hosts} hosts @{link}": {
            c: row.get(c) for c in ("ray", "velo", "velo_one")
        }
        for link, row in rows.items()
    }
    return Outcome("fan-out", text, rows, shapes, links)


def _broadcast(args: argparse.Namespace, links: list[str], security: Any) -> Outcome:
    from ray_velo.bench.broadcast import WEIGHTS, format_broadcast
    from ray_velo.bench.twohost import run_two_host_fan_out

    hosts = args.hosts or 2
    rows = run_two_host_fan_out(links, 0, args.fan_out, args.reps, hosts, security, weights=True)
    text = format_broadcast(rows, args.fan_out, hosts)
    shapes = {
        f"{WEIGHTS} to {args.fan_out} readers on {hosts} hosts @{link}": {
            **row["seconds"],
            **{probe: row[probe] for probe in ("raw_one", "raw_chain") if probe in row},
        }
        for link, row in rows.items()
    }
    return Outcome("weights broadcast", text, rows, shapes, links, "wire")


def _two_host_transport(
    args: argparse.Namespace, links: list[str], sizes: list[int], security: Any
) -> Outcome:
    from ray_velo.bench.transport import format_transport
    from ray_velo.bench.twohost import run_two_host_transport

    per_link = run_two_host_transport(links, sizes, args.reps, security)
    texts, shapes = [], {}
    for link, got in per_link.items():
        where = f"two hosts, {link} link, VELO's bytes over the agents' wire"
        texts.append(format_transport(got["measured"], where, got["raw_s"]))
        shapes.update(_transport_shapes(got["measured"], f"@{link}", got["raw_s"]))
    return Outcome("two-host transport", "\n\n".join(texts), per_link, shapes, links, "wire")


def _shapes(security: Any, checkout: str | None, ucx_tcp: bool, links: list[str] | None) -> Outcome:
    from ray_velo.bench.shapes import BENCH_SHAPES, format_shapes, measure_shapes

    pythonpath = os.path.abspath(checkout) if checkout else None
    chosen = [s for s in BENCH_SHAPES if links is None or s.link in links]
    if not chosen:
        raise BenchRefused(f"--link {','.join(links or [])}: no shape runs on that link")
    result = measure_shapes(chosen, pythonpath=pythonpath, security=security, ucx_tcp=ucx_tcp)
    shapes: Shapes = {
        name: {c: statistics.median(v) for c, v in row["seconds"].items()}
        for name, row in result["shapes"].items()
    }
    links = sorted({s.link for s in chosen})
    transport = "wire, ucx tcp (opt-in)" if ucx_tcp else "wire"
    return Outcome("shapes", format_shapes(result), result, shapes, links, transport)


def _compare(args: argparse.Namespace) -> int:
    from ray_velo.bench.record import compare_sittings, load_sitting

    first, second = (load_sitting(path) for path in args.compare)
    print(compare_sittings(first, second))
    return 0


def _ranges(args: argparse.Namespace) -> int:
    from ray_velo.bench.record import load_sitting, ranges_table

    sittings = [load_sitting(path) for path in args.ranges]
    print(ranges_table(sittings))
    if args.plot:
        from ray_velo.bench.plots import plot_sittings

        codes = sorted({str(s["code"].get("commit") or "?")[:7] for s in sittings})
        title = (
            f"two hosts (UCX tcp over a veth link), {len(sittings)} sittings of "
            f"{', '.join(codes)}: medians and ranges"
        )
        try:
            plot_sittings(sittings, args.plot, title)
        except ValueError as exc:
            raise BenchRefused(str(exc)) from None
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _mode(args: argparse.Namespace) -> Callable[[argparse.Namespace], Outcome]:
    if args.two_host:
        return _two_host
    for flag, run in (
        (args.decorator, _decorator),
        (args.calls, _calls),
        (args.scale, _scale),
        (args.transport, _transport),
    ):
        if flag:
            return run
    return _same_host


def _preflight(args: argparse.Namespace) -> None:
    """What can be refused before a minute of measuring: the options, root for the testbed,
    matplotlib for ``--plot``, a writable ``--out``."""
    refusal = _refusal(args)
    if refusal:
        raise BenchRefused(refusal)
    if args.two_host:
        from ray_velo.testbed import check_privileges
        from ray_velo.testbed.errors import TestbedUnavailable

        try:
            check_privileges()
        except TestbedUnavailable as exc:
            raise BenchRefused(f"--two-host: {exc}") from None
    if args.transport and not args.without_nixl:
        from ray_velo.bench.transport import nixl_unusable

        why = nixl_unusable()
        if why is not None:
            raise BenchRefused(
                f"--transport measures VELO beside Ray's NIXL, which cannot run here ({why}); "
                "or add --without-nixl"
            )
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise BenchRefused("--plot needs matplotlib: pip install 'ray-velo[plot]'") from None
    for path in (args.out, args.plot):
        folder = os.path.dirname(os.path.abspath(path)) if path else ""
        if path and not os.access(folder, os.W_OK):
            raise BenchRefused(f"cannot write {path}: {folder} is not a writable folder")


def run_bench_command(args: argparse.Namespace) -> int:
    """``ray-velo bench``: refuse what cannot run (one line, exit 2), else measure, print and
    record."""
    from ray_velo.bench.record import SittingError, make_sitting, write_sitting

    try:
        if args.compare:
            return _compare(args)
        if args.ranges:
            _preflight(args)
            return _ranges(args)
        _preflight(args)
        if args.two_host:
            print(f"Ray on the testbed: auth {args.auth}, TLS {'on' if args.tls else 'off'}",
                  file=sys.stderr if args.json else sys.stdout)  # fmt: skip
        outcome = _mode(args)(args)
    except (BenchRefused, SittingError) as exc:  # a sitting of --compare or --ranges
        print(f"ray-velo bench: {exc}", file=sys.stderr)
        return 2
    sitting = make_sitting(
        outcome.mode,
        outcome.results,
        outcome.shapes,
        links=outcome.links,
        transport=outcome.transport,
        argv=sys.argv[1:],
        checkout=args.checkout,
    )
    print(json.dumps(sitting, indent=1, sort_keys=True) if args.json else outcome.text)
    if args.out:
        write_sitting(args.out, sitting)
        print(f"wrote {args.out}", file=sys.stderr)
    if args.plot:
        if outcome.mode != "same-host":  # that one drew its own, with every column
            from ray_velo.bench.plots import plot_sittings

            try:
                plot_sittings([sitting], args.plot, f"ray-velo bench, {outcome.mode}: one sitting")
            except ValueError as exc:
                print(f"ray-velo bench: --plot: {exc}", file=sys.stderr)
                return 1
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


# --- the options ----------------------------------------------------------------------------


def add_bench_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``ray-velo bench`` and its options."""
    bench = sub.add_parser("bench", help="ray_velo vs Ray's object store vs raw UCX")
    bench.add_argument("--sizes", help="payload sizes in MiB, comma separated (default 1..1024)")
    bench.add_argument("--reps", type=int, default=5, help="repetitions per size (median)")
    bench.add_argument(
        "--json", action="store_true", help="print the sitting as JSON instead of the table"
    )
    bench.add_argument(
        "--out", metavar="FILE", help="write the sitting (results, commit, machine, link) as JSON"
    )
    bench.add_argument(
        "--plot", metavar="FILE", help="the default bench's GB/s curve as a PNG (matplotlib)"
    )
    bench.add_argument(
        "--no-ucx-raw", action="store_true", help="skip the raw ceilings (UCX GET, TCP socket)"
    )
    _add_modes(bench)
    bench.add_argument(
        "--without-nixl",
        action="store_true",
        help="with --transport: go on where NIXL is not installed (no NIXL column)",
    )
    bench.add_argument(
        "--ucx-tcp",
        action="store_true",
        help="with --two-host --shapes: also measure ray_velo with UCX allowed over TCP (the "
        "operator's opt-in), each link's shapes in turn with the default (the wire)",
    )
    bench.add_argument(
        "--checkout",
        metavar="DIR",
        help="with --two-host --shapes: measure the ray_velo of another checkout (its root; "
        "its compiled UCX binding built in place), to compare commits in sittings",
    )
    bench.add_argument(
        "--fan-out",
        type=int,
        default=0,
        metavar="K",
        help="with --two-host: one payload from host a to K readers at once (on host b, or "
        "round-robin over b, c, ... with --hosts), Ray vs ray_velo; with --transport too: one "
        "RDT weights ref (GPT-2's state dict) to K rollout actors, VELO vs NIXL vs Ray's store",
    )
    bench.add_argument(
        "--hosts",
        type=int,
        metavar="N",
        help="with --two-host --fan-out: emulate N hosts (default 2): the producer on a, "
        "the K readers round-robin over b, c, ...",
    )
    _add_two_host_options(bench)
    bench.add_argument("--chunk-mib", type=float, help="chunked path: chunk size in MiB")
    bench.add_argument("--in-flight", type=int, help="chunked path: pulls in flight")
    bench.set_defaults(run=run_bench_command)


def _add_modes(bench: argparse.ArgumentParser) -> None:
    """The bench's modes: at most one per run."""
    modes = bench.add_mutually_exclusive_group()
    modes.add_argument(
        "--decorator",
        action="store_true",
        help="a @ray_velo.transfer pipeline vs the same pipeline on Ray's object store",
    )
    modes.add_argument(
        "--transport",
        action="store_true",
        help='tensor_transport="VELO"/"VELO_NUMPY" (and NIXL) vs Ray\'s object store, actor to actor',
    )
    modes.add_argument(
        "--calls",
        action="store_true",
        help="each call on a transfer's path: over Ray vs over the agents' socket and TCP wire",
    )
    modes.add_argument(
        "--scale",
        action="store_true",
        help="per-operation cost (put, fetch, release, cross-node fetch) at 1k, 10k and 100k "
        "live handles on a node, beside Ray's put+get, and the agent's memory per handle",
    )
    modes.add_argument(
        "--shapes",
        action="store_true",
        help="with --two-host: the shapes we sell (4 MiB to 3 GiB, a state dict) vs Ray, "
        "end to end and interleaved",
    )
    modes.add_argument(
        "--compare",
        nargs=2,
        metavar=("A.json", "B.json"),
        help="two sittings (written by --out) side by side: B's speed over A's, per shape",
    )
    modes.add_argument(
        "--ranges",
        nargs="+",
        metavar="FILE",
        help="sittings of one commit: per shape the range of each figure, as the README's table",
    )


def _add_two_host_options(bench: argparse.ArgumentParser) -> None:
    """``ray-velo bench --two-host`` and the options that go with it."""
    bench.add_argument(
        "--two-host",
        action="store_true",
        help="across two emulated hosts (network namespaces, shaped veth; root)",
    )
    bench.add_argument(
        "--link",
        default=None,
        help="with --two-host: link rates, comma separated: 10gbit, 25gbit, none (unshaped); "
        "default 10gbit (with --shapes: every shape's own link; given, only the shapes on "
        "those links)",
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
