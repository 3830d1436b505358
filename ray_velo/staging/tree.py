"""Staged values and the one walk over a call's arguments and results; staging, resolving and
discarding are that walk with different leaf functions (docs/transfer.md §1)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ray_velo.config import check_lifetime
from ray_velo.errors import ConfigError
from ray_velo.protocol import DataHandle, TypeHeader

__all__ = ["PackedPart", "StagedValue", "TransferOptions", "visit", "walk"]


@dataclass(frozen=True, slots=True)
class TransferOptions:
    """Options of one decorated function, method or actor class.

    Attributes:
        threshold_bytes: payloads strictly above this are staged (bytes); None (the
            default) takes the cluster's ``VeloConfig.threshold_bytes`` (256 KiB).
        consumers: how many resolutions one staged value allows (fan-out).
        ttl: seconds after which a staged value's handle ends whatever happens; None: no
            TTL unless ``fetch_timeout`` is set, which then serves as the TTL.
        fetch_timeout: the caller's budget (s) for each receiver's fetch.
        stage_returns: stage large results (and yielded items) too.
        lifetime: ``"detached"``: what is staged outlives the Ray job that staged it (until
            resolved, released or its TTL fires); None: it ends with that job.
    """

    threshold_bytes: int | None = None
    consumers: int = 1
    ttl: float | None = None
    fetch_timeout: float | None = None
    stage_returns: bool = True
    lifetime: str | None = None

    def __post_init__(self) -> None:
        if self.threshold_bytes is not None and (
            not isinstance(self.threshold_bytes, int) or self.threshold_bytes < 0
        ):
            raise ConfigError(
                field="threshold_bytes", value=self.threshold_bytes, rule="must be an int >= 0"
            )
        if not isinstance(self.consumers, int) or self.consumers < 1:
            raise ConfigError(field="consumers", value=self.consumers, rule="must be >= 1")
        for name in ("ttl", "fetch_timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(field=name, value=value, rule="must be None or > 0 seconds")
        check_lifetime(self.lifetime)

    @property
    def effective_ttl(self) -> float | None:
        if self.ttl is not None:
            return self.ttl
        return self.fetch_timeout


@dataclass(frozen=True, slots=True)
class PackedPart:
    """Where a payload sits in the one slot its call's payloads were packed into, and how to
    rebuild it from its bytes."""

    offset: int
    header: TypeHeader


@dataclass(frozen=True, slots=True)
class StagedValue:
    """A payload staged on its sender's node, travelling in place of the value.

    ``budget_s`` is the sender's ``fetch_timeout`` for this send (the protocol's
    ``_rv_budget_ms``: a decorated call's budget starts when it is sent, so all of it is
    left); the receiver starts that bound when it resolves. ``part``: the payload is one of
    several packed into ``handle``'s slot (they share its references: one resolution of the
    call takes them all).
    """

    handle: DataHandle
    nbytes: int
    consumers: int = 1
    budget_s: float | None = None
    part: PackedPart | None = None

    def __repr__(self) -> str:
        where = "" if self.part is None else f" at {self.part.offset}"
        return f"StagedValue({self.handle}{where}, {self.nbytes} bytes)"


def walk(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """``value`` rebuilt with ``leaf(x)`` in place of every ``x`` that is not a list, tuple
    (a namedtuple keeps its type) or dict."""
    if isinstance(value, list):
        return [walk(v, leaf) for v in value]
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(walk(v, leaf) for v in value))
    if isinstance(value, tuple):
        return tuple(walk(v, leaf) for v in value)
    if isinstance(value, dict):
        return {k: walk(v, leaf) for k, v in value.items()}
    return leaf(value)


def visit(value: Any, leaf: Callable[[Any], object]) -> None:
    """Call ``leaf`` on every leaf of ``value`` (see :func:`walk`) for its effect."""
    walk(value, leaf)
