"""The benches' progress: a tqdm bar on a terminal, one plain line per step in a log or CI."""

from __future__ import annotations

import io
import threading
from collections.abc import Callable
from typing import Any

import pytest
from tqdm import tqdm

from ray_velo.bench.progress import Progress
from ray_velo.bench.samehost import bench_steps
from ray_velo.bench.transport import STEPS_PER_SIZE


class _Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_a_log_gets_one_plain_line_per_step_with_its_count() -> None:
    """`ray-velo bench --transport 2>log`: each step is a line a reader (or CI) can follow."""
    log = io.StringIO()
    with Progress(4, "transport bench", stream=log) as progress:
        for size in (64, 256):
            progress.step(f"{size} MiB: torch interleaved")
            progress.step(f"{size} MiB: numpy and fresh actors")
    assert log.getvalue().splitlines() == [
        "[1/4] 64 MiB: torch interleaved",
        "[2/4] 64 MiB: numpy and fresh actors",
        "[3/4] 256 MiB: torch interleaved",
        "[4/4] 256 MiB: numpy and fresh actors",
    ]
    assert "\r" not in log.getvalue()


def test_a_long_step_says_what_runs_and_a_warning_gets_its_own_line() -> None:
    log = io.StringIO()
    with Progress(2, "shapes bench", stream=log) as progress:
        progress.working("link 10gbit: 4 MiB @10gbit")
        progress.step("link 10gbit: 4 MiB @10gbit")
        progress.write("raw UCX GET unavailable: no UCX")
    assert log.getvalue().splitlines() == [
        "[0/2] link 10gbit: 4 MiB @10gbit ...",
        "[1/2] link 10gbit: 4 MiB @10gbit",
        "raw UCX GET unavailable: no UCX",
    ]


def test_a_terminal_gets_a_tqdm_bar_that_is_closed_at_the_end() -> None:
    terminal = _Terminal()
    threads = set(threading.enumerate())
    with Progress(3, "scale bench", stream=terminal) as progress:
        bar = progress._bar
        assert isinstance(bar, tqdm)
        progress.working("filling node a to 1,000 live handles")
        for count in ("1,000", "10,000", "100,000"):
            progress.step(f"{count} live handles")
        progress.write("a note")
    text = terminal.getvalue()
    assert "scale bench" in text and "3/3" in text and "a note" in text
    assert "\r" in text  # drawn in place, not line by line
    assert "[1/3]" not in text  # no plain lines beside the bar
    assert bar.n == 3 and bar.total == 3
    assert bar not in tqdm._instances  # closed
    assert set(threading.enumerate()) <= threads  # no monitor thread left running


def test_the_bar_is_closed_when_the_run_fails() -> None:
    progress = Progress(3, "calls bench", stream=_Terminal())
    with pytest.raises(RuntimeError, match="a node died"), progress:
        progress.step("two local nodes up")
        raise RuntimeError("a node died")
    assert progress._bar not in tqdm._instances
    with pytest.raises(RuntimeError, match="after it closed"):
        progress.step("late")


@pytest.mark.parametrize("stream", [io.StringIO, _Terminal])
def test_the_count_never_shows_more_than_the_total(stream: type[io.StringIO]) -> None:
    """A miscounted run raises the total rather than showing 3/2, and is not stopped."""
    out = stream()
    with Progress(2, "bench", stream=out) as progress:
        for n in range(3):
            progress.step(f"step {n}")
    assert progress.done == progress.total == 3
    if progress._bar is not None:
        assert progress._bar.n == progress._bar.total == 3
    else:
        assert out.getvalue().splitlines()[-1] == "[3/3] step 2"


def test_a_run_of_no_steps_and_closing_twice_are_harmless() -> None:
    log = io.StringIO()
    progress = Progress(0, "bench", stream=log)
    with progress:
        pass
    progress.close()
    assert log.getvalue() == ""
    with pytest.raises(ValueError, match="below 0"):
        Progress(-1, "bench")


class _Remote:
    """A fake actor method: ``.remote(...)`` returns the value (with ``ray.get`` the identity)."""

    def __init__(self, value: Callable[..., Any]) -> None:
        self.value = value

    def remote(self, *args: Any) -> Any:
        return self.value(*args)


class _Actor:
    def __getattr__(self, name: str) -> _Remote:
        values: dict[str, Callable[..., Any]] = {
            "path_counts": lambda: {},
            "read": lambda value: value,
        }
        return _Remote(values.get(name, lambda *args: 1))


class _FakeCluster:
    def __init__(self, **_: Any) -> None:
        self.producer, self.consumer = _Actor(), _Actor()

    def close(self) -> None:
        pass


def test_the_same_host_bench_takes_the_steps_it_announces(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A round per rep and warm-up per size, the latency probe, a raw UCX probe per size
    (one failing: its warning is a line of its own, and the count goes on)."""
    from ray_velo.bench import samehost

    monkeypatch.setattr("ray.get", lambda value, **_: value)
    monkeypatch.setattr(samehost, "_Cluster", _FakeCluster)
    monkeypatch.setattr(samehost, "transfer_round", lambda *_, **__: {"ray": 1.0, "velo": 0.5})
    monkeypatch.setattr(samehost, "measure_latency", lambda *_: {})
    probes = iter([0.1, RuntimeError("no UCX")])

    def ucx_raw_get(nbytes: int, reps: int) -> float:
        probe = next(probes)
        if isinstance(probe, Exception):
            raise probe
        return probe

    monkeypatch.setattr(samehost, "ucx_raw_get", ucx_raw_get)
    rows = samehost.run_bench([1 << 20, 4 << 20], 3, latency={})
    assert len(rows) == 2
    lines = capsys.readouterr().err.splitlines()
    steps = [line for line in lines if line.startswith("[")]
    total = bench_steps(2, 3, latency=True, ucx_raw=True)
    assert [line.split("]")[0] for line in steps] == [f"[{n}/{total}" for n in range(1, total + 1)]
    assert steps[0] == f"[1/{total}] 1 MiB warm-up" and steps[1] == f"[2/{total}] 1 MiB rep 1"
    assert "raw UCX GET unavailable: no UCX" in lines

    seen: list[tuple[int, int, str]] = []  # a caller's own progress callable
    probes = iter([0.1, 0.1])
    samehost.run_bench([1 << 20, 4 << 20], 3, progress=lambda *step: seen.append(step))
    assert [(done, total) for done, total, _ in seen] == [
        (n, bench_steps(2, 3, latency=False, ucx_raw=True)) for n in range(1, len(seen) + 1)
    ]
    assert seen[-1][:2] == (seen[-1][1], seen[-1][1])


def test_the_transport_bench_ticks_twice_per_size(monkeypatch: pytest.MonkeyPatch) -> None:
    from ray_velo.bench import transport

    monkeypatch.setattr("ray.get", lambda value, **_: value)
    producer, consumer = _Actor(), _Actor()
    pairs = {"torch_plain": (producer, consumer), "torch_velo": (producer, consumer)}
    ticks: list[str] = []
    for size in (64 << 20, 256 << 20):
        row = transport._measure_size(pairs, _Actor(), size, 2, ticks.append)
        assert row["consistent"]
    assert len(ticks) == STEPS_PER_SIZE * 2
    assert ticks[0] == "64 MiB: torch, torch_plain, torch_velo interleaved"
    assert ticks[-1] == "256 MiB: numpy and fresh actors"
