"""One cross-node fetch as a pure state machine: events in, instructions out, one owner of the
destination at a time (docs/architecture.md §6)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from ray_velo.errors import OwnerDied, PayloadTooLarge, ProtocolError, StagingError
from ray_velo.protocol import DataHandle, Rdma, RdmaOffer, Ready, build_offer

__all__ = [
    "Acquire",
    "Allocate",
    "Allocated",
    "Answered",
    "CheckDescriptor",
    "Count",
    "DecodeFailed",
    "Decoded",
    "Done",
    "EndLease",
    "Fail",
    "Failed",
    "FetchFacts",
    "FetchMachine",
    "Get",
    "GetExpired",
    "GetFailed",
    "GetOk",
    "GiveBack",
    "Mode",
    "Pull",
    "Pulled",
    "Quarantine",
    "Stage",
    "WithdrawWriter",
]

Mode = Literal["release", "detach", "hold", "claim"]
DestOwner = Literal["fetch", "writer", "quarantine", "slot"]
Answer = Ready | Rdma


@dataclass(frozen=True, slots=True)
class FetchFacts:
    """What the consumer knows before it starts: its three offer facts, its payload limit,
    the capacity of a PinnedWriter destination (None: it allocates its own), whether it can
    GET through windows (it reaches the owner's ``_rv_window`` and registers windows of a
    plain destination itself), and whether it can read the owner's bytes over the agents'
    wire (the owner has a bulk port, this agent the cluster's credentials)."""

    has_registry: bool
    rdma_enabled: bool
    peer_registered: bool
    payload_max: int | None = None
    writer_bytes: int | None = None
    windows: bool = False
    wire: bool = False


# --- instructions ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Acquire:
    """Request: ``_rv_acquire`` with this offer; ``claim`` claims a reference;
    ``chunked_deadline`` asks for a chunked lease deadline (the fetch's budget)."""

    offer: RdmaOffer | None
    claim: bool
    chunked_deadline: bool


@dataclass(frozen=True, slots=True)
class CheckDescriptor:
    """Request: decode and check the RDMA answer's descriptor (never reaches UCX unchecked)."""

    answer: Rdma


@dataclass(frozen=True, slots=True)
class Allocate:
    """Request: a destination of ``nbytes``, in registered memory when ``registered``; in
    plain memory with a window of it registrable at a time (charged now) when ``windows``."""

    nbytes: int
    registered: bool
    windows: bool = False


@dataclass(frozen=True, slots=True)
class Get:
    """Request: GET the checked descriptor into the destination, renewing the lease (a
    windowed answer has no descriptor: the driver asks for each window's; a wire answer
    neither: the owner sends the lease's bytes, read over the wire)."""

    answer: Rdma
    descriptor: Any


@dataclass(frozen=True, slots=True)
class Pull:
    """Request: pull every chunk of the chunked answer into the destination."""

    answer: Ready


@dataclass(frozen=True, slots=True)
class Count:
    """Record ``velo_rendezvous_rdma_path_total{path, reason}`` on the consumer."""

    path: str
    reason: str


@dataclass(frozen=True, slots=True)
class EndLease:
    """End the owner's lease (fire-and-forget): release (one reference too) or detach;
    ``claim`` marks the reference as a claimed one (release) or gives the claim back
    (detach)."""

    lease_id: int
    release: bool
    claim: bool


@dataclass(frozen=True, slots=True)
class GiveBack:
    """The destination this fetch allocated goes back to its pool."""


@dataclass(frozen=True, slots=True)
class Quarantine:
    """The destination this fetch allocated may still be written by UCX: quarantine it."""


@dataclass(frozen=True, slots=True)
class WithdrawWriter:
    """The PinnedWriter may still be written by UCX: quarantine it; the writer is gone."""


@dataclass(frozen=True, slots=True)
class Stage:
    """The destination becomes the node-local slot of the payload (``answer`` says its size
    and type)."""

    answer: Answer


@dataclass(frozen=True, slots=True)
class Done:
    """The fetch succeeded over ``path``. ``kept_lease``: the owner's lease the caller now
    holds (``hold`` mode), else 0. ``claimed``: the caller holds a claim on the handle."""

    path: str
    answer: Answer
    kept_lease: int
    claimed: bool


@dataclass(frozen=True, slots=True)
class Fail:
    """The fetch failed with ``error``; every lease and buffer was dealt with first."""

    error: BaseException


Instruction = (
    Acquire
    | CheckDescriptor
    | Allocate
    | Get
    | Pull
    | Count
    | EndLease
    | GiveBack
    | Quarantine
    | WithdrawWriter
    | Stage
    | Done
    | Fail
)

# --- events -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Answered:
    answer: Answer


@dataclass(frozen=True, slots=True)
class Decoded:
    descriptor: Any


@dataclass(frozen=True, slots=True)
class DecodeFailed:
    why: str = ""


@dataclass(frozen=True, slots=True)
class Allocated:
    """``ok`` False: no registered memory for it (``pool_exhausted``, docs/protocol.md §8)."""

    ok: bool


@dataclass(frozen=True, slots=True)
class GetOk:
    pass


@dataclass(frozen=True, slots=True)
class GetFailed:
    """The GET failed; ``unsafe``: UCX may still write the destination."""

    unsafe: bool = False


@dataclass(frozen=True, slots=True)
class GetExpired:
    """The fetch's bound ran out during the GET (``error`` is the TransferTimeout)."""

    error: BaseException
    unsafe: bool = False


@dataclass(frozen=True, slots=True)
class Pulled:
    pass


@dataclass(frozen=True, slots=True)
class Failed:
    """Performing the last request raised ``error``."""

    error: BaseException


Event = (
    Answered | Decoded | DecodeFailed | Allocated | GetOk | GetFailed | GetExpired | Pulled | Failed
)

State = Literal[
    "new", "acquiring", "decoding", "alloc_registered", "alloc_window", "alloc_plain", "getting",
    "reacquiring", "pulling", "done", "failed",
]  # fmt: skip


class FetchMachine:
    """The protocol of one fetch. One use; not thread-safe."""

    def __init__(self, handle: DataHandle, node: str, mode: Mode, facts: FetchFacts) -> None:
        self.handle = handle
        self.node = node
        self.mode: Mode = mode
        self.facts = facts
        self.state: State = "new"
        self.dest: DestOwner | None = None
        self.dest_bytes = 0
        self.dest_registered = False
        self.answer: Answer | None = None
        self.lease_id: int | None = None  # the owner's lease this fetch must still end
        self.offered = False
        self.fell_back = False
        self.claimed = False  # this fetch holds a claim on the handle
        self._descriptor: Any = None

    @property
    def consuming(self) -> bool:
        return self.mode in ("release", "claim")

    # --- driving ---------------------------------------------------------------------

    def start(self) -> list[Instruction]:
        """The first instructions: record why no offer goes out (if so), then acquire."""
        if self.state != "new":
            raise RuntimeError("a FetchMachine starts once")
        facts = self.facts
        offer = build_offer(
            facts.has_registry,
            facts.rdma_enabled,
            facts.peer_registered,
            windows=facts.windows,
            wire=facts.wire,
        )
        out: list[Instruction] = []
        if offer.reason is not None:
            out.append(Count("chunked", offer.reason))
        self.offered = offer.offer is not None
        self.state = "acquiring"
        out.append(Acquire(offer.offer, claim=self.consuming, chunked_deadline=self.mode != "hold"))
        return out

    def on(self, event: Event) -> list[Instruction]:
        """The instructions that follow ``event`` (the result of the last request)."""
        if isinstance(event, Failed):
            return self._fail(event.error)
        handler = _HANDLERS.get((self.state, type(event)))
        if handler is None:
            raise RuntimeError(f"fetch in state {self.state} cannot take {type(event).__name__}")
        return handler(self, event)

    # --- transitions -----------------------------------------------------------------

    def _answered(self, event: Answered) -> list[Instruction]:
        answer = event.answer
        if self.answer is None:
            self.claimed = self.consuming  # the first answer carries the claim
        self.answer = answer
        self.lease_id = answer.lease_id
        limit = self.facts.payload_max
        if limit is not None and answer.total_len > limit:
            # Refused before anything of its size is allocated. A consuming fetch releases
            # (transparent handles are single-use: the owner frees its copy); others detach.
            out: list[Instruction] = [self._end_lease(release=self.consuming)]
            out += self._drop_dest()
            self.state = "failed"
            size = answer.total_len
            return [
                *out,
                Fail(PayloadTooLarge(handle=str(self.handle), size_bytes=size, limit_bytes=limit)),
            ]
        if isinstance(answer, Rdma):
            if self.fell_back or not self.offered:
                why = "again to the fallback acquire" if self.fell_back else "to an acquire"
                error = ProtocolError(
                    f"owner on node {self.node} answered RDMA {why} that carried no offer; "
                    "refusing to retry"
                )
                return self._fail(error)
            if answer.wire:
                if not self.facts.wire:
                    error = ProtocolError(
                        f"owner on node {self.node} answered the wire path to an offer "
                        "without it; refusing to retry"
                    )
                    return self._fail(error)
                return self._destination(answer, registered=False)  # plain: nothing to GET
            if answer.window_bytes:
                if not self.facts.windows:
                    error = ProtocolError(
                        f"owner on node {self.node} answered windows to an offer without "
                        "them; refusing to retry"
                    )
                    return self._fail(error)
                return self._destination(answer, registered=True)  # descriptors come later
            self.state = "decoding"
            return [CheckDescriptor(answer)]
        if answer.total_len == 0:
            return self._finish("chunked")
        if self.dest == "fetch" and self.dest_bytes >= answer.total_len:
            self.state = "pulling"  # the registered destination of a failed GET serves
            return [Pull(answer)]
        if self.dest == "fetch":
            self.state = "alloc_plain"
            return [GiveBack(), Allocate(answer.total_len, registered=False)]
        return self._destination(answer, registered=False)

    def _destination(self, answer: Answer, registered: bool) -> list[Instruction]:
        writer = self.facts.writer_bytes
        if writer is None:
            self.state = "alloc_registered" if registered else "alloc_plain"
            return [Allocate(answer.total_len, registered=registered)]
        if answer.total_len > writer:
            error = ValueError(
                f"PinnedWriter holds {writer} bytes, payload of {self.handle} is "
                f"{answer.total_len} bytes"
            )
            return self._fail(error)
        self.dest, self.dest_bytes, self.dest_registered = "writer", writer, True
        if isinstance(answer, Rdma):
            return self._get(answer)
        self.state = "pulling"
        return [Pull(answer)]

    def _decoded(self, event: Decoded) -> list[Instruction]:
        assert isinstance(self.answer, Rdma)
        self._descriptor = event.descriptor
        return self._destination(self.answer, registered=True)

    def _get(self, answer: Rdma) -> list[Instruction]:
        self.state = "getting"
        return [Get(answer, self._descriptor)]

    def _decode_failed(self, event: DecodeFailed) -> list[Instruction]:
        return self._fallback("decode_error")

    def _allocated_registered(self, event: Allocated) -> list[Instruction]:
        assert isinstance(self.answer, Rdma)
        if not event.ok:
            if self.facts.windows:  # a plain destination, registered a window at a time
                self.state = "alloc_window"
                return [Allocate(self.answer.total_len, registered=False, windows=True)]
            return self._fallback("pool_exhausted")
        self.dest, self.dest_bytes, self.dest_registered = "fetch", self.answer.total_len, True
        return self._get(self.answer)

    def _allocated_window(self, event: Allocated) -> list[Instruction]:
        assert isinstance(self.answer, Rdma)
        if not event.ok:
            return self._fallback("pool_exhausted")
        self.dest, self.dest_bytes, self.dest_registered = "fetch", self.answer.total_len, False
        return self._get(self.answer)

    def _allocated_plain(self, event: Allocated) -> list[Instruction]:
        answer = self.answer
        assert answer is not None
        if not event.ok:
            error = StagingError(
                f"no memory on this node for {answer.total_len} bytes of {self.handle}"
            )
            return self._fail(error)
        self.dest, self.dest_bytes, self.dest_registered = "fetch", answer.total_len, False
        if isinstance(answer, Rdma):  # the wire path: the owner sends into plain memory
            return self._get(answer)
        self.state = "pulling"
        return [Pull(answer)]

    def _get_ok(self, event: GetOk) -> list[Instruction]:
        path = "wire" if isinstance(self.answer, Rdma) and self.answer.wire else "rdma"
        return [Count(path, "ok"), *self._finish(path)]

    def _get_failed(self, event: GetFailed) -> list[Instruction]:
        out: list[Instruction] = []
        if event.unsafe:
            if self.dest == "writer":
                out.append(WithdrawWriter())
                self.dest = "quarantine"
                error = StagingError(
                    f"a timed-out GET of {self.handle} may still write the PinnedWriter; it "
                    "was withdrawn, allocate a new one"
                )
                return [*out, *self._fail(error)]
            out += self._quarantine()
        return [*out, *self._fallback("get_failed")]

    def _get_expired(self, event: GetExpired) -> list[Instruction]:
        out: list[Instruction] = []
        if event.unsafe:
            if self.dest == "writer":
                out.append(WithdrawWriter())
                self.dest = "quarantine"
            else:
                out += self._quarantine()
        return [*out, *self._fail(event.error)]

    def _pulled(self, event: Pulled) -> list[Instruction]:
        return self._finish("chunked")

    # --- shared steps ----------------------------------------------------------------

    def _quarantine(self) -> list[Instruction]:
        if self.dest != "fetch":
            return []
        self.dest = "quarantine"
        self.dest_bytes = 0
        return [Quarantine()]

    def _fallback(self, reason: str) -> list[Instruction]:
        """Exactly once: detach (the claim, if any, stays), acquire with no offer."""
        self.fell_back = True
        out: list[Instruction] = [
            Count("chunked", reason),
            self._end_lease(release=False, keep_claim=True),
        ]
        self.state = "reacquiring"
        return [*out, Acquire(None, claim=False, chunked_deadline=self.mode != "hold")]

    def _end_lease(self, release: bool, keep_claim: bool = False) -> EndLease:
        assert self.lease_id is not None
        lease, self.lease_id = self.lease_id, None
        if release:
            claim = self.claimed
            self.claimed = False
            return EndLease(lease, release=True, claim=claim)
        give_back = self.claimed and not keep_claim
        if give_back:
            self.claimed = False
        return EndLease(lease, release=False, claim=give_back)

    def _drop_dest(self) -> list[Instruction]:
        if self.dest == "fetch":
            self.dest = None
            return [GiveBack()]
        return []

    def _finish(self, path: str) -> list[Instruction]:
        assert self.answer is not None
        out: list[Instruction] = []
        kept = 0
        if self.mode == "release":
            out.append(self._end_lease(release=True))
        elif self.mode == "hold":
            kept, self.lease_id = self.lease_id or 0, None
        else:  # detach; claim: the claim stays the caller's
            out.append(self._end_lease(release=False, keep_claim=True))
        if self.dest == "fetch":
            self.dest = "slot"
            out.append(Stage(self.answer))
        self.state = "done"
        return [*out, Done(path, self.answer, kept, claimed=self.claimed)]

    def _fail(self, error: BaseException) -> list[Instruction]:
        """Deal with the lease and its claim (unless the owner is gone) and the destination.

        An acquire that failed in flight left no lease this fetch can name; if the owner
        granted it anyway, its deadline (or the slot's TTL) ends it there.
        """
        out: list[Instruction] = []
        if self.lease_id is not None and not isinstance(error, OwnerDied):
            out.append(self._end_lease(release=False))
        self.lease_id = None
        self.claimed = False
        out += self._drop_dest()
        self.state = "failed"
        return [*out, Fail(error)]


_HANDLERS: dict[tuple[str, type], Callable[[FetchMachine, Any], list[Instruction]]] = {
    ("acquiring", Answered): FetchMachine._answered,
    ("reacquiring", Answered): FetchMachine._answered,
    ("decoding", Decoded): FetchMachine._decoded,
    ("decoding", DecodeFailed): FetchMachine._decode_failed,
    ("alloc_registered", Allocated): FetchMachine._allocated_registered,
    ("alloc_window", Allocated): FetchMachine._allocated_window,
    ("alloc_plain", Allocated): FetchMachine._allocated_plain,
    ("getting", GetOk): FetchMachine._get_ok,
    ("getting", GetFailed): FetchMachine._get_failed,
    ("getting", GetExpired): FetchMachine._get_expired,
    ("pulling", Pulled): FetchMachine._pulled,
}
