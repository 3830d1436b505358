"""Configuration: every knob, with its default and rules, as frozen dataclasses validated when built
(docs/protocol.md §16). Durations in seconds, sizes in bytes."""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

from ray_velo.errors import ConfigError

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_THRESHOLD",
    "DETACHED",
    "SPEC_CHUNK_SIZE",
    "RdmaConfig",
    "RdmaPoolConfig",
    "RdmaRendezvousConfig",
    "UcxConfig",
    "VeloConfig",
    "check_lifetime",
]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

#: Payloads above this go through rendezvous when staged transparently (docs/protocol.md §12:
#: 256 KiB).
DEFAULT_THRESHOLD = 256 * KiB
#: The protocol's chunk size. Far too small for Ray calls (~1 ms each); see DEFAULT_CHUNK_SIZE
#: (docs/protocol.md §20).
SPEC_CHUNK_SIZE = 512 * KiB
#: Chunk size of the chunked path over Ray calls. Measured on Ray: 512 KiB chunks move at
#: ~0.1 GB/s, 16 MiB chunks at ~0.7-0.9 GB/s cross-node (docs/tuning.md has the table).
DEFAULT_CHUNK_SIZE = 16 * MiB
#: Pulls kept in flight per chunked transfer (docs/tuning.md).
DEFAULT_PULLS_IN_FLIGHT = 4

#: ``lease_timeout`` clamps up to this (docs/protocol.md §11: on the wire 0 ms means "no
#: deadline").
LEASE_TIMEOUT_FLOOR_S = 0.001
#: A cap on ``lease_timeout`` (about 31.7 million years) that keeps ``lease_timeout_ms``
#: well inside the wire's u64 after float rounding.
LEASE_TIMEOUT_MAX_S = 1e15
#: ``ep_idle_timeout`` rises to this (docs/protocol.md §16: floor 500 ms).
EP_IDLE_TIMEOUT_FLOOR_S = 0.5


#: ``lifetime=DETACHED``: staged data outlives the Ray job that staged it (shared across jobs
#: on purpose); it lives until released or its TTL fires. Ray's word for such actors.
DETACHED = "detached"


def check_lifetime(lifetime: object) -> bool:
    """Whether ``lifetime`` asks for detached data (None: the data follows its Ray job).

    Raises:
        ConfigError: ``lifetime`` is neither None nor ``"detached"``.
    """
    if lifetime is None:
        return False
    if lifetime == DETACHED and isinstance(lifetime, str):
        return True
    raise ConfigError(
        field="lifetime",
        value=lifetime,
        rule='must be None (the data ends with its Ray job) or "detached" (it outlives its '
        "job until released or its TTL fires)",
    )


def _positive(obj: object, name: str) -> None:
    value = getattr(obj, name)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(field=name, value=value, rule="must be a positive integer (bytes)")


def _non_negative(obj: object, name: str) -> None:
    value = getattr(obj, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(field=name, value=value, rule="must be an integer >= 0 (bytes)")


def _is_seconds(value: object) -> bool:
    # A real number of seconds: not a bool, not NaN (which passes every `<` test) and not
    # infinite (None already says "unbounded", and inf breaks the ms conversions).
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive_seconds_or_none(obj: object, name: str) -> None:
    value = getattr(obj, name)
    if value is None:
        return
    if not _is_seconds(value) or value <= 0:
        raise ConfigError(
            field=name, value=value, rule="must be None or a positive, finite number of seconds"
        )


def _set(obj: object, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)


@dataclass(frozen=True, slots=True)
class RdmaRendezvousConfig:
    """The RDMA path's rules on the owner (docs/protocol.md §7 and §16).

    Attributes:
        rdma_min_bytes: pinned slots below this answer chunked (bytes).
        enabled: the kill switch; ``VELO_RDMA_RENDEZVOUS_DISABLE`` forces it off.
        lease_timeout: RDMA lease deadline in seconds; clamped to at least 1 ms.
    """

    rdma_min_bytes: int = 64 * KiB
    enabled: bool = True
    lease_timeout: float = 30.0

    def __post_init__(self) -> None:
        _non_negative(self, "rdma_min_bytes")
        if not _is_seconds(self.lease_timeout) or self.lease_timeout <= 0:
            raise ConfigError(
                field="lease_timeout",
                value=self.lease_timeout,
                rule="must be a positive, finite number of seconds",
            )
        if self.lease_timeout > LEASE_TIMEOUT_MAX_S:
            raise ConfigError(
                field="lease_timeout",
                value=self.lease_timeout,
                rule=f"must be at most {LEASE_TIMEOUT_MAX_S:g} s (lease_timeout_ms is a u64)",
            )
        if self.lease_timeout < LEASE_TIMEOUT_FLOOR_S:
            # On the wire 0 means "no deadline": a sub-millisecond value would round to it.
            _set(self, "lease_timeout", LEASE_TIMEOUT_FLOOR_S)
        if self.rdma_min_bytes > DEFAULT_THRESHOLD:
            warnings.warn(
                f"rdma_min_bytes={self.rdma_min_bytes} is above the transparent staging threshold "
                f"({DEFAULT_THRESHOLD}): payloads in between sit in pinned memory and never use "
                "the RDMA path",
                stacklevel=3,
            )

    @property
    def lease_timeout_ms(self) -> int:
        """The lease timeout as sent on the wire (whole ms, never 0)."""
        return max(1, round(self.lease_timeout * 1000))


@dataclass(frozen=True, slots=True)
class RdmaPoolConfig:
    """The registered arena pool (docs/protocol.md §16). Sizes in bytes, durations in s."""

    initial_arena_bytes: int = 64 * MiB
    max_arena_bytes: int = 1 * GiB
    dedicated_arena_min: int = 64 * MiB
    #: Cap on registered bytes per node, pool and regions together. None (the default; the
    #: protocol says 1 GiB, docs/protocol.md §20): each agent takes a quarter of its node's
    #: memory, at least the protocol's 1 GiB, at most half its shm directory
    #: (``ray_velo.agent.node_memory.default_budget``): with 1 GiB a single 1.5 GiB payload fell to
    #: the chunked path on any node (docs/tuning.md).
    registered_bytes_budget: int | None = None
    arena_reclaim_after: float | None = None
    retain_arena_bytes: int = 64 * MiB
    #: Emptied dedicated arenas kept mapped for reuse (bytes); 0 unmaps them at once, as the
    #: protocol does (docs/protocol.md §20). None (the default): the node's budget, so a
    #: payload the budget takes whole finds its arena warm next time: a fresh arena (map,
    #: first-touch faults) costs more than the copy it serves (docs/tuning.md measures it).
    warm_dedicated_bytes: int | None = None
    #: Transparent staging (``@ray_velo.transfer``) never maps or registers an arena inside
    #: a caller's send (docs/protocol.md §12); after it misses registered memory, the agent's
    #: timer maps an arena of that size and leaves it warm, so the next payload takes the RDMA
    #: path. False is the protocol's behaviour: only an explicit pinned ``put`` ever maps.
    warm_up_after_miss: bool = True
    #: A dedicated payload whose size repeats within this many seconds (a pipeline's next
    #: round) asks the timer for a spare arena of that size, mapped while no transfer of the
    #: node is in flight, so the round after maps nothing inside its put (docs/tuning.md
    #: "Spare arenas"). 0 turns spares off.
    spare_repeat_window: float = 30.0
    #: No spare arena above this many bytes. None (the default): an eighth of the registered
    #: budget, never below ``dedicated_arena_min``: a larger spare crowds out live payloads'
    #: budget, and such a payload spends far longer on the wire than a map costs.
    spare_arena_max_bytes: int | None = None
    #: A payload in plain memory (one the budget could not take whole) still moves by GET:
    #: each side registers a window of this many bytes at a time, charged to the budget
    #: (the owner two per transfer, the next ready while one moves). Not in the protocol
    #: (docs/protocol.md §19); a whole number of pages. docs/tuning.md "Payloads larger than
    #: the budget".
    window_bytes: int = 64 * MiB

    def __post_init__(self) -> None:
        for name in ("initial_arena_bytes", "max_arena_bytes", "dedicated_arena_min"):
            _positive(self, name)
        _positive(self, "window_bytes")
        if self.window_bytes % 4096:
            raise ConfigError(
                field="window_bytes", value=self.window_bytes, rule="must be whole 4 KiB pages"
            )
        if self.registered_bytes_budget is not None:
            _positive(self, "registered_bytes_budget")
        _non_negative(self, "retain_arena_bytes")
        if self.warm_dedicated_bytes is not None:
            _non_negative(self, "warm_dedicated_bytes")
        _positive_seconds_or_none(self, "arena_reclaim_after")
        if not _is_seconds(self.spare_repeat_window) or self.spare_repeat_window < 0:
            raise ConfigError(
                field="spare_repeat_window",
                value=self.spare_repeat_window,
                rule="must be a non-negative, finite number of seconds (0: no spares)",
            )
        if self.spare_arena_max_bytes is not None:
            _non_negative(self, "spare_arena_max_bytes")
        if self.max_arena_bytes < self.initial_arena_bytes:
            raise ConfigError(
                field="max_arena_bytes",
                value=self.max_arena_bytes,
                rule=f"must be >= initial_arena_bytes ({self.initial_arena_bytes})",
            )


@dataclass(frozen=True, slots=True)
class UcxConfig:
    """The UCX transport beside Ray's control plane (docs/protocol.md §16).

    Attributes:
        enabled: False simulates a node without UCX (the path metric says not_configured).
        eager_max: largest UCX active message (bytes); kept for parity, unused by the GET path.
        ep_idle_timeout: experimental endpoint idle reaper (s); floor 500 ms; None = off.
        eager_endpoints: wire up the endpoint when a peer is registered, not at first use.
        options: extra UCX settings without the ``UCX_`` prefix, e.g. ``{"TLS": "cma,tcp"}``.
            Applied to our UCX context only; the process environment is never mutated.
        tcp: let UCX use its ``tcp`` transport (GETs between hosts on a TCP network). Off by
            default: UCX over TCP authenticates no one, so a process that reaches one of its
            ports reads any byte of the agent's memory. Turn it on only for a network you
            trust (``VELO_UCX_TCP=1`` does too); without it, payloads cross hosts on a TCP
            network over the agents' authenticated wire (docs/deployment.md §8).
    """

    enabled: bool = True
    eager_max: int = 1 * MiB
    ep_idle_timeout: float | None = None
    eager_endpoints: bool = False
    options: tuple[tuple[str, str], ...] = ()
    tcp: bool = False

    def __post_init__(self) -> None:
        _positive(self, "eager_max")
        _positive_seconds_or_none(self, "ep_idle_timeout")
        if self.ep_idle_timeout is not None and self.ep_idle_timeout < EP_IDLE_TIMEOUT_FLOOR_S:
            _set(self, "ep_idle_timeout", EP_IDLE_TIMEOUT_FLOOR_S)
        if isinstance(self.options, dict):
            _set(self, "options", tuple(sorted((str(k), str(v)) for k, v in self.options.items())))


@dataclass(frozen=True, slots=True)
class RdmaConfig:
    """Everything about the RDMA path (docs/protocol.md §16)."""

    rendezvous: RdmaRendezvousConfig = field(default_factory=RdmaRendezvousConfig)
    pool: RdmaPoolConfig = field(default_factory=RdmaPoolConfig)
    ucx: UcxConfig = field(default_factory=UcxConfig)
    shutdown_timeout: float = 30.0
    drop_dereg_timeout: float = 30.0

    def __post_init__(self) -> None:
        _positive_seconds_or_none(self, "shutdown_timeout")
        _positive_seconds_or_none(self, "drop_dereg_timeout")


@dataclass(frozen=True, slots=True)
class VeloConfig:
    """Agent-wide configuration (docs/protocol.md §16).

    Attributes:
        threshold_bytes: transparent staging threshold; payloads above it are staged.
        chunk_size: chunk size of the chunked path (bytes).
        pulls_in_flight: chunk pulls kept in flight per transfer.
        staged_fetch_timeout: the longest a fetch may take (s); None = unbounded.
        staged_payload_max: the largest payload this node takes by rendezvous (bytes).
        shm_dir: where arena segments live (a tmpfs; default /dev/shm).
        rdma: the RDMA path's configuration.
        plain_arena_bytes: size of each unregistered ("plain memory") arena.
        sweep_interval: period of the TTL / chunked-lease sweep while deadlines exist (s).
        wire_streams: connections one read over the agents' wire is split over, for a payload
            of at least 64 MiB: one fills a 10 Gbit/s link (docs/benchmarks.md); more for a
            link one TCP stream does not fill.
        wire_stall_s: over the agents' wire, a read that receives no byte for this long fails
            (its fetch falls back to chunks once), and a send that moves none is aborted (its
            bytes go back): a peer that stalls or vanishes costs this much, never a hang.
        fault_injection: for ray_velo's own fault tests only: agents are built with their
            RDMA backend and chunk answers wrapped in faults their ``inject_fault`` entry
            arms (docs/architecture.md §12). Off (the default), no fault code runs in an
            agent and ``inject_fault`` is refused.
    """

    threshold_bytes: int = DEFAULT_THRESHOLD
    chunk_size: int = DEFAULT_CHUNK_SIZE
    pulls_in_flight: int = DEFAULT_PULLS_IN_FLIGHT
    staged_fetch_timeout: float | None = None
    staged_payload_max: int | None = None
    shm_dir: str = "/dev/shm"
    rdma: RdmaConfig = field(default_factory=RdmaConfig)
    plain_arena_bytes: int = 64 * MiB
    sweep_interval: float = 0.1
    wire_streams: int = 1
    wire_stall_s: float = 10.0
    fault_injection: bool = False

    def __post_init__(self) -> None:
        for name in (
            "threshold_bytes",
            "chunk_size",
            "pulls_in_flight",
            "plain_arena_bytes",
            "wire_streams",
        ):
            _positive(self, name)
        if self.chunk_size % 4096:
            raise ConfigError(
                field="chunk_size", value=self.chunk_size, rule="must be a multiple of 4096 bytes"
            )
        _positive_seconds_or_none(self, "staged_fetch_timeout")
        _positive_seconds_or_none(self, "sweep_interval")
        if not _is_seconds(self.wire_stall_s) or self.wire_stall_s <= 0:
            raise ConfigError(
                field="wire_stall_s",
                value=self.wire_stall_s,
                rule="must be a positive, finite number of seconds",
            )
        if self.staged_payload_max is not None:
            _positive(self, "staged_payload_max")
        if not self.shm_dir:
            raise ConfigError(field="shm_dir", value=self.shm_dir, rule="must name a directory")

    def replace(self, **changes: Any) -> VeloConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)
