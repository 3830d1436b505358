"""How every ``ray-velo bench`` mode shows its progress: a tqdm bar on stderr when stderr is a
terminal, else one plain line per step (``[3/12] 256 MiB: torch interleaved``), so that logs
and CI show progress without carriage returns.

Rules: a step is counted when it is done (its label says what was done); :meth:`Progress.working`
says what runs now without counting; the count never shows more than the total (a step past
it raises the total instead: a miscount must not stop a measurement); the bar is closed when
the ``with`` block ends, however it ends.
"""

from __future__ import annotations

import sys
import threading
from typing import IO, Any

from tqdm import tqdm

__all__ = ["Progress"]


class _Bar(tqdm):  # type: ignore[misc]  # tqdm ships no types
    """tqdm without its monitor thread (nothing outlives the bar) and with a thread lock
    (tqdm's default multiprocessing lock would start Python's resource tracker)."""

    monitor_interval = 0


_Bar.set_lock(threading.RLock())


class Progress:
    """``total`` steps of the run named ``label``, shown on ``stream`` (default: stderr).

    Use as a context manager::

        with Progress(2 * len(sizes), "transports") as progress:
            ...
            progress.step(f"{size >> 20} MiB: numpy")
    """

    def __init__(self, total: int, label: str, stream: IO[str] | None = None) -> None:
        if total < 0:
            raise ValueError(f"Progress total {total} below 0")
        self.total = total
        self.label = label
        self.done = 0
        self._stream: IO[str] = stream if stream is not None else sys.stderr
        self._bar: Any = None
        self._closed = False

    @property
    def terminal(self) -> bool:
        """Whether the stream is a terminal (tqdm draws the bar) or not (plain lines)."""
        isatty = getattr(self._stream, "isatty", None)
        try:
            return bool(isatty()) if isatty is not None else False
        except ValueError:  # a closed stream
            return False

    def __enter__(self) -> Progress:
        if self.terminal:
            self._bar = _Bar(
                total=self.total,
                desc=self.label,
                file=self._stream,
                unit="step",
                dynamic_ncols=True,
                leave=True,
            )
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def step(self, label: str) -> None:
        """Count one step as done; ``label`` says which."""
        if self._closed:
            raise RuntimeError(f"progress of {self.label!r} stepped after it closed")
        self.done += 1
        self.total = max(self.total, self.done)
        if self._bar is not None:
            self._bar.total = self.total
            self._bar.set_postfix_str(label, refresh=False)
            self._bar.update(1)
        else:
            self._line(f"[{self.done}/{self.total}] {label}")

    def working(self, label: str) -> None:
        """Say what runs now (a long step), without counting it."""
        if self._closed:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(f"{label} ...")
        else:
            self._line(f"[{self.done}/{self.total}] {label} ...")

    def write(self, text: str) -> None:
        """A message of its own (a warning), on its own line above the bar."""
        if self._bar is not None:
            self._bar.write(text, file=self._stream)
        else:
            self._line(text)

    def close(self) -> None:
        """End the bar (its last state stays on screen); again is a no-op."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()

    def _line(self, text: str) -> None:
        self._stream.write(text + "\n")
        self._stream.flush()
