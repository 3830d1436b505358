"""``ray-velo bench --two-host --shapes`` and the CI speed guard: the shapes we sell, moved by
ray_velo and by Ray's object store in the same run, round by round and interleaved, on the
two-host testbed (docs/benchmarks.md "The shapes we sell").

Each shape is timed end to end from a driver on host a, as a user's call is: a producer actor
on host a hands its payload to a consumer actor on host b, which reads every page. The first
round is the first time the nodes see the size (only a small transfer warmed the pools), as in
a new user's run: what maps memory then is in the figure. A shape's speed over Ray is
Ray's median round over ray_velo's; the sums of the rounds are shown beside it.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ray_velo.bench.progress import Progress
from ray_velo.testbed import Testbed
from ray_velo.testbed.errors import TestbedError
from ray_velo.testbed.probes import raw_tcp
from ray_velo.testbed.security import DEFAULT_SECURITY, Security

__all__ = [
    "BENCH_SHAPES",
    "GUARD_SHAPES",
    "Shape",
    "format_shapes",
    "measure_shapes",
    "shape_ratios",
    "speed_over_ray",
]

MiB = 1 << 20
GiB = 1 << 30
DRIVER = os.path.join(os.path.dirname(__file__), "shapes_driver.py")
DRIVER_TIMEOUT_S = 900.0


@dataclass(frozen=True, slots=True)
class Shape:
    """One payload shape: ``kind`` ``"array"`` (rv.put / rv.fetch of a uint8 array of
    ``nbytes``), ``"pipe"`` (that array as an actor's return handed to another actor, a steady
    pipeline, under ``@rv.transfer`` against the same undecorated) or ``"dict"`` (GPT-2
    small's state dict, as ``"pipe"``), on a link of ``link``."""

    name: str
    link: str
    kind: str
    nbytes: int
    rounds: int


#: What the CI guard measures (tests/twohost/test_speed_guard.py): the shapes we sell.
GUARD_SHAPES = (
    Shape("4 MiB @10gbit", "10gbit", "array", 4 * MiB, 9),
    Shape("256 MiB @10gbit", "10gbit", "array", 256 * MiB, 5),
    Shape("state dict @10gbit", "10gbit", "dict", 0, 3),
    Shape("1.5 GiB unshaped", "none", "array", 1536 * MiB, 3),
)
#: ``ray-velo bench --two-host --shapes``: the guard's shapes with more rounds, a steady
#: decorated pipeline, and GiBs (3 GiB unshaped only: on this 24 GiB machine two nodes' object
#: stores, arenas and the producer's copy of 3 GiB at both links ran it out of memory; the
#: link's ceiling at 3 GiB is measured by ``--transfers-only``).
BENCH_SHAPES = (
    Shape("4 MiB @10gbit", "10gbit", "array", 4 * MiB, 15),
    Shape("256 MiB @10gbit", "10gbit", "array", 256 * MiB, 7),
    Shape("state dict @10gbit", "10gbit", "dict", 0, 5),
    Shape("256 MiB decorator @10gbit", "10gbit", "pipe", 256 * MiB, 7),
    Shape("1.5 GiB @10gbit", "10gbit", "array", 1536 * MiB, 3),
    Shape("1.5 GiB unshaped", "none", "array", 1536 * MiB, 3),
    Shape("3 GiB unshaped", "none", "array", 3 * GiB, 3),
)


def _drive(
    testbed: Any, shapes: Sequence[Shape], pythonpath: str | None, ucx_tcp: bool = False
) -> dict[str, Any]:
    spec = json.dumps([[s.name, s.kind, s.nbytes, s.rounds] for s in shapes])
    env = {"PYTHONPATH": pythonpath} if pythonpath else None
    # Ray puts the driver's working directory first on its workers' import path: in another
    # checkout's root, its ray_velo is the one imported
    argv = [sys.executable, DRIVER, spec, *(["--ucx-tcp"] if ucx_tcp else [])]
    done = testbed.run(argv, env=env, timeout_s=DRIVER_TIMEOUT_S, cwd=pythonpath)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])  # type: ignore[no-any-return]
    raise TestbedError(
        step="shapes driver", detail=f"exit {done.returncode}: {done.stderr[-1500:]}"
    )


def measure_shapes(
    shapes: Sequence[Shape],
    *,
    pythonpath: str | None = None,
    raw_link: bool = True,
    security: Security = DEFAULT_SECURITY,
    ucx_tcp: bool = False,
) -> dict[str, Any]:
    """Every shape on one two-host testbed (its links reshaped between link groups), each
    shape's rounds interleaved with Ray's; with ``raw_link``, one plain TCP socket moves each
    array shape's bytes after its rounds. ``pythonpath``: the ray_velo checkout the nodes and
    the driver run (another commit's, to compare; None: this one). ``ucx_tcp``: each link
    group is measured twice in turn, with the agents' defaults (the bytes over the wire) and
    with UCX allowed over TCP (the operator's opt-in), the latter's rounds as ``velo_ucx_tcp``
    (Ray's rounds of both runs as ``ray``).

    Returns ``{"shapes": {name: {link, kind, bytes, seconds: {velo, ray[, velo_ucx_tcp,
    raw_tcp]}, consistent, registered_before, registered_after}}}``.

    Raises:
        TestbedUnavailable: this machine cannot make network namespaces (not root).
        TestbedError: a node or the driver failed.
    """
    groups: dict[str, list[Shape]] = {}  # by link, in order
    for shape in shapes:
        groups.setdefault(shape.link, []).append(shape)
    biggest = max(s.nbytes for s in shapes)
    env = {"PYTHONPATH": pythonpath} if pythonpath else None
    out: dict[str, Any] = {}
    first = next(iter(groups))
    store = max(1 << 30, 2 * biggest)  # the payload put and its copy read (as --transfers-only)
    with Progress(len(groups), "shapes bench") as progress:
        progress.working(f"starting the two-host testbed (link {first})")
        with Testbed(hosts=2, link=first, object_store_bytes=store, env=env, **security) as testbed:
            for link, group in groups.items():
                testbed.set_link(link)
                names = ", ".join(s.name for s in group)
                progress.working(f"link {link}: {names}")
                measured = _drive(testbed, group, pythonpath)["shapes"]
                if ucx_tcp:
                    opted = _drive(testbed, group, pythonpath, ucx_tcp=True)["shapes"]
                    for name, other in opted.items():
                        seconds = measured[name]["seconds"]
                        seconds["velo_ucx_tcp"] = other["seconds"]["velo"]
                        seconds["ray"] = seconds["ray"] + other["seconds"]["ray"]
                        measured[name]["consistent"] &= other["consistent"]
                for shape in group:
                    row = measured[shape.name]
                    if raw_link and shape.kind != "dict":
                        row["seconds"]["raw_tcp"] = [raw_tcp(testbed, shape.nbytes, 3)]
                    out[shape.name] = {
                        "link": link, "kind": shape.kind, "bytes": shape.nbytes, **row
                    }  # fmt: skip
                progress.step(f"link {link}: {names}")
    return {"shapes": out}


def speed_over_ray(row: dict[str, Any]) -> float:
    """A measured shape's speed over Ray's: Ray's median seconds over ray_velo's."""
    seconds: dict[str, list[float]] = row["seconds"]
    return statistics.median(seconds["ray"]) / statistics.median(seconds["velo"])


def shape_ratios(row: dict[str, Any]) -> dict[str, float | None]:
    """A measured shape's ``velo/ray`` (:func:`speed_over_ray`), ``velo/ray total`` (Ray's
    seconds over ray_velo's, each summed over the rounds: the first round's weight shows)
    and ``velo/raw`` (the raw socket's median over ray_velo's median, arrays only)."""
    seconds = row["seconds"]
    raw = seconds.get("raw_tcp")
    ucx = seconds.get("velo_ucx_tcp")
    return {
        "velo/ray": speed_over_ray(row),
        "velo/ray total": sum(seconds["ray"]) / sum(seconds["velo"]),
        "velo/raw": statistics.median(raw) / statistics.median(seconds["velo"]) if raw else None,
        "ucx_tcp/raw": statistics.median(raw) / statistics.median(ucx) if raw and ucx else None,
    }


def _round_ms(values: Sequence[float]) -> str:
    return ", ".join(f"{v * 1e3:.0f}" for v in values)


def format_shapes(result: dict[str, Any]) -> str:
    """The shapes as text: each column's rounds (ms), the ratios, host a's memory."""
    lines = []
    for name, row in result["shapes"].items():
        ratios = shape_ratios(row)
        seconds = row["seconds"]
        text = (
            f"{name:>20}: ray_velo {_round_ms(seconds['velo'])} ms | Ray "
            f"{_round_ms(seconds['ray'])} ms | velo/Ray {ratios['velo/ray']:.2f}x (totals "
            f"{ratios['velo/ray total']:.2f}x)"
        )
        if ratios["velo/raw"] is not None:
            text += f" | velo/raw link {ratios['velo/raw']:.2f}"
        if "velo_ucx_tcp" in seconds:
            text += f" | UCX over tcp (opt-in) {_round_ms(seconds['velo_ucx_tcp'])} ms"
            if ratios["ucx_tcp/raw"] is not None:
                text += f", /raw link {ratios['ucx_tcp/raw']:.2f}"
        if not row["consistent"]:
            text += " | WARNING: the consumer read different values"
        lines.append(text)
        before, after = row.get("registered_before"), row.get("registered_after")
        if before is not None and after is not None:
            lines.append(
                f"{'':>22}host a's registered memory {before / MiB:.0f} MiB before, "
                f"{after / MiB:.0f} MiB after"
            )
    lines.append(
        "Rounds in ms, timed end to end from a driver on host a (producer actor on a, consumer "
        "actor on b reading every page), ray_velo and Ray by turns; velo/Ray = Ray's median "
        "over ray_velo's (totals: the sums of the rounds); ray_velo's bytes over the agents' authenticated "
        "wire on the veth link (UCX over tcp only in the opt-in column)."
    )
    return "\n".join(lines)
