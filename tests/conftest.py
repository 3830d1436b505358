"""Shared fixtures: leak checks that apply to every test."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

SHM_DIR = "/dev/shm"


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
