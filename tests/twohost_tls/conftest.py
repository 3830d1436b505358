"""A two-host testbed with Ray's TLS on (``RAY_USE_TLS=1``, each host a certificate of a
throwaway CA made for it) and token auth, for the wire's TLS. A package of its own: the
three-host testbed of tests/twohost is gone before this one starts (one cluster at a time on
this 2-core machine). Skipped, with the reason, where namespaces cannot be made."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ray_velo.errors import TestbedUnavailable
from ray_velo.testbed import Testbed, check_privileges
from ray_velo.testbed.netns import namespaces, process_running


@pytest.fixture(scope="package")
def tls_testbed() -> Iterator[Testbed]:
    try:
        check_privileges()
    except TestbedUnavailable as exc:
        pytest.skip(f"SKIPPED (namespaces): {exc}")
    bed = Testbed(hosts=2, link=None, object_store_bytes=1 << 30, tls=True)
    bed.start()
    made = bed.network.made
    yield bed
    pids = bed.network.pids()
    bed.close()
    assert not set(made) & set(namespaces()), "testbed namespaces left behind"
    alive = [pid for pid in pids if process_running(pid)]
    assert not alive, f"testbed processes outlived it: {alive}"
