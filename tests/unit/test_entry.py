"""The agent's entry points, declared once (ray_velo.entry): every declaration is served, the
carriers' tables come from it, and the wire's numbers never move."""

from __future__ import annotations

from ray_velo.actors.agent import RendezvousAgent
from ray_velo.entry import ENTRIES, OWNER_HANDLERS, WIRE_METHODS
from ray_velo.local import channel
from ray_velo.owner.service import HANDLERS, OwnerService
from ray_velo.protocol import frames

#: The wire's numbers as agents of earlier versions send them: never renumbered.
WIRE_AS_SHIPPED = (
    "_rv_metadata", "_rv_acquire", "_rv_ref", "_rv_detach", "_rv_release", "_rv_lease_renew",
    "_rv_copy", "_rv_relay", "_rv_relay_end", "_rv_window",
)  # fmt: skip


def test_every_entry_point_is_served() -> None:
    """Each delegated entry is a method of the plain agent; each coroutine one, and every
    delegation, a method of the Ray actor; each owner handler a method of the owner's
    service. Names are unique."""
    from ray_velo.actors.directory import _RendezvousActor

    names = [e.name for e in ENTRIES]
    assert len(names) == len(set(names))
    for entry in ENTRIES:
        assert callable(getattr(_RendezvousActor, entry.name, None)), entry.name
        if entry.runs != "coroutine":
            assert callable(getattr(RendezvousAgent, entry.name, None)), entry.name
    assert all(callable(getattr(OwnerService, name, None)) for name in OWNER_HANDLERS)


def test_the_carriers_tables_are_the_declarations() -> None:
    assert frames.WIRE_METHODS == WIRE_METHODS == WIRE_AS_SHIPPED
    assert HANDLERS == OWNER_HANDLERS
    assert {"stage_reserve", "local_acquire", "fetch_remote"} == channel.CHANNEL_METHODS
    assert {
        "stage_commit", "stage_abort", "local_end", "claim_end", "release_quietly"
    } == channel.NOTICE_METHODS  # fmt: skip
    assert "_rv_pull" not in WIRE_METHODS, "chunks travel in Ray calls"
