"""The agents' wire under Ray's TLS, across two emulated hosts: nothing of ours travels in
clear where Ray's own traffic does not, payload bytes included."""

from __future__ import annotations

import pytest

from ray_velo.testbed import Testbed
from tests.twohost.conftest import run_scenario

pytestmark = [pytest.mark.twohost, pytest.mark.slow]


def test_a_cross_host_fetch_under_rays_tls(tls_testbed: Testbed) -> None:
    """Ray with RAY_USE_TLS=1 and token auth on both hosts: arrays put on host a arrive
    right on host b, their acquires and their bytes over the agents' wire under TLS with
    Ray's own certificates; a peer that holds the cluster's secret but speaks plain TCP is
    closed at TLS and counted."""
    env = tls_testbed.driver_env(tls_testbed.hosts[1])
    assert env["RAY_USE_TLS"] == "1" and env["RAY_AUTH_MODE"] == "token"
    result = run_scenario(tls_testbed, "tls")
    assert all(c["ok"] for c in result["checked"]), result["checked"]
    assert result["consumer_paths"] == {"wire/ok": 2}
    assert result["owner_bulk_bytes_sent"] >= sum(c["nbytes"] for c in result["checked"])
    assert result["wire_tls"] == [True, True]
    assert result["wire_calls"] >= 2, "the acquires went over the wire"
    assert result["plain_tcp"] == "closed"
    assert result["auth_failures"] == {"tls": 1}
    assert result["owner_live_slots"] == 0
