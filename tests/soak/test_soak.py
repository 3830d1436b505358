"""The soak as a user runs it (``ray-velo soak``), 21 seconds in the suite (21 samples, one a
second); and its verdict logic on made-up samples, so a growing figure is known to fail it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ray_velo.bench.soak import Slack, SoakResult, _check, _levels

MiB = 1 << 20


@pytest.mark.ray
@pytest.mark.multinode
@pytest.mark.slow
def test_a_21_second_soak_moves_pinned_and_plain_payloads_and_nothing_grows(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    done = subprocess.run(
        [sys.executable, "-m", "ray_velo.cli", "soak", "--minutes", "0.35", "--consumers", "2",
         "--out", str(out)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["ok"] and result["failures"] == []
    assert result["wrong_bytes"] == 0 and result["errors"] == []
    # pinned and plain payloads both cross over the wire (UCX is closed by default)
    assert result["paths"].get("owner:wire/ok", 0) > 0
    assert result["staged"]["pinned"] > 0 and result["staged"]["plain"] > 0
    assert len(result["final"]) == 2
    for final in result["final"].values():
        assert final["live_slots"] == 0 and final["live_leases"] == 0
    assert "PASS" in done.stdout


def samples(figure: str, values: list[int]) -> dict[str, list[dict[str, int]]]:
    base = {"registered_bytes": 64 * MiB, "segments": 2, "fds": 60, "threads": 30,
            "rss_anon_bytes": 64 * MiB, "live_slots": 1, "live_leases": 0}  # fmt: skip
    return {"node-a": [{"t_s": i, **base, figure: v} for i, v in enumerate(values)]}


def verdict(figure: str, values: list[int]) -> list[str]:
    result = SoakResult(minutes=1, consumers=1, rounds=10)
    result.samples = samples(figure, values)
    result.final = {"node-a": {**result.samples["node-a"][-1], "live_slots": 0}}
    result.baseline, result.end = _levels(result)
    _check(result, Slack())
    return result.failures


@pytest.mark.parametrize(
    ("figure", "step"),
    [
        ("registered_bytes", 300 * MiB),  # past one more doubled arena of the pool
        ("segments", 3),
        ("fds", 17),
        ("threads", 9),
        ("rss_anon_bytes", 65 * MiB),
    ],
)
def test_growth_past_the_slack_fails_the_soak_and_a_warm_pool_does_not(
    figure: str, step: int
) -> None:
    start = samples(figure, [0])["node-a"][0][figure]
    leak = [start + 2 * step * i // 8 for i in range(9)]  # grows all the way through
    failures = verdict(figure, leak)
    assert len(failures) == 1 and figure in failures[0], failures
    warm = [start, start + step, *[start + step] * 7]  # steps up early, then stays
    assert verdict(figure, warm) == []


def test_a_leftover_slot_or_too_few_samples_fail_the_soak() -> None:
    result = SoakResult(minutes=1, consumers=1, rounds=10)
    result.samples = samples("fds", [60, 60, 60])
    result.final = {"node-a": {**result.samples["node-a"][-1], "live_slots": 2}}
    result.baseline, result.end = _levels(result)
    _check(result, Slack())
    assert result.failures == ["node node-a: 2 live_slots left after"]
    short = SoakResult(minutes=1, consumers=1, rounds=1)
    short.samples = samples("fds", [60])
    short.final = {"node-a": short.samples["node-a"][-1]}
    short.baseline, short.end = _levels(short)
    _check(short, Slack())
    assert any("too few samples" in f for f in short.failures)
