"""The figures the README and docs quote come from committed sittings: every file in
docs/sittings/ is a sitting, and every table marked ``<!-- ranges: GLOB -->`` is exactly what
``ray-velo bench --ranges GLOB`` makes of the files the glob names. No Ray."""

from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest

from ray_velo.bench.record import load_sitting, ranges_table

ROOT = Path(__file__).resolve().parents[2]
MARKED = re.compile(r"<!-- ranges: (\S+) -->\n(.*?)\n<!-- /ranges -->", re.S)
PAGES = [ROOT / "README.md", ROOT / "docs" / "benchmarks.md"]


def test_every_committed_sitting_reads() -> None:
    files = sorted((ROOT / "docs" / "sittings").glob("*.json"))
    assert files, "no committed sitting"
    for path in files:
        sitting = load_sitting(str(path))
        assert sitting["shapes"], f"{path.name}: no shape"
        assert sitting["code"].get("commit"), f"{path.name}: no commit"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_quoted_ranges_are_the_committed_sittings(page: Path) -> None:
    text = page.read_text()
    blocks = MARKED.findall(text)
    if page.name == "README.md":
        assert blocks, "the README quotes no ranges of committed sittings"
    for pattern, table in blocks:
        files = sorted(glob.glob(str(ROOT / pattern)))
        assert len(files) >= 2, f"{page.name}: {pattern} names {len(files)} sittings"
        expected = ranges_table([load_sitting(f) for f in files])
        assert table.strip() == expected, (
            f"{page.name}: the table under {pattern} is not what its sittings say; "
            f"run `ray-velo bench --ranges {pattern}`"
        )
