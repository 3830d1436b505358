"""The speed guard: the shapes we sell, moved by ray_velo and by Ray's object store in the same
run on the two-host testbed, each against a floor on ray_velo's speed over Ray's.

A 2x loss once landed unnoticed (issue 37: a spare 1.5 GiB arena mapped beside every GiB
transfer). Each floor sits below the lowest ratio seen on the 2-core machines (this one and
CI's) and so that a 2x loss from CI's figures falls below it; a shape below its floor is
measured once more, in a testbed of its own, and fails only if it is low again (a real loss is
low twice, a noisy neighbour rarely). The issue-37 regression is caught by the memory check:
its Ray ratio at 1.5 GiB (1.6x) was no worse than CI's fixed code (1.52x). The numbers are in
docs/benchmarks.md "The speed guard". Its own folder: it builds a testbed of its own, with
object stores that hold a 1.5 GiB payload, and nothing else may run beside it.
"""

from __future__ import annotations

from typing import Any

import pytest

from ray_velo.bench.shapes import (
    GUARD_SHAPES,
    format_shapes,
    measure_shapes,
    shape_ratios,
    speed_over_ray,
)
from ray_velo.testbed import check_privileges
from ray_velo.testbed.errors import TestbedUnavailable

pytestmark = [pytest.mark.twohost, pytest.mark.slow]

MiB = 1 << 20

#: ray_velo's speed over Ray's (Ray's median seconds over ray_velo's), the least each shape
#: may show. Lowest seen in 20 runs on the 2-core machine (2026-12-06): 1.65, 1.14, 0.75,
#: 2.78; on CI's: 1.56, 1.54, 1.16, 1.52. A 2x loss from CI's figures falls below each floor.
FLOORS = {
    "4 MiB @10gbit": 1.1,
    "256 MiB @10gbit": 1.0,
    "state dict @10gbit": 0.55,
    "1.5 GiB unshaped": 1.0,
}
#: ray_velo's speed over one plain TCP socket's on the same link, where the link bounds it
#: (at 10 Gbit/s ray_velo runs near the link's rate: 0.88-0.91 in nine sittings of three
#: commits, where Ray's own run varies by a third between rounds).
RAW_FLOORS = {"256 MiB @10gbit": 0.6}


def _low(result: dict[str, Any]) -> dict[str, str]:
    """The shapes of ``result`` below a floor, each with why."""
    low = {}
    for name, row in result["shapes"].items():
        assert row["consistent"], f"{name}: the consumer read different values"
        speed = speed_over_ray(row)
        print(f"speed guard: {name}: {speed:.2f}x Ray (floor {FLOORS[name]:.2f}x)")
        if speed < FLOORS[name]:
            low[name] = f"{name} at {speed:.2f}x Ray, below its floor {FLOORS[name]:.2f}x"
        if name in RAW_FLOORS:
            raw = shape_ratios(row)["velo/raw"]
            assert raw is not None, f"{name}: the link was not probed"
            print(f"speed guard: {name}: {raw:.2f} of the raw link (floor {RAW_FLOORS[name]})")
            if raw < RAW_FLOORS[name]:
                low[name] = f"{name} at {raw:.2f} of the raw link, below {RAW_FLOORS[name]}"
    return low


def test_the_shapes_we_sell_stay_ahead_of_ray() -> None:
    """4 MiB and 256 MiB at 10 Gbit/s, GPT-2 small's state dict through @rv.transfer, and
    1.5 GiB unshaped, each interleaved with Ray's object store round by round: ray_velo's
    speed over Ray's stays above its floor (at 256 MiB its speed over the raw link too) in
    the run or in a second measure of the shapes that fell below, every read is right, and
    after the 1.5 GiB rounds host a holds at most one arena of that size (the warm one),
    never a spare beside it."""
    try:
        check_privileges()
    except TestbedUnavailable as exc:
        pytest.skip(f"SKIPPED (namespaces): {exc}")
    assert set(FLOORS) == {shape.name for shape in GUARD_SHAPES}
    result = measure_shapes(GUARD_SHAPES, raw_link=True)
    print("\n" + format_shapes(result))
    big = result["shapes"]["1.5 GiB unshaped"]
    grown = big["registered_after"] - big["registered_before"]
    assert grown <= 1536 * MiB + 1536 * MiB // 8, (
        f"host a kept {grown / MiB:.0f} MiB more registered memory after the 1.5 GiB rounds: "
        "more than the one warm arena of that size"
    )
    low = _low(result)
    if low:
        print(f"speed guard: measuring {sorted(low)} once more")
        again = [shape for shape in GUARD_SHAPES if shape.name in low]
        second = measure_shapes(again, raw_link=True)
        print("\n" + format_shapes(second))
        low = {name: f"{low[name]}, then {why}" for name, why in _low(second).items()}
    assert not low, "ray_velo slower than it was, twice: " + "; ".join(low.values())
