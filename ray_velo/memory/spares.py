"""When a node maps a spare dedicated arena ahead of the next payload of a size: a pure rule,
time passed in (docs/tuning.md "Spare arenas").

A spare saves the next put of a size the map and first-touch faults of a fresh arena (1.6-1.8
GB/s on one core here, slower than the copy it serves), and costs that same CPU time plus the
arena's memory while it waits. So it is mapped only where it pays and where it hurts nothing:

1. **The size repeats.** A dedicated placement of about the same size (the warm arenas' own
   1/8 tolerance) happened within ``repeat_window_s`` before: a pipeline's next round, not a
   one-off put of any size.
2. **The size is bounded** by ``max_bytes`` (by default an eighth of the registered budget):
   above it the spare's memory would crowd out what the budget keeps for live payloads, and a
   payload that large spends far longer on the wire than a map costs.
3. **Warm memory stays inside** ``warm_dedicated_bytes``: a spare never pushes a warm arena out.
4. **No transfer of the node is in flight** when it is mapped (the caller defers it): mapping
   is a core's worth of work for up to a second, and on a small node that halves a transfer
   (issue 37: 1.5 GiB at 0.54 GB/s instead of 1.08).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ray_velo.memory.arena import page_round_up

__all__ = ["SparePolicy"]


def _close(a: int, b: int) -> bool:
    """Whether page-rounded sizes ``a`` and ``b`` would share one warm arena (the larger at
    most 1/8 above the smaller, as the pool takes warm arenas)."""
    low, high = min(a, b), max(a, b)
    return high <= low + low // 8


@dataclass(slots=True)
class SparePolicy:
    """Decides whether a dedicated placement asks for a spare arena of its size.

    Args:
        repeat_window_s: a size placed again within this many seconds is a repeating one.
        max_bytes: no spare for payloads above this many bytes.
        warm_limit_bytes: warm dedicated arenas a spare must fit beside
            (``warm_dedicated_bytes``).

    Not thread-safe: the caller serialises calls.
    """

    repeat_window_s: float
    max_bytes: int
    warm_limit_bytes: int
    #: page-rounded size -> when a payload of about that size was last placed
    _last_seen: dict[int, float] = field(default_factory=dict)

    def placed(self, nbytes: int, now: float, *, warm_held_bytes: int, has_warm: bool) -> bool:
        """A payload of ``nbytes`` took a dedicated arena at ``now`` (or missed one);
        ``warm_held_bytes``: the warm arenas mapped now; ``has_warm``: one of them would
        take the next payload of this size already. Returns whether to map a spare."""
        if self.repeat_window_s <= 0:
            return False  # spares off
        size = page_round_up(nbytes)
        repeated = self._seen(size, now)
        return (
            repeated
            and not has_warm
            and size <= self.max_bytes
            and warm_held_bytes + size <= self.warm_limit_bytes
        )

    def _seen(self, size: int, now: float) -> bool:
        """Record ``size`` at ``now``; whether about that size was seen within the window."""
        horizon = now - self.repeat_window_s
        for old in [s for s, when in self._last_seen.items() if when < horizon]:
            del self._last_seen[old]  # bounded: only the sizes of the last window stay
        match = next((s for s in self._last_seen if _close(s, size)), None)
        if match is not None:
            del self._last_seen[match]
        self._last_seen[size] = now
        return match is not None

    @property
    def sizes_tracked(self) -> int:
        """Sizes seen within the window (for tests: the table stays bounded)."""
        return len(self._last_seen)
