"""Two ``ray start`` nodes on this host, for where network namespaces cannot be made: a cluster
test without root, not a cross-host one (UCX uses shared memory or CMA)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence

from ray_velo.testbed.cluster import check_ray_start, remove_segments_of
from ray_velo.testbed.errors import TestbedError
from ray_velo.testbed.netns import end_processes
from ray_velo.testbed.security import AuthMode, auth_env, new_token, without_inherited

__all__ = ["OneHostCluster"]

_BASE_ENV = {"RAY_USAGE_STATS_ENABLED": "0"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class OneHostCluster:
    """A head and ``workers`` worker nodes started with ``ray start`` on this host.

    Each node has a custom resource naming it (``host_a``, ``host_b``, ...). Use as a
    context manager; :meth:`run` starts a driver with ``RAY_ADDRESS`` set.
    """

    def __init__(
        self,
        workers: int = 1,
        num_cpus: int = 2,
        object_store_bytes: int = 1 << 29,
        auth: AuthMode = "token",
    ) -> None:
        """``auth``: Ray's auth mode for every node and driver (``"token"``: Ray's coming
        default, with a fresh token; ``"disabled"`` to compare)."""
        self.workers, self.num_cpus, self.object_store_bytes = workers, num_cpus, object_store_bytes
        self.auth_token = new_token() if auth == "token" else None
        self._auth_env = auth_env(auth, self.auth_token)
        self.temp_dir = tempfile.mkdtemp(prefix="rvray-")
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._started = False

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = without_inherited(os.environ)
        env.update(_BASE_ENV)
        env.update(self._auth_env)
        env.update(extra or {})
        return env

    def _node_argv(self, index: int) -> list[str]:
        resource = {f"host_{chr(ord('a') + index)}": 1000}
        argv = [
            sys.executable, "-m", "ray.scripts.scripts", "start",
            "--node-ip-address=127.0.0.1", f"--num-cpus={self.num_cpus}",
            f"--resources={json.dumps(resource)}", f"--temp-dir={self.temp_dir}",
            f"--object-store-memory={self.object_store_bytes}", "--disable-usage-stats",
            # ports of its own: two nodes share this host's port space
            f"--node-manager-port={_free_port()}", f"--object-manager-port={_free_port()}",
            f"--metrics-export-port={_free_port()}", f"--runtime-env-agent-port={_free_port()}",
            f"--dashboard-agent-listen-port={_free_port()}",
            f"--dashboard-agent-grpc-port={_free_port()}",
        ]  # fmt: skip
        if index == 0:
            return [
                *argv, "--head", f"--port={self.port}", "--include-dashboard=false",
                f"--ray-client-server-port={_free_port()}",
            ]  # fmt: skip
        return [*argv, f"--address={self.address}"]

    def start(self, timeout_s: float = 120.0) -> OneHostCluster:
        """Start every node; on failure, end what started."""
        self._started = True
        deadline = time.monotonic() + timeout_s
        try:
            for index in range(1 + self.workers):
                done = subprocess.run(
                    self._node_argv(index), env=self.env(), capture_output=True, text=True,
                    timeout=max(1.0, deadline - time.monotonic()), check=False,
                )  # fmt: skip
                check_ray_start(done, f"ray start (node {index})")
        except BaseException:
            self.close()
            raise
        return self

    def pids(self) -> list[int]:
        """Every process whose command line names this cluster's temp directory."""
        marker = self.temp_dir.encode()
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker in f.read():
                        pids.append(int(entry))
            except OSError:  # gone meanwhile, or not ours to read
                continue
        return pids

    def run(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout_s: float = 600
    ) -> subprocess.CompletedProcess[str]:
        """Run a driver that joins the cluster (``RAY_ADDRESS`` is set); output captured."""
        try:
            return subprocess.run(
                list(argv), env=self.env({"RAY_ADDRESS": self.address, **(env or {})}),
                capture_output=True, text=True, timeout=timeout_s, check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            raise TestbedError(step="driver", detail=f"timed out after {timeout_s} s") from exc

    def close(self) -> list[int]:
        """End every process of the cluster by pid, their segments, the temp dir; returns
        the pids ended. Idempotent."""
        if not self._started:
            return []
        self._started = False
        ended = end_processes(self.pids())
        remove_segments_of(ended)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return ended

    def __enter__(self) -> OneHostCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
