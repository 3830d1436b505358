"""Shared fixtures: leak checks that apply to every test; Hypothesis's settings."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

SHM_DIR = "/dev/shm"

# Ray's coming default for every cluster this suite starts (token auth: local clusters from
# Ray 2.59, every cluster from 2.61), with one fresh token for the whole run. Set before any
# test imports Ray: Ray reads its auth mode once, when it loads. The testbeds set their own.
if "RAY_AUTH_MODE" not in os.environ:
    from ray_velo.testbed.security import auth_env, new_token

    os.environ.update(auth_env("token", new_token()))

# Hypothesis times each example (200 ms deadline) and the generation of inputs (too_slow):
# on a loaded 2-core CI machine a first draw took 1.9 s and failed a test that asserts
# nothing about time. Correctness properties here never depend on speed.
settings.register_profile("ray_velo", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ray_velo")


def velo_segments() -> set[str]:
    try:
        return {name for name in os.listdir(SHM_DIR) if name.startswith("ray_velo-")}
    except FileNotFoundError:
        return set()


def _parents() -> dict[int, int]:
    """pid -> parent pid of every live process (from /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                # the command name (field 2) may hold spaces: the fields after its ")" count
                parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return parents


def _ours_or_orphaned(segment: str, parents: dict[int, int]) -> bool:
    """Whether a segment (``ray_velo-<pid>-...``) is this suite's leak: its process died
    without removing it, or it is a process this suite started that is still running. A live
    process outside the suite (a cluster someone runs beside it) is not the suite's."""
    try:
        pid = int(segment.split("-")[1])
    except (IndexError, ValueError):
        return True
    if pid not in parents:
        return True  # its process is gone and left it behind
    while pid in parents and pid > 1:
        if pid == os.getpid():
            return True
        pid = parents[pid]
    return False


@pytest.fixture(scope="session", autouse=True)
def no_segment_outlives_the_session() -> Iterator[None]:
    """Every shared-memory segment ray_velo created is gone when the suite ends."""
    before = velo_segments()
    yield
    parents = _parents()
    leaked = {name for name in velo_segments() - before if _ours_or_orphaned(name, parents)}
    assert not leaked, f"shared-memory segments left behind: {sorted(leaked)}"
