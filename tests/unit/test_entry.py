"""The agent's entry points, declared once (ray_velo.protocol.entry): every declaration is served, the
carriers' tables come from it, and the wire's numbers never move."""

from __future__ import annotations

from pathlib import Path

import pytest

from ray_velo.local import channel
from ray_velo.owner.service import HANDLERS, OwnerService
from ray_velo.protocol import frames
from ray_velo.protocol.entry import ENTRIES, OWNER_HANDLERS, WIRE_METHODS
from ray_velo.testing import AgentPair

#: The wire's numbers as agents of earlier versions send them: never renumbered.
WIRE_AS_SHIPPED = (
    "_rv_metadata", "_rv_acquire", "_rv_ref", "_rv_detach", "_rv_release", "_rv_lease_renew",
    "_rv_copy", "_rv_relay", "_rv_relay_end", "_rv_window",
)  # fmt: skip


def test_every_entry_point_is_served(tmp_path: Path) -> None:
    """Each entry resolves, on a real agent, to a method of the role it names; each is a
    method of the Ray actor; each owner handler a method of the owner's service. Names are
    unique, and an unknown name is refused."""
    from ray_velo.actors.directory import _RendezvousActor

    names = [e.name for e in ENTRIES]
    assert len(names) == len(set(names))
    with AgentPair(tmp_path) as pair:
        for entry in ENTRIES:
            assert callable(getattr(_RendezvousActor, entry.name, None)), entry.name
            served = pair.owner.entry(entry.name)
            assert callable(served), entry.name
            assert served.__name__ == entry.serves.rsplit(".", 1)[-1], entry.name
        with pytest.raises(ValueError, match="unknown entry point"):
            pair.owner.entry("_rv_nonsense")
    assert all(callable(getattr(OwnerService, name, None)) for name in OWNER_HANDLERS)


def test_the_carriers_tables_are_the_declarations() -> None:
    assert frames.WIRE_METHODS == WIRE_METHODS == WIRE_AS_SHIPPED
    assert HANDLERS == OWNER_HANDLERS
    assert {
        "stage_reserve", "local_acquire", "fetch_remote", "fetch_into_writer", "route",
    } == channel.CHANNEL_METHODS  # fmt: skip
    assert {
        "stage_commit", "stage_abort", "stage_written", "end_lease", "claim_end",
        "release_quietly",
    } == channel.NOTICE_METHODS  # fmt: skip
    assert "_rv_pull" not in WIRE_METHODS, "chunks travel in Ray calls"
