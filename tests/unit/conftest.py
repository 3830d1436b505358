"""Fixtures shared by the unit tests."""

from __future__ import annotations

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
