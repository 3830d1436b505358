"""Fixtures shared by the unit tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def segments(directory: Path) -> list[str]:
    """The ray_velo arena files in ``directory``, sorted."""
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("ray_velo-"))


@pytest.fixture
def shm_dir(tmp_path: Path) -> Iterator[Path]:
    """A scratch shared-memory directory that must hold no segment when the test ends."""
    directory = tmp_path / "shm"
    directory.mkdir()
    yield directory
    assert segments(directory) == [], "a ray_velo segment was left behind"


def velo_threads() -> list[threading.Thread]:
    """The ray_velo threads alive in this process."""
    return [t for t in threading.enumerate() if t.name.startswith("ray_velo-") and t.is_alive()]


@pytest.fixture(autouse=True)
def no_thread_outlives_its_test() -> Iterator[None]:
    """Every thread a unit test starts (a ticker, a writer, a copy) is ended by the end of
    that test; a thread that is ending gets a moment to finish."""
    assert not velo_threads(), f"a ray_velo thread was already running: {velo_threads()}"
    yield
    deadline = time.monotonic() + 2.0
    while velo_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not velo_threads(), f"threads left behind: {velo_threads()}"
