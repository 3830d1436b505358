"""How an agent learns that a Ray job ended: a look at Ray's job table, only while some live handle
follows a job (docs/deployment.md, "Staged data follows its job")."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Collection
from typing import Protocol

__all__ = [
    "FILTERED_LOOKUPS_MAX",
    "JOB_END_BOUND_S",
    "JOB_POLL_S",
    "JOB_QUERY_TIMEOUT_S",
    "JobTable",
    "JobWatch",
    "RayJobTable",
]

_log = logging.getLogger(__name__)

#: How often an agent that follows jobs asks whether they ended (s).
JOB_POLL_S = 1.0
#: The bound on one look at the job table (s); a look that fails is retried next period.
JOB_QUERY_TIMEOUT_S = 2.0
#: A job's handles end at most this long after Ray marks the job dead: one period, then
#: one look at its longest.
JOB_END_BOUND_S = JOB_POLL_S + JOB_QUERY_TIMEOUT_S
#: Up to this many followed jobs are asked about one by one (small answers); beyond, one
#: call lists the whole table.
FILTERED_LOOKUPS_MAX = 4
#: Failed looks logged at warning level: the first, then one in this many.
_WARN_EVERY = 60


class JobTable(Protocol):
    """Which of some Ray jobs (hex ids) have ended."""

    def dead(self, jobs: Collection[str]) -> set[str]:
        """The jobs of ``jobs`` that ended. A job the table does not know is not dead (a
        GCS restarted without persistence forgets jobs: keeping data beats losing it).

        Raises:
            Exception: the table could not be read (the caller retries later).
        """
        ...


class RayJobTable:
    """Ray's job table, read through this process's GCS client (an agent is a Ray actor)."""

    def __init__(self, timeout_s: float = JOB_QUERY_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s

    def dead(self, jobs: Collection[str]) -> set[str]:
        from ray_velo import _ray

        return _ray.dead_jobs(jobs, self.timeout_s, FILTERED_LOOKUPS_MAX)


class JobWatch:
    """When the agent next looks at the job table, and what looking has cost so far.

    Counters (for ``ray-velo status`` and the tests): ``looks`` made, ``look_seconds`` spent
    in them (wall time of the GCS calls), ``failures``, and ``jobs_ended`` seen.
    """

    def __init__(self, table: JobTable, period_s: float = JOB_POLL_S) -> None:
        self.table = table
        self.period_s = period_s
        self.due_at = -math.inf
        self.looks = 0
        self.look_seconds = 0.0
        self.failures = 0
        self.jobs_ended = 0

    def look(self, jobs: Collection[str], now: float) -> set[str]:
        """The jobs of ``jobs`` that ended (none when the table cannot be read); the next
        look is due one period after ``now``."""
        self.due_at = now + self.period_s
        started = time.perf_counter()
        try:
            dead = self.table.dead(jobs)
        except Exception as exc:  # the GCS is away or slow: keep the data, ask again later
            self.failures += 1
            level = logging.WARNING if self.failures % _WARN_EVERY == 1 else logging.DEBUG
            _log.log(level, "ray_velo: could not read Ray's job table (%s); retrying", exc)
            return set()
        finally:
            self.looks += 1
            self.look_seconds += time.perf_counter() - started
        self.jobs_ended += len(dead)
        return dead

    def counters(self) -> dict[str, float]:
        return {
            "looks": self.looks,
            "look_seconds": self.look_seconds,
            "failures": self.failures,
            "jobs_ended": self.jobs_ended,
        }
