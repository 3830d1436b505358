"""Staged data follows its Ray job (issue 15), on the real two-node cluster: jobs here are
separate driver processes (tests/on_ray/jobdriver.py) that join the cluster, stage data in
their driver and in a task, read it on node b (which keeps a node-local copy), and end
without releasing anything: they exit, or are killed. Every process a test starts is ended
by its pid.

The bound tested: a job's data is gone from both nodes within BOUND_S of its driver being
gone: the agents' own bound (JOB_END_BOUND_S: one poll of Ray's job table, one look at its
longest), the liveness check that sees a killed reader (LIVENESS_INTERVAL_S), and Ray's own
part (RAY_NOTICE_S: the raylet marks the job dead and kills its workers and actors).
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import select
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray

import ray_velo as rv
from ray_velo.actors.agent import LIVENESS_INTERVAL_S
from ray_velo.actors.jobs import JOB_END_BOUND_S
from tests.on_ray.conftest import agent_info, node_ids, wait_for, wait_until_freed
from tests.on_ray.test_operator import ray_velo_cli

pytestmark = [pytest.mark.ray, pytest.mark.multinode, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
NODES = ("node_a", "node_b")
#: Ray's part of a job's end on a loaded 2-core machine: the driver's raylet marks the job
#: dead in the GCS, and the job's workers and actors are killed.
RAY_NOTICE_S = 4.0
BOUND_S = JOB_END_BOUND_S + LIVENESS_INTERVAL_S + RAY_NOTICE_S
#: How long a job driver may take to join the cluster, stage and read (workers start).
START_S = 180.0


@ray.remote(resources={"node_b": 1}, num_cpus=0)
def fetch_on_b(handle: rv.DataHandle) -> str:
    try:
        rv.fetch(handle, release=False)
    except rv.HandleNotFound as exc:
        return str(exc)
    return "fetched"


class Job:
    """One Ray job: tests/on_ray/jobdriver.py in a driver process of its own."""

    def __init__(self, address: str, args: tuple[str, ...], log: Path) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        self.log = log
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.on_ray.jobdriver", "--address", address, *args],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, cwd=ROOT, env=env,
            )  # fmt: skip
        self._buffer = b""
        self.id = ""
        self.handles: dict[str, rv.DataHandle] = {}
        self.crcs: dict[str, int] = {}

    def wait_ready(self) -> None:
        ready = self.expect("READY", START_S)
        self.id = ready["job"]
        self.handles = pickle.loads(base64.b64decode(ready["handles"]))
        self.crcs = ready["crcs"]

    def _failed(self, why: str) -> AssertionError:
        tail = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
        return AssertionError(f"job driver {self.proc.pid}: {why}\n--- its stderr ---\n{tail}")

    def expect(self, kind: str, timeout_s: float) -> dict[str, Any]:
        """The next ``KIND {json}`` line the driver prints, within ``timeout_s``."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while True:
            line, newline, rest = self._buffer.partition(b"\n")
            if newline:
                self._buffer = rest
                text = line.decode(errors="replace")
                if text.startswith(f"{kind} "):
                    return json.loads(text[len(kind) + 1 :])  # type: ignore[no-any-return]
                continue  # anything else it printed is not for us
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._failed(f"no {kind} line within {timeout_s} s")
            readable, _, _ = select.select([fd], [], [], min(left, 0.5))
            if readable:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise self._failed(f"exited ({self.proc.wait()}) before printing {kind}")
                self._buffer += chunk

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{command}\n".encode())
        self.proc.stdin.flush()

    def end(self, how: str) -> float:
        """End the driver: ``exit`` (its script returns) or ``sigkill``. Returns when (the
        monotonic clock) the process was seen gone."""
        if how == "exit":
            self.send("exit")
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        else:
            os.kill(self.proc.pid, signal.SIGKILL)
        try:
            code = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            raise self._failed(f"still running 60 s after {how}") from None
        if how == "exit" and code != 0:
            raise self._failed(f"exited with {code}")
        return time.monotonic()

    def close(self) -> None:
        """Kill the driver if it still runs (a failed test) and reap it."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=60)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


@pytest.fixture()
def jobs(cluster: Any, tmp_path: Path) -> Iterator[Callable[..., Job]]:
    """Starts job drivers (with jobdriver.py's options) and waits until each is READY; ends
    every one still running when the test ends, by its pid."""
    started: list[Job] = []

    def start(*args: str) -> Job:
        job = Job(cluster.address, args, tmp_path / f"job-{len(started)}.log")
        started.append(job)
        job.wait_ready()
        return job

    yield start
    for job in started:
        job.close()


def slots() -> dict[str, int]:
    return {node: agent_info(node)["live_slots"] for node in NODES}


def followed(node: str) -> list[str]:
    return list(agent_info(node)["jobs_followed"])


def assert_gone_because_its_job_ended(job: Job) -> None:
    for name, handle in job.handles.items():
        with pytest.raises(rv.HandleNotFound, match="its job ended"):
            rv.fetch(handle, release=False)
        said = ray.get(fetch_on_b.remote(handle), timeout=120)
        assert "its job ended" in said, (name, said)


def test_a_job_that_exits_leaves_none_of_its_data_on_either_node(
    velo: None, jobs: Callable[..., Job]
) -> None:
    """A user's script stages 16 MiB in its driver and 16 MiB in a task on node a, reads the
    first on node b without consuming it (node b keeps a copy) and exits without releasing
    anything. Within the bound neither node holds any of it, and a fetch of either handle,
    on either node, is told that its job ended. Node a asked Ray's job table while it held
    the job's data, each look costing milliseconds."""
    before = slots()
    looks = agent_info("node_a")["job_watch"]["looks"]
    job = jobs()
    during = slots()
    assert during["node_a"] >= before["node_a"] + 2, (before, during)
    assert job.id in followed("node_a")
    gone_at = job.end("exit")
    wait_for("the job's data freed on both nodes", lambda: slots() == before, 60.0)
    took = time.monotonic() - gone_at
    print(f"job {job.id}: its data was gone from both nodes {took:.2f} s after its driver")
    assert took <= BOUND_S, f"{took:.1f} s > {BOUND_S} s"
    assert_gone_because_its_job_ended(job)
    watch = agent_info("node_a")["job_watch"]
    mean_ms = 1000 * watch["look_seconds"] / max(1, watch["looks"])
    print(f"node a looked at Ray's job table {watch['looks'] - looks} times, {mean_ms:.1f} ms each")
    assert watch["looks"] > looks and mean_ms < 250, watch


def test_a_second_job_keeps_its_data_and_reads_it_while_the_first_ends(
    velo: None, jobs: Callable[..., Job]
) -> None:
    """Two jobs share the cluster; the first exits. Its data goes; the second job's stays,
    and the second job still reads it, in its driver and on node b. Node b, which only held
    copies of either job's data, never asked Ray's job table anything."""
    before = slots()
    assert followed("node_b") == [], "an earlier test left data on node b"
    b_looks = agent_info("node_b")["job_watch"]["looks"]
    first, second = jobs(), jobs()
    first.end("exit")
    for handle in first.handles.values():
        wait_until_freed(handle, timeout_s=BOUND_S)
    assert first.id not in followed("node_a") and second.id in followed("node_a")
    second.send("fetch")
    fetched = second.expect("FETCHED", START_S)
    assert fetched == {"here": second.crcs, "on_b": second.crcs}
    assert agent_info("node_b")["job_watch"]["looks"] == b_looks
    second.end("exit")
    wait_for("the second job's data freed", lambda: slots() == before, BOUND_S)
    assert_gone_because_its_job_ended(second)


def test_a_detached_slot_outlives_its_job_until_another_job_releases_it(
    velo: None, cluster: Any, jobs: Callable[..., Job]
) -> None:
    """A job shares a payload on purpose (``lifetime="detached"``) beside one of its own,
    and exits. ``ray-velo status`` lists the shared one; after the job's end its own payload
    is gone and the shared one is not; this test's driver (another job) then reads it and
    consumes its reference, which frees it."""
    before = slots()
    job = jobs("--lifetime", "detached")
    shared, own = job.handles["driver"], job.handles["task"]
    done = ray_velo_cli("status", "--json", address=cluster.address)
    assert done.returncode == 0, done.stderr
    head = next(s for s in json.loads(done.stdout) if s["node_id"] == node_ids()["node_a"])
    assert {(d["slot"], d["job"]) for d in head["detached"]} >= {(shared.slot_id, job.id)}
    job.end("exit")
    wait_until_freed(own, timeout_s=BOUND_S)  # the job's end was seen
    assert rv.metadata(shared).refcount == 1
    view = rv.fetch(shared)  # another job consumes the shared payload's one reference
    assert zlib.crc32(np.ascontiguousarray(view)) == job.crcs["driver"]
    del view
    with pytest.raises(rv.HandleNotFound, match="released by its last consumer"):
        rv.metadata(shared)
    wait_for("both payloads freed", lambda: slots() == before, BOUND_S)


def test_a_job_whose_driver_is_killed_leaves_none_of_its_data(
    velo: None, jobs: Callable[..., Job]
) -> None:
    """A job's driver is killed with SIGKILL while an actor of the job on node b holds a
    view of a node-local copy: the job's slots, node b's copies and the actor's lease all go
    within the bound, and the handles say that their job ended."""
    before = slots()
    job = jobs("--hold-on-b")
    assert slots()["node_b"] > before["node_b"], "node b holds no copy for the actor's view"
    gone_at = job.end("sigkill")
    wait_for("the killed job's data freed on both nodes", lambda: slots() == before, 60.0)
    took = time.monotonic() - gone_at
    print(f"killed job {job.id}: its data was gone {took:.2f} s after its driver")
    assert took <= BOUND_S, f"{took:.1f} s > {BOUND_S} s"
    assert_gone_because_its_job_ended(job)
