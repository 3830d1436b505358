"""The session's shared-memory leak check: a segment is this suite's leak when its process
died without removing it or is a process the suite started and left running; a segment of a
live process outside the suite (a cluster run beside it) is not."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import _ours_or_orphaned, _parents


def test_a_dead_or_own_process_segment_is_a_leak_another_live_ones_is_not() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        parents = _parents()
        assert _ours_or_orphaned(f"ray_velo-{child.pid}-00aa-0", parents)  # started by us
        assert _ours_or_orphaned(f"ray_velo-{os.getpid()}-00aa-0", parents)
        assert not _ours_or_orphaned("ray_velo-1-00aa-0", parents)  # init: not ours
        assert not _ours_or_orphaned(f"ray_velo-{os.getppid()}-00aa-0", parents)
    finally:
        child.kill()
        child.wait()
    assert _ours_or_orphaned(f"ray_velo-{child.pid}-00aa-0", _parents())  # died, left it
    assert _ours_or_orphaned("ray_velo-not-a-pid", _parents())
