"""ray_velo across two emulated hosts: UCX over TCP on a veth link, as on Ethernet clusters."""

from __future__ import annotations

import os
import sys

import pytest

from ray_velo.testbed import Testbed
from tests.twohost.conftest import run_scenario

pytestmark = [pytest.mark.twohost, pytest.mark.slow]


def test_put_fetch_crosses_the_link_over_tcp(testbed: Testbed) -> None:
    """A producer on host a stages arrays (300 KiB to 96 MiB) and bytes; a consumer on host b
    fetches each with one UCX GET over TCP on the hosts' link; every byte arrives right and
    the owner keeps nothing afterwards."""
    result = run_scenario(testbed, "put_fetch")
    assert all(c["ok"] for c in result["checked"]), result["checked"]
    assert [c["type"] for c in result["checked"]] == ["ndarray"] * 3 + ["bytes"]
    assert result["consumer_paths"] == {"rdma/ok": 4}
    assert result["owner_paths"] == {"rdma/ok": 4}
    lanes = {lane for node in result["transports"].values() for lane in node}
    assert lanes == {"tcp/veth0"}, "the bytes must have crossed the link over TCP"
    assert result["owner_live_slots"] == 0


def test_decorated_pipeline_across_hosts(testbed: Testbed) -> None:
    """@rv.transfer: an actor on host a returns a 32 MiB array to a task on host b, and the
    driver sends a task on b a dict of two arrays; the bodies see the right bytes, and each
    call's payloads crossed by one UCX GET (the dict's two arrays packed in one slot)."""
    result = run_scenario(testbed, "pipeline")
    assert result["from_actor_ok"] and result["dict_ok"]
    assert result["consumer_paths"] == {"rdma/ok": 2}


def test_kill_switch_sends_everything_by_chunks(testbed: Testbed) -> None:
    """Both agents restarted with VELO_RDMA_RENDEZVOUS_DISABLE=1: payloads are staged in
    plain memory and pulled in chunks; the path counters say why on both sides."""
    result = run_scenario(testbed, "kill_switch")
    assert all(c["ok"] for c in result["checked"]), result["checked"]
    assert result["consumer_paths"] == {"chunked/kill_switch": 2}
    # the owner counts its switch at staging; the consumer's switch means no offer
    assert result["owner_paths"] == {"chunked/kill_switch": 2, "chunked/no_offer": 2}
    assert result["owner_live_slots"] == 0


def test_consumer_that_cannot_reach_the_owner_falls_back_once(testbed: Testbed) -> None:
    """Host b's UCX is limited to `lo` (a wrong UCX_NET_DEVICES): its GET to host a fails,
    the fetch detaches, acquires again with no offer and pulls chunks, exactly once; the
    bytes are right and the reason is counted."""
    result = run_scenario(testbed, "unreachable")
    assert all(c["ok"] for c in result["checked"]), result["checked"]
    assert result["consumer_paths"] == {"chunked/get_failed": 1}
    assert result["owner_paths"] == {"rdma/ok": 1, "chunked/no_offer": 1}
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
    """Host a's payload for hosts b and c: host c reads host b's copy over the link (TCP)
    while host b still fills it, the bytes right on both; once both consumed it, neither
    copy is left and the owner forgot them."""
    result = run_scenario(testbed, "broadcast")
    assert result["ok"]
    assert result["c_relayed"] == 1, "host c's bytes must come from host b's copy"
    lanes = {lane for node in result["transports"].values() for lane in node}
    assert lanes == {"tcp/veth0"}
    assert result["owner_copy_sources"] == 0
