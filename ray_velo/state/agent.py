"""The agent's three pure state objects, built together over one buffer ledger; the cross-cutting
sweeps reach them in the order written here (docs/architecture.md §4). No I/O."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ray_velo.protocol.handle import DataHandle
from ray_velo.state.consumer import ConsumerState
from ray_velo.state.ledger import Effects
from ray_velo.state.owner import PULL_GRACE_S, OwnerState
from ray_velo.state.reservations import Reservations

__all__ = ["AgentStates", "Reaped"]


@dataclass(slots=True)
class Reaped:
    """What the death of processes leaves the caller to do: give back ``unclaim`` (one
    entry per claim) to the handles' owners, and wake whoever waits for the commit of
    ``never_committed`` slots."""

    unclaim: list[DataHandle] = field(default_factory=list)
    never_committed: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class AgentStates:
    """One agent's state objects."""

    owner: OwnerState
    reservations: Reservations
    consumer: ConsumerState

    @classmethod
    def over(cls, owner: OwnerState) -> AgentStates:
        """The reservations and the consumer-side state over ``owner`` (and its ledger)."""
        return cls(owner, Reservations(owner), ConsumerState(owner, owner.id_key))

    @classmethod
    def new(
        cls,
        worker_id: int,
        node: str = "",
        *,
        pull_grace_s: float = PULL_GRACE_S,
        id_key: bytes | None = None,
    ) -> AgentStates:
        """Fresh state objects for agent incarnation ``worker_id`` (``id_key``: the key of
        its slot, lease and relay-lease ids; random by default, a test passes one to replay
        a run)."""
        return cls.over(OwnerState(worker_id, node, pull_grace_s=pull_grace_s, id_key=id_key))

    def sweep(self, now: float, fx: Effects) -> int:
        """Expire TTLs, lease deadlines, pull graces, relay leases and idle kept copies.
        Returns the RDMA leases reaped."""
        rdma_reaped, _ = self.owner.sweep(now, fx)
        self.consumer.sweep(now, fx)
        return rdma_reaped

    def next_due(self) -> float | None:
        """When :meth:`sweep` has something to do next (None: nothing is timed)."""
        due = [d for d in (self.owner.next_due(), self.consumer.next_due()) if d is not None]
        return min(due, default=None)

    def transfers_in_flight(self) -> int:
        """Transfers of this node moving bytes now: leases other nodes GET or pull under,
        and this node's own fetches."""
        owner = self.owner.counts()
        leases = owner.rdma_leases + owner.chunked_leases + owner.wire_leases
        return leases + self.consumer.fetches_in_flight

    def watched_pids(self) -> set[int]:
        """Processes whose death matters: readers, producers, claimers, followed producers."""
        pids = self.owner.watched_pids() | self.reservations.pids() | self.consumer.claim_pids()
        return pids - {0}

    def reap(self, dead: Iterable[int], now: float, fx: Effects) -> Reaped:
        """Processes ``dead`` died: their leases, reservations and claims end."""
        dead = set(dead)
        self.owner.reap(dead, now, fx)
        never_committed = self.reservations.reap(dead, fx)
        return Reaped(self.consumer.reap(dead), never_committed)

    def clear(self, now: float, fx: Effects) -> int:
        """Shutdown: every reservation, destination, copy and slot ends and its buffer goes
        back (not the quarantined ones). Returns the slots freed."""
        self.reservations.clear(fx)
        self.consumer.clear(fx)
        return self.owner.clear(now, fx)

    def validate(self) -> None:
        """Each object checks its invariants and its part of the ledger (together: all of
        it).

        Raises:
            AssertionError: an invariant is broken; the message names it.
        """
        self.owner.validate()
        self.reservations.validate()
        self.consumer.validate()
