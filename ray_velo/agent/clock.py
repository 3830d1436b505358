"""An agent's one time: :class:`Clock` (monotonic seconds, and waits bounded on them) and
:class:`Deadline` (a bound a call carries), built once with the agent and passed to every part
below it, so a test's :class:`~ray_velo.testing.FakeClock` moves all of them at once
(docs/architecture.md §4)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ray_velo.errors import TransferTimeout

__all__ = ["MIN_WAIT_S", "Clock", "Deadline"]

#: The least a bounded call is given: a bound of 0 means "no bound" to Ray and to sockets.
MIN_WAIT_S = 0.001
#: How often a wait looks again without being told of a change (a lease's deadline passes
#: with no change of state to wake it; a fake clock moves without one).
_LOOK_AGAIN_S = 0.1


class Clock:
    """Monotonic seconds (``time.monotonic`` unless given another source), read by calling it."""

    def __init__(self, source: Callable[[], float] = time.monotonic) -> None:
        self._source = source

    def __call__(self) -> float:
        return self._source()

    def left(self, until: float) -> float:
        """Seconds from now to ``until``, at least :data:`MIN_WAIT_S` (for a call's bound)."""
        return max(until - self(), MIN_WAIT_S)

    def deadline(self, timeout_s: float | None, bound: str = "fetch timeout") -> Deadline:
        """A :class:`Deadline` ``timeout_s`` from now (None: unbounded)."""
        at = None if timeout_s is None else self() + timeout_s
        return Deadline(at, timeout_s, bound, self)

    def wait(self, changed: threading.Condition, ready: Callable[[], bool], until: float) -> bool:
        """Wait, holding ``changed``'s lock, until ``ready()`` or this clock passes ``until``;
        says which. ``changed`` is notified on every change that may make ``ready`` true."""
        with changed:
            while not ready():
                left = until - self()
                if left <= 0:
                    return False
                self._idle(changed, min(left, _LOOK_AGAIN_S))
            return True

    def _idle(self, changed: threading.Condition, seconds: float) -> None:
        """Sleep on ``changed`` for at most ``seconds`` of this clock."""
        changed.wait(seconds)


@dataclass(frozen=True, slots=True)
class Deadline:
    """``at`` (seconds on ``clock``) or None for unbounded, and which bound it is."""

    at: float | None
    timeout_s: float | None
    bound: str
    clock: Clock = field(compare=False)

    def remaining(self) -> float | None:
        """Seconds left (never negative), or None when unbounded."""
        return None if self.at is None else max(0.0, self.at - self.clock())

    def expired(self) -> bool:
        return self.at is not None and self.clock() >= self.at

    def budget_ms(self) -> int:
        """What is left, rounded up to whole ms, for the wire (0 = unbounded)."""
        left = self.remaining()
        return 0 if left is None else max(1, math.ceil(left * 1000))

    def timeout_error(self, handle: object) -> TransferTimeout:
        return TransferTimeout(handle=str(handle), timeout_s=self.timeout_s, bound=self.bound)
