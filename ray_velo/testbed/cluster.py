"""A real Ray cluster across emulated hosts: ``ray start`` in each network namespace, UCX over TCP
on their links, everything ended by pid (docs/benchmarks.md, "The testbed")."""

from __future__ import annotations

import json
import os
import re
import shutil
import string
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Final

from ray_velo.testbed.errors import TestbedError
from ray_velo.testbed.netns import (
    IFACE,
    Network,
    parse_rate,
    process_running,
    remove_stale_networks,
)
from ray_velo.testbed.security import (
    AuthMode,
    auth_env,
    make_tls_files,
    new_token,
    tls_env,
    without_inherited,
)

__all__ = [
    "ENV_VAR",
    "GCS_PORT",
    "Host",
    "Testbed",
    "TestbedInfo",
    "check_ray_start",
    "connect",
    "logged_worker_pids",
    "remove_segments_of",
]

GCS_PORT: Final = 6379
ENV_VAR: Final = "RAY_VELO_TESTBED"
"""What a driver inside the testbed reads to connect (JSON of :class:`TestbedInfo`)."""
_HOST_RESOURCE_UNITS: Final = 1000
#: The environment of every Ray process in the testbed: UCX over TCP on the hosts' link, no
#: usage reporting. Ray's auth mode (one for nodes and drivers, research/two-host.md) and TLS
#: come from the testbed's ``auth`` and ``tls`` (:mod:`ray_velo.testbed.security`).
BASE_ENV: Final = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "UCX_TLS": "tcp",
    "UCX_NET_DEVICES": IFACE,
}


@dataclass(frozen=True, slots=True)
class Host:
    """One emulated host of a running testbed.

    ``resource`` is the custom resource its Ray node has (``host_a``...): ask for a small
    amount of it (``resources={"host_b": 0.01}``) to place a task or actor there.
    """

    index: int
    name: str
    netns: str
    address: str
    resource: str


@dataclass(frozen=True, slots=True)
class TestbedInfo:
    """What a driver needs to join: the head's address, its own host, every host."""

    __test__ = False  # not a pytest test class

    address: str
    node_ip: str
    hosts: tuple[Host, ...]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> TestbedInfo:
        data = json.loads(text)
        return cls(data["address"], data["node_ip"], tuple(Host(**h) for h in data["hosts"]))


class Testbed:
    """Emulated hosts with a Ray node on each.

    Args:
        hosts: number of hosts (>= 2; names a, b, c...).
        link: link rate (``"10gbit"``, ``"25gbit"``, ``"none"`` or None for unshaped).
        num_cpus: logical CPUs each Ray node advertises.
        object_store_bytes: each node's object store (None: Ray's default).
        env: extra environment for every Ray node (e.g. ``UCX_*`` settings).
        host_env: extra environment per host index, over ``env`` (e.g. a wrong
            ``UCX_NET_DEVICES`` on one host).
        system_config: Ray ``--system-config`` of the head.
        mtu: the links' MTU.
        start_ray: start the Ray nodes (False: the network alone, for link probes).
        auth: Ray's auth mode for every node and driver: ``"token"`` (Ray's coming default;
            a fresh token per testbed, :attr:`auth_token`) or ``"disabled"`` to compare.
        tls: run Ray with ``RAY_USE_TLS=1``, each host with a certificate of a throwaway CA
            made for this testbed.

    Raises (from :meth:`start`):
        TestbedUnavailable: no root, or namespaces cannot be made.
        TestbedError: a Ray node did not start.
    """

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        hosts: int = 2,
        link: str | None = "10gbit",
        *,
        num_cpus: int = 4,
        object_store_bytes: int | None = None,
        env: Mapping[str, str] | None = None,
        host_env: Mapping[int, Mapping[str, str]] | None = None,
        system_config: Mapping[str, Any] | None = None,
        mtu: int = 9000,
        start_ray: bool = True,
        auth: AuthMode = "token",
        tls: bool = False,
    ) -> None:
        if hosts > len(string.ascii_lowercase):
            raise ValueError(f"at most {len(string.ascii_lowercase)} hosts, got {hosts}")
        self.link = link or "none"
        self.network = Network(hosts, parse_rate(link), mtu=mtu)
        self.num_cpus = num_cpus
        self.object_store_bytes = object_store_bytes
        self.env = dict(env or {})
        self.host_env = {i: dict(e) for i, e in (host_env or {}).items()}
        self.system_config = dict(system_config or {})
        self.temp_dir = os.path.join("/tmp", self.network.tag)
        names = string.ascii_lowercase
        self.hosts = tuple(
            Host(h.index, names[h.index], h.netns, h.address, f"host_{names[h.index]}")
            for h in self.network.hosts
        )
        self.address = f"{self.hosts[0].address}:{GCS_PORT}"
        self.start_ray = start_ray
        self.auth: AuthMode = auth
        self.auth_token = new_token() if auth == "token" else None
        self._auth_env = auth_env(auth, self.auth_token)
        self.tls = tls
        self._tls_env: dict[int, dict[str, str]] = {}
        self._started = False

    # --- lifetime ----------------------------------------------------------------------

    def start(self, timeout_s: float = 120.0) -> Testbed:
        """Build the network and start a Ray node on every host. On failure, undo it all."""
        remove_stale_networks()
        self.network.build()
        self._started = True
        try:
            if self.tls:
                files = make_tls_files(
                    os.path.join(self.temp_dir, "tls"), [h.address for h in self.hosts]
                )
                self._tls_env = {
                    h.index: tls_env(f) for h, f in zip(self.hosts, files, strict=True)
                }
            deadline = time.monotonic() + timeout_s
            for host in self.hosts if self.start_ray else ():
                self._ray_start(host, deadline)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """End every process on the hosts (by pid), remove their shm segments, the
        namespaces and the temp dir. Idempotent."""
        if not self._started:
            return
        self._started = False
        ended = self.network.destroy()
        # A worker that died before now (an agent Ray killed with its job, one the memory
        # monitor killed) is no longer in a namespace to be listed: its Ray log names it.
        gone = [p for p in logged_worker_pids(self.temp_dir) if not process_running(p)]
        remove_segments_of([*ended, *gone])
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> Testbed:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- Ray ---------------------------------------------------------------------------

    def node_env(self, host: Host) -> dict[str, str]:
        """The environment of ``host``'s Ray node (and so of its workers and agent)."""
        env = without_inherited(os.environ)
        env.update(BASE_ENV)
        env.update(self._auth_env)
        env.update(self._tls_env.get(host.index, {}))
        env.update(self.env)
        env.update(self.host_env.get(host.index, {}))
        return env

    def _ray_start(self, host: Host, deadline: float) -> None:
        argv = [
            sys.executable,
            "-m",
            "ray.scripts.scripts",
            "start",
            f"--node-ip-address={host.address}",
            f"--num-cpus={self.num_cpus}",
            f"--resources={json.dumps({host.resource: _HOST_RESOURCE_UNITS})}",
            f"--temp-dir={self.temp_dir}",
            "--disable-usage-stats",
        ]
        if self.object_store_bytes is not None:
            argv.append(f"--object-store-memory={self.object_store_bytes}")
        if host.index == 0:
            argv += ["--head", f"--port={GCS_PORT}", "--include-dashboard=false"]
            if self.system_config:
                argv.append(f"--system-config={json.dumps(self.system_config)}")
        else:
            argv.append(f"--address={self.address}")
        left = max(1.0, deadline - time.monotonic())
        try:
            done = subprocess.run(
                self.command(host, argv),
                env=self.node_env(host),
                capture_output=True,
                text=True,
                timeout=left,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise TestbedError(step=f"ray start on host {host.name}", detail="timed out") from exc
        check_ray_start(done, f"ray start on host {host.name}")

    # --- drivers -----------------------------------------------------------------------

    def set_link(self, link: str | None) -> None:
        """Shape every link to ``link`` (``"10gbit"``, ``"none"``...) from now on; the Ray
        nodes stay up."""
        self.network.reshape(parse_rate(link))
        self.link = link or "none"

    def info(self, host: Host) -> TestbedInfo:
        return TestbedInfo(self.address, host.address, self.hosts)

    def command(self, host: Host, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", host.netns, *argv]

    def driver_env(self, host: Host, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = self.node_env(host)
        env[ENV_VAR] = self.info(host).to_json()
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.update(extra or {})
        return env

    def run(
        self,
        argv: Sequence[str],
        *,
        host: int = 0,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 600.0,
        cwd: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a driver (``argv``, e.g. ``[sys.executable, "-m", "mod"]``) on ``host``;
        its output is captured. A driver still running at ``timeout_s`` is ended (its
        whole namespace is ended at :meth:`close` anyway). ``cwd``: its working directory
        (Ray puts a driver's on its workers' import path).

        Raises:
            TestbedError: the driver timed out.
        """
        target = self.hosts[host]
        try:
            return subprocess.run(
                self.command(target, argv),
                env=self.driver_env(target, env),
                capture_output=True,
                text=True,
                timeout=timeout_s,
                cwd=cwd,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise TestbedError(
                step=f"driver {' '.join(argv)}", detail=f"still running after {timeout_s} s"
            ) from exc

    def popen(
        self,
        argv: Sequence[str],
        *,
        host: int = 0,
        env: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> subprocess.Popen[str]:
        """Start ``argv`` on ``host`` without waiting (its pipes as ``kwargs`` say)."""
        target = self.hosts[host]
        return subprocess.Popen(
            self.command(target, argv), env=self.driver_env(target, env), text=True, **kwargs
        )


def check_ray_start(done: subprocess.CompletedProcess[str], step: str) -> None:
    """Raise :class:`TestbedError` for a ``ray start`` that failed (the last lines it said)."""
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise TestbedError(step=step, detail=f"exit {done.returncode}: " + " | ".join(tail))


def connect(timeout_s: float = 60.0, **ray_init_kwargs: Any) -> TestbedInfo:
    """Join the testbed from a driver that :meth:`Testbed.run` started; waits until every
    host's node is alive.

    Raises:
        TestbedError: not inside a testbed, or the nodes did not all come up in time.
    """
    import ray

    text = os.environ.get(ENV_VAR)
    if not text:
        raise TestbedError(step="connect", detail=f"{ENV_VAR} is not set: not a testbed driver")
    info = TestbedInfo.from_json(text)
    ray_init_kwargs.setdefault("log_to_driver", False)
    from ray_velo.api import runtime_env

    ray_init_kwargs["runtime_env"] = runtime_env(ray_init_kwargs.get("runtime_env"))
    ray.init(address=info.address, _node_ip_address=info.node_ip, **ray_init_kwargs)
    deadline = time.monotonic() + timeout_s
    while True:
        nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
        alive = {n["NodeManagerAddress"] for n in nodes if n.get("Alive")}
        if alive >= {h.address for h in info.hosts}:
            return info
        if time.monotonic() > deadline:
            raise TestbedError(
                step="connect", detail=f"nodes alive {sorted(alive)} after {timeout_s} s"
            )
        time.sleep(0.1)


#: Ray's per-worker log files, named for the worker's pid (python-core-worker-<id>_<pid>.log,
#: worker-<id>-<job>-<pid>.out/.err).
_WORKER_LOG = re.compile(r"^(?:python-core-worker-[0-9a-f]+_|worker-[0-9a-f]+-[0-9a-f]+-)(\d+)\.")


def logged_worker_pids(temp_dir: str) -> list[int]:
    """The pids of every Ray worker that ran under ``temp_dir`` (from its log file names)."""
    pids: set[int] = set()
    for logs, _, names in os.walk(temp_dir):
        if os.path.basename(logs) != "logs":
            continue
        for name in names:
            match = _WORKER_LOG.match(name)
            if match:
                pids.add(int(match.group(1)))
    return sorted(pids)


def remove_segments_of(pids: Sequence[int], directory: str = "/dev/shm") -> list[str]:
    """Remove the ray_velo segments and agent sockets that the (now ended) processes
    ``pids`` created."""
    from ray_velo.memory.arena import SEGMENT_PREFIX

    prefixes = tuple(f"{SEGMENT_PREFIX}{pid}-" for pid in pids)
    prefixes += tuple(f"ray_velo_agent-{pid}-" for pid in pids)  # the agents' Unix sockets
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if prefixes and name.startswith(prefixes):
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                continue
            removed.append(name)
    return removed
