"""A fetch's bound: when it ends, which bound it is, and what is left of it for the wire."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ray_velo.errors import TransferTimeout

__all__ = ["Deadline"]


@dataclass(frozen=True, slots=True)
class Deadline:
    """``at`` (seconds on ``clock``) or None for unbounded, and which bound it is."""

    at: float | None
    timeout_s: float | None
    bound: str
    clock: Callable[[], float] = field(default=time.monotonic, compare=False)

    @classmethod
    def start(
        cls,
        timeout_s: float | None,
        bound: str = "fetch timeout",
        clock: Callable[[], float] = time.monotonic,
    ) -> Deadline:
        at = None if timeout_s is None else clock() + timeout_s
        return cls(at, timeout_s, bound, clock)

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
