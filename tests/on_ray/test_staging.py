"""@ray_velo.transfer on a real two-node cluster: transparent staging of arguments, results
and streamed items between tasks and actors on different nodes."""

from __future__ import annotations

import os
import signal
import time
import zlib
from typing import Any

import numpy as np
import pytest
import ray

import ray_velo as rv
from ray_velo.config import KiB, MiB
from tests.on_ray.conftest import agent_info, wait_for
from tests.on_ray.test_faults import used_bytes

pytestmark = [pytest.mark.ray, pytest.mark.multinode]

ON_A = {"resources": {"node_a": 1}, "num_cpus": 0}
ON_B = {"resources": {"node_b": 1}, "num_cpus": 0}


def crc(array: Any) -> int:
    return zlib.crc32(np.ascontiguousarray(array).view(np.uint8))


@rv.transfer
@ray.remote(**ON_A)
def make(nbytes: int, seed: int = 0) -> dict[str, Any]:
    big = np.random.default_rng(seed).integers(0, 255, nbytes, dtype=np.uint8)
    return {"arrays": [big, big[: nbytes // 2]], "meta": ("small", np.arange(3)), "crc": crc(big)}


@rv.transfer
@ray.remote(**ON_B)
def inspect_on_b(payload: dict[str, Any]) -> dict[str, Any]:
    big, half = payload["arrays"]
    return {
        "types": [type(big).__name__, type(half).__name__, type(payload["meta"][1]).__name__],
        "crc_ok": crc(big) == payload["crc"] and crc(half) == crc(big[: big.size // 2]),
        "node": ray.get_runtime_context().get_node_id(),
        "saw_handle": any(isinstance(x, rv.StagedValue) for x in (big, half)),
    }


def test_task_to_task_across_nodes_with_nested_containers(velo: None) -> None:
    """A result dict holding a list of two large arrays and a small tuple goes from a task
    on node a to a task on node b: the body sees arrays, never a handle, bytes verified."""
    result = ray.get(inspect_on_b.remote(make.remote(4 * MiB)))
    assert result["types"] == ["ndarray", "ndarray", "ndarray"]
    assert result["crc_ok"] and not result["saw_handle"]
    # the producer's staged values were single-use: consumed, so node a holds nothing
    deadline = time.monotonic() + 5
    while agent_info("node_a")["live_slots"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert agent_info("node_a")["live_slots"] == 0


@rv.transfer
@ray.remote(**ON_A)
class Producer:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def batch(self, seed: int) -> np.ndarray:
        return np.full(self.nbytes, seed % 251, dtype=np.uint8)

    def echo_size(self, array: np.ndarray) -> int:
        return int(array.nbytes)


@rv.transfer
@ray.remote(**ON_B)
def total(array: np.ndarray) -> int:
    return int(array.sum(dtype=np.int64))


def test_actor_method_to_task(velo: None) -> None:
    """An actor method's large result feeds a task on the other node; a large argument to
    an actor method is staged by the caller (the driver)."""
    producer = Producer.remote(2 * MiB)
    assert ray.get(total.remote(producer.batch.remote(7))) == 7 * 2 * MiB
    assert ray.get(producer.echo_size.remote(np.zeros(3 * MiB, dtype=np.uint8))) == 3 * MiB
    ray.kill(producer.ray_handle)


@rv.transfer
@ray.remote(**ON_B)
def seen_as(value: Any) -> str:
    return "staged-then-resolved" if isinstance(value, np.ndarray) else type(value).__name__


def test_threshold_boundary(velo: None) -> None:
    """Exactly 256 KiB travels inline (no slot staged); 256 KiB + 1 byte is staged."""
    staged0 = agent_info("node_a")["counters"]["slots_staged"]
    ray.get(seen_as.remote(np.zeros(256 * KiB, dtype=np.uint8)))
    assert agent_info("node_a")["counters"]["slots_staged"] == staged0
    ray.get(seen_as.remote(np.zeros(256 * KiB + 1, dtype=np.uint8)))
    assert agent_info("node_a")["counters"]["slots_staged"] == staged0 + 1


@rv.transfer(consumers=3)
@ray.remote(**ON_A)
def fan_out_source() -> np.ndarray:
    return np.arange(MiB, dtype=np.uint8)


@ray.remote(**ON_B)
def consume_staged(box: list[Any]) -> int:
    return crc(rv.resolve(box[0]))


def test_fan_out_to_three_consumers_then_a_fourth_is_refused(velo: None) -> None:
    """consumers=3: three tasks resolve the same staged result; the fourth gets
    HandleReleased naming the option to change."""
    staged = ray.get(fan_out_source.remote())
    assert isinstance(staged, rv.StagedValue) and staged.consumers == 3
    expected = crc(np.arange(MiB, dtype=np.uint8))
    assert ray.get([consume_staged.remote([staged]) for _ in range(3)]) == [expected] * 3
    with pytest.raises(rv.HandleReleased, match="consumers="):
        ray.get(consume_staged.remote([staged]))


@rv.transfer(ttl=1.0)
@ray.remote(**ON_A)
def dropped() -> np.ndarray:
    return np.ones(2 * MiB, dtype=np.uint8)


def test_dropped_result_is_freed_by_its_ttl(velo: None) -> None:
    """Nobody resolves a staged result: its TTL frees it, and the pool returns to baseline."""
    before = used_bytes("node_a")
    ref = dropped.remote()
    ray.get(ref)
    del ref
    info = agent_info("node_a")  # staged, or its commit still on the way (not waited for)
    assert info["live_slots"] + info["reservations"] == 1
    deadline = time.monotonic() + 10
    while agent_info("node_a")["live_slots"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert agent_info("node_a")["live_slots"] == 0
    assert used_bytes("node_a") == before


@rv.transfer
@ray.remote(num_returns="streaming", **ON_A)
def stream(count: int, nbytes: int) -> Any:
    for i in range(count):
        yield np.full(nbytes, i, dtype=np.uint8)


@ray.remote(**ON_B)
def drain(count: int, nbytes: int) -> list[int]:
    sums = []
    for item in rv.resolve_stream(stream.remote(count, nbytes)):
        sums.append(int(item[::4096].sum()) // max(1, len(item[::4096])))
    return sums


def test_streaming_generator_items_consumed_on_another_node(velo: None) -> None:
    """10 items of 32 MiB streamed from node a, each resolved on node b as it arrives."""
    assert ray.get(drain.remote(10, 32 * MiB)) == list(range(10))


@ray.remote(**ON_B)
def drain_until_error(count: int, nbytes: int) -> tuple[int, str]:
    got = 0
    try:
        for _ in rv.resolve_stream(stream.remote(count, nbytes)):
            got += 1
    except rv.PayloadTooLarge as exc:
        return got, str(exc)
    return got, ""


def warm_on_node_a(nbytes: int) -> None:
    """Staging inside a call takes only memory the agent already mapped: map an arena of
    this size on node a (the driver's node) the explicit way, and free it (it stays warm)."""
    view = rv.fetch(rv.put(np.zeros(nbytes, dtype=np.uint8)))
    del view
    # the slot's end and its memory's return to the pool both follow a lease-end notice:
    # a send before the memory is free would find no arena and ride inline
    wait_for(
        "the warm arena free on node a",
        lambda: not agent_info("node_a")["live_slots"] and used_bytes("node_a") == 0,
        10.0,
    )


def test_payload_over_the_receivers_limit(velo: None) -> None:
    """staged_payload_max is 96 MiB here: a task argument over it fails the task with both
    sizes; a stream item over it ends that stream while another stream goes on."""
    warm_on_node_a(97 * MiB)
    with pytest.raises(rv.PayloadTooLarge, match=str(97 * MiB)):
        ray.get(seen_as.remote(np.zeros(97 * MiB, dtype=np.uint8)))
    over, fine = drain_until_error.remote(3, 97 * MiB), drain.remote(3, MiB)
    got, message = ray.get(over)
    assert got == 0 and str(96 * MiB) in message
    assert ray.get(fine) == [0, 1, 2]
    deadline = time.monotonic() + 10  # refused items were released on the owner
    while agent_info("node_a")["live_slots"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert agent_info("node_a")["live_slots"] == 0


@ray.remote(**ON_A)
def gate(seconds: float) -> None:
    time.sleep(seconds)


@rv.transfer(fetch_timeout=1.0)
@ray.remote(**ON_B)
def bounded(array: np.ndarray, _gate: Any) -> int:
    return int(array.nbytes)


def test_fetch_timeout_expires_against_a_stalled_owner(velo: None) -> None:
    """The caller's fetch_timeout travels with the staged argument: the owner stalls
    (SIGSTOP), the callee's fetch fails with TransferTimeout, and the TTL (the same bound)
    frees the staged copy once the owner resumes."""
    owner_pid = agent_info("node_a")["pid"]
    # staged before the stall; the callee starts (and fetches) only after the gate task
    ref = bounded.remote(np.ones(MiB, dtype=np.uint8), gate.remote(1.0))
    os.kill(owner_pid, signal.SIGSTOP)
    try:
        with pytest.raises(rv.TransferTimeout, match=r"1\.0 s"):
            ray.get(ref, timeout=30)
    finally:
        os.kill(owner_pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while agent_info("node_a")["live_slots"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert agent_info("node_a")["live_slots"] == 0


def test_wrong_decorator_order_fails_at_decoration_time() -> None:
    """@transfer below @ray.remote is refused when the module loads, showing the order."""
    with pytest.raises(TypeError, match=r"must sit above @ray\.remote"):

        @ray.remote
        @rv.transfer
        def f(x: int) -> int:
            return x

    with pytest.raises(TypeError, match=r"must sit above @ray\.remote"):

        @ray.remote
        @rv.transfer
        class A:
            pass


@rv.transfer
@ray.remote(**ON_B, max_retries=1, retry_exceptions=True)
def flaky(array: np.ndarray, marker: str) -> int:
    if not os.path.exists(marker):
        open(marker, "w").close()
        raise RuntimeError("first attempt fails after resolving its argument")
    return int(array.nbytes)


def test_task_retry_resolves_the_single_use_argument_again(velo: None, tmp_path: Any) -> None:
    """A task that resolved its staged argument and then failed is retried by Ray: the
    reference is consumed only after a successful body, so the retry resolves it too."""
    marker = str(tmp_path / "attempted")
    assert ray.get(flaky.remote(np.ones(MiB, dtype=np.uint8), marker)) == MiB


@rv.transfer
@ray.remote(**ON_A)
def forward(array: np.ndarray) -> Any:
    # the body forwards what it received: a plain array, staged anew by this call
    return ray.get(total.remote(array))


def test_forwarded_values_carry_no_staging_metadata(velo: None) -> None:
    """A callee that passes its argument on sends the value, staged by its own call: the
    next receiver never fetches the first caller's handle, and nothing stays staged."""
    array = np.full(2 * MiB, 3, dtype=np.uint8)
    assert ray.get(forward.remote(array)) == 3 * 2 * MiB


class _Interrupted(BaseException):
    """What a cancelled task sees (Ray raises KeyboardInterrupt in it)."""


def test_a_result_whose_staging_is_interrupted_midway_leaves_nothing_staged(
    velo: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two payloads in one result go into one packed slot; the copy of the second is
    interrupted: the reservation, with the first already in it, is given back, and no slot
    is left that nobody could ever hold the handle of."""
    from ray_velo.client import session
    from ray_velo.staging.resolution import stage_tree

    warm_on_node_a(2 * MiB + 64)
    before = agent_info("node_a")
    copy = session.copy_into
    copied: list[int] = []

    def interrupted_second(dest: Any, source: Any) -> None:
        if copied:
            raise _Interrupted
        copied.append(source.nbytes)
        copy(dest, source)

    monkeypatch.setattr(session, "copy_into", interrupted_second)
    with pytest.raises(_Interrupted):
        stage_tree([np.ones(MiB, np.uint8), np.ones(MiB, np.uint8)], rv.TransferOptions(), None)
    assert copied == [MiB], "the first payload was not copied into the packed slot"
    wait_for(
        "the reservation given back",
        lambda: (
            (lambda i: (i["live_slots"], i["reservations"]))(agent_info("node_a"))
            == (before["live_slots"], 0)
        ),
    )


def test_a_call_s_payloads_travel_in_one_slot(velo: None) -> None:
    """Three payloads of one result, one of them named twice: one slot on the producer's
    node, each value read back right (the repeated one twice), the slot gone after."""
    from ray_velo.staging.resolution import resolve, stage_tree

    warm_on_node_a(4 * MiB)
    before = agent_info("node_a")["live_slots"]
    shared = np.arange(MiB // 8, dtype=np.int64)
    value = {"a": np.full(MiB, 1, np.uint8), "b": [shared, shared], "c": b"x" * (MiB // 2)}
    staged = stage_tree(value, rv.TransferOptions(), None)
    handles = {staged["a"].handle, staged["b"][0].handle, staged["b"][1].handle}
    assert len(handles) == 1 and staged["c"].handle in handles
    assert agent_info("node_a")["live_slots"] == before + 1
    got = resolve(staged)
    assert np.array_equal(got["a"], value["a"]) and got["c"] == value["c"]
    assert all(np.array_equal(v, shared) for v in got["b"])
    del got
    wait_for("the slot released", lambda: agent_info("node_a")["live_slots"] == before)


def test_a_stream_closed_at_its_yield_releases_the_item_it_handed_out(velo: None) -> None:
    """Ray ends a streaming generator at its yield only when the stream is cancelled: the
    item it was handing out may never reach a reader, so it is released. A stream that runs
    to its end keeps every item staged for its readers."""
    from ray_velo.staging.resolution import discard_tree
    from ray_velo.staging.wrappers import _callee

    def numbers() -> Any:
        for i in range(3):
            yield np.full(MiB, i, np.uint8)

    warm_on_node_a(MiB)
    before = agent_info("node_a")["live_slots"]
    body = _callee(numbers, rv.TransferOptions())
    cancelled = body()
    first = next(cancelled)
    assert isinstance(first, rv.StagedValue)
    assert agent_info("node_a")["live_slots"] == before + 1
    cancelled.close()
    wait_for("the handed-out item released", lambda: agent_info("node_a")["live_slots"] == before)
    finished = list(body())
    assert [rv.metadata(item.handle).refcount for item in finished] == [1, 1, 1]
    discard_tree(finished)


@rv.transfer(consumers=2)
@ray.remote(**ON_A)
def weights(nbytes: int) -> dict[str, Any]:
    import torch

    return {
        "w": torch.arange(nbytes // 4, dtype=torch.float32),
        "b": torch.full((nbytes // 8,), 2.0),
        "tiny": torch.ones(4),  # below the threshold: inside the Ray call
    }


@rv.transfer
@ray.remote(**ON_B)
def train_step(state: dict[str, Any]) -> dict[str, Any]:
    sums = {name: float(t.double().sum()) for name, t in state.items()}
    w, b = state["w"], state["b"]
    # the staged tensors view one block (the slot fetched into this worker's memory), in
    # the order packed; a copy each would be separate allocations
    gap = b.data_ptr() - w.data_ptr()
    for tensor in state.values():
        tensor.zero_()  # in place: the callee's own tensors
    return {"sums": sums, "gap": gap, "zeroed": all(not t.any() for t in state.values())}


def test_tensors_reach_a_callee_on_another_node_as_its_own(velo: None) -> None:
    """A dict of tensors returned by a decorated task on node a to two decorated callees on
    node b in turn (consumers=2): each gets the producer's values in tensors of its own
    (the slot lands in its memory: one block, written in place without touching the other
    callee's or the producer's bytes), and once both are done neither node keeps
    anything."""
    import torch

    nbytes = 4 * MiB
    warm_on_node_a(nbytes + nbytes // 2 + 64)
    before_a = agent_info("node_a")["live_slots"]
    expected = {
        "w": float(torch.arange(nbytes // 4, dtype=torch.float32).double().sum()),
        "b": 2.0 * (nbytes // 8),
        "tiny": 4.0,
    }
    ref = weights.remote(nbytes)
    first = ray.get(train_step.remote(ref))
    second = ray.get(train_step.remote(ref))
    for seen in (first, second):
        assert seen["sums"] == expected, "a callee saw another's writes or wrong bytes"
        assert seen["zeroed"]
        assert seen["gap"] == nbytes, "the tensors were not views of the fetched slot"
    del ref
    wait_for(
        "both nodes back to what they held",
        lambda: agent_info("node_a")["live_slots"] == before_a and used_bytes("node_b") == 0,
    )


@rv.transfer
@ray.remote(**ON_A)
def one_tensor(nbytes: int, value: float) -> Any:
    import torch

    return torch.full((nbytes // 4,), value)


@rv.transfer
@ray.remote(**ON_B)
def add_in_place(tensor: Any, value: float) -> float:
    tensor += value
    return float(tensor.double().sum())


def test_one_tensor_is_the_callee_s_to_write(velo: None) -> None:
    """A single tensor through the decorator across nodes: the callee writes it in place
    (no read-only warning, no shared bytes), and nothing stays staged."""
    import warnings

    nbytes = 2 * MiB
    warm_on_node_a(nbytes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = ray.get(add_in_place.remote(one_tensor.remote(nbytes, 1.5), 1.0))
    assert got == 2.5 * (nbytes // 4)
    wait_for(
        "nothing staged on node a, nothing held on node b",
        lambda: not agent_info("node_a")["live_slots"] and used_bytes("node_b") == 0,
    )
