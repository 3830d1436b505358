"""A Ray job of its own for tests/on_ray/test_jobs.py: a separate driver process that joins
the test cluster, stages data as a user's job does, and then does what the test tells it.

    python -m tests.on_ray.jobdriver --address ADDR [--mib 16] [--lifetime detached]
                                     [--hold-on-b]

It stages ``driver`` (an ``rv.put`` in this driver, with ``--lifetime``) and ``task`` (a
task's ``rv.put`` on node a, returned as a handle); a task on node b reads ``driver``
without consuming it, so node b keeps a node-local copy; with ``--hold-on-b`` an actor of
this job on node b holds a zero-copy view of ``task`` until the job ends. Then it prints
``READY {json}`` (its job id, and the handles pickled in base64) and serves commands, one a
line on stdin:

* ``fetch``: read every handle without consuming it, here and in a task on node b; prints
  ``FETCHED {json}`` (name -> crc32 of the bytes, or the error's text);
* ``exit`` (or end of input): return from main, as a finished script does.
"""

from __future__ import annotations

import argparse
import base64
import json
import pickle
import sys
import zlib
from typing import Any

import numpy as np
import ray

import ray_velo as rv

MiB = 1 << 20
ON_A = {"resources": {"node_a": 1}, "num_cpus": 0}
ON_B = {"resources": {"node_b": 1}, "num_cpus": 0}


def pattern(nbytes: int, seed: int) -> np.ndarray:
    return ((np.arange(nbytes, dtype=np.uint64) * 131 + seed) % 251).astype(np.uint8)


def crc_or_error(handle: rv.DataHandle) -> Any:
    try:
        return zlib.crc32(np.ascontiguousarray(rv.fetch(handle, release=False)))
    except rv.VeloError as exc:
        return f"{type(exc).__name__}: {exc}"


@ray.remote(**ON_A)
def put_on_a(nbytes: int, seed: int) -> rv.DataHandle:
    return rv.put(pattern(nbytes, seed))


@ray.remote(**ON_B)
def read_on_b(handle: rv.DataHandle) -> Any:
    return crc_or_error(handle)


@ray.remote(**ON_B)
class Holder:
    """Holds a view of a fetched payload on node b for as long as it lives."""

    def __init__(self) -> None:
        self.views: list[Any] = []

    def hold(self, handle: rv.DataHandle) -> int:
        view = rv.fetch(handle, release=False)
        self.views.append(view)
        return zlib.crc32(np.ascontiguousarray(view))


def say(kind: str, body: dict[str, Any]) -> None:
    print(f"{kind} {json.dumps(body)}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.on_ray.jobdriver")
    parser.add_argument("--address", required=True)
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--lifetime", default=None)
    parser.add_argument("--hold-on-b", action="store_true")
    args = parser.parse_args()
    ray.init(address=args.address, log_to_driver=False)
    rv.init()
    nbytes = args.mib * MiB
    handles = {
        "driver": rv.put(pattern(nbytes, 1), lifetime=args.lifetime),
        "task": ray.get(put_on_a.remote(nbytes, 2), timeout=120),
    }
    crcs = {"driver": zlib.crc32(pattern(nbytes, 1)), "task": zlib.crc32(pattern(nbytes, 2))}
    read = ray.get(read_on_b.remote(handles["driver"]), timeout=120)
    assert read == crcs["driver"], read
    holder = None
    if args.hold_on_b:
        holder = Holder.remote()
        assert ray.get(holder.hold.remote(handles["task"]), timeout=120) == crcs["task"]
    say(
        "READY",
        {
            "job": ray.get_runtime_context().get_job_id(),
            "handles": base64.b64encode(pickle.dumps(handles)).decode(),
            "crcs": crcs,
        },
    )
    for line in sys.stdin:
        command = line.strip()
        if command == "exit":
            break
        if command == "fetch":
            here = {name: crc_or_error(h) for name, h in handles.items()}
            on_b = {name: ray.get(read_on_b.remote(h), timeout=120) for name, h in handles.items()}
            say("FETCHED", {"here": here, "on_b": on_b})
    return 0


if __name__ == "__main__":
    sys.exit(main())
