"""Ray's ``python/ray/tests/rdt/test_rdt_gloo.py`` (ray-project/ray at
0718d5b02581bfef3960d8e37c4d6484f7c368f9, whose API matches the installed Ray 2.60.0), ported
to ``"VELO"`` (torch) and ``"VELO_NUMPY"`` (numpy) on the real two-node cluster.

Ported as ``test_rdt_ported.py`` says (its helpers are shared): ``"gloo"`` became the transport
under test and the collective groups went (VELO needs none). GLOO is two-sided (the sender's
background thread sends each transfer) and cannot abort a transfer (Ray kills both actors when
one fails); VELO is one-sided (the receiver fetches from the node agent) and can abort: the
ports whose meaning rests on that say how they differ.
"""

from __future__ import annotations

import logging
import re
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import ray
from ray._common.test_utils import SignalActor

from ray_velo.rdt import VELO
from tests.on_ray.conftest import wait_for
from tests.on_ray.test_rdt_ported import (
    FLAVORS,
    GET_TIMEOUT_S,
    ON_A,
    SHARED,
    Flavor,
    live_slots,
    num_rdt_objects,
    pytest_generate_tests,  # noqa: F401  (the parametrization of this module's tests too)
    shared_actors_end,  # noqa: F401  (this module's shared actors end with it)
    shared_actors_settle,  # noqa: F401  (and are checked after each port)
)

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.ray, pytest.mark.multinode]

try:
    from tensordict import TensorDict

    support_tensordict = True
except ImportError:  # Ray's own test skips these where tensordict is missing
    support_tensordict = False

Placement = tuple[dict[str, Any], dict[str, Any]]


def doubled(data: Any) -> Any:
    if isinstance(data, list):
        return [doubled(d) for d in data]
    if support_tensordict and isinstance(data, TensorDict):
        return data.apply(lambda x: x * 2)
    return data * 2


def gloo_peer(transport: str) -> Any:
    """test_rdt_gloo.py's GPUTestActor for ``transport``."""

    @ray.remote(num_cpus=0)
    class GlooPeer:
        @ray.method(tensor_transport=transport)
        def echo(self, data: Any) -> Any:
            return data

        def add(self, a: Any, b: Any) -> Any:
            return a + b

        def double(self, data: Any) -> Any:
            return doubled(data)

        def increment(self, data: Any) -> Any:
            data += 1
            return data

        def get_out_of_band_tensors(self, obj_id: str, timeout: float | None = None) -> Any:
            rdt_store = ray._private.worker.global_worker.rdt_manager.rdt_store
            return rdt_store.wait_and_get_object(obj_id, timeout or 0)

        def get_num_rdt_objects(self) -> int:
            return num_rdt_objects()

        def fail(self, error_message: str) -> None:
            raise Exception(error_message)

    return GlooPeer


GLOO_PEERS = {transport: gloo_peer(transport) for transport in FLAVORS}


def peers(flavor: Flavor, *options: dict[str, Any], fresh: bool = False) -> list[Any]:
    """test_rdt_gloo.py's actors for ``flavor``, shared between ports (``SharedActors``)
    unless ``fresh``."""
    cls = GLOO_PEERS[flavor.transport]
    return [cls.options(**o).remote() if fresh else SHARED.take(cls, o) for o in options]


def store_empty(actor: Any) -> bool:
    return bool(ray.get(actor.get_num_rdt_objects.remote(), timeout=60) == 0)


def test_gc_rdt_object(velo: None, flavor: Flavor, placement: Placement) -> None:
    """Ports test_rdt_gloo.py::test_gc_rdt_object: a small value and inline bytes, read twice
    by a receiver; its RDT store empties after, the sender's once the ref goes (and with it
    VELO's staged slot)."""
    sender, receiver = peers(flavor, *placement)
    ray.get(sender.__ray_ready__.remote(), timeout=GET_TIMEOUT_S)
    base = live_slots("node_a")
    small_tensor, cpu_data = flavor.randn(1), b"1" * 100
    ref1 = sender.echo.remote([small_tensor, cpu_data])
    ref2 = receiver.double.remote(ref1)
    ref3 = receiver.double.remote(ref1)
    for result in ray.get([ref2, ref3], timeout=GET_TIMEOUT_S):
        assert flavor.same(result[0], small_tensor * 2)
        assert result[1] == cpu_data * 2
    wait_for("receiver's RDT store empty", lambda: store_empty(receiver))
    del ref1
    wait_for("sender's RDT store empty", lambda: store_empty(sender))
    wait_for("sender's slot freed", lambda: live_slots("node_a") == base)


def test_gc_rdt_metadata(velo: None, flavor: Flavor, placement: Placement) -> None:
    """Ports test_rdt_gloo.py::test_gc_rdt_metadata: the driver manages the ref's RDT
    metadata until the ref goes."""
    sender, receiver = peers(flavor, *placement)
    ref = sender.echo.remote(flavor.randn(100, 100))
    rdt_ref_id = ref.hex()
    rdt_manager = ray._private.worker.global_worker.rdt_manager
    assert rdt_manager.is_managed_object(rdt_ref_id)
    ray.get(receiver.double.remote(ref), timeout=GET_TIMEOUT_S)
    del ref
    wait_for("metadata forgotten", lambda: not rdt_manager.is_managed_object(rdt_ref_id))


def test_gc_del_ref_before_recv_finish(velo: None, flavor: Flavor, placement: Placement) -> None:
    """Ports test_rdt_gloo.py::test_gc_del_ref_before_recv_finish: the ref is dropped right
    after the receiving task is submitted; the receiver still gets it, then both RDT stores
    empty."""
    sender, receiver = peers(flavor, *placement)
    small_tensor, cpu_data = flavor.randn(1), b"1" * 100
    ref1 = sender.echo.remote([small_tensor, cpu_data])
    ref2 = receiver.double.remote(ref1)
    del ref1
    result = ray.get(ref2, timeout=GET_TIMEOUT_S)
    assert flavor.same(result[0], small_tensor * 2)
    assert result[1] == cpu_data * 2
    wait_for("receiver's RDT store empty", lambda: store_empty(receiver))
    wait_for("sender's RDT store empty", lambda: store_empty(sender))


def test_gc_intra_actor_rdt_object(velo: None, flavor: Flavor) -> None:
    """Ports test_rdt_gloo.py::test_gc_intra_actor_rdt_object: a ref passed twice to the
    actor that made it; its RDT store empties once the ref goes."""
    (actor,) = peers(flavor, ON_A)
    small_tensor = flavor.randn(1)
    ref = actor.echo.remote(small_tensor)
    assert flavor.same(ray.get(actor.double.remote(ref), timeout=GET_TIMEOUT_S), small_tensor * 2)
    assert flavor.same(ray.get(actor.double.remote(ref), timeout=GET_TIMEOUT_S), small_tensor * 2)
    del ref
    wait_for("actor's RDT store empty", lambda: store_empty(actor))


def test_gc_pass_ref_to_same_and_different_actors(
    velo: None, flavor: Flavor, placement: Placement
) -> None:
    """Ports test_rdt_gloo.py::test_gc_pass_ref_to_same_and_different_actors: one ref to
    its maker and to another actor; the other's store empties after its task, the maker's
    once the ref goes."""
    actor1, actor2 = peers(flavor, *placement)
    small_tensor = flavor.randn(1)
    ref = actor1.echo.remote(small_tensor)
    result1, result2 = actor1.double.remote(ref), actor2.double.remote(ref)
    assert flavor.same(ray.get(result1, timeout=GET_TIMEOUT_S), small_tensor * 2)
    assert flavor.same(ray.get(result2, timeout=GET_TIMEOUT_S), small_tensor * 2)
    wait_for("other actor's RDT store empty", lambda: store_empty(actor2))
    del ref
    wait_for("maker's RDT store empty", lambda: store_empty(actor1))


def test_p2p(velo: None, flavor: Flavor, placement: Placement) -> None:
    """Ports test_rdt_gloo.py::test_p2p: a small and a 500x500 value, doubled by another
    actor."""
    sender, receiver = peers(flavor, *placement)
    for value in (flavor.randn(1), flavor.randn(500, 500, seed=1)):
        result = ray.get(receiver.double.remote(sender.echo.remote(value)), timeout=GET_TIMEOUT_S)
        assert flavor.same(result, value * 2)


def blocking_peer(transport: str, has_tensor_transport_method: bool) -> Any:
    """test_p2p_blocking's actor: a method naming ``transport``, or only
    enable_tensor_transport."""

    class _BlockingPeer:
        def double(self, data: Any) -> Any:
            return doubled(data)

        def infinite_sleep(self, started: Any, release: Any) -> None:
            started.send.remote()
            ray.get(release.wait.remote())  # the original looped forever

    if has_tensor_transport_method:

        @ray.remote(num_cpus=0)
        class WithMethod(_BlockingPeer):
            @ray.method(tensor_transport=transport)
            def echo(self, data: Any) -> Any:
                return data

        return WithMethod

    @ray.remote(num_cpus=0, enable_tensor_transport=True)
    class Enabled(_BlockingPeer):
        def echo(self, data: Any) -> Any:
            return data

    return Enabled


BLOCKING_PEERS = {(t, m): blocking_peer(t, m) for t in FLAVORS for m in (True, False)}


@pytest.mark.parametrize("has_tensor_transport_method", [True, False])
def test_p2p_blocking(
    velo: None, flavor: Flavor, placement: Placement, has_tensor_transport_method: bool
) -> None:
    """Ports test_rdt_gloo.py::test_p2p_blocking: a receiver gets the sender's object while
    the sender's main thread is busy in another task, for a class with a method naming the
    transport and for one with only enable_tensor_transport (the call naming it with
    .options). The sender's endless task waits on a signal released at the end instead of
    sleeping forever."""
    cls = BLOCKING_PEERS[(flavor.transport, has_tensor_transport_method)]
    sender, receiver = cls.options(**placement[0]).remote(), cls.options(**placement[1]).remote()
    started, release = SignalActor.remote(), SignalActor.remote()
    tensor = flavor.randn(500, 500)
    sender_fn = (
        sender.echo
        if has_tensor_transport_method
        else sender.echo.options(tensor_transport=flavor.transport)
    )
    ref = sender_fn.remote(tensor)
    try:
        sender.infinite_sleep.remote(started, release)
        ray.get(started.wait.remote(), timeout=60)
        result = ray.get(receiver.double.remote(ref), timeout=60)
        assert flavor.same(result, tensor * 2)
    finally:
        release.send.remote()


def test_p2p_with_cpu_data(velo: None, flavor: Flavor, placement: Placement) -> None:
    """Ports test_rdt_gloo.py::test_p2p_with_cpu_data: a return through the transport with
    no tensor in it (an int). Actors of its own: Ray keeps such an object in the sender's
    RDT store after its ref is gone (nothing of ray_velo's: no slot is staged for it, which
    the ``velo`` fixture checks), where the shared actors must end empty."""
    sender, receiver = peers(flavor, *placement, fresh=True)
    ref = sender.echo.remote(123)
    assert ray.get(receiver.double.remote(ref), timeout=GET_TIMEOUT_S) == 246


def test_send_same_ref_to_same_actor_task_multiple_times(
    velo: None, flavor: Flavor, placement: Placement
) -> None:
    """Ports test_rdt_gloo.py::test_send_same_ref_to_same_actor_task_multiple_times: one
    ref twice in one task's arguments; the receiver's store empties after."""
    sender, receiver = peers(flavor, *placement)
    small_tensor = flavor.randn(1)
    ref = sender.echo.remote(small_tensor)
    result = ray.get(receiver.add.remote(ref, ref), timeout=GET_TIMEOUT_S)
    assert flavor.same(result, small_tensor * 2)
    wait_for("receiver's RDT store empty", lambda: store_empty(receiver))


def test_send_same_ref_to_same_actor_multiple_times(
    velo: None, flavor: Flavor, placement: Placement
) -> None:
    """Ports test_rdt_gloo.py::test_send_same_ref_to_same_actor_multiple_times: one ref to
    two tasks of one receiver."""
    sender, receiver = peers(flavor, *placement)
    small_tensor = flavor.randn(1)
    ref = sender.echo.remote(small_tensor)
    for _ in range(2):
        result = ray.get(receiver.double.remote(ref), timeout=GET_TIMEOUT_S)
        assert flavor.same(result, small_tensor * 2)


def test_intra_rdt_tensor_transfer(velo: None, flavor: Flavor) -> None:
    """Ports test_rdt_gloo.py::test_intra_rdt_tensor_transfer: refs passed back to the actor
    that made them: one value, a value with an int, two values with an int."""
    (actor,) = peers(flavor, ON_A)
    small_tensor, cpu_data = flavor.randn(1), 42
    result = ray.get(actor.double.remote(actor.echo.remote(small_tensor)), timeout=60)
    assert flavor.same(result, small_tensor * 2)

    result = ray.get(actor.double.remote(actor.echo.remote([small_tensor, cpu_data])), timeout=60)
    assert flavor.same(result[0], small_tensor * 2)
    assert result[1] == cpu_data * 2

    tensor1, tensor2 = flavor.randn(1, seed=1), flavor.randn(2, seed=2)
    ref = actor.echo.remote([tensor1, tensor2, cpu_data])
    result = ray.get(actor.double.remote(ref), timeout=GET_TIMEOUT_S)
    assert flavor.same(result[0], tensor1 * 2)
    assert flavor.same(result[1], tensor2 * 2)
    assert result[2] == cpu_data * 2


def test_send_same_ref_multiple_times_intra_actor(velo: None, flavor: Flavor) -> None:
    """Ports test_rdt_gloo.py::test_send_same_ref_multiple_times_intra_actor: one ref twice
    in one task of the actor that made it."""
    (actor,) = peers(flavor, ON_A)
    small_tensor = flavor.randn(1)
    ref = actor.echo.remote(small_tensor)
    assert flavor.same(ray.get(actor.add.remote(ref, ref), timeout=60), small_tensor * 2)


def test_mix_cpu_gpu_data(velo: None, flavor: Flavor, placement: Placement) -> None:
    """Ports test_rdt_gloo.py::test_mix_cpu_gpu_data: a value and an int in one return."""
    sender, receiver = peers(flavor, *placement)
    tensor, cpu_data = flavor.randn(1), 17
    result = ray.get(receiver.double.remote(sender.echo.remote([tensor, cpu_data])), timeout=60)
    assert flavor.same(result[0], tensor * 2)
    assert result[1] == cpu_data * 2


def test_object_in_plasma(velo: None, flavor: Flavor, placement: Placement) -> None:
    """Ports test_rdt_gloo.py::test_object_in_plasma: beside the value, 1 MB of bytes, large
    enough for Ray's object store instead of the task reply."""
    sender, receiver = peers(flavor, *placement)
    tensor, cpu_data = flavor.randn(1), b"1" * 1000 * 1000
    result = ray.get(receiver.double.remote(sender.echo.remote([tensor, cpu_data])), timeout=60)
    assert flavor.same(result[0], tensor * 2)
    assert result[1] == cpu_data * 2


def test_multiple_tensors(velo: None, flavor: Flavor, placement: Placement) -> None:
    """Ports test_rdt_gloo.py::test_multiple_tensors: two values, an int and two TensorDicts
    in one return (0 in the TensorDicts' places where tensordict is missing, as the original
    does, and for VELO_NUMPY, whose arrays a TensorDict cannot hold)."""
    sender, receiver = peers(flavor, *placement)
    with_td = support_tensordict and flavor.transport == VELO
    tensor1, tensor2, cpu_data = flavor.randn(1, seed=1), flavor.randn(2, seed=2), 5
    if with_td:
        td1 = TensorDict({"action1": torch.randn(2), "reward1": torch.randn(2)}, batch_size=[2])
        td2 = TensorDict({"action2": torch.randn(2), "reward2": torch.randn(2)}, batch_size=[2])
    else:
        td1 = td2 = 0
    ref = sender.echo.remote([tensor1, tensor2, cpu_data, td1, td2])
    result = ray.get(receiver.double.remote(ref), timeout=GET_TIMEOUT_S)
    assert flavor.same(result[0], tensor1 * 2)
    assert flavor.same(result[1], tensor2 * 2)
    assert result[2] == cpu_data * 2
    if with_td:
        assert torch.equal(result[3]["action1"], td1["action1"] * 2)
        assert torch.equal(result[3]["reward1"], td1["reward1"] * 2)
        assert torch.equal(result[4]["action2"], td2["action2"] * 2)
        assert torch.equal(result[4]["reward2"], td2["reward2"] * 2)
    else:
        assert result[3:] == [0, 0]


def test_fetch_rdt_object_to_driver(velo: None, flavor: Flavor, where: dict[str, Any]) -> None:
    """Ports test_rdt_gloo.py::test_fetch_rdt_object_to_driver: the driver reads one value,
    two, and two with an int, through Ray's object store (the actor on the driver's node or
    the other)."""
    (actor,) = peers(flavor, where)
    tensor1, tensor2 = flavor.of([1, 2, 3]), flavor.of([4, 5, 6])
    got = ray.get(actor.echo.remote(tensor1), _use_object_store=True, timeout=60)
    assert flavor.same(got, tensor1)
    got = ray.get(actor.echo.remote([tensor1, tensor2]), _use_object_store=True, timeout=60)
    assert flavor.same(got[0], tensor1)
    assert flavor.same(got[1], tensor2)
    got = ray.get(actor.echo.remote([tensor1, tensor2, 7]), _use_object_store=True, timeout=60)
    assert flavor.same(got[0], tensor1)
    assert flavor.same(got[1], tensor2)
    assert got[2] == 7


def test_invalid_tensor_transport(velo: None) -> None:
    """Ports test_rdt_gloo.py::test_invalid_tensor_transport: an unknown transport name is
    refused in @ray.method, in .options() and in ray.put (transport-agnostic: run once, with
    the VELO actor)."""
    with pytest.raises(ValueError, match="Invalid tensor transport"):

        @ray.remote
        class InvalidActor:
            @ray.method(tensor_transport="invalid")
            def echo(self, data: Any) -> Any:
                return data

    (actor,) = peers(FLAVORS[VELO], ON_A)
    with pytest.raises(ValueError, match="Invalid tensor transport"):
        actor.double.options(tensor_transport="invalid").remote(torch.randn(1))
    with pytest.raises(ValueError, match="Invalid tensor transport"):
        ray.put(torch.randn(1), _tensor_transport="invalid")


needs_tensordict = pytest.mark.skipif(
    not support_tensordict, reason="tensordict is not installed (Ray skips these likewise)"
)


@needs_tensordict
def test_tensordict_transfer(velo: None, placement: Placement) -> None:
    """Ports test_rdt_gloo.py::test_tensordict_transfer: a TensorDict's tensors travel by
    VELO and the receiver doubles them (VELO only: a TensorDict holds torch tensors)."""
    sender, receiver = peers(FLAVORS[VELO], *placement)
    td = TensorDict({"action": torch.randn(2), "reward": torch.randn(2)}, batch_size=[2])
    result = ray.get(receiver.double.remote(sender.echo.remote(td)), timeout=GET_TIMEOUT_S)
    assert torch.equal(result["action"], td["action"] * 2)
    assert torch.equal(result["reward"], td["reward"] * 2)


@needs_tensordict
def test_nested_tensordict(velo: None, placement: Placement) -> None:
    """Ports test_rdt_gloo.py::test_nested_tensordict: a TensorDict inside a TensorDict
    (VELO only)."""
    sender, receiver = peers(FLAVORS[VELO], *placement)
    inner_td = TensorDict({"action": torch.randn(2), "reward": torch.randn(2)}, batch_size=[2])
    outer_td = TensorDict({"inner_td": inner_td, "test": torch.randn(2)}, batch_size=[2])
    result = ray.get(receiver.double.remote(sender.echo.remote(outer_td)), timeout=60)
    assert torch.equal(result["inner_td"]["action"], inner_td["action"] * 2)
    assert torch.equal(result["inner_td"]["reward"], inner_td["reward"] * 2)
    assert torch.equal(result["test"], outer_td["test"] * 2)


@needs_tensordict
def test_tensor_extracted_from_tensordict_in_rdt_store(velo: None) -> None:
    """Ports test_rdt_gloo.py::test_tensor_extracted_from_tensordict_in_rdt_store: Ray's
    store holds a TensorDict's tensors as a list (VELO only)."""
    (actor,) = peers(FLAVORS[VELO], ON_A)
    td = TensorDict({"action": torch.randn(2), "reward": torch.randn(2)}, batch_size=[2])
    rdt_ref = actor.echo.remote(td)
    stored = ray.get(actor.get_out_of_band_tensors.remote(rdt_ref.hex()), timeout=60)
    assert len(stored) == 2
    assert torch.equal(stored[0], td["action"])
    assert torch.equal(stored[1], td["reward"])


def options_actor(enable_tensor_transport: bool) -> Any:
    """test_dynamic_tensor_transport_via_options's actor (no method naming a transport)."""

    class OptionsActor:
        def normal_method(self) -> str:
            return "normal"

        def tensor_method(self, transport: str) -> Any:
            return FLAVORS[transport].randn(5, 5)

        def double(self, data: Any) -> Any:
            return data * 2

    if enable_tensor_transport:
        return ray.remote(num_cpus=0, enable_tensor_transport=True)(OptionsActor)
    return ray.remote(num_cpus=0)(OptionsActor)


OPTIONS_ACTORS = {enabled: options_actor(enabled) for enabled in (True, False)}


@pytest.mark.parametrize("enable_tensor_transport", [True, False])
def test_dynamic_tensor_transport_via_options(
    velo: None, flavor: Flavor, placement: Placement, enable_tensor_transport: bool
) -> None:
    """Ports test_rdt_gloo.py::test_dynamic_tensor_transport_via_options: .options(
    tensor_transport=...) works on an actor declared with enable_tensor_transport=True and
    is refused, saying so, on one without."""
    cls = OPTIONS_ACTORS[enable_tensor_transport]
    sender, receiver = cls.options(**placement[0]).remote(), cls.options(**placement[1]).remote()
    assert ray.get(sender.normal_method.remote(), timeout=GET_TIMEOUT_S) == "normal"
    method = sender.tensor_method.options(tensor_transport=flavor.transport)
    if enable_tensor_transport:
        ref = method.remote(flavor.transport)
        tensor = ray.get(ref, _use_object_store=True, timeout=GET_TIMEOUT_S)
        result = ray.get(receiver.double.remote(ref), _use_object_store=True, timeout=60)
        assert flavor.same(result, tensor * 2)
    else:
        expected = re.escape(
            f'Currently, methods with .options(tensor_transport="{flavor.transport}") are not '
            "supported when enable_tensor_transport=False. Please set "
            "@ray.remote(enable_tensor_transport=True) on the actor class definition."
        )
        with pytest.raises(ValueError, match=expected):
            method.remote(flavor.transport)


def test_app_error_inter_actor(velo: None, flavor: Flavor, placement: Placement) -> None:
    """Ports test_rdt_gloo.py::test_app_error_inter_actor: a receiver sees the sender's
    exception, and the pair still moves a value after."""
    src_actor, dst_actor = peers(flavor, *placement)
    ref = src_actor.fail.options(tensor_transport=flavor.transport).remote("test_app_error")
    with pytest.raises(Exception, match="test_app_error"):
        ray.get(dst_actor.double.remote(ref), timeout=GET_TIMEOUT_S)
    small_tensor = flavor.randn(1)
    result = ray.get(dst_actor.double.remote(src_actor.echo.remote(small_tensor)), timeout=60)
    assert flavor.same(result, small_tensor * 2)


def test_app_error_intra_actor(velo: None, flavor: Flavor) -> None:
    """Ports test_rdt_gloo.py::test_app_error_intra_actor: as above, within one actor."""
    (actor,) = peers(flavor, ON_A)
    ref = actor.fail.options(tensor_transport=flavor.transport).remote("test_app_error")
    with pytest.raises(Exception, match="test_app_error"):
        ray.get(actor.double.remote(ref), timeout=GET_TIMEOUT_S)
    small_tensor = flavor.randn(1)
    result = ray.get(actor.double.remote(actor.echo.remote(small_tensor)), timeout=60)
    assert flavor.same(result, small_tensor * 2)


def test_app_error_fetch_to_driver(velo: None, flavor: Flavor) -> None:
    """Ports test_rdt_gloo.py::test_app_error_fetch_to_driver: the driver sees the actor's
    exception through Ray's object store, then reads a value."""
    (actor,) = peers(flavor, ON_A)
    ref = actor.fail.options(tensor_transport=flavor.transport).remote("test_app_error")
    with pytest.raises(Exception, match="test_app_error"):
        ray.get(ref, _use_object_store=True, timeout=GET_TIMEOUT_S)
    small_tensor = flavor.of([1, 2, 3])
    got = ray.get(actor.echo.remote(small_tensor), _use_object_store=True, timeout=60)
    assert flavor.same(got, small_tensor)


def failing_rdt_actor(transport: str) -> Any:
    """test_rdt_gloo.py's FailingRDTActor for ``transport``."""
    flavor = FLAVORS[transport]

    @ray.remote(num_cpus=0)
    class FailingRDTActor:
        def __init__(self) -> None:
            self.attempts = 0

        @ray.method(tensor_transport=transport, max_task_retries=1, retry_exceptions=[ValueError])
        def fail_first_attempt(self) -> Any:
            self.attempts += 1
            if self.attempts == 1:
                raise ValueError("first-attempt failure")
            return flavor.of([1, 2, 3])

        @ray.method(tensor_transport=transport, max_task_retries=1, retry_exceptions=[ValueError])
        def rdt_obj_always_fails(self) -> Any:
            self.attempts += 1
            raise ValueError("permanent failure")

        def consume(self, tensor: Any) -> Any:
            return tensor

        def get_num_rdt_objects(self) -> int:
            return num_rdt_objects()

    return FailingRDTActor


FAILING_RDT_ACTORS = {t: failing_rdt_actor(t) for t in FLAVORS}


def test_rdt_retry_then_succeeds(velo: None, flavor: Flavor, placement: Placement) -> None:
    """Ports test_rdt_gloo.py::test_rdt_retry_then_succeeds: a return that fails once and is
    retried arrives; the sender holds one entry for it in Ray's store (and one staged slot
    on its node's agent)."""
    cls = FAILING_RDT_ACTORS[flavor.transport]
    sender, receiver = cls.options(**placement[0]).remote(), cls.options(**placement[1]).remote()
    ray.get(sender.__ray_ready__.remote(), timeout=GET_TIMEOUT_S)
    base = live_slots("node_a")
    ref = sender.fail_first_attempt.remote()
    result = ray.get(receiver.consume.remote(ref), timeout=GET_TIMEOUT_S)
    assert flavor.same(result, flavor.of([1, 2, 3]))
    assert ray.get(sender.get_num_rdt_objects.remote(), timeout=60) == 1
    assert live_slots("node_a") == base + 1


def test_rdt_retry_fetch_through_obj_store(velo: None, flavor: Flavor) -> None:
    """Ports test_rdt_gloo.py::test_rdt_retry_fetch_through_obj_store: the retried return
    read by the driver through Ray's object store."""
    sender = FAILING_RDT_ACTORS[flavor.transport].options(**ON_A).remote()
    ref = sender.fail_first_attempt.remote()
    got = ray.get(ref, _use_object_store=True, timeout=GET_TIMEOUT_S)
    assert flavor.same(got, flavor.of([1, 2, 3]))


def test_rdt_retries_exhausted_raises(velo: None, flavor: Flavor, placement: Placement) -> None:
    """Ports test_rdt_gloo.py::test_rdt_retries_exhausted_raises: when every attempt fails,
    the receiver's task raises the user's exception."""
    cls = FAILING_RDT_ACTORS[flavor.transport]
    sender, receiver = cls.options(**placement[0]).remote(), cls.options(**placement[1]).remote()
    ref = sender.rdt_obj_always_fails.remote()
    with pytest.raises(Exception, match="permanent failure"):
        ray.get(receiver.consume.remote(ref), timeout=GET_TIMEOUT_S)


def saving_actor(transport: str) -> Any:
    """test_write_after_save's actor for ``transport``."""

    @ray.remote(num_cpus=0, enable_tensor_transport=True)
    class SavingActor:
        @ray.method(tensor_transport=transport)
        def save(self, data: Any) -> Any:
            # numpy arguments arrive read-only (Ray's object store): keep a writable copy
            self.data = np.array(data) if isinstance(data, np.ndarray) else data
            return self.data

        def receive(self, data: Any) -> Any:
            return data

        def increment_saved(self) -> Any:
            ray.experimental.wait_tensor_freed(self.data, timeout=GET_TIMEOUT_S)
            self.data += 1
            return self.data

    return SavingActor


SAVING_ACTORS = {t: saving_actor(t) for t in FLAVORS}


def test_write_after_save(velo: None, flavor: Flavor, placement: Placement) -> None:
    """Ports test_rdt_gloo.py::test_write_after_save: an actor that kept the value it
    returned waits (wait_tensor_freed) until the ref is gone before writing it; the
    receiver got the value as returned. VELO_NUMPY's actor keeps a writable copy of its
    read-only numpy argument."""
    cls = SAVING_ACTORS[flavor.transport]
    sender, receiver = cls.options(**placement[0]).remote(), cls.options(**placement[1]).remote()
    medium_tensor = flavor.randn(500, 500)
    ref = sender.save.remote(medium_tensor)
    tensor1 = sender.increment_saved.remote()
    tensor2 = receiver.receive.remote(ref)
    with pytest.raises(ray.exceptions.GetTimeoutError):
        ray.get(tensor1, timeout=1)  # still waiting: the ref lives
    del ref
    assert flavor.same(ray.get(tensor1, timeout=GET_TIMEOUT_S), medium_tensor + 1)
    assert flavor.same(ray.get(tensor2, timeout=GET_TIMEOUT_S), medium_tensor)


def free_like_ray(obj_id: str, transport: str, meta: Any) -> None:
    """What Ray's __ray_free__ does when an object's last ref goes: the transport's
    garbage_collect (VELO ends its staged copy), then the store's pop."""
    from ray.experimental.rdt.util import get_tensor_transport_manager

    rdt_store = ray._private.worker.global_worker.rdt_manager.rdt_store
    tensors = rdt_store.get_object(obj_id)
    get_tensor_transport_manager(transport).garbage_collect(obj_id, meta, tensors)
    rdt_store.pop_object(obj_id)


def test_wait_tensor_freed(velo: None, flavor: Flavor) -> None:
    """Ports test_rdt_gloo.py::test_wait_tensor_freed: wait_tensor_freed times out while
    Ray's store holds the tensor and returns once another thread frees it. The original's
    free is a bare pop (GLOO's metadata holds nothing); VELO stages a copy when Ray adds
    the object, so the free is Ray's own (garbage_collect, then pop)."""
    rdt_store = ray._private.worker.global_worker.rdt_manager.rdt_store
    obj_id, tensor = "random_id", flavor.randn(1)
    meta = rdt_store.add_object_primary(obj_id, [tensor], flavor.transport)
    assert rdt_store.has_object(obj_id)
    with pytest.raises(TimeoutError):
        ray.experimental.wait_tensor_freed(tensor, timeout=1)
    assert rdt_store.has_object(obj_id)

    gc = threading.Timer(0.1, free_like_ray, args=(obj_id, flavor.transport, meta))
    gc.start()
    ray.experimental.wait_tensor_freed(tensor, timeout=30)
    gc.join()
    assert not rdt_store.has_object(obj_id)


def test_wait_tensor_freed_double_tensor(velo: None, flavor: Flavor) -> None:
    """Ports test_rdt_gloo.py::test_wait_tensor_freed_double_tensor: a tensor in two
    objects is freed when both are (freed as Ray does, as above)."""
    rdt_store = ray._private.worker.global_worker.rdt_manager.rdt_store
    obj_id1, obj_id2, tensor = "random_id1", "random_id2", flavor.randn(1)
    meta1 = rdt_store.add_object_primary(obj_id1, [tensor], flavor.transport)
    meta2 = rdt_store.add_object_primary(obj_id2, [tensor], flavor.transport)
    assert rdt_store.has_object(obj_id1)
    assert rdt_store.has_object(obj_id2)
    with pytest.raises(TimeoutError):
        ray.experimental.wait_tensor_freed(tensor, timeout=1)

    gc = threading.Timer(0.1, free_like_ray, args=(obj_id1, flavor.transport, meta1))
    gc.start()
    with pytest.raises(TimeoutError):
        ray.experimental.wait_tensor_freed(tensor, timeout=1)
    gc.join()
    assert not rdt_store.has_object(obj_id1)

    gc = threading.Timer(0.1, free_like_ray, args=(obj_id2, flavor.transport, meta2))
    gc.start()
    ray.experimental.wait_tensor_freed(tensor, timeout=30)
    gc.join()
    assert not rdt_store.has_object(obj_id2)


def test_send_back_and_dst_warning(velo: None, flavor: Flavor) -> None:
    """Ports test_rdt_gloo.py::test_send_back_and_dst_warning: a ref sent back to its maker
    and to another actor warns once; sending it again does not (asserted here, the
    original only said so)."""
    src_actor, dst_actor = peers(flavor, ON_A, ON_A)
    tensor = flavor.of([1, 2, 3])
    with pytest.warns(UserWarning, match=r"RDT ObjectRef\(.+\)"):
        t = src_actor.echo.remote(tensor)
        t1 = src_actor.echo.remote(t)
        t2 = dst_actor.echo.remote(t)
        ray.get([t1, t2], _use_object_store=True, timeout=GET_TIMEOUT_S)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t3 = dst_actor.echo.remote(t)
        ray.get(t3, _use_object_store=True, timeout=GET_TIMEOUT_S)
    assert not [w for w in caught if "RDT ObjectRef" in str(w.message)]


def test_duplicate_objectref_transfer(velo: None, placement: Placement) -> None:
    """Ports test_rdt_gloo.py::test_duplicate_objectref_transfer: one ref to two tasks of one
    receiver that each write into it in place; each gets a clean copy. VELO only: VELO_NUMPY
    hands read-only arrays (as Ray's object store does), which numpy refuses to write."""
    flavor = FLAVORS[VELO]
    actor0, actor1 = peers(flavor, *placement)
    small_tensor = flavor.randn(1)
    ref = actor0.echo.remote(small_tensor)
    result1, result2 = actor1.increment.remote(ref), actor1.increment.remote(ref)
    val1, val2 = ray.get([result1, result2], timeout=GET_TIMEOUT_S)
    assert flavor.same(val1, small_tensor + 1)
    assert flavor.same(val2, small_tensor + 1)


def creator_actor(transport: str) -> Any:
    """test_transfer_from_not_actor_creator's actor for ``transport``."""
    flavor = FLAVORS[transport]

    @ray.remote(num_cpus=0)
    class Actor:
        @ray.method(tensor_transport=transport)
        def create(self) -> Any:
            return flavor.of([1, 2, 3])

        def consume(self, obj: Any) -> Any:
            return obj

        def do_transfer(self, a1: Any, a2: Any) -> Any:
            return ray.get(a1.consume.remote(a2.create.remote()), timeout=GET_TIMEOUT_S)

    return Actor


CREATOR_ACTORS = {t: creator_actor(t) for t in FLAVORS}


def test_transfer_from_not_actor_creator(velo: None, flavor: Flavor, placement: Placement) -> None:
    """Ports test_rdt_gloo.py::test_transfer_from_not_actor_creator: an actor that created
    neither of two others has one's return passed to the other (no collective group; the
    creator on node a, the consumer on node a or b, the submitter on node a)."""
    cls = CREATOR_ACTORS[flavor.transport]
    consumer = cls.options(**placement[1]).remote()
    creator = cls.options(**placement[0]).remote()
    submitter = cls.options(**ON_A).remote()
    got = ray.get(submitter.do_transfer.remote(consumer, creator), timeout=GET_TIMEOUT_S)
    assert flavor.same(got, flavor.of([1, 2, 3]))


def error_actor(transport: str) -> Any:
    """test_rdt_gloo.py's ErrorActor for ``transport`` (its blocking tasks wait on a
    signal instead of sleeping 100 s)."""

    @ray.remote(num_cpus=0)
    class ErrorActor:
        @ray.method(tensor_transport=transport)
        def send(self, tensor: Any) -> Any:
            return tensor

        def recv(self, tensor: Any) -> Any:
            return tensor

        @ray.method(concurrency_group="_ray_system")
        def block_background_thread(self, signal: Any) -> None:
            ray.get(signal.wait.remote())

        def block_main_thread(self, signal: Any) -> None:
            ray.get(signal.wait.remote())

    return ErrorActor


ERROR_ACTORS = {t: error_actor(t) for t in FLAVORS}


def test_send_actor_dies_before_creating(velo: None, flavor: Flavor, placement: Placement) -> None:
    """Ports test_rdt_gloo.py::test_send_actor_dies_before_creating: the sender is killed
    before it creates the object; the receiver's task fails with ActorDiedError."""
    cls = ERROR_ACTORS[flavor.transport]
    sender, receiver = cls.options(**placement[0]).remote(), cls.options(**placement[1]).remote()
    signal = SignalActor.remote()
    sender.block_main_thread.remote(signal)
    rdt_ref = sender.send.remote(flavor.randn(100, 100))
    result_ref = receiver.recv.remote(rdt_ref)
    ray.kill(sender)
    with pytest.raises(ray.exceptions.ActorDiedError):
        ray.get(result_ref, timeout=GET_TIMEOUT_S)


@contextmanager
def rdt_manager_log(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Capture the driver's RDT manager log (Ray's "ray" logger does not propagate)."""
    logger = logging.getLogger("ray.experimental.rdt.rdt_manager")
    caplog.set_level(logging.INFO, logger=logger.name)
    logger.addHandler(caplog.handler)
    try:
        yield
    finally:
        logger.removeHandler(caplog.handler)


def test_recv_actor_dies(
    velo: None, flavor: Flavor, placement: Placement, caplog: pytest.LogCaptureFixture
) -> None:
    """Ports test_rdt_gloo.py::test_recv_actor_dies: the receiver is killed before its
    receive ran; Ray logs the failed transfer and the receiver's task fails with
    ActorDiedError. GLOO cannot abort a transfer, so Ray also killed the sender and
    destroyed the collective group (the original asserts both); VELO can (Ray only tells
    the receiver), so here the sender lives on and its object still reaches a new
    receiver."""
    cls = ERROR_ACTORS[flavor.transport]
    sender, receiver = cls.options(**placement[0]).remote(), cls.options(**placement[1]).remote()
    signal = SignalActor.remote()
    tensor = flavor.randn(100, 100)
    with rdt_manager_log(caplog):
        rdt_ref = sender.send.remote(tensor)
        receiver.block_background_thread.remote(signal)
        result_ref = receiver.recv.remote(rdt_ref)
        ray.kill(receiver)
        wait_for(
            "Ray logged the failed transfer",
            lambda: any(
                re.search(r"RDT transfer with.*failed", r.getMessage()) for r in caplog.records
            ),
        )
    with pytest.raises(ray.exceptions.ActorDiedError):
        ray.get(result_ref, timeout=GET_TIMEOUT_S)
    new_receiver = cls.options(**placement[1]).remote()
    assert flavor.same(ray.get(new_receiver.recv.remote(rdt_ref), timeout=60), tensor)
