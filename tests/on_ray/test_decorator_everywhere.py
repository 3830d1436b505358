"""@ray_velo.transfer wherever Ray goes: on a method of a plain ``@ray.remote`` class, on
async actor methods and async generators, through ``.options(...)``, and
``rv.resolve`` over any nesting of ObjectRefs."""

from __future__ import annotations

import asyncio
import zlib
from typing import Any

import numpy as np
import pytest
import ray

import ray_velo as rv
from ray_velo.config import MiB
from tests.on_ray.conftest import agent_info

pytestmark = [pytest.mark.ray, pytest.mark.multinode]

ON_A = {"resources": {"node_a": 1}, "num_cpus": 0}
ON_B = {"resources": {"node_b": 1}, "num_cpus": 0}


def crc(array: Any) -> int:
    return zlib.crc32(np.ascontiguousarray(array).view(np.uint8))


def block(seed: int, nbytes: int = 2 * MiB) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, nbytes, dtype=np.uint8)


def staged_count(node: str) -> int:
    return int(agent_info(node)["counters"]["slots_staged"])


@rv.transfer
@ray.remote(**ON_A)
def produce(seed: int) -> np.ndarray:
    return block(seed)


@ray.remote(**ON_B)
class PlainWorker:
    """A plain Ray actor: only its methods are decorated."""

    @rv.transfer
    def checksum(self, array: np.ndarray) -> dict[str, Any]:
        return {"type": type(array).__name__, "crc": crc(array)}

    @rv.transfer
    def make(self, seed: int) -> np.ndarray:
        return block(seed)

    def undecorated(self, value: Any) -> str:
        return type(value).__name__


def test_a_decorated_method_of_a_plain_actor_resolves_and_stages(velo: None) -> None:
    """A method decorated inside a plain @ray.remote class resolves a staged argument (a
    decorated producer's result from node a) and stages its own result, which the driver
    resolves: the bytes moved through ray_velo both ways, not through Ray's object store."""
    worker = PlainWorker.remote()
    staged_a = staged_count("node_a")
    got = ray.get(worker.checksum.remote(produce.remote(1)), timeout=120)
    assert got == {"type": "ndarray", "crc": crc(block(1))}
    assert staged_count("node_a") == staged_a + 1

    staged_b = staged_count("node_b")
    result = ray.get(worker.make.remote(2), timeout=120)
    assert isinstance(result, rv.StagedValue)
    assert staged_count("node_b") == staged_b + 1
    assert crc(rv.resolve(result)) == crc(block(2))
    # an undecorated method of the same class is left alone
    assert ray.get(worker.undecorated.remote(np.zeros(4)), timeout=60) == "ndarray"


@rv.transfer
@ray.remote(**ON_B)
class AsyncWorker:
    async def checksum(self, array: np.ndarray) -> int:
        await asyncio.sleep(0)
        return crc(array)

    async def make(self, seed: int) -> np.ndarray:
        await asyncio.sleep(0)
        return block(seed)

    async def stream(self, count: int) -> Any:
        for seed in range(count):
            await asyncio.sleep(0)
            yield block(seed, MiB)


def test_async_actor_methods(velo: None) -> None:
    """An async actor's methods take staged arguments (a decorated producer's result from
    node a, and a large argument the caller passes) and stage their results; an async
    generator method streams staged items. (Ray itself refuses ``async def`` tasks.)"""
    worker = AsyncWorker.remote()
    assert ray.get(worker.checksum.remote(produce.remote(4)), timeout=120) == crc(block(4))
    assert ray.get(worker.checksum.remote(block(5)), timeout=120) == crc(block(5))
    made = ray.get(worker.make.remote(6), timeout=120)
    assert isinstance(made, rv.StagedValue)
    assert crc(rv.resolve(made)) == crc(block(6))
    stream = worker.stream.options(num_returns="streaming").remote(3)
    items = list(rv.resolve_stream(stream, timeout=120))
    assert [crc(item) for item in items] == [crc(block(seed, MiB)) for seed in range(3)]


def test_options_keep_the_staging(velo: None) -> None:
    """.options(...) on a decorated function, actor class and method still stages."""
    staged_a = staged_count("node_a")
    ref = produce.options(name="produce-with-options").remote(7)
    assert isinstance(ray.get(ref, timeout=120), rv.StagedValue)
    assert crc(rv.resolve(ref)) == crc(block(7))
    assert staged_count("node_a") == staged_a + 1

    worker = AsyncWorker.options(name="async-worker-with-options").remote()
    staged_b = staged_count("node_b")
    made = worker.make.options(name="make-with-options").remote(8)
    assert crc(rv.resolve(made)) == crc(block(8))
    assert staged_count("node_b") == staged_b + 1


def test_resolve_takes_any_nesting_of_object_refs(velo: None) -> None:
    """rv.resolve fetches ObjectRefs inside lists, tuples and dicts mixed with plain values,
    and resolves every staged value it finds."""
    refs = {"pair": [produce.remote(10), produce.remote(11)], "one": (produce.remote(12), 5)}
    got = rv.resolve(refs, timeout=120)
    assert [crc(a) for a in got["pair"]] == [crc(block(10)), crc(block(11))]
    assert crc(got["one"][0]) == crc(block(12)) and got["one"][1] == 5
