"""A bench run as a *sitting*: its results with the commit, the machine, Ray's and UCX's versions
and the link, written as JSON by ``ray-velo bench --out FILE``; ``ray-velo bench --compare A B``
sets two sittings side by side, shape by shape (docs/benchmarks.md "Sittings").

Every mode's record carries ``shapes``: ``{shape: {column: median seconds}}``, the part two
sittings are compared by; ``results`` keeps the mode's whole output.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

from ray_velo.errors import VeloError

__all__ = [
    "SittingError",
    "compare_sittings",
    "load_sitting",
    "make_sitting",
    "ranges_table",
    "write_sitting",
]

SCHEMA = 1
MiB = 1 << 20


class SittingError(VeloError, ValueError):
    """A sitting file cannot be read or compared (what is wrong is in the message)."""


#: The checkout this ray_velo runs from (where it runs from one).
_OWN_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _git(root: str, *argv: str) -> str:
    try:
        done = subprocess.run(
            ["git", "-C", root, *argv], capture_output=True, text=True, check=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip()


def code_version(checkout: str | None = None) -> dict[str, Any]:
    """The ray_velo that ran: its git commit (and whether the tree had changes) where it runs
    from a checkout, and its version. ``checkout``: another checkout that was measured."""
    from ray_velo import __version__

    root = checkout or _OWN_ROOT
    commit = _git(root, "rev-parse", "HEAD")
    out: dict[str, Any] = {"commit": commit or None}
    if checkout is None:
        out["version"] = __version__
    else:
        out["checkout"] = os.path.abspath(checkout)
    if commit:
        out["subject"] = _git(root, "log", "-1", "--format=%s")[:100]
        out["dirty"] = bool(_git(root, "status", "--porcelain", "--untracked-files=no"))
    return out


def machine() -> dict[str, Any]:
    """What this machine is: cores, memory, CPU model, kernel."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if "model name" in line), "")
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "memory_bytes": os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"),
        "cpu_model": model,
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def _versions() -> dict[str, str | None]:
    try:
        import ray

        ray_version: str | None = ray.__version__
    except ImportError:
        ray_version = None
    try:
        from ray_velo.ucx.loader import ucx_version

        ucx: str | None = ".".join(map(str, ucx_version()))
    except Exception:  # no UCX here: the sitting says so
        ucx = None
    return {"ray": ray_version, "ucx": ucx}


def make_sitting(
    mode: str,
    results: Any,
    shapes: Mapping[str, Mapping[str, float | None]],
    *,
    links: list[str] | None = None,
    transport: str | None = None,
    argv: list[str] | None = None,
    checkout: str | None = None,
) -> dict[str, Any]:
    """A sitting of ``mode``: ``shapes`` (``{shape: {column: median seconds}}``), the mode's
    whole ``results``, and where and with what they were measured (``checkout``: the other
    ray_velo checkout that ran, where not this one)."""
    return {
        "schema": SCHEMA,
        "mode": mode,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "code": code_version(checkout),
        "machine": machine(),
        **_versions(),
        "links": links or [],
        "transport": transport,
        "argv": argv or [],
        "shapes": {k: dict(v) for k, v in shapes.items()},
        "results": results,
    }


def write_sitting(path: str, sitting: Mapping[str, Any]) -> None:
    """Write ``sitting`` to ``path`` as JSON."""
    with open(path, "w") as f:
        json.dump(sitting, f, indent=1, sort_keys=True)
        f.write("\n")


def load_sitting(path: str) -> dict[str, Any]:
    """A sitting written by :func:`write_sitting`.

    Raises:
        SittingError: the file is missing, not JSON, or not a sitting.
    """
    try:
        with open(path) as f:
            sitting = json.load(f)
    except OSError as exc:
        raise SittingError(f"{path}: cannot read it ({exc.strerror})") from exc
    except json.JSONDecodeError as exc:
        raise SittingError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from exc
    if not isinstance(sitting, dict) or not isinstance(sitting.get("shapes"), dict):
        raise SittingError(f"{path}: not a sitting of `ray-velo bench --out` (no 'shapes')")
    if sitting.get("schema") != SCHEMA:
        raise SittingError(
            f"{path}: sitting schema {sitting.get('schema')!r}; this ray_velo reads {SCHEMA}"
        )
    return sitting


def _who(sitting: Mapping[str, Any]) -> str:
    code = sitting.get("code", {})
    commit = (code.get("commit") or code.get("version") or "?")[:10]
    dirty = "+changes" if code.get("dirty") else ""
    cpus = sitting.get("machine", {}).get("cpus", "?")
    return f"{commit}{dirty}, {sitting.get('date', '?')}, {cpus} cores, {sitting.get('mode')}"


def compare_sittings(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    """Each shape and column the two sittings share: A's and B's median ms and B's speed over
    A's (above 1: B is faster); and within each sitting ray_velo's speed over Ray's where both
    were measured.

    Raises:
        SittingError: the sittings share no shape.
    """
    common = [s for s in a["shapes"] if s in b["shapes"]]
    if not common:
        raise SittingError(
            f"the sittings share no shape (A: {sorted(a['shapes'])[:4]}, "
            f"B: {sorted(b['shapes'])[:4]})"
        )
    lines = [f"A: {_who(a)}", f"B: {_who(b)}"]
    if a.get("machine", {}).get("cpu_model") != b.get("machine", {}).get("cpu_model"):
        lines.append("NOTE: different machines; compare the velo/Ray columns, not the times")
    head = f"{'shape':>24} {'column':>12} {'A ms':>9} {'B ms':>9} {'B/A speed':>10}"
    lines += [head, "-" * len(head)]
    for shape in common:
        columns_a, columns_b = a["shapes"][shape], b["shapes"][shape]
        for column in [c for c in columns_a if c in columns_b]:
            sa, sb = columns_a[column], columns_b[column]
            if not sa or not sb:
                continue
            lines.append(
                f"{shape:>24} {column:>12} {sa * 1e3:>9.1f} {sb * 1e3:>9.1f} {sa / sb:>9.2f}x"
            )
        for side, columns in (("A", columns_a), ("B", columns_b)):
            velo, ray = columns.get("velo"), columns.get("ray")
            if velo and ray:
                lines.append(f"{shape:>24} {'velo/Ray ' + side:>12} {ray / velo:>30.2f}x")
    return "\n".join(lines)


def _span(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    low, high = format(min(values), fmt), format(max(values), fmt)
    return low if low == high else f"{low}-{high}"


#: What a ranges table shows, by the kind of sitting: (label, column) of median ms, then
#: (label, slower column, faster column, unit) of speeds: the faster's over the slower's.
_Columns = tuple[tuple[str, str], ...]
_Speeds = tuple[tuple[str, str, str, str], ...]
_TABLES: dict[str, tuple[_Columns, _Speeds]] = {
    "velo": (
        (
            ("Ray, ms", "ray"),
            ("ray_velo, ms", "velo"),
            ("UCX over tcp (opt-in), ms", "velo_ucx_tcp"),
        ),
        (
            ("ray_velo / Ray", "ray", "velo", "x"),
            ("ray_velo / raw link", "raw_tcp", "velo", ""),
            ("UCX over tcp / raw link", "raw_tcp", "velo_ucx_tcp", ""),
        ),
    ),
    "transport": (
        (
            ("Ray's store, ms", "torch_plain"),
            ("NIXL, ms", "torch_nixl"),
            ("VELO, ms", "torch_velo"),
            ("`@rv.transfer`, ms", "torch_decorated"),
        ),
        (
            ("VELO / NIXL", "torch_nixl", "torch_velo", "x"),
            ("VELO / Ray", "torch_plain", "torch_velo", "x"),
            ("VELO / raw link", "raw_tcp", "torch_velo", ""),
            ("`@rv.transfer` / Ray", "torch_plain", "torch_decorated", "x"),
        ),
    ),
    "weights broadcast": (
        (
            ("VELO x1, ms", "velo_one"),
            ("VELO xK, ms", "velo"),
            ("NIXL xK, ms", "nixl"),
            ("Ray's store xK, ms", "ray"),
        ),
        (
            ("VELO xK / x1", "velo", "velo_one", "x"),
            ("NIXL xK / x1", "nixl", "nixl_one", "x"),
            ("Ray xK / x1", "ray", "ray_one", "x"),
            ("raw chain / one stream", "raw_chain", "raw_one", "x"),
            ("VELO / NIXL", "nixl", "velo", "x"),
            ("VELO / Ray", "ray", "velo", "x"),
        ),
    ),
    "two-host": (
        (("Ray, ms", "ray"), ("`rv.put`, ms", "velo"), ("built in place, ms", "velo_built")),
        (
            ("`rv.put` / Ray", "ray", "velo", "x"),
            ("`rv.put` / raw link", "raw_tcp", "velo", ""),
            ("built / raw link", "raw_tcp", "velo_built", ""),
        ),
    ),
}


def _table_kind(sitting: Mapping[str, Any]) -> str:
    mode = str(sitting.get("mode", ""))
    if mode in ("weights broadcast", "two-host"):
        return mode
    return "transport" if mode.endswith("transport") else "velo"


def ranges_table(sittings: Sequence[Mapping[str, Any]]) -> str:
    """The shapes the sittings share as a markdown table: per shape the range (lowest to
    highest over the sittings) of each side's median ms and the speeds between them (and
    over the raw link, where probed). What the README quotes. Tensor-transport sittings show
    Ray's store, NIXL and VELO; ``--two-host`` ones ``rv.put`` and the array built in place;
    the others Ray and ray_velo.

    Raises:
        SittingError: no sitting given, or they share no shape.
    """
    if not sittings:
        raise SittingError("no sitting to take ranges from")
    from ray_velo.bench.shapes import BENCH_SHAPES

    columns, speeds = _TABLES[_table_kind(sittings[0])]
    order = {shape.name: i for i, shape in enumerate(BENCH_SHAPES)}  # theirs, then by name
    shared = [s for s in sittings[0]["shapes"] if all(s in x["shapes"] for x in sittings)]
    shapes = sorted(shared, key=lambda s: (order.get(s, len(order)), s))
    if not shapes:
        raise SittingError("the sittings share no shape")
    labels = [label for label, _ in columns] + [label for label, *_ in speeds]
    table = []
    for shape in shapes:
        rows = [x["shapes"][shape] for x in sittings]
        cells = [_span([r[c] * 1e3 for r in rows if r.get(c)], ".0f") for _, c in columns]
        for _, slow, fast, unit in speeds:
            ratios = [r[slow] / r[fast] for r in rows if r.get(slow) and r.get(fast)]
            cells.append(_span(ratios, ".2f") + unit if ratios else "-")
        table.append((shape, cells))
    # a column no sitting measured (an older bench's) is left out, not shown empty
    shown = [i for i in range(len(labels)) if any(cells[i] != "-" for _, cells in table)]
    lines = [
        "| shape | " + " | ".join(labels[i] for i in shown) + " |",
        "|---|" + "---|" * len(shown),
    ]
    for shape, cells in table:
        lines.append(f"| {shape} | " + " | ".join(cells[i] for i in shown) + " |")
    return "\n".join(lines)
