"""A timer thread that runs only while there is something to time: ``tick(now)`` returns when it
next needs to run, ``poke()`` makes it ask again."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

__all__ = ["Ticker"]

_log = logging.getLogger(__name__)


class Ticker:
    """Runs ``tick(now) -> next_due | None`` on its own thread, at the due times it returns."""

    def __init__(
        self,
        tick: Callable[[float], float | None],
        *,
        name: str = "ray_velo-ticker",
        clock: Callable[[], float],
    ) -> None:
        self._tick = tick
        self._clock = clock
        self._cond = threading.Condition()
        self._poked = False
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def poke(self) -> None:
        """Re-evaluate now (call after setting a deadline)."""
        with self._cond:
            self._poked = True
            self._cond.notify()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and wait for it (idempotent)."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Whether the thread still runs (False once stopped)."""
        return self._thread.is_alive()

    def _run(self) -> None:
        due: float | None = None
        while True:
            with self._cond:
                while not self._stopped and not self._poked:
                    if due is None:
                        self._cond.wait()  # nothing to time: sleep until poked
                    else:
                        remaining = due - self._clock()
                        if remaining <= 0:
                            break
                        self._cond.wait(remaining)
                if self._stopped:
                    return
                self._poked = False
            try:
                due = self._tick(self._clock())
            except Exception:  # a failing tick must not kill the agent's timers
                _log.exception("ray_velo ticker failed; retrying in 1 s")
                due = self._clock() + 1.0
