"""The owner's handlers: decode, change the state under the lock, act outside it, encode
(docs/protocol.md §5, docs/architecture.md §6)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ray_velo.agent import nonblocking
from ray_velo.agent.core import AgentCore
from ray_velo.errors import ProtocolError, VeloError
from ray_velo.memory.windows import WindowSet
from ray_velo.protocol import (
    OFFER_UCX,
    OFFER_WIRE,
    AcquireRequest,
    CopyNotice,
    DataHandle,
    DetachRequest,
    LeaseRenewRequest,
    MetadataRequest,
    MetadataResponse,
    OwnerFacts,
    PathDecision,
    PullRequest,
    Rdma,
    RdmaOffer,
    Ready,
    RefRequest,
    ReleaseRequest,
    WindowAnswer,
    WindowRequest,
    decide_path,
    decode,
    encode,
)
from ray_velo.state.ledger import Buffer
from ray_velo.state.owner import RegionSlot
from ray_velo.state.relays import RELAY_MIN_BYTES
from ray_velo.state.store import SlotView

__all__ = ["OwnerService"]


#: The smallest window a slot still being written is read in.
WRITTEN_WINDOW_MIN = 4 << 20
#: The most a window's answer waits for its producer's bytes (a consumer's window call
#: gives up after 10 s, ray_velo.consumer.windows).
WRITTEN_WAIT_S = 10.0


class OwnerService:
    """The handlers of one agent as owner."""

    def __init__(self, core: AgentCore) -> None:
        self.core = core
        #: RDMA leases granted on plain slots, read through windows (``ray-velo status``).
        self.windowed_leases = 0
        #: Windows registered for them.
        self.windows_registered = 0

    def _rv_metadata(self, data: bytes) -> bytes:
        request = decode(MetadataRequest, data)
        self.core.commits.wait(request.handle)
        with self.core.lock:
            slot = self.core.state.slot(request.handle)
            answer = MetadataResponse(slot.total_len, slot.refcount, slot.pinned)
        return encode(answer)

    def _rv_acquire(self, data: bytes) -> bytes:
        """A read lease and the path, in one round trip (the protocol's eight checks,
        docs/protocol.md §7). A plain slot's windows are opened before the lock is taken:
        charging the budget may unmap idle warm arenas, which must hold up no other call."""
        request = decode(AcquireRequest, data)
        core = self.core
        core.commits.wait(request.handle)
        if not _streams(request.rdma):
            core.wait_written(request.handle)
        opened = self._open_windows(request)
        granted = False
        try:
            consumer = None
            with core.changing() as fx:
                if request.consumer_node and request.consumer_worker:
                    consumer = (request.consumer_node, request.consumer_worker)
                    core.metrics.leases_reaped(core.state.supersede(*consumer, core.clock(), fx))
                slot = core.state.slot(request.handle)
                decision, windows = self._decide(request, slot, opened)
                if decision.path == "wire":
                    fx.poke = True
                    return self._grant_direct(request, slot, b"", consumer, wire=True)
                if decision.path == "rdma":
                    fx.poke = True
                    answer = self._grant_direct(
                        request, slot, decision.descriptor, consumer, windows
                    )
                    granted = windows is not None  # the lease owns them from here on
                    return answer
                fx.poke = request.lease_ms > 0 or bool(request.holder_pid)
                return self._grant_chunked(request, slot, consumer)
        finally:
            if opened is not None and not granted:  # no lease owns them: after the lock
                opened.close()

    def _open_windows(self, request: AcquireRequest) -> WindowSet | None:
        """The window set of the plain slot this acquire may read through windows, opened
        (charged to the budget), or None: no windows offered, the slot takes none, or the
        budget cannot take them. Outside the lock; the decision under it may still not use
        them (the caller closes them then)."""
        offer = request.rdma
        if offer is None or not offer.windows or self.core.rdma is None:
            return None
        if OFFER_WIRE in offer.backends and self.core.serves_wire:
            return None  # a plain slot goes over the wire: nothing to register
        core = self.core
        with core.lock:
            try:
                slot = core.state.slot(request.handle)
            except VeloError:
                return None  # the acquire itself says why
            worth = (
                core.rdma_enabled and slot.total_len >= core.config.rdma.rendezvous.rdma_min_bytes
            )
            buffer = _window_buffer(slot)
            if not worth or buffer is None or core.memory.registrar is None:
                return None
            address, nbytes = buffer.address, slot.total_len
        # charging the budget may unmap idle warm arenas: not on the event loop
        nonblocking.check("opening registered windows of a plain slot")
        window_set = WindowSet(
            core.memory.registrar, core.memory.budget, address, nbytes,
            core.config.rdma.pool.window_bytes,
        )  # fmt: skip
        return window_set if window_set.open() else None

    def _decide(
        self, request: AcquireRequest, slot: SlotView, opened: WindowSet | None
    ) -> tuple[PathDecision, WindowSet | None]:
        """The eight checks and the wire's, counted: the decision (an RDMA one carries its
        descriptor), and the window set of a plain slot (``opened``, if the checks reach
        it)."""
        core = self.core
        used: list[WindowSet] = []

        def open_windows() -> bool:
            if opened is None:
                return False
            used.append(opened)
            return True

        facts = OwnerFacts(
            offer=request.rdma,
            has_registry=core.rdma is not None,
            rdma_enabled=core.rdma_enabled,
            slot_pinned=slot.pinned,
            total_len=slot.total_len,
            rdma_min_bytes=core.config.rdma.rendezvous.rdma_min_bytes,
            draining=core.state.counts().draining,
            windowed=bool(request.rdma and request.rdma.windows and _window_buffer(slot)),
            serves_wire=core.serves_wire,
            slot_in_memory=slot.location is not None and slot.total_len > 0,
        )
        decision = decide_path(facts, lambda: self._descriptor(slot), open_windows)
        core.metrics.path(decision.path, decision.reason)
        return decision, (used[0] if used else None)

    def _grant_direct(
        self,
        request: AcquireRequest,
        slot: SlotView,
        descriptor: bytes,
        consumer: tuple[str, int] | None,
        windows: WindowSet | None = None,
        *,
        wire: bool = False,
    ) -> bytes:
        """An RDMA lease (always with a deadline) and the answer carrying the descriptor, or
        the window size of a plain slot (the lease owns its window set from here on) or of a
        slot whose producer is still writing it (each window is answered once written); or,
        ``wire``, a wire lease (a deadline too) whose bytes this owner sends over the wire
        (it waits for a streamed producer's bytes itself: no windows)."""
        rendezvous = self.core.config.rdma.rendezvous
        lease = self.core.state.grant(
            request.handle,
            self.core.clock(),
            kind="wire" if wire else "rdma",
            timeout=rendezvous.lease_timeout,
            claim=request.claim,
            consumer=consumer,
            windows=windows,
        )
        window_bytes = 0
        if windows is not None:
            self.windowed_leases += 1
            window_bytes = windows.window_bytes
        elif not wire and self.core.state.writes.active(slot.slot_id):
            # with the descriptor: the consumer asks how far the bytes are written
            window_bytes = written_window_bytes(slot.total_len)
        unclaimed = _unclaimed(request, slot)
        relay, announce = None, False
        if request.copies and consumer is not None:
            # A large payload is read from a copy when there is one (its own node's first); the
            # consumer's copy counts only if someone may still fetch the handle (the last
            # consumer's copy goes with its reader, and nobody need hear of it).
            announce = unclaimed != 0
            pick = slot.total_len >= RELAY_MIN_BYTES
            relay = self.core.state.sources.grant(
                slot.slot_id, *consumer, pick=pick, announce=announce
            )
        return encode(
            Rdma(
                lease.lease_id,
                descriptor,
                rendezvous.lease_timeout_ms,
                slot.total_len,
                slot.type_header,
                announce=announce,
                relay_node=relay.node if relay else "",
                relay_worker=relay.worker if relay else 0,
                unclaimed=unclaimed,
                window_bytes=window_bytes,
                wire=wire,
            )
        )

    def _grant_chunked(
        self, request: AcquireRequest, slot: SlotView, consumer: tuple[str, int] | None
    ) -> bytes:
        """A chunked lease (a deadline only when asked: ``lease_ms``) and its answer."""
        lease = self.core.state.grant(
            request.handle,
            self.core.clock(),
            kind="local" if request.holder_pid else "chunked",
            timeout=request.lease_ms / 1000 if request.lease_ms > 0 else None,
            holder_pid=request.holder_pid,
            claim=request.claim,
            consumer=consumer,
        )
        chunk = self.core.config.chunk_size
        return encode(
            Ready(
                lease.lease_id,
                lease.lease_id,
                chunk,
                math.ceil(slot.total_len / chunk),
                slot.total_len,
                slot.type_header,
                _unclaimed(request, slot),
            )
        )

    def _descriptor(
        self, slot: SlotView, start: int = 0, nbytes: int | None = None
    ) -> bytes | None:
        """Check 8: the staging still exists (registered) and the descriptor of its bytes
        ``[start, start + nbytes)`` (None: to the end) encodes."""
        rdma = self.core.rdma
        if rdma is None:
            return None
        length = slot.total_len - start if nbytes is None else nbytes
        location = slot.location
        if isinstance(location, RegionSlot):
            region = location.region
            if region.state.name != "REGISTERED":
                return None
            address = region.address + location.offset + start
            return rdma.descriptor(region.registration, address, length)
        if location is None or location.registration is None:
            return None
        return rdma.descriptor(location.registration, location.address + start, length)

    def _rv_pull(self, data: bytes) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """One chunk.

        A pool slot's chunk is returned as a view of the arena: Ray copies it into its
        object store while serializing the return value, after this method returns, so a
        slot abandoned right after keeps its memory out of the pool for the pull grace. A
        region's chunk is copied here, under the region's copy gate.
        """
        request = decode(PullRequest, data)
        core = self.core
        with core.lock:
            plan = core.state.pull(
                request.transfer_id, request.index, core.config.chunk_size, core.clock()
            )
            location = plan.slot.location  # under the lock: shutdown may demote the slot
        if plan.view and location is not None and not isinstance(location, RegionSlot):
            handle = DataHandle(core.worker_id, plan.slot.slot_id)
            core.wait_written(handle, plan.start + plan.length)
            view = location.view()
            return np.frombuffer(view, dtype=np.uint8, count=plan.length, offset=plan.start)
        try:
            out = np.empty(plan.length, dtype=np.uint8)
            if plan.length and isinstance(location, RegionSlot):
                # never a view into caller memory: copy under the region's gate
                location.region.copy_into(location.offset + plan.start, out.data)
            return out
        finally:
            with core.changing() as fx:
                core.state.end_read(plan.slot.slot_id, core.clock(), fx)

    def _rv_ref(self, data: bytes) -> int:
        request = decode(RefRequest, data)
        self.core.commits.wait(request.handle)
        with self.core.lock:
            return self.core.state.ref(request.handle)

    def _rv_detach(self, data: bytes) -> None:
        request = decode(DetachRequest, data)
        self._end(request.handle, request.lease_id, release=False, claim=request.claim)

    def _rv_release(self, data: bytes) -> None:
        request = decode(ReleaseRequest, data)
        self._end(request.handle, request.lease_id, release=True, claim=request.claim)

    def _end(self, handle: Any, lease_id: int, *, release: bool, claim: bool) -> None:
        """Detach (lock only, or a claim given back) or release (lock and one reference)."""
        core = self.core
        core.commits.wait(handle)
        with core.changing() as fx:
            core.state.end_lease(handle, lease_id, release, core.clock(), fx, claim=claim)

    def copy_gone(self, notice: CopyNotice) -> None:
        """``_rv_copy`` about one of our handles: that node's copy of it is no more."""
        with self.core.lock:
            self.core.state.sources.gone(notice.handle.slot_id, notice.node, notice.worker)

    def _rv_lease_renew(self, data: bytes) -> None:
        request = decode(LeaseRenewRequest, data)
        with self.core.lock:
            self.core.state.renew(request.handle, request.lease_id, self.core.clock())

    def _rv_window(self, data: bytes) -> bytes:
        """Window ``index`` of a plain slot, registered for the RDMA lease that opened the
        window set (renewed), after unregistering the window its GET finished.

        Raises:
            HandleNotFound, LeaseNotFound: the handle or the lease ended (the window set was
                closed with it: nothing more is registered for it).
            ProtocolError: the lease has no windows, or the index is out of range.
        """
        request = decode(WindowRequest, data)
        nonblocking.check("registering a window")  # UCX calls: on a thread
        core = self.core
        with core.lock:
            windows = core.state.renew(request.handle, request.lease_id, core.clock())
            slot = core.state.slot(request.handle)
        if not isinstance(windows, WindowSet):
            return self._written_window(request, slot)
        if not -1 <= request.index < windows.count:
            raise ProtocolError(f"window {request.index} of {windows.count}")
        windows.done_through(request.done)
        if request.index < 0:  # only done with them (a held lease keeps none registered)
            return encode(WindowAnswer())
        registration, address, nbytes = windows.window(request.index)
        core.wait_written(request.handle, address - windows.address + nbytes, WRITTEN_WAIT_S)
        self.windows_registered += 1
        descriptor = core.rdma.descriptor(registration, address, nbytes) if core.rdma else None
        if not descriptor:
            raise ProtocolError(f"window {request.index} of {request.handle} did not encode")
        return encode(WindowAnswer(descriptor))

    def _written_window(self, request: WindowRequest, slot: SlotView) -> bytes:
        """The descriptor of a registered slot's bytes from window ``index`` to as far as
        its producer has written them (at least that window), for a lease whose answer
        said the slot is still being written (streamed staging): one GET takes all that is
        there.

        Raises:
            ProtocolError: the index is out of range, or the slot is not registered.
            StagingError: the window was not written within :data:`WRITTEN_WAIT_S`.
        """
        size = written_window_bytes(slot.total_len)
        count = -(-slot.total_len // size)
        if not -1 <= request.index < count:
            raise ProtocolError(f"window {request.index} of {count}")
        if request.index < 0:
            return encode(WindowAnswer())
        core, start = self.core, request.index * size
        core.wait_written(request.handle, min(slot.total_len, start + size), WRITTEN_WAIT_S)
        with core.lock:
            upto = core.state.writes.upto(slot.slot_id, slot.total_len)
        descriptor = self._descriptor(slot, start, upto - start)
        if not descriptor:
            raise ProtocolError(f"lease {request.lease_id} of {request.handle} has no windows")
        return encode(WindowAnswer(descriptor))


def written_window_bytes(total_len: int) -> int:
    """The windows a slot still being written is read in: about a sixteenth of it (the
    first is GOT while the producer writes the rest), at least :data:`WRITTEN_WINDOW_MIN`
    and whole MiB."""
    mib = 1 << 20
    return max(WRITTEN_WINDOW_MIN, -(-total_len // 16 // mib) * mib)


def _window_buffer(slot: SlotView) -> Buffer | None:
    """The plain memory of a slot whose producer asked for registered memory (not a region,
    not empty, not demoted at shutdown), whose ranges a window set can register; else None."""
    location = slot.location
    if not slot.windowable or slot.pinned or slot.total_len <= 0:
        return None
    return None if location is None or isinstance(location, RegionSlot) else location


def _streams(offer: RdmaOffer | None) -> bool:
    """Whether an acquire with ``offer`` may be answered before the producer wrote all the
    bytes (streamed staging): its consumer GETs window by window, or it can only read over
    the wire or by chunks, where the owner waits for each piece's bytes before it sends."""
    if offer is None:
        return False
    return offer.windows or (OFFER_WIRE in offer.backends and OFFER_UCX not in offer.backends)


def _unclaimed(request: AcquireRequest, slot: SlotView) -> int:
    """What a consuming acquire's answer says is left to claim (-1: not a consuming one)."""
    return slot.refcount - slot.claimed if request.claim else -1
