"""``ray-velo bench --calls`` as a user runs it: every call a transfer waits for is timed
both as a Ray call and over ray_velo's own control plane, on a cluster it makes and ends."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.ray
@pytest.mark.multinode
@pytest.mark.slow
def test_the_calls_bench_times_each_call_both_ways() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ray_velo.cli", "bench", "--calls", "--reps", "5"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    for call in ("stage_reserve", "local_acquire", "fetch_remote", "a handler"):
        line = next(row for row in done.stdout.splitlines() if call in row)
        cells = re.findall(r"-?\d+\.\d+", line)
        assert len(cells) == 3, line  # Ray call, ray_velo, saved: every one measured
        assert all(float(cell) > 0 for cell in cells[:2]), line


def test_fan_out_needs_two_hosts() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ray_velo.cli", "bench", "--fan-out", "3"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "--two-host" in done.stderr


def test_hosts_needs_at_least_two() -> None:
    """``--hosts 1`` leaves no host for a reader: refused before any testbed is built."""
    done = subprocess.run(
        [sys.executable, "-m", "ray_velo.cli", "bench", "--two-host", "--fan-out", "2",
         "--hosts", "1"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "--hosts 1" in done.stderr, done.stderr


def test_hosts_needs_fan_out() -> None:
    """``--hosts`` only places fan-out readers: without ``--fan-out`` it is refused."""
    done = subprocess.run(
        [sys.executable, "-m", "ray_velo.cli", "bench", "--two-host", "--hosts", "3"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "--fan-out" in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--budget-mib", "1024"], "go with --two-host"),
        (["--two-host", "--fan-out", "2", "--transfers-only"], "go with --two-host"),
        (["--two-host", "--budget-mib", "0"], "--budget-mib 0"),
    ],
)
def test_the_large_payload_options_are_refused_where_they_mean_nothing(
    args: list[str], said: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ray_velo.cli", "bench", *args],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and said in done.stderr, done.stderr
