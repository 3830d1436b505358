"""``ray-velo bench --two-host``: ray_velo across emulated hosts, beside Ray and the link's own
ceiling (docs/benchmarks.md)."""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ray_velo.bench.actors import (
    LATENCY_REPS,
    cpu_ticks,
    format_latency,
    stolen_since,
    transport_text,
)
from ray_velo.bench.fanout import hosts_text, reader_hosts
from ray_velo.bench.hostdriver import PROBE_PREFIX, RESULT_PREFIX
from ray_velo.testbed import Testbed
from ray_velo.testbed.errors import TestbedError
from ray_velo.testbed.probes import raw_tcp, raw_ucx_get
from ray_velo.testbed.security import DEFAULT_SECURITY, Security

__all__ = ["LinkResult", "format_two_host", "run_two_host", "run_two_host_transport"]

MiB = 1 << 20
DRIVER_TIMEOUT_S = 1800.0


@dataclass
class LinkResult:
    """One link's measurements: per size, each column's median seconds."""

    link: str
    rows: dict[int, dict[str, float | None]] = field(default_factory=dict)
    paths: dict[str, dict[str, int]] = field(default_factory=dict)
    transports: dict[str, list[str]] = field(default_factory=dict)
    #: mid-size payloads: per size, median seconds of ray, velo, pipe_ray, pipe_velo
    latency: dict[int, dict[str, float | None]] = field(default_factory=dict)
    #: per size, each column's seconds round by round (raw probes follow their round)
    samples: dict[int, dict[str, list[float]]] = field(default_factory=dict)

    def gbps(self, size: int, column: str) -> float | None:
        seconds = self.rows.get(size, {}).get(column)
        return size / seconds / 1e9 if seconds else None

    def ratio(self, size: int, a: str, b: str) -> float | None:
        x, y = self.gbps(size, a), self.gbps(size, b)
        return x / y if x and y else None

    def round_ratios(self, size: int, a: str, b: str) -> list[float]:
        """``a``'s speed over ``b``'s, round by round (the rounds both were measured in)."""
        columns = self.samples.get(size, {})
        return [y / x for x, y in zip(columns.get(a, []), columns.get(b, []), strict=False)]

    def transport(self) -> str:
        return transport_text(self.transports)

    def as_dict(self) -> dict[str, Any]:
        return {
            "link": self.link,
            "transport": self.transport(),
            "rows": {
                str(size): {
                    "seconds": row,
                    "gbps": {c: self.gbps(size, c) for c in row if not c.endswith("_stolen")},
                }
                for size, row in self.rows.items()
            },
            "paths": self.paths,
            "samples_s": {str(size): columns for size, columns in self.samples.items()},
            "latency_s": {str(size): row for size, row in self.latency.items()},
        }


def _drive(
    testbed: Any,
    sizes: Sequence[int],
    reps: int,
    extra: Sequence[str] = (),
    probe: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Run the driver on host a; its result. ``probe(size)`` runs whenever the driver asks
    (``--probe-rounds``), while the driver waits."""
    argv = [sys.executable, "-m", "ray_velo.bench.hostdriver"]
    argv += ["--sizes", ",".join(map(str, sizes)), "--reps", str(reps), *extra]
    if probe is not None:
        argv.append("--probe-rounds")
    driver = testbed.popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None)
    timer = threading.Timer(DRIVER_TIMEOUT_S, driver.kill)  # the whole driver's bound
    timer.start()
    tail: list[str] = []
    try:
        assert driver.stdout is not None and driver.stdin is not None
        for line in driver.stdout:
            if line.startswith(PROBE_PREFIX) and probe is not None:
                probe(int(line[len(PROBE_PREFIX) :]))
                driver.stdin.write("go\n")
                driver.stdin.flush()
            elif line.startswith(RESULT_PREFIX):
                return json.loads(line[len(RESULT_PREFIX) :])  # type: ignore[no-any-return]
            else:
                tail = [*tail[-20:], line]
        driver.wait(60)
    finally:
        timer.cancel()
        if driver.poll() is None:
            driver.kill()
            driver.wait(10)
    raise TestbedError(
        step="bench driver",
        detail=f"exit {driver.returncode} without a result: {''.join(tail)[-800:]}",
    )


def _probe_into(testbed: Any, samples: dict[int, dict[str, list[float]]]) -> Callable[[int], None]:
    """A probe for :func:`_drive`: one raw socket and one bare UCX GET of ``size`` bytes,
    appended to ``samples[size]``."""

    def probe(size: int) -> None:
        columns = samples.setdefault(size, {})
        start = cpu_ticks()
        columns.setdefault("raw_tcp", []).append(raw_tcp(testbed, size, 1))
        columns.setdefault("raw_ucx", []).append(raw_ucx_get(testbed, size, 1))
        columns.setdefault("raw_stolen", []).append(stolen_since(start) or 0.0)

    return probe


def run_two_host(
    links: Sequence[str],
    sizes: Sequence[int],
    reps: int = 5,
    *,
    with_raw: bool = True,
    budget_mib: int | None = None,
    transfers_only: bool = False,
    security: Security = DEFAULT_SECURITY,
) -> list[LinkResult]:
    """Measure every link in ``links`` (one testbed each).
    ``budget_mib``: the agents' ``registered_bytes_budget`` (a payload above it moves through
    registered windows); ``transfers_only``: no pipelines and no mid-size latency table;
    ``security``: Ray's auth mode and TLS on the testbed (Ray's coming default: token auth).

    Raises:
        TestbedUnavailable: this machine cannot make network namespaces (not root).
        TestbedError: a node or the driver failed.
    """
    results = []
    for link in links:
        sys.stderr.write(f"two-host testbed, link {link}:\n")
        # Ray's store holds the payload put and its copy read; more only for the pipelines
        store = max(1 << 30, (2 if transfers_only else 4) * max(sizes))
        with Testbed(hosts=2, link=link, object_store_bytes=store, **security) as testbed:
            result = LinkResult(link)
            extra = ["--transfers-only"] if transfers_only else []
            if budget_mib:
                extra += ["--budget-mib", str(budget_mib)]
            probe = _probe_into(testbed, result.samples) if with_raw else None
            measured = _drive(testbed, sizes, reps, extra, probe)
        for size, columns in result.samples.items():  # the raw probes' medians
            row = result.rows.setdefault(size, {})
            row.update({column: statistics.median(v) for column, v in columns.items()})
        for size_text, columns in measured.get("samples", {}).items():
            result.samples.setdefault(int(size_text), {}).update(columns)
        for size_text, row in measured["rows"].items():
            result.rows.setdefault(int(size_text), {}).update(row)
        result.paths = measured["paths"]
        result.transports = measured["transports"]
        result.latency = {int(k): v for k, v in measured.get("latency", {}).items()}
        results.append(result)
    return results


def run_two_host_transport(
    links: Sequence[str],
    sizes: Sequence[int],
    reps: int = 5,
    security: Security = DEFAULT_SECURITY,
) -> dict[str, dict[str, Any]]:
    """``--transport``: the tensor transports across each link (one testbed each), per
    size, with the raw link probed (one TCP socket) for each size after its rounds: per link,
    ``{"measured": measure_transports' result, "raw_s": {size: seconds}}``."""
    out = {}
    for link in links:
        sys.stderr.write(f"two-host testbed, link {link}: tensor transports\n")
        store = max(1 << 30, 6 * max(sizes))
        with Testbed(hosts=2, link=link, object_store_bytes=store, **security) as testbed:
            measured = _drive(testbed, list(sizes), reps, ["--transport"])
            objects = [row["size_bytes"] for row in measured.get("objects", [])]
            raw = {size: raw_tcp(testbed, size, reps) for size in [*sizes, *objects]}
        out[link] = {"measured": measured, "raw_s": raw}
    return out


def run_two_host_fan_out(
    links: Sequence[str],
    size: int,
    k: int,
    reps: int = 5,
    hosts: int = 2,
    security: Security = DEFAULT_SECURITY,
    *,
    weights: bool = False,
) -> dict[str, dict[str, Any]]:
    """``--fan-out K [--hosts N]``: one payload from host a to K readers spread round-robin
    over hosts b, c, ... of an ``hosts``-host testbed, across each link (one testbed each):
    per link, what :func:`~ray_velo.bench.fanout.measure_fan_out` measured. ``weights``
    (``--transport``): one RDT ref of GPT-2's state dict instead, VELO beside NIXL and Ray's
    store (:func:`~ray_velo.bench.broadcast.measure_broadcast`; ``size`` unused).

    Raises:
        ValueError: ``hosts`` below 2 or above the testbed's 26, or ``k`` below 1.
        TestbedUnavailable: this machine cannot make network namespaces (not root).
        TestbedError: a node or the driver failed.
    """
    placed = hosts_text(reader_hosts(k, hosts))
    what = "one weights ref" if weights else "fan-out"
    extra = ["--fan-out", str(k), *(["--transport"] if weights else [])]
    rows = {}
    for link in links:
        sys.stderr.write(f"{hosts}-host testbed, link {link}: {what} to {k} on {placed}\n")
        store = max(1 << 30, 4 * size)
        with Testbed(hosts=hosts, link=link, object_store_bytes=store, **security) as testbed:
            rows[link] = _drive(testbed, [size], reps, extra)
            if weights:
                nbytes = rows[link]["size_bytes"]
                rows[link]["raw_one"] = raw_tcp(testbed, nbytes, reps)
                rows[link]["raw_chain"] = _raw_chain(testbed, nbytes, min(k, hosts - 1), reps)
    return rows


def _raw_chain(testbed: Any, nbytes: int, links: int, reps: int) -> float:
    """Seconds for ``links`` plain TCP streams at once, host a -> b -> c ... (a relay
    chain's links, nothing else): the slowest stream's median. What this machine's CPUs
    allow a chain of that many hops, against one stream's time."""
    with ThreadPoolExecutor(links) as pool:
        streams = [
            pool.submit(raw_tcp, testbed, nbytes, reps, src=i, dst=i + 1) for i in range(links)
        ]
        return max(stream.result() for stream in streams)


_COLUMNS = (
    ("ray", "Ray"),
    ("velo", "velo"),
    ("velo_built", "built"),
    ("chunked", "chunked"),
    ("pipe_ray", "pipe Ray"),
    ("pipe_velo", "pipe velo"),
    ("raw_tcp", "raw tcp"),
    ("raw_ucx", "raw ucx"),
)
_RATIOS = (
    ("velo", "ray", "velo/Ray"),
    ("velo", "raw_tcp", "velo/raw"),
    ("velo_built", "raw_tcp", "built/raw"),
    ("chunked", "ray", "chunk/Ray"),
    ("pipe_velo", "pipe_ray", "pipe v/R"),
)


#: (whole, staging, GET leg) columns of each ray_velo transfer: medians of each, so the
#: remainder is only roughly the control calls and the read.
_BREAKDOWNS = (("velo", "put", "get_leg"), ("velo_built", "seal", "built_get_leg"))
_LABEL = dict(_COLUMNS)

#: A round whose transfer or probe lost more of the machine's CPU time than this to the
#: hypervisor is "disturbed": its ratio is shown, and left out of the quiet-round median.
QUIET_STOLEN = 0.03


def _round_lines(result: LinkResult, size: int) -> list[str]:
    """Each round's velo/raw, side by side (the probe ran right after the round), the CPU
    time stolen from the machine meanwhile, and the median of the undisturbed rounds."""
    lines = []
    columns = result.samples.get(size, {})
    stolen = [
        max(pair)
        for pair in zip(columns.get("velo_stolen", []), columns.get("raw_stolen", []), strict=False)
    ]
    if stolen:
        each = ", ".join(f"{s:.0%}" for s in stolen)
        lines.append(
            f"{'':>7} {size // MiB} MiB CPU stolen by the hypervisor, round by round: {each}"
        )
    for velo, raw in itertools.product(("velo", "velo_built"), ("raw_tcp", "raw_ucx")):
        ratios = result.round_ratios(size, velo, raw)
        if not ratios:
            continue
        each = ", ".join(f"{r:.2f}" for r in ratios)
        name = f"{_LABEL[velo]}/{raw.replace('_', ' ')}"
        text = (
            f"{'':>7} {size // MiB} MiB {name} round by round: {each} "
            f"(median {statistics.median(ratios):.2f}, range {min(ratios):.2f}-{max(ratios):.2f}"
        )
        quiet = [r for r, s in zip(ratios, stolen, strict=False) if s <= QUIET_STOLEN]
        if stolen:
            text += f"; {len(quiet)} rounds with <= {QUIET_STOLEN:.0%} stolen"
            text += f": median {statistics.median(quiet):.2f}" if quiet else ""
        lines.append(text + ")")
    return lines


def format_two_host(results: Sequence[LinkResult]) -> str:
    """The results as text: GB/s per column, then the ratios, one block per link."""
    head = f"{'link':>7} {'size':>8} " + " ".join(f"{label:>9}" for _, label in _COLUMNS)
    head += " " + " ".join(f"{label:>9}" for *_, label in _RATIOS)
    lines = [head, "-" * len(head)]
    for result in results:
        for size in sorted(result.rows):
            cells = []
            for column, _ in _COLUMNS:
                value = result.gbps(size, column)
                cells.append(f"{value:>9.2f}" if value is not None else f"{'-':>9}")
            for a, b, _ in _RATIOS:
                value = result.ratio(size, a, b)
                cells.append(f"{value:>8.2f}x" if value is not None else f"{'-':>9}")
            lines.append(f"{result.link:>7} {size // MiB:>4} MiB " + " ".join(cells))
        for size in sorted(result.rows):
            row = result.rows[size]
            for total, staging, leg in _BREAKDOWNS:
                whole, stage_s, leg_s = row.get(total), row.get(staging), row.get(leg)
                if whole and stage_s and leg_s:
                    lines.append(
                        f"{'':>7} {size // MiB} MiB {_LABEL[total]} breakdown: {staging} "
                        f"{stage_s * 1e3:.1f} ms, UCX GET {leg_s * 1e3:.1f} ms, control calls + "
                        f"read {(whole - stage_s - leg_s) * 1e3:.1f} ms"
                    )
            lines.extend(_round_lines(result, size))
        lines.append(
            f"{'':>7} UCX transport that moved velo's bytes: {result.transport()}; "
            f"consumer path decisions {result.paths}"
        )
    for result in results:
        if result.latency:
            lines.append("")
            lines.append(f"link {result.link}: " + format_latency(result.latency, LATENCY_REPS))
    lines.append("")
    lines.append(
        "GB/s, medians. Two emulated hosts (network namespaces, veth link shaped with tc tbf, "
        "`ray start` on each; ray_velo's bytes over the agents' wire, UCX closed). Ray / velo / chunked = put on host a + fetch and "
        "read of every page on host b (chunked: kill switch and no wire on both agents); built = "
        "the same "
        "array built in place on a (rv.empty, fill not timed, seal: no staging copy); pipe = actor on a "
        "returns the array to a task on b that reads it, undecorated vs @rv.transfer, timed "
        "from the driver; raw tcp = one plain TCP socket a -> b; raw ucx = bare UCX GET."
    )
    return "\n".join(lines)
