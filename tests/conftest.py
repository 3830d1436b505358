"""Shared fixtures: leak checks that apply to every test; Hypothesis's settings."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

SHM_DIR = "/dev/shm"

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


@pytest.fixture(scope="session", autouse=True)
def no_segment_outlives_the_session() -> Iterator[None]:
    """Every shared-memory segment ray_velo created is gone when the suite ends."""
    before = velo_segments()
    yield
    leaked = velo_segments() - before
    assert not leaked, f"shared-memory segments left behind: {sorted(leaked)}"
