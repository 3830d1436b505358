"""The version smoke: ray_velo's main features on whatever Ray this interpreter has.

``python tests/versions/smoke.py`` starts a two-node ``ray.cluster_utils.Cluster`` under the
auth mode of its environment (``RAY_AUTH_MODE``, read by Ray when it loads), runs each feature
below and prints ``SMOKE <json>`` as its last line: for each feature ``"ok"``, ``"skipped: <why>"``
(a feature this Ray lacks, refused with the message ray_velo gives) or ``"failed: <error>"``.
tests/versions/test_matrix.py runs it in a virtual environment per claimed Ray version.

Features: cross-node ``rv.put`` / ``rv.fetch`` with the path counted; ``@rv.transfer`` task to
task and on an actor; a streaming generator; the ``VELO_NUMPY`` (and, with torch, ``VELO``)
tensor transport actor to actor where this Ray has the API; ``ray-velo status --json``; a job
whose driver exits and whose staged data is freed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import ray
from ray.cluster_utils import Cluster

import ray_velo as rv

PREFIX = "SMOKE "
MiB = 1 << 20
ON_A = {"resources": {"node_a": 1}, "num_cpus": 0}
ON_B = {"resources": {"node_b": 1}, "num_cpus": 0}


def crc(value: Any) -> int:
    return zlib.crc32(np.ascontiguousarray(value).view(np.uint8))


def pattern(nbytes: int, seed: int = 1) -> np.ndarray[Any, Any]:
    return ((np.arange(nbytes, dtype=np.uint64) * 131 + seed) % 251).astype(np.uint8)


def agent_of(resource: str) -> dict[str, Any]:
    from ray_velo.actors import ensure_agent

    node = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"])
    agent = ensure_agent(node)  # held: Ray 2.40's method keeps only a weak reference
    return ray.get(agent.info.remote())  # type: ignore[no-any-return]


def wait_for(what: str, ready: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout_s} s: {what}")
        time.sleep(0.1)


# --- the features ------------------------------------------------------------------------


@ray.remote(**ON_A)
def put_on_a(nbytes: int) -> rv.DataHandle:
    # staged by a task on node a: the driver's node is whichever raylet of this host it
    # attached to (Ray 2.50 picks either), and a fetch there is same-node
    return rv.put(pattern(nbytes))


@ray.remote(**ON_B)
def crc_on_b(handle: rv.DataHandle) -> int:
    return crc(rv.fetch(handle))


def put_fetch() -> str:
    before = agent_of("node_b")["metrics"]["velo_rendezvous_rdma_path_total"]
    handle = ray.get(put_on_a.remote(8 * MiB))
    assert ray.get(crc_on_b.remote(handle)) == crc(pattern(8 * MiB)), "bytes differ"
    after = agent_of("node_b")["metrics"]["velo_rendezvous_rdma_path_total"]
    moved = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
    assert moved == {"wire/ok": 1}, f"consumer path decisions {moved}"
    return "ok"


def decorator() -> str:
    @rv.transfer
    @ray.remote(**ON_A)
    def make(nbytes: int) -> np.ndarray[Any, Any]:
        return pattern(nbytes, 3)

    @rv.transfer
    @ray.remote(**ON_B)
    def check(value: np.ndarray[Any, Any]) -> int:
        return crc(value)

    @rv.transfer
    @ray.remote(**ON_B)
    class Reader:
        def check(self, value: np.ndarray[Any, Any]) -> int:
            return crc(value)

    expected = crc(pattern(4 * MiB, 3))
    assert ray.get(check.remote(make.remote(4 * MiB))) == expected, "task to task"
    reader = Reader.remote()
    assert ray.get(reader.check.remote(make.remote(4 * MiB))) == expected, "to an actor"
    return "ok"


def stream() -> str:
    @rv.transfer
    @ray.remote(num_returns="streaming", **ON_A)
    def items(count: int) -> Any:
        for i in range(count):
            yield np.full(2 * MiB, i, dtype=np.uint8)

    @ray.remote(**ON_B)
    def drain(count: int) -> list[int]:
        return [int(item[0]) for item in rv.resolve_stream(items.remote(count))]

    assert ray.get(drain.remote(4)) == [0, 1, 2, 3]
    return "ok"


def tensor_transport() -> str:
    from ray_velo import _ray

    if not _ray.has_tensor_transport():
        try:
            rv.register_transports()
        except rv.RayFeatureUnavailable as exc:
            return f"skipped: {exc}"
        raise AssertionError("register_transports did not refuse a Ray without the API")
    registered = rv.register_transports()
    names = ["VELO_NUMPY"] + (["VELO"] if "torch" in sys.modules else [])

    @ray.remote(enable_tensor_transport=True, **ON_A)
    class Source:
        @ray.method(tensor_transport="VELO_NUMPY")
        def array(self, nbytes: int) -> np.ndarray[Any, Any]:
            return pattern(nbytes, 5)

    @ray.remote(enable_tensor_transport=True, **ON_B)
    class Sink:
        def crc(self, value: np.ndarray[Any, Any]) -> int:
            return crc(value)

    source, sink = Source.remote(), Sink.remote()
    assert ray.get(sink.crc.remote(source.array.remote(4 * MiB))) == crc(pattern(4 * MiB, 5))
    if "VELO" in names:
        torch = sys.modules["torch"]

        @ray.remote(enable_tensor_transport=True, **ON_A)
        class TensorSource:
            @ray.method(tensor_transport="VELO")
            def tensor(self, n: int) -> Any:
                return torch.arange(n, dtype=torch.float32)

        @ray.remote(enable_tensor_transport=True, **ON_B)
        class TensorSink:
            def total(self, value: Any) -> float:
                return float(value.sum())

        made, taken = TensorSource.remote(), TensorSink.remote()
        assert (
            ray.get(taken.total.remote(made.tensor.remote(1 << 20)))
            == (1 << 20) * ((1 << 20) - 1) / 2
        )
    return f"ok ({', '.join(names)} actor to actor; registered by this call: {registered})"


def status_json() -> str:
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    done = subprocess.run(
        [sys.executable, "-m", "ray_velo.cli", "status", "--json"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-1500:]
    statuses = json.loads(done.stdout)
    assert len(statuses) == 2 and all("transport" in s for s in statuses), statuses
    return "ok"


JOB = """
import sys, numpy as np, ray, ray_velo as rv
ray.init(address="auto", log_to_driver=False)
handle = rv.put(np.ones(4 << 20, dtype=np.uint8))
print("STAGED", flush=True)
sys.stdin.read()  # until the smoke has seen the slot: then the job ends, as a script does
"""


def live_slots() -> int:
    return sum(agent_of(node)["live_slots"] for node in ("node_a", "node_b"))


def job_end() -> str:
    before = live_slots()
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    job = subprocess.Popen(
        [sys.executable, "-c", JOB], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert job.stdout is not None and job.stdin is not None
        assert job.stdout.readline().strip() == "STAGED", job.stderr and job.stderr.read()[-1500:]
        wait_for("the job's slot staged", lambda: live_slots() == before + 1)
        job.stdin.close()
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    wait_for("the ended job's slot freed", lambda: live_slots() == before)
    return "ok"


FEATURES: dict[str, Callable[[], str]] = {
    "put/fetch": put_fetch,
    "@transfer": decorator,
    "stream": stream,
    "tensor transport": tensor_transport,
    "status --json": status_json,
    "job end": job_end,
}


def main() -> int:
    if os.environ.get("RAY_VELO_SMOKE_TORCH") == "1":
        import torch  # noqa: F401  (the VELO transport)
    result: dict[str, Any] = {"ray": ray.__version__, "auth": os.environ.get("RAY_AUTH_MODE", "")}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"node_a": 4}, "include_dashboard": False},
    )
    try:
        cluster.add_node(num_cpus=2, resources={"node_b": 4})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        from ray_velo import _ray

        result["auth_seen"] = _ray.auth_mode()
        rv.init()
        for name, feature in FEATURES.items():
            try:
                result[name] = feature()
            except Exception as exc:
                traceback.print_exc()
                result[name] = f"failed: {type(exc).__name__}: {exc}"
    finally:
        try:
            rv.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()
    sys.stdout.write(PREFIX + json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
