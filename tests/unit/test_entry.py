"""The agent's entry points, declared once (ray_velo.protocol.entry): every declaration is served, the
carriers' tables come from it, and the wire's numbers never move."""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

import ray_velo
from ray_velo.client.session import Session
from ray_velo.local import channel
from ray_velo.owner.service import OwnerService
from ray_velo.protocol import entry as entry_module
from ray_velo.protocol import frames
from ray_velo.protocol.entry import ENTRIES, WIRE_METHODS
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
            served = pair.owner.serve(entry)
            assert callable(served), entry.name
            assert served.__name__ == entry.serves.rsplit(".", 1)[-1], entry.name
    owner_handlers = [e.name for e in ENTRIES if e.owner]
    assert all(callable(getattr(OwnerService, name, None)) for name in owner_handlers)


def test_the_carriers_tables_are_the_declarations() -> None:
    assert frames.WIRE_METHODS == WIRE_METHODS == WIRE_AS_SHIPPED
    assert {
        "stage_reserve", "local_acquire", "fetch_remote", "fetch_into_writer", "route",
    } == channel.CHANNEL_METHODS  # fmt: skip
    assert {
        "stage_commit", "stage_abort", "stage_written", "end_lease", "claim_end",
        "release_quietly",
    } == channel.NOTICE_METHODS  # fmt: skip
    assert "_rv_pull" not in WIRE_METHODS, "chunks travel in Ray calls"


def test_the_actors_entry_points_are_methods_written_in_its_class() -> None:
    """Each entry point is a method the actor's class body declares (none added at run time),
    so a reader finds ``_rv_release`` where the actor is: a ``def`` of its own, or
    ``_rv_release = _served(entries.RV_RELEASE)``, the constant of the same entry."""
    from ray_velo.actors import directory

    tree = ast.parse(textwrap.dedent(inspect.getsource(directory._RendezvousActor)))
    declared: dict[str, str] = {}
    for node in tree.body[0].body:  # type: ignore[attr-defined]
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            declared[node.name] = node.name
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            (target,) = node.targets
            (constant,) = node.value.args
            assert isinstance(target, ast.Name) and isinstance(constant, ast.Attribute)
            declared[target.id] = getattr(entry_module, constant.attr).name
    for entry in ENTRIES:
        assert declared.get(entry.name) == entry.name, entry.name
        method = vars(directory._RendezvousActor)[entry.name]
        assert method.__name__ == entry.name, entry.name


def test_a_process_calls_its_agent_through_a_typed_client() -> None:
    """Every entry the node's socket carries is a method of the session (the process's
    client of its agent), with the entry's name."""
    for entry in ENTRIES:
        if entry.socket:
            assert callable(getattr(Session, entry.name, None)), entry.name


def library_files() -> list[Path]:
    root = Path(ray_velo.__file__).parent
    files = [p for p in root.rglob("*.py") if p.name != "entry.py" or p.parent.name != "protocol"]
    return sorted(set(files) | set((root / "actors").resolve().rglob("*.py")))


#: The ways code reaches an entry point by name: carriers' calls, lookups, wire frames.
CARRIER_CALLS = {
    "call", "call_async", "send", "notify", "route", "entry", "getattr", "_owner_call",
    "to_owner", "encode_request", "handle", "remote",
}  # fmt: skip


def entry_strings(source: str) -> list[str]:
    """String literals naming an entry point where code reaches a carrier with them or
    compares with them."""
    names = {e.name for e in ENTRIES}
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            values = [*node.args, *(k.value for k in node.keywords)]
            values = values if called in CARRIER_CALLS else []
        elif isinstance(node, ast.Compare):
            values = [node.left, *node.comparators]
        else:
            continue
        found += [
            f"line {v.lineno}: {v.value!r}"
            for v in values
            if isinstance(v, ast.Constant) and v.value in names
        ]
    return found


def test_no_call_site_names_an_entry_point_by_string() -> None:
    """Code reaches an entry point through its declaration (a constant of
    ray_velo.protocol.entry, or a typed client's method), never by a string literal: a typo
    fails the type check, not a cluster at run time."""
    offenders = {str(p): f for p in library_files() if (f := entry_strings(p.read_text()))}
    assert not offenders, offenders
    probe = "link.call('_rv_window', b'', None)\nif method == 'route':\n    getattr(a, 'ping')\n"
    assert len(entry_strings(probe)) == 3  # the check sees each kind of site
