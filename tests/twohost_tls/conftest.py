"""A two-host testbed with Ray's TLS on (``RAY_USE_TLS=1``, each host a certificate of a
throwaway CA made for it) and token auth, for the wire's TLS. A package of its own: the
three-host testbed of tests/twohost is gone before this one starts (one cluster at a time on
this 2-core machine). Skipped, with the reason, where namespaces cannot be made."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ray_velo.testbed import Testbed
from tests.twohost.conftest import built_testbed


@pytest.fixture(scope="package")
def tls_testbed() -> Iterator[Testbed]:
    yield from built_testbed(hosts=2, link=None, object_store_bytes=1 << 30, tls=True)
