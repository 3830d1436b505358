"""The testbed shared by the cross-host tests: three network namespaces joined by veth links
to a bridge, a Ray node started with ``ray start`` in each, UCX over TCP.

Built once for this folder; it needs root (CAP_NET_ADMIN), and where namespaces cannot be
made every test here is skipped with the reason. After the folder, nothing it started may be
left: no namespace, no process, no shared-memory segment.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from ray_velo.testbed import Testbed, check_privileges
from ray_velo.testbed.errors import TestbedUnavailable
from ray_velo.testbed.netns import namespaces, process_running

SCENARIOS = os.path.join(os.path.dirname(__file__), "scenarios.py")


def built_testbed(**options: Any) -> Iterator[Testbed]:
    """A testbed built with ``options`` for a fixture to yield, skipped (with the reason)
    where namespaces cannot be made; after it nothing it started may be left: no namespace,
    no process."""
    try:
        check_privileges()
    except TestbedUnavailable as exc:
        pytest.skip(f"SKIPPED (namespaces): {exc}")
    bed = Testbed(**options)
    bed.start()
    made = bed.network.made
    yield bed
    pids = bed.network.pids()
    bed.close()
    assert not set(made) & set(namespaces()), "testbed namespaces left behind"
    alive = [pid for pid in pids if process_running(pid)]
    assert not alive, f"testbed processes outlived it: {alive}"


@pytest.fixture(scope="package")
def testbed() -> Iterator[Testbed]:
    # Three hosts: a and b for most tests, c for a broadcast (a to b and c).
    yield from built_testbed(hosts=3, link=None, object_store_bytes=1 << 30)


def run_scenario(testbed: Testbed, name: str) -> dict[str, Any]:
    """Run scenario ``name`` of scenarios.py as a driver on host a; its JSON result."""
    done = testbed.run([sys.executable, SCENARIOS, name], timeout_s=300)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])  # type: ignore[no-any-return]
    raise AssertionError(
        f"scenario {name} exited {done.returncode} without a result:\n{done.stderr[-3000:]}"
    )
