"""ray_velo across two emulated hosts on a veth link, as on Ethernet clusters: by default the
owner sends the bytes over the agents' authenticated wire (UCX is closed: its TCP transport
authenticates no one); with the operator's opt-in, UCX over TCP GETs them."""

from __future__ import annotations

import os
import sys

import pytest

from ray_velo.testbed import Testbed
from tests.twohost.conftest import run_scenario

pytestmark = [pytest.mark.twohost, pytest.mark.slow]


def test_put_fetch_crosses_the_link_over_the_wire(testbed: Testbed) -> None:
    """A producer on host a stages arrays (300 KiB to 96 MiB) and bytes; a consumer on host b
    fetches each, host a sending it over its bulk port (no UCX runs: the testbed's
    UCX_TLS=tcp names only what an agent leaves out); every byte arrives right and the owner
    keeps nothing afterwards."""
    result = run_scenario(testbed, "put_fetch")
    assert all(c["ok"] for c in result["checked"]), result["checked"]
    assert [c["type"] for c in result["checked"]] == ["ndarray"] * 3 + ["bytes"]
    assert result["consumer_paths"] == {"wire/ok": 4}
    assert result["owner_paths"] == {"wire/ok": 4}
    assert result["consumer_ucx"] is False and result["transports"] == {}
    sent = sum(c["nbytes"] for c in result["checked"])
    assert result["owner_bulk_bytes_sent"] >= sent
    assert result["owner_live_slots"] == 0


def test_with_the_opt_in_ucx_over_tcp_gets_the_bytes_and_a_failed_get_falls_back_once(
    testbed: Testbed,
) -> None:
    """Both agents restarted with VELO_UCX_TCP=1 (a network the operator trusts): one UCX
    GET over TCP on the hosts' link per payload, as before the wire carried them. Then host
    b's UCX is limited to `lo` (a wrong UCX_NET_DEVICES): its endpoint to host a comes up
    (UCX wires up lazily) but its GET fails; the fetch detaches, acquires again with no offer
    and pulls chunks, exactly once; the bytes are right and the reason is counted."""
    result = run_scenario(testbed, "ucx_tcp")
    opted, lo_only = result["opt_in"], result["lo_only"]
    assert all(c["ok"] for c in opted["checked"]), opted["checked"]
    assert opted["consumer_paths"] == {"rdma/ok": 2}
    lanes = {lane for node in opted["transports"].values() for lane in node}
    assert lanes == {"tcp/veth0"}, "the bytes must have crossed the link over TCP"
    assert all(c["ok"] for c in lo_only["checked"]), lo_only["checked"]
    assert lo_only["consumer_paths"] == {"chunked/get_failed": 1}
    assert lo_only["owner_paths"] == {"rdma/ok": 1, "chunked/no_offer": 1}
    assert lo_only["owner_live_slots"] == 0


def test_decorated_pipeline_across_hosts(testbed: Testbed) -> None:
    """@rv.transfer: an actor on host a returns a 32 MiB array to a task on host b, and the
    driver sends a task on b a dict of two arrays; the bodies see the right bytes, and each
    call's payloads crossed in one transfer (the dict's two arrays packed in one slot)."""
    result = run_scenario(testbed, "pipeline")
    assert result["from_actor_ok"] and result["dict_ok"]
    assert result["consumer_paths"] == {"wire/ok": 2}


def test_kill_switch_turns_the_gets_off_not_the_wire(testbed: Testbed) -> None:
    """Both agents restarted with VELO_RDMA_RENDEZVOUS_DISABLE=1 (and UCX allowed over TCP):
    payloads are staged in plain memory (the owner counts its switch at staging) and no
    GET runs; the wire, which the switch does not cover, carries them."""
    result = run_scenario(testbed, "kill_switch")
    assert all(c["ok"] for c in result["checked"]), result["checked"]
    assert result["consumer_paths"] == {"wire/ok": 2}
    assert result["owner_paths"] == {"chunked/kill_switch": 2, "wire/ok": 2}
    assert result["owner_live_slots"] == 0


def test_a_sender_that_stalls_mid_range_ends_in_the_readers_bound_and_one_fallback(
    testbed: Testbed,
) -> None:
    """Host a's send stops after its first piece for longer than host b waits for a byte
    (2 s): host b's read fails, its fetch detaches and pulls chunks, once; the bytes are
    right, the stalled send ends, nothing is left."""
    result = run_scenario(testbed, "stalled_sender")
    assert all(c["ok"] for c in result["checked"]), result["checked"]
    assert result["consumer_paths"] == {"chunked/get_failed": 1}
    assert result["owner_paths"] == {"wire/ok": 1, "chunked/no_offer": 1}
    assert result["seconds"] < 6.0
    assert result["owner_live_slots"] == 0


def test_the_quickstart_runs_on_the_ray_start_cluster(testbed: Testbed) -> None:
    """examples/quickstart.py (the README's example) run as a user runs it on a cluster
    started with ``ray start`` on two hosts: it joins through RAY_ADDRESS, its sum is exact,
    and it ends cleanly (the testbed then checks that nothing it started is left)."""
    import numpy as np

    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "quickstart.py")
    done = testbed.run(
        [sys.executable, os.path.abspath(example)],
        env={"RAY_ADDRESS": testbed.address},
        timeout_s=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    expected = float(np.random.default_rng(0).standard_normal(32 << 20).sum())
    assert float(done.stdout.strip().splitlines()[-1]) == pytest.approx(expected, rel=1e-12)


def test_a_broadcast_to_two_hosts_reads_the_first_copy_as_it_fills(testbed: Testbed) -> None:
    """Host a's payload for hosts b and c: host c reads host b's copy over the wire (host b
    sends it) while host b still fills it, the bytes right on both; once both consumed it,
    neither copy is left and the owner forgot them."""
    result = run_scenario(testbed, "broadcast")
    assert result["ok"]
    assert result["c_relayed"] == 1, "host c's bytes must come from host b's copy"
    assert result["b_bulk_bytes_sent"] >= 64 * 2**20 - 16 * 2**20  # at least what c lagged
    assert result["owner_copy_sources"] == 0
