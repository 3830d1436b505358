"""The README's first example and examples/quickstart.py are the same code (the file is what
the cluster tests run)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_quickstart_file_is_the_readmes_first_example() -> None:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("```python\n", 1)[1].split("```", 1)[0]
    quickstart = (ROOT / "examples" / "quickstart.py").read_text()
    body = quickstart.split('"""\n\n', 1)[1]  # after the module docstring
    assert body == block
