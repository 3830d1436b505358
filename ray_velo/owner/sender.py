"""The owner as the sender of its bytes over the agents' wire: each bulk read checks its lease
before every piece, and the bytes it is sending stay out of every pool until the piece is
out (docs/architecture.md §13).

Why a lease that ends stops its sends at once: the owner, not the reader, moves the bytes
now, so a lease ended by its release, its TTL, its job or a newer incarnation of its
consumer must not let a byte of memory that was reused reach that reader. The read gate
(``OwnerState.begin_send``) keeps the bytes of the piece in flight (they are parked if the
slot is freed meanwhile); the next piece finds the lease gone and the connection is reset,
so the reader gets an error, never the new bytes. The send copies each piece into the
kernel's socket buffer (``send``), not ``sendfile``: a page that ``sendfile`` references may
still be read by the kernel after the call returns, when the memory may have been reused.
"""

from __future__ import annotations

from collections.abc import Iterator

from ray_velo.agent.core import COMMIT_WAIT_S, AgentCore
from ray_velo.errors import AgentShuttingDown, StagingError
from ray_velo.protocol import ReadRequest
from ray_velo.state.ledger import Buffer
from ray_velo.state.owner import RegionSlot, SendPlan
from ray_velo.wire.bulk import Send

__all__ = ["PIECE_BYTES", "WireSender"]

#: The owner checks the lease (and waits for a streamed producer's bytes) once a piece: 4 MiB
#: is 3 ms at 10 Gbit/s, and 64 lock takes for a 256 MiB payload.
PIECE_BYTES = 4 << 20


class WireSender:
    """Opens the bulk reads of one agent: of its slots (wire leases) and of the copies of other
    owners' payloads it holds (relay leases)."""

    def __init__(self, core: AgentCore, piece_bytes: int = PIECE_BYTES) -> None:
        self.core = core
        self.piece_bytes = piece_bytes
        self.closed = False

    def close(self) -> None:
        """The agent shuts down: a send waiting for a producer's bytes stops now."""
        with self.core.changing():
            self.closed = True

    def open(self, request: ReadRequest) -> Send:
        """The send ``request`` asks for.

        Raises:
            LeaseNotFound: no live lease of that id (wire lease, or relay lease with ``copy``).
            ProtocolError: the range is outside the payload (or, of a copy, not landed yet).
        """
        core = self.core
        with core.lock:
            if request.copy:
                buffer = core.consumer_state.relay_send_begin(
                    request.handle, request.lease_id, request.start, request.stop, core.clock()
                )
                return _CopySend(core, request, buffer, self.piece_bytes)
            plan = core.state.begin_send(
                request.handle, request.lease_id, request.start, request.stop, core.clock()
            )
        return _SlotSend(self, request, plan)


class _SlotSend:
    """Bytes of one of our slots, under a wire lease."""

    def __init__(self, sender: WireSender, request: ReadRequest, plan: SendPlan) -> None:
        self.sender, self.core, self.request, self.plan = sender, sender.core, request, plan
        self.piece_bytes = sender.piece_bytes

    def _wait_written(self, upto: int) -> None:
        """Until the slot's producer wrote bytes ``[0, upto)`` (streamed staging).

        Raises:
            StagingError: they were not written in time (the producer stalled or died).
            AgentShuttingDown: the agent shuts down meanwhile.
        """
        core, slot_id = self.core, self.plan.slot.slot_id

        def ready() -> bool:
            return self.sender.closed or core.state.writes.through(slot_id, upto)

        if not core.wait_until(ready, core.clock() + COMMIT_WAIT_S):
            raise StagingError(
                f"slot {slot_id}: its producer did not write its bytes within {COMMIT_WAIT_S} s"
            )
        if self.sender.closed:
            raise AgentShuttingDown(node=core.node_id)

    def pieces(self) -> Iterator[memoryview]:
        core, request, plan = self.core, self.request, self.plan
        location = plan.location
        bounce = None
        if isinstance(location, RegionSlot):  # never a view into caller memory: copies
            bounce = memoryview(bytearray(min(self.piece_bytes, plan.stop - plan.start)))
        for at in range(plan.start, plan.stop, self.piece_bytes):
            end = min(plan.stop, at + self.piece_bytes)
            self._wait_written(end)
            with core.lock:
                core.state.still_sending(request.handle, request.lease_id, core.clock())
            if isinstance(location, RegionSlot):
                assert bounce is not None
                piece = bounce[: end - at]
                location.region.copy_into(location.offset + at, piece)  # under its copy gate
                yield piece
            else:
                yield location.view()[at:end]

    def close(self) -> None:
        core = self.core
        with core.changing() as fx:
            core.state.end_read(self.plan.slot.slot_id, core.clock(), fx)


class _CopySend:
    """Bytes of this node's copy of another owner's payload, under a relay lease (they
    landed: the reader asked ``_rv_relay`` how far first)."""

    def __init__(
        self, core: AgentCore, request: ReadRequest, buffer: Buffer, piece_bytes: int
    ) -> None:
        self.core, self.request, self.buffer, self.piece_bytes = core, request, buffer, piece_bytes

    def pieces(self) -> Iterator[memoryview]:
        core, request = self.core, self.request
        view = self.buffer.view()
        for at in range(request.start, request.stop, self.piece_bytes):
            with core.lock:
                core.consumer_state.relay_still_sending(
                    request.handle, request.lease_id, core.clock()
                )
            yield view[at : min(request.stop, at + self.piece_bytes)]

    def close(self) -> None:
        core, request = self.core, self.request
        with core.changing() as fx:
            core.consumer_state.relay_send_end(request.handle, request.lease_id, core.clock(), fx)
