"""The testbed's network on its own (no Ray): namespaces, shaped links, stale cleanup, and
the bench's answer when it cannot build one."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from ray_velo.testbed import Testbed, check_privileges, remove_stale_networks
from ray_velo.testbed.errors import TestbedUnavailable
from ray_velo.testbed.netns import (
    IFACE,
    Network,
    namespace_pids,
    namespaces,
    process_running,
)
from ray_velo.testbed.probes import raw_tcp

pytestmark = pytest.mark.twohost


@pytest.fixture(autouse=True)
def _root_only() -> None:
    try:
        check_privileges()
    except TestbedUnavailable as exc:
        pytest.skip(f"SKIPPED (namespaces): {exc}")


def _qdisc(netns: str) -> str:
    done = subprocess.run(
        ["tc", "-n", netns, "qdisc", "show", "dev", IFACE], capture_output=True, text=True
    )
    return done.stdout


def test_two_hosts_on_a_shaped_link() -> None:
    """Two hosts joined by a veth pair shaped to 10 Gbit/s at both ends: a TCP socket crosses
    it, and afterwards no namespace is left."""
    with Testbed(hosts=2, link="10gbit", start_ray=False) as bed:
        for host in bed.hosts:
            assert "tbf" in _qdisc(host.netns) and "10Gbit" in _qdisc(host.netns)
        seconds = raw_tcp(bed, 4 << 20, reps=1)
        assert seconds > 0
        made = bed.network.made
    assert not set(made) & set(namespaces())


def test_a_link_is_reshaped_in_place() -> None:
    """One testbed measures two links (the speed guard): reshaping takes the shaping off both
    ends, puts another rate on, and the hosts stay as they were."""
    with Testbed(hosts=2, link="10gbit", start_ray=False) as bed:
        made = bed.network.made
        bed.set_link("none")
        assert bed.link == "none"
        assert all("tbf" not in _qdisc(host.netns) for host in bed.hosts)
        bed.set_link("25gbit")
        assert all("25Gbit" in _qdisc(host.netns) for host in bed.hosts)
        assert bed.network.made == made
        assert raw_tcp(bed, 1 << 20, reps=1) > 0


def test_three_hosts_on_a_switch() -> None:
    """Three hosts on a bridge in a switch namespace: host a reaches host c."""
    with Testbed(hosts=3, link=None, start_ray=False) as bed:
        assert bed.network.switch is not None
        assert "tbf" not in _qdisc(bed.hosts[0].netns)
        assert raw_tcp(bed, 1 << 20, reps=1, src=0, dst=2) > 0


def test_a_killed_run_leaves_nothing_for_long() -> None:
    """A run that was killed left its namespaces and a process inside them; the next testbed
    start (remove_stale_networks) ends that process and deletes the namespaces, and touches
    no live run's namespaces."""
    creator = subprocess.Popen([sys.executable, "-c", "pass"])
    creator.wait()  # a pid that is no longer running: the "killed run"
    stale = f"rvtb-{creator.pid}-0-h0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    sleeper = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "600"])
    live = Network(2, None)
    live.build()
    try:
        deadline = time.monotonic() + 10  # `ip netns exec` enters, then execs sleep
        while sleeper.pid not in namespace_pids(stale):
            assert time.monotonic() < deadline, "the stale namespace's process never started"
            time.sleep(0.02)
        removed = remove_stale_networks()
        assert stale in removed
        assert stale not in namespaces()
        sleeper.wait(10)
        assert not process_running(sleeper.pid)
        assert set(live.made) <= set(namespaces()), "a live run's namespaces were removed"
    finally:
        live.destroy()
        subprocess.run(["ip", "netns", "delete", stale], capture_output=True)


# The interpreter lives under /root here, which an ordinary user cannot read: the child
# imports what the command needs, then drops to uid/gid 65534 (nobody) and runs it.
_AS_NOBODY = """
import sys
# what the command imports lazily, imported while this process can still read the checkout
import ray_velo.bench.command, ray_velo.bench.record, ray_velo.bench.twohost
import ray_velo.cli, ray_velo.errors, ray_velo.testbed
import os
os.setgid(65534)
os.setuid(65534)
sys.exit(ray_velo.cli.main(["bench", "--two-host", "--link", "10gbit"]))
"""


def test_bench_without_root_exits_2_with_the_reason() -> None:
    """`ray-velo bench --two-host` as an ordinary user: exit status 2 and a message that
    says it needs root."""
    done = subprocess.run(
        [sys.executable, "-c", _AS_NOBODY], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "root" in done.stderr and "CAP_NET_ADMIN" in done.stderr
    assert not done.stdout
