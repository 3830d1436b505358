"""The README's first command, ``ray-velo demo``, as a new user runs it: two local Ray nodes it
makes and ends, the array's bytes checked on the consumer's node by Ray's object store and by
ray_velo, the path that moved them named."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.ray
@pytest.mark.multinode
@pytest.mark.slow
def test_the_readmes_demo_moves_verified_bytes_and_names_its_path() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ray_velo.cli", "demo", "--size-mib", "64"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    out = done.stdout
    assert re.search(r"Ray object store .* bytes verified", out), out
    assert re.search(r"ray_velo, the agents' wire .* bytes verified", out), out
    assert re.search(r"ray_velo: [\d.]+x Ray's object store", out), out
    # every fetch took the wire (UCX is closed by default), and the figures say they are not
    # cross-host ones
    assert re.search(r"consumer-side path decisions: \{'wire/ok': \d+\}", out), out
    assert "not cross-host figures" in out
