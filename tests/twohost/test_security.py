"""Trusted by default, across two emulated hosts running Ray's coming default (token auth on,
a fresh token per testbed): nothing of ray_velo answers a process that Ray did not admit."""

from __future__ import annotations

import statistics

import pytest

from ray_velo.protocol.frames import WIRE_METHODS
from ray_velo.testbed import Testbed
from tests.twohost.conftest import run_scenario

pytestmark = [pytest.mark.twohost, pytest.mark.slow]


def test_the_testbed_runs_rays_token_auth(testbed: Testbed) -> None:
    """Every node and driver the testbed starts gets one fresh 64-hex-digit token."""
    assert testbed.auth == "token"
    token = testbed.auth_token
    assert token is not None and len(token) == 64 and int(token, 16) >= 0
    env = testbed.driver_env(testbed.hosts[0])
    assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN"] == token


def test_an_outsider_without_the_token_gets_nothing(testbed: Testbed) -> None:
    """A process on host a without Ray's token (no RAY_AUTH_TOKEN, no ~/.ray/auth_token)
    sends every wire method with a real handle of host b's agent, before any handshake,
    after a handshake with a secret of its own, and after replaying a real agent's recorded
    handshake; holds a handshake half open; connects to b's Unix socket as uid nobody;
    tries Ray itself; and scans every TCP port b's agent process listens on (found in
    /proc), asking each for the payload's bytes before and after a handshake of its own.
    Each is refused or closed, with no answer: no port gives a byte of the payload, ours
    close unanswered, and the agent runs no UCX worker (UCX's TCP transport, which would
    serve any address of the process to anyone, is closed by default). The handle keeps its
    reference; the legitimate consumer then fetches the right bytes; b counted the
    failures."""
    result = run_scenario(testbed, "outsider")
    seen = result["outsider"]
    assert seen["token_in_env"] is False
    assert seen["before"] == dict.fromkeys(WIRE_METHODS, "closed"), seen["before"]
    assert seen["wrong_secret"] == "closed"
    assert seen["replayed"] == "closed"
    assert seen["half_open"]["outcome"] == "closed"
    assert seen["half_open"]["closed_after_s"] < 4.0  # the 2 s bound, on a loaded machine
    assert seen["unix_socket_as_nobody"] == "denied"
    assert seen["ray"].startswith("refused"), seen["ray"]
    assert seen["ucx"] == "none"
    ports = seen["ports"]
    ours = [p for p in ports if p.rpartition(":")[2] in result["ours"]]
    assert len(ours) == 2, (ports, result["ours"])  # the scan found the wire and bulk ports
    for port, outcome in ports.items():
        if outcome == "loopback only":
            continue
        assert not any(o["payload"] for o in outcome.values()), (port, outcome)
        if port in ours:
            assert all(o["bytes"] <= 68 for o in outcome.values()), (port, outcome)
    assert result["refcount_after_outsider"] == 1, "an outsider's release must not count"
    assert result["fetched_ok"]
    failures = result["auth_failures"]
    # 10 frames not a hello (malformed, or silent when shorter than one), two bad proofs,
    # one half-open handshake; on the two ports of ours the scan found, two connections
    # that said nothing, two reads not a hello, two bad proofs
    assert failures.get("bad_proof") == 2 + 2, failures
    assert failures.get("malformed", 0) + failures.get("silent", 0) == len(WIRE_METHODS) + 1 + 4
    assert result["owner_live_slots"] == 0


def test_a_flood_of_silent_connections_leaves_real_fetches_their_time(testbed: Testbed) -> None:
    """200 connections that never speak held open on host b's wire (re-opened as b drops
    them) while freshly started agents on host c fetch from b, each over a new wire
    connection: every fetch is right and takes its normal time (measured without the flood
    in the same run); b dropped and counted the silent ones."""
    result = run_scenario(testbed, "silent_flood")
    assert result["baseline"]["ok"] and result["flooded"]["ok"]
    normal = statistics.median(result["baseline"]["times_s"])
    flooded = result["flooded"]["times_s"]
    # a starved handshake would wait out the 2 s bound (or fail): none comes near it
    assert max(flooded) < 2.0, result
    assert statistics.median(flooded) < 2 * normal + 0.25, result
    failures = result["auth_failures"]
    assert failures.get("dropped", 0) + failures.get("silent", 0) >= 200, failures
    assert set(failures) <= {"dropped", "silent", "closed"}, (
        failures
    )  # closed: by the flood at its end
    assert result["owner_live_slots"] == 0
