"""The two-host bench's side-by-side rounds: per-round ratios, medians and their text."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

from ray_velo.bench.actors import machine_process, medians, rounds, wait_processes_gone
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


def test_rounds_the_hypervisor_disturbed_are_named_and_left_out_of_the_quiet_median() -> None:
    result = LinkResult("10gbit")
    result.samples[GiB] = {
        "velo": [1.0, 2.0, 1.0],
        "raw_tcp": [0.9, 0.9, 1.0],
        "velo_stolen": [0.01, 0.13, 0.0],
        "raw_stolen": [0.0, 0.01, 0.05],  # the third round's probe was disturbed
    }
    result.rows[GiB] = {"velo": 1.0, "raw_tcp": 0.9}
    text = format_two_host([result])
    assert "CPU stolen by the hypervisor, round by round: 1%, 13%, 5%" in text
    assert "velo/raw tcp round by round: 0.90, 0.45, 1.00" in text
    assert "1 rounds with <= 3% stolen: median 0.90)" in text


def test_cpu_ticks_count_steal_among_all_ticks(tmp_path: Path) -> None:
    from ray_velo.bench.actors import cpu_ticks

    stat = tmp_path / "stat"
    stat.write_text("cpu  100 20 30 400 5 0 6 7 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    assert cpu_ticks(str(stat)) == (7, 568)  # steal is the 8th; guest time is in user already
    stat.write_text("cpu  1 2 3\n")  # an old kernel: no steal column
    assert cpu_ticks(str(stat)) == (0, 6)
    assert cpu_ticks(str(tmp_path / "missing")) == (0, 0)


def test_the_built_in_place_transfer_has_its_own_rounds_and_breakdown() -> None:
    result = LinkResult("10gbit")
    result.samples[GiB] = {
        "velo": [1.0, 1.25],
        "velo_built": [0.95, 1.0],
        "raw_tcp": [0.9, 0.95],
    }
    result.rows[GiB] = {
        "velo": 1.1,
        "put": 0.1,
        "get_leg": 0.9,
        "velo_built": 1.0,
        "seal": 0.002,
        "built_get_leg": 0.95,
        "raw_tcp": 0.9,
    }
    text = format_two_host([result])
    assert "velo/raw tcp round by round: 0.90, 0.76" in text
    assert "built/raw tcp round by round: 0.95, 0.95" in text
    assert "velo breakdown: put 100.0 ms, UCX GET 900.0 ms, control calls + read 100.0 ms" in text
    assert "built breakdown: seal 2.0 ms, UCX GET 950.0 ms, control calls + read 48.0 ms" in text
    header = text.splitlines()[0].split()
    assert "built" in header and "built/raw" in header


def test_a_round_after_a_killed_pair_waits_for_its_processes_to_be_gone() -> None:
    # A fresh NIXL pair's processes run on after ray.kill: the next column's round must not
    # share the cores with them. Pids of another machine (boot id) are not waited for.
    boot_id = machine_process()[0]
    exiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    lingering = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        wait_processes_gone([(boot_id, exiting.pid)], bound_s=30.0)
        assert exiting.poll() is not None  # exited (a zombie until reaped counts as gone)
        started = time.monotonic()
        wait_processes_gone([("another-machine", lingering.pid)], bound_s=30.0)
        assert time.monotonic() - started < 5.0
        started = time.monotonic()
        wait_processes_gone([(boot_id, lingering.pid)], bound_s=0.3)  # the bound holds
        assert 0.3 <= time.monotonic() - started < 5.0
        assert lingering.poll() is None
    finally:
        for process in (exiting, lingering):
            process.kill()
            process.wait(timeout=30)
