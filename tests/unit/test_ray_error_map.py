"""The one map from Ray's errors to ours (``ray_velo.agent.calls.map_ray_error``), as a table.

Ray's exception objects are built directly, as Ray builds them when a call fails; no cluster.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from ray import exceptions as ray_errors

from ray_velo.agent.calls import Peer, map_ray_error
from ray_velo.errors import (
    AgentDied,
    HandleNotFound,
    OwnerDied,
    OwnerUnreachable,
    PayloadTooLarge,
    VeloError,
)
from ray_velo.protocol import DataHandle

HANDLE = DataHandle(0x5819998A40A44867, 2, "node-a")
NODE = "node-a"
OBJECT_HEX = "ab" * 14
ACTOR_ID = b"\x01" * 16


def task_error(cause: BaseException) -> ray_errors.RayTaskError:
    return ray_errors.RayTaskError("RendezvousAgent._rv_acquire", "Traceback: ...", cause)


#: Ray's "this callee is gone" errors, each as Ray raises it.
DEAD: dict[str, Callable[[], ray_errors.RayError]] = {
    "RayActorError": lambda: ray_errors.RayActorError(),
    "ActorDiedError": lambda: ray_errors.ActorDiedError(),
    "NodeDiedError": lambda: ray_errors.NodeDiedError("node node-a died"),
    "ObjectLostError": lambda: ray_errors.ObjectLostError(OBJECT_HEX, None, "call site"),
    "OwnerDiedError": lambda: ray_errors.OwnerDiedError(OBJECT_HEX, None, "call site"),
}


@pytest.mark.parametrize("peer", ["agent", "owner"])
@pytest.mark.parametrize(
    "cause",
    [
        HandleNotFound(handle=str(HANDLE), reason="released by its last consumer"),
        PayloadTooLarge(handle=str(HANDLE), size_bytes=2 << 20, limit_bytes=1 << 20),
        VeloError("the agent is shutting down"),
    ],
    ids=["HandleNotFound", "PayloadTooLarge", "VeloError"],
)
def test_an_error_the_callee_raised_comes_back_as_itself(peer: Peer, cause: VeloError) -> None:
    """The owner answered HandleNotFound (or any of our errors): the caller gets that very
    error, not a Ray wrapper around it, whichever peer it called."""
    assert map_ray_error(task_error(cause), peer=peer, handle=HANDLE, node=NODE) is cause


def test_ray_wraps_the_callees_error_as_both_classes_and_the_cause_still_wins() -> None:
    """What ``ray.get`` really raises is ``RayTaskError(HandleNotFound)``, an instance of both
    classes: the map still returns the plain cause (no Ray class, no Ray traceback text)."""
    cause = HandleNotFound(handle=str(HANDLE), reason="expired (TTL)")
    raised = task_error(cause).as_instanceof_cause()
    assert isinstance(raised, HandleNotFound)
    mapped = map_ray_error(raised, peer="owner", handle=HANDLE, node=NODE)
    assert mapped is cause
    assert not isinstance(mapped, ray_errors.RayError)


@pytest.mark.parametrize(
    ("peer", "whom"),
    [
        ("agent", "this node's agent failed"),
        ("owner", f"owner of {HANDLE} on node {NODE} failed"),
    ],
)
def test_a_foreign_error_in_the_callee_becomes_a_velo_error_naming_the_peer(
    peer: Peer, whom: str
) -> None:
    """A bug in the callee raised ValueError: the caller gets a VeloError that says which
    peer failed (the owner's handle and node) and what it raised."""
    mapped = map_ray_error(
        task_error(ValueError("boom in the handler")), peer=peer, handle=HANDLE, node=NODE
    )
    assert type(mapped) is VeloError
    assert str(mapped) == f"{whom}: ValueError('boom in the handler')"


def test_an_unavailable_agent_is_reported_dead() -> None:
    """This node's own agent is unavailable (restarting): the caller's next call starts a
    fresh one, so it is AgentDied."""
    unavailable = ray_errors.ActorUnavailableError("the actor is restarting", ACTOR_ID)
    assert type(map_ray_error(unavailable, peer="agent")) is AgentDied


def test_an_unavailable_owner_is_unreachable_not_dead() -> None:
    """An owner Ray reports unavailable (stalled, or restarting) may come back: the caller
    gets OwnerUnreachable with the handle and node, not OwnerDied."""
    unavailable = ray_errors.ActorUnavailableError("the actor is restarting", ACTOR_ID)
    assert isinstance(unavailable, ray_errors.RayActorError)  # why the order of checks matters
    mapped = map_ray_error(unavailable, peer="owner", handle=HANDLE, node=NODE)
    assert type(mapped) is OwnerUnreachable
    assert (mapped.handle, mapped.node) == (str(HANDLE), NODE)  # type: ignore[attr-defined]
    assert str(HANDLE) in str(mapped) and NODE in str(mapped)


@pytest.mark.parametrize("make", DEAD.values(), ids=DEAD.keys())
def test_a_dead_agent_is_agent_died(make: Callable[[], ray_errors.RayError]) -> None:
    """This node's agent (or its node, or the call's result) is gone: AgentDied."""
    assert type(map_ray_error(make(), peer="agent", handle=HANDLE, node=NODE)) is AgentDied


@pytest.mark.parametrize("make", DEAD.values(), ids=DEAD.keys())
def test_a_dead_owner_is_owner_died_with_its_handle_and_node(
    make: Callable[[], ray_errors.RayError],
) -> None:
    """The owner's actor or node died mid-call: OwnerDied names the handle and the node, so
    the user knows which payload to stage again."""
    mapped = map_ray_error(make(), peer="owner", handle=HANDLE, node=NODE)
    assert type(mapped) is OwnerDied
    assert (mapped.handle, mapped.node) == (str(HANDLE), NODE)  # type: ignore[attr-defined]
    assert str(HANDLE) in str(mapped) and NODE in str(mapped)


@pytest.mark.parametrize("peer", ["agent", "owner"])
@pytest.mark.parametrize(
    "exc",
    [
        ray_errors.GetTimeoutError("Get timed out"),
        ray_errors.TaskCancelledError(),
        ray_errors.RaySystemError("gcs lost"),
        ValueError("not Ray's"),
        KeyboardInterrupt(),
    ],
    ids=["GetTimeoutError", "TaskCancelledError", "RaySystemError", "ValueError", "Interrupt"],
)
def test_any_other_error_is_returned_unchanged(peer: Peer, exc: BaseException) -> None:
    """Errors the map has no meaning for come back as the same object, for the caller to
    re-raise with its own traceback."""
    assert map_ray_error(exc, peer=peer, handle=HANDLE, node=NODE) is exc
