"""The agent's entry points, each declared once; everything else is derived from
:data:`ENTRIES` (docs/architecture.md §8). Pure data: no I/O, no Ray."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "BLOCKING",
    "BY_NAME",
    "CHANNEL_CALLS",
    "CHANNEL_NOTICES",
    "COROUTINES",
    "ENTRIES",
    "ORDERED_NOTICES",
    "OWNER_HANDLERS",
    "QUICK",
    "WIRE_METHODS",
    "Entry",
]

Runs = Literal["loop", "threads", "coroutine"]
Socket = Literal["", "call", "notice", "ordered"]


@dataclass(frozen=True, slots=True)
class Entry:
    """One entry point of the agent.

    ``serves``: the method that runs it, as a path from the agent (``"producers.reserve"``:
    ``agent.producers.reserve``; a bare name is a method of the agent itself).
    ``runs``: ``loop`` (a short change of the agent's state, run on its event loop and moved
    to its threads only if it reaches a step that may block), ``threads`` (it may wait on
    peers, map or copy) or ``coroutine`` (an async method of the actor itself).
    ``socket``: how the node's Unix socket carries it: ``call`` (the caller waits for the
    answer), ``notice`` (nobody waits), ``ordered`` (a notice run in order with the calls of its
    connection), or not at all. ``wire``: its number on the agents' TCP wire, or None.
    ``owner``: one of the owner's handlers (a peer's acquire, release...).
    """

    name: str
    serves: str
    runs: Runs
    socket: Socket = ""
    wire: int | None = None
    owner: bool = False


ENTRIES: tuple[Entry, ...] = (
    # a producer on the node: reserve shared memory, commit it as a slot, or give it back
    Entry("stage_reserve", "producers.reserve", "loop", socket="call"),
    Entry("stage_commit", "producers.commit", "loop", socket="ordered"),
    Entry("stage_abort", "producers.abort", "loop", socket="ordered"),
    Entry("stage_written", "producers.written", "loop", socket="ordered"),
    # a reader on the node: a lease on a slot it reads in place, and its end
    Entry("local_acquire", "readers.acquire", "loop", socket="call"),
    Entry("end_lease", "readers.end_lease", "loop", socket="ordered"),
    # a process's fetch from another node (its waits on the owner hold no thread)
    Entry("fetch_remote", "consumer.fetch", "coroutine", socket="call"),
    # a tensor transport's receive: a PinnedWriter reserved and the bytes fetched into it
    Entry("fetch_into_writer", "fetch_into_writer", "coroutine", socket="call"),
    # a consuming call's claims, and a release nobody waits for
    Entry("claim_end", "consumer.claim_end", "threads", socket="notice"),
    Entry("release_quietly", "consumer.release_quietly", "threads", socket="notice"),
    # the owner's handlers (the protocol's seven, docs/protocol.md §5, and the windows), as other agents call them
    Entry("_rv_metadata", "owner._rv_metadata", "loop", wire=0, owner=True),
    Entry("_rv_acquire", "owner._rv_acquire", "loop", wire=1, owner=True),
    Entry("_rv_ref", "owner._rv_ref", "loop", wire=2, owner=True),
    Entry("_rv_detach", "owner._rv_detach", "loop", wire=3, owner=True),
    Entry("_rv_release", "owner._rv_release", "loop", wire=4, owner=True),
    Entry("_rv_lease_renew", "owner._rv_lease_renew", "loop", wire=5, owner=True),
    Entry("_rv_pull", "owner._rv_pull", "threads", owner=True),  # chunks: stays a Ray call
    Entry("_rv_window", "owner._rv_window", "loop", wire=9, owner=True),
    # node-local copies read by other nodes (broadcast)
    Entry("_rv_copy", "consumer.copy_notice", "loop", wire=6),
    Entry("_rv_relay", "consumer.relays.serve", "loop", wire=7),
    Entry("_rv_relay_end", "consumer.relays.end", "loop", wire=8),
    # caller-owned regions
    Entry("region_alloc", "regions.alloc", "threads"),
    Entry("region_stage", "regions.stage", "threads"),
    Entry("region_unregister", "regions.unregister", "threads"),
    Entry("region_deregistered", "regions.deregistered", "threads"),
    # routing, peers, operation
    # a process's call to a handle's owner (metadata, ref, detach, release), via its agent
    Entry("route", "consumer.route", "loop", socket="call"),
    Entry("ucx_address", "ucx_address", "loop"),
    Entry("register_peers", "peers.register", "threads"),
    Entry("cleanup", "cleanup", "threads"),
    Entry("status", "status", "threads"),
    Entry("inject_fault", "inject_fault", "threads"),
    Entry("info", "info", "coroutine"),
    Entry("ping", "ping", "coroutine"),
    Entry("shutdown", "shutdown", "coroutine"),
)

#: Each entry by name.
BY_NAME: dict[str, Entry] = {e.name: e for e in ENTRIES}

_BY_WIRE = sorted((e.wire, e.name) for e in ENTRIES if e.wire is not None)
#: The wire's methods in number order (index = number on the wire).
WIRE_METHODS: tuple[str, ...] = tuple(name for _, name in _BY_WIRE)
#: The owner's handlers (``OwnerService.handle``, and ``route`` for a peer's handle).
OWNER_HANDLERS = frozenset(e.name for e in ENTRIES if e.owner)
#: What the node's Unix socket carries: calls, notices, and the notices run in order.
CHANNEL_CALLS = frozenset(e.name for e in ENTRIES if e.socket == "call")
CHANNEL_NOTICES = frozenset(e.name for e in ENTRIES if e.socket in ("notice", "ordered"))
ORDERED_NOTICES = frozenset(e.name for e in ENTRIES if e.socket == "ordered")
#: The actor's delegations to the plain agent: on its loop, and on its threads.
QUICK: tuple[str, ...] = tuple(e.name for e in ENTRIES if e.runs == "loop")
BLOCKING: tuple[str, ...] = tuple(e.name for e in ENTRIES if e.runs == "threads")
#: The actor's own async methods.
COROUTINES = frozenset(e.name for e in ENTRIES if e.runs == "coroutine")

if len(BY_NAME) != len(ENTRIES):
    raise AssertionError("two entries share a name")
if [number for number, _ in _BY_WIRE] != list(range(len(_BY_WIRE))):
    raise AssertionError(f"wire numbers must run 0..n-1 without a gap: {_BY_WIRE}")
