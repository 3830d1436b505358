"""The library type-checks (mypy --strict, as pyproject configures it) and lints clean (ruff):
the typed seams (the RDMA backend protocol, the state objects) are checked in every run of the
suite, not only when someone remembers to run the tools."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"SKIPPED: {module} is not installed (pip install -e '.[test]')")
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip


@pytest.mark.slow
def test_the_library_type_checks() -> None:
    done = run("mypy")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_the_tree_lints_clean() -> None:
    done = run("ruff", "check", ".")
    assert done.returncode == 0, done.stdout[-4000:]


#: The most methods the owner's state may have: what grows beside its slots (the reads in
#: progress, the streamed writes, the copies) goes into objects of its own. The wire's sends
#: (begin_send, still_sending) are two questions to the slot table itself.
OWNER_STATE_METHODS_MAX = 37


def test_the_owner_state_stays_small() -> None:
    import ast

    tree = ast.parse((ROOT / "ray_velo" / "state" / "owner.py").read_text())
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "OwnerState"]
    methods = [f.name for f in cls.body if isinstance(f, ast.FunctionDef)]
    assert len(methods) <= OWNER_STATE_METHODS_MAX, (
        f"OwnerState has {len(methods)} methods (at most {OWNER_STATE_METHODS_MAX}): move a "
        f"concern into an object of its own, as ReadGate and StreamedWrites"
    )
