"""The agent's timer thread: it runs only while something is timed, and never outlives stop()."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from ray_velo.actors.ticker import Ticker
from tests.unit.conftest import velo_threads


class Recorder:
    """A tick function: records when it ran and returns the due times it is given."""

    def __init__(self, plan: Callable[[int, float], float | None]) -> None:
        self.plan = plan
        self.calls: list[float] = []
        self.ran = threading.Condition()

    def __call__(self, now: float) -> float | None:
        with self.ran:
            self.calls.append(now)
            self.ran.notify_all()
        return self.plan(len(self.calls), now)

    def wait_for(self, count: int, timeout: float = 5.0) -> None:
        with self.ran:
            assert self.ran.wait_for(lambda: len(self.calls) >= count, timeout), (
                f"{len(self.calls)} ticks, expected {count}"
            )


@pytest.fixture
def start() -> Iterator[Callable[..., Ticker]]:
    tickers: list[Ticker] = []

    def _start(
        tick: Callable[[float], float | None], clock: Callable[[], float] = time.monotonic
    ) -> Ticker:
        ticker = Ticker(tick, clock=clock)
        tickers.append(ticker)
        return ticker

    yield _start
    for ticker in tickers:
        ticker.stop()


def test_nothing_timed_means_no_tick_until_poked(start: Callable[..., Ticker]) -> None:
    """An agent that staged nothing with a deadline arms no timer and burns no CPU."""
    tick = Recorder(lambda n, now: None)
    ticker = start(tick)
    time.sleep(0.15)
    assert tick.calls == []
    assert ticker.alive
    ticker.poke()
    tick.wait_for(1)
    time.sleep(0.15)  # tick returned None: blocked again
    assert len(tick.calls) == 1
    ticker.poke()
    tick.wait_for(2)


def test_runs_tick_at_the_due_time_it_returns(start: Callable[..., Ticker]) -> None:
    """A lease deadline 50 ms out: the sweep runs once it is due, not before."""
    period = 0.05
    tick = Recorder(lambda n, now: now + period if n < 4 else None)
    ticker = start(tick)
    ticker.poke()
    tick.wait_for(4)
    gaps = [b - a for a, b in zip(tick.calls, tick.calls[1:], strict=False)]
    assert all(gap >= period for gap in gaps), gaps
    assert all(gap < period + 0.5 for gap in gaps), gaps  # late only by scheduling
    time.sleep(2 * period)
    assert len(tick.calls) == 4  # the fourth tick returned None: nothing more


def test_a_due_time_in_the_past_runs_at_once(start: Callable[..., Ticker]) -> None:
    tick = Recorder(lambda n, now: now - 10.0 if n < 3 else None)
    start(tick).poke()
    tick.wait_for(3, timeout=1.0)


def test_poke_moves_a_far_due_time_forward(start: Callable[..., Ticker]) -> None:
    """A new, earlier deadline (poke) is not stuck behind an hour-long wait."""
    tick = Recorder(lambda n, now: now + 3600.0)
    ticker = start(tick)
    ticker.poke()
    tick.wait_for(1)
    began = time.monotonic()
    ticker.poke()
    tick.wait_for(2, timeout=1.0)
    assert time.monotonic() - began < 1.0


def test_poke_during_a_tick_is_not_lost(start: Callable[..., Ticker]) -> None:
    """A deadline set while the sweep runs gets a sweep after it."""
    inside = threading.Event()
    release = threading.Event()

    def slow(n: int, now: float) -> float | None:
        if n == 1:
            inside.set()
            release.wait(5.0)
        return None

    tick = Recorder(slow)
    ticker = start(tick)
    ticker.poke()
    assert inside.wait(5.0)
    ticker.poke()  # while the first tick still runs
    release.set()
    tick.wait_for(2)


def test_stop_joins_the_thread(start: Callable[..., Ticker]) -> None:
    """An agent's shutdown leaves no timer thread behind, even one waiting on a deadline."""
    tick = Recorder(lambda n, now: now + 3600.0)
    ticker = Ticker(tick, name="ray_velo-test-ticker", clock=time.monotonic)
    assert [t.name for t in velo_threads()] == ["ray_velo-test-ticker"]
    ticker.poke()
    tick.wait_for(1)
    began = time.monotonic()
    ticker.stop()
    assert time.monotonic() - began < 1.0
    assert not ticker.alive
    assert not velo_threads()
    ticker.stop()  # idempotent
    ticker.poke()  # harmless after stop
    assert len(tick.calls) == 1


def test_stop_while_idle_joins_the_thread() -> None:
    ticker = Ticker(lambda now: None, clock=time.monotonic)
    ticker.stop()
    assert not ticker.alive


def test_stop_from_inside_tick_does_not_deadlock(start: Callable[..., Ticker]) -> None:
    """The tick itself may decide the agent is shutting down."""
    holder: list[Ticker] = []
    done = threading.Event()

    def stopping(now: float) -> float | None:
        holder[0].stop()
        done.set()
        return now  # due at once, but stopped: never runs again

    ticker = start(stopping)
    holder.append(ticker)
    ticker.poke()
    assert done.wait(5.0)
    ticker._thread.join(5.0)
    assert not ticker.alive


def test_failing_tick_is_logged_and_retried_about_a_second_later(
    start: Callable[..., Ticker], caplog: pytest.LogCaptureFixture
) -> None:
    """A sweep that raises must not kill the agent's timers: it runs again in ~1 s."""

    def flaky(n: int, now: float) -> float | None:
        if n == 1:
            raise RuntimeError("sweep failed")
        return None

    tick = Recorder(flaky)
    with caplog.at_level(logging.ERROR, logger="ray_velo.actors.ticker"):
        ticker = start(tick)
        ticker.poke()
        tick.wait_for(2, timeout=5.0)
    retry_after = tick.calls[1] - tick.calls[0]
    assert 1.0 <= retry_after < 1.6, retry_after
    failures = [r for r in caplog.records if r.name == "ray_velo.actors.ticker"]
    assert len(failures) == 1
    assert "retrying in 1 s" in failures[0].getMessage()
    assert failures[0].exc_info is not None
    assert isinstance(failures[0].exc_info[1], RuntimeError)
    assert ticker.alive


def test_tick_gets_the_injected_clock(start: Callable[..., Ticker]) -> None:
    """Time is an argument: the tick sees the ticker's clock, not the wall."""
    tick = Recorder(lambda n, now: None)
    start(tick, clock=lambda: 1234.5).poke()
    tick.wait_for(1)
    assert tick.calls == [1234.5]
