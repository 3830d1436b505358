"""The two-host bench's side-by-side rounds: per-round ratios, medians and their text."""

from __future__ import annotations

import statistics

from ray_velo.bench.actors import medians, rounds
from ray_velo.bench.twohost import LinkResult, format_two_host

GiB = 1 << 30


def test_rounds_drop_the_warm_up_and_keep_round_order() -> None:
    seconds = iter([9.0, 3.0, 1.0, 2.0])  # the first is the warm-up
    seen: list[int] = []
    samples = rounds(3, lambda: {"velo": next(seconds), "leg": None}, seen.append)
    assert samples == {"velo": [3.0, 1.0, 2.0]}
    assert seen == [0, 1, 2, 3]
    again = iter([9.0, 3.0, 1.0, 2.0])
    assert medians(3, lambda: {"velo": next(again)}, lambda _: None) == {"velo": 2.0}


def test_each_round_is_compared_with_the_probe_that_followed_it() -> None:
    result = LinkResult("10gbit")
    result.samples[3 * GiB] = {"velo": [3.0, 2.5, 4.0], "raw_tcp": [2.7, 2.5, 2.0]}
    ratios = result.round_ratios(3 * GiB, "velo", "raw_tcp")
    assert ratios == [2.7 / 3.0, 2.5 / 2.5, 2.0 / 4.0]
    assert result.round_ratios(3 * GiB, "velo", "raw_ucx") == []
    result.rows[3 * GiB] = {
        column: statistics.median(values) for column, values in result.samples[3 * GiB].items()
    }
    text = format_two_host([result])
    assert "velo/raw tcp round by round: 0.90, 1.00, 0.50 (median 0.90, range 0.50-1.00)" in text
    assert "velo/raw ucx" not in text  # no probe: no line
    assert result.as_dict()["samples_s"] == {str(3 * GiB): result.samples[3 * GiB]}
