"""The agent's entry points, each declared once; everything else is derived from
:data:`ENTRIES` (docs/architecture.md §8). Pure data: no I/O, no Ray."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, cast

__all__ = [
    "BY_NAME",
    "CHANNEL_CALLS",
    "CHANNEL_NOTICES",
    "ENTRIES",
    "ORDERED_NOTICES",
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

    def served_by(self, agent: object) -> Callable[..., Any]:
        """The method that serves this entry on ``agent`` (the plain agent): the one resolver
        the actor, its socket, its wire and its calls to its own owner go through."""
        target = agent
        for part in self.serves.split("."):
            target = getattr(target, part)
        return cast(Callable[..., Any], target)


# a producer on the node: reserve shared memory, commit it as a slot, or give it back
STAGE_RESERVE = Entry("stage_reserve", "producers.reserve", "loop", socket="call")
STAGE_COMMIT = Entry("stage_commit", "producers.commit", "loop", socket="ordered")
STAGE_ABORT = Entry("stage_abort", "producers.abort", "loop", socket="ordered")
STAGE_WRITTEN = Entry("stage_written", "producers.written", "loop", socket="ordered")
# a reader on the node: a lease on a slot it reads in place, and its end
LOCAL_ACQUIRE = Entry("local_acquire", "readers.acquire", "loop", socket="call")
END_LEASE = Entry("end_lease", "readers.end_lease", "loop", socket="ordered")
# a process's fetch from another node (its waits on the owner hold no thread)
FETCH_REMOTE = Entry("fetch_remote", "consumer.fetch", "coroutine", socket="call")
# a tensor transport's receive: a PinnedWriter reserved and the bytes fetched into it
FETCH_INTO_WRITER = Entry("fetch_into_writer", "fetch_into_writer", "coroutine", socket="call")
# a consuming call's claims, and a release nobody waits for
CLAIM_END = Entry("claim_end", "consumer.claim_end", "threads", socket="notice")
RELEASE_QUIETLY = Entry("release_quietly", "consumer.release_quietly", "threads", socket="notice")
# the owner's handlers (the protocol's seven, docs/protocol.md §5, and the windows), as other agents call them
RV_METADATA = Entry("_rv_metadata", "owner._rv_metadata", "loop", wire=0, owner=True)
RV_ACQUIRE = Entry("_rv_acquire", "owner._rv_acquire", "loop", wire=1, owner=True)
RV_REF = Entry("_rv_ref", "owner._rv_ref", "loop", wire=2, owner=True)
RV_DETACH = Entry("_rv_detach", "owner._rv_detach", "loop", wire=3, owner=True)
RV_RELEASE = Entry("_rv_release", "owner._rv_release", "loop", wire=4, owner=True)
RV_LEASE_RENEW = Entry("_rv_lease_renew", "owner._rv_lease_renew", "loop", wire=5, owner=True)
RV_PULL = Entry("_rv_pull", "owner._rv_pull", "threads", owner=True)  # chunks: stays a Ray call
RV_WINDOW = Entry("_rv_window", "owner._rv_window", "loop", wire=9, owner=True)
# node-local copies read by other nodes (broadcast)
RV_COPY = Entry("_rv_copy", "consumer.copy_notice", "loop", wire=6)
RV_RELAY = Entry("_rv_relay", "consumer.relays.serve", "loop", wire=7)
RV_RELAY_END = Entry("_rv_relay_end", "consumer.relays.end", "loop", wire=8)
# caller-owned regions
REGION_ALLOC = Entry("region_alloc", "regions.alloc", "threads")
REGION_STAGE = Entry("region_stage", "regions.stage", "threads")
REGION_UNREGISTER = Entry("region_unregister", "regions.unregister", "threads")
REGION_DEREGISTERED = Entry("region_deregistered", "regions.deregistered", "threads")
# routing, peers, operation
# a process's call to a handle's owner (metadata, ref, detach, release), via its agent
ROUTE = Entry("route", "consumer.route", "loop", socket="call")
UCX_ADDRESS = Entry("ucx_address", "ucx_address", "loop")
REGISTER_PEERS = Entry("register_peers", "peers.register", "threads")
CLEANUP = Entry("cleanup", "cleanup", "threads")
STATUS = Entry("status", "status", "threads")
INJECT_FAULT = Entry("inject_fault", "inject_fault", "threads")
INFO = Entry("info", "info", "coroutine")
PING = Entry("ping", "ping", "coroutine")
SHUTDOWN = Entry("shutdown", "shutdown", "coroutine")

#: Every entry point, in the order declared above.
ENTRIES: tuple[Entry, ...] = tuple(v for v in list(globals().values()) if isinstance(v, Entry))

#: Each entry by name.
BY_NAME: dict[str, Entry] = {e.name: e for e in ENTRIES}

_BY_WIRE = sorted((e.wire, e.name) for e in ENTRIES if e.wire is not None)
#: The wire's methods in number order (index = number on the wire).
WIRE_METHODS: tuple[str, ...] = tuple(name for _, name in _BY_WIRE)
#: What the node's Unix socket carries: calls, notices, and the notices run in order.
CHANNEL_CALLS = frozenset(e.name for e in ENTRIES if e.socket == "call")
CHANNEL_NOTICES = frozenset(e.name for e in ENTRIES if e.socket in ("notice", "ordered"))
ORDERED_NOTICES = frozenset(e.name for e in ENTRIES if e.socket == "ordered")

if len(BY_NAME) != len(ENTRIES):
    raise AssertionError("two entries share a name")
if [number for number, _ in _BY_WIRE] != list(range(len(_BY_WIRE))):
    raise AssertionError(f"wire numbers must run 0..n-1 without a gap: {_BY_WIRE}")
