"""Network namespaces joined by shaped veth links: the "hosts" of an emulated cluster
(docs/benchmarks.md, "The testbed")."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from ray_velo.testbed.errors import TestbedError, TestbedUnavailable

__all__ = [
    "IFACE",
    "LINK_RATES",
    "HostNet",
    "Network",
    "check_privileges",
    "end_processes",
    "namespace_pids",
    "parse_rate",
    "process_running",
    "remove_stale_networks",
]

NS_PREFIX: Final = "rvtb"
IFACE: Final = "veth0"
"""Every host's interface has this name, so one ``UCX_NET_DEVICES`` serves every host."""
SUBNET: Final = "10.213.0"
LINK_RATES: Final = {"10gbit": 10e9, "25gbit": 25e9, "none": None}
"""The rates the bench names; :func:`parse_rate` takes any ``<n>gbit`` / ``<n>mbit``."""

_NS_RE: Final = re.compile(rf"^{NS_PREFIX}-(\d+)-(\d+)-(h\d+|sw)$")
_sequence = itertools.count()
_COMMAND_TIMEOUT_S: Final = 30.0


def parse_rate(rate: str | None) -> float | None:
    """Bits per second of a link rate like ``"10gbit"``; None (or ``"none"``): unshaped.

    Raises:
        ValueError: not of the form ``<number>gbit`` or ``<number>mbit``.
    """
    if rate is None or rate == "none":
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(gbit|mbit)", rate)
    if match is None:
        raise ValueError(f"link rate {rate!r}: use e.g. 10gbit, 25gbit, 500mbit or none")
    return float(match.group(1)) * (1e9 if match.group(2) == "gbit" else 1e6)


def _run(argv: Sequence[str], step: str, *, check: bool = True) -> str:
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TestbedError(step=step, detail=f"{' '.join(argv)}: {exc}") from exc
    if check and done.returncode != 0:
        raise TestbedError(
            step=step, detail=f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}"
        )
    return done.stdout


def check_privileges() -> None:
    """Raise :class:`TestbedUnavailable` unless this process can make network namespaces.

    It tries: root, ``ip`` and ``tc`` on the PATH, then one namespace made and deleted.
    """
    if os.geteuid() != 0:
        raise TestbedUnavailable(reason=f"this process runs as uid {os.geteuid()}, not root")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise TestbedUnavailable(reason=f"`{tool}` is not on the PATH")
    probe = f"{NS_PREFIX}-{os.getpid()}-probe"
    try:
        _run(["ip", "netns", "add", probe], "probe")
    except TestbedError as exc:
        raise TestbedUnavailable(reason=f"`ip netns add` failed: {exc.fields['detail']}") from exc
    _run(["ip", "netns", "delete", probe], "probe", check=False)


def namespaces() -> list[str]:
    """Every testbed namespace on this machine (any run's)."""
    out = _run(["ip", "netns", "list"], "list namespaces", check=False)
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if _NS_RE.match(n)]


def namespace_pids(netns: str) -> list[int]:
    """The processes inside ``netns`` (``ip netns pids``)."""
    out = _run(["ip", "netns", "pids", netns], f"list processes of {netns}", check=False)
    return [int(p) for p in out.split() if p.isdigit()]


def process_running(pid: int) -> bool:
    """Whether ``pid`` runs (an exited process not yet reaped by its parent does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


#: How long processes get to exit on SIGTERM before SIGKILL. Ray's gcs_server and autoscaler
#: monitor never exit on it and its raylets only after 10 s; everything else is gone within a
#: second, and what they leave (segments, session files) is removed by pid after.
TERM_GRACE_S = 2.0


def end_processes(pids: Iterable[int], grace_s: float = TERM_GRACE_S) -> list[int]:
    """SIGTERM ``pids``, wait up to ``grace_s``, SIGKILL what is left; wait until all are gone.

    Returns the pids that were still running at the start.
    """
    pids = [p for p in set(pids) if p != os.getpid() and process_running(p)]
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while any(process_running(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not any(process_running(p) for p in pids):
            break
    return pids


@dataclass(frozen=True, slots=True)
class HostNet:
    """One emulated host: its namespace and address on the link."""

    index: int
    netns: str
    address: str


class Network:
    """The namespaces and links of one testbed.

    Args:
        hosts: how many hosts (>= 2).
        rate_bps: each link's rate in bits per second; None leaves links unshaped.
        mtu: the links' MTU (9000: jumbo frames, as on a tuned cluster network).
    """

    def __init__(self, hosts: int, rate_bps: float | None, *, mtu: int = 9000) -> None:
        if hosts < 2:
            raise ValueError(f"a testbed needs at least 2 hosts, got {hosts}")
        self.rate_bps = rate_bps
        self.mtu = mtu
        self.tag = f"{NS_PREFIX}-{os.getpid()}-{next(_sequence)}"
        self.hosts = [HostNet(i, f"{self.tag}-h{i}", f"{SUBNET}.{i + 1}") for i in range(hosts)]
        self.switch = f"{self.tag}-sw" if hosts > 2 else None
        self._made: list[str] = []
        self._ends: list[tuple[str, str]] = []  # (namespace, device) of every link end

    @property
    def made(self) -> list[str]:
        """The namespaces this network created so far."""
        return list(self._made)

    def build(self) -> None:
        """Create the namespaces, links, addresses and shaping. On failure, undo it all.

        Raises:
            TestbedUnavailable: namespaces cannot be made here.
            TestbedError: a later step failed.
        """
        check_privileges()
        try:
            for netns in [h.netns for h in self.hosts] + ([self.switch] if self.switch else []):
                _run(["ip", "netns", "add", netns], "create a namespace")
                self._made.append(netns)
                _run(["ip", "-n", netns, "link", "set", "lo", "up"], "loopback up")
            if self.switch is None:
                a, b = self.hosts
                self._veth(a.netns, IFACE, b.netns, IFACE)
            else:
                _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"], "bridge")
                _run(["ip", "-n", self.switch, "link", "set", "br0", "up"], "bridge up")
                for host in self.hosts:
                    port = f"p{host.index}"
                    self._veth(host.netns, IFACE, self.switch, port)
                    _run(
                        ["ip", "-n", self.switch, "link", "set", port, "master", "br0"],
                        "bridge port",
                    )
            for host in self.hosts:
                _run(
                    ["ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", IFACE],
                    "address",
                )
        except BaseException:
            self.destroy()
            raise

    def _veth(self, ns_a: str, name_a: str, ns_b: str, name_b: str) -> None:
        _run(
            [
                *("ip", "link", "add", name_a, "netns", ns_a, "type", "veth"),
                *("peer", "name", name_b, "netns", ns_b),
            ],
            "veth pair",
        )
        for netns, name in ((ns_a, name_a), (ns_b, name_b)):
            self._ends.append((netns, name))
            _run(["ip", "-n", netns, "link", "set", name, "mtu", str(self.mtu)], "mtu")
            _run(["ip", "-n", netns, "link", "set", name, "up"], "link up")
            if self.rate_bps is not None:
                self._shape(netns, name)

    def _shape(self, netns: str, device: str) -> None:
        rate = self.rate_bps
        assert rate is not None
        # The bucket must hold at least one timer tick of traffic at the rate (~4 ms here).
        burst = max(8 << 20, int(rate / 8 / 250))
        _run(
            [
                *("tc", "-n", netns, "qdisc", "add", "dev", device, "root", "tbf"),
                *("rate", f"{int(rate)}bit", "burst", str(burst), "latency", "10ms"),
            ],
            "shape the link (tc tbf)",
        )

    def reshape(self, rate_bps: float | None) -> None:
        """Shape every link to ``rate_bps`` (None: unshaped) from now on; the hosts and
        their processes stay as they are."""
        for netns, device in self._ends:
            _run(["tc", "-n", netns, "qdisc", "del", "dev", device, "root"], "unshape", check=False)
        self.rate_bps = rate_bps
        if rate_bps is not None:
            for netns, device in self._ends:
                self._shape(netns, device)

    def pids(self) -> list[int]:
        """Every process inside this network's namespaces."""
        return [pid for netns in self._made for pid in namespace_pids(netns)]

    def destroy(self, grace_s: float = TERM_GRACE_S) -> list[int]:
        """End every process inside the namespaces (by pid), then delete them. Idempotent.

        Returns the pids it ended.
        """
        ended = end_processes(self.pids(), grace_s)
        for netns in reversed(self._made):
            _run(["ip", "netns", "delete", netns], f"delete {netns}", check=False)
        self._made.clear()
        return ended


def remove_stale_networks() -> list[str]:
    """Delete the namespaces of testbed runs whose creating process is gone, ending the
    processes left inside them. Returns the namespaces removed."""
    removed = []
    for netns in namespaces():
        match = _NS_RE.match(netns)
        assert match is not None
        if process_running(int(match.group(1))):
            continue
        end_processes(namespace_pids(netns))
        _run(["ip", "netns", "delete", netns], f"delete {netns}", check=False)
        removed.append(netns)
    return removed
