"""The RDMA kill switch: ``VELO_RDMA_RENDEZVOUS_DISABLE`` (docs/protocol.md §15)."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["KILL_SWITCH_ENV", "kill_switch_engaged"]

KILL_SWITCH_ENV = "VELO_RDMA_RENDEZVOUS_DISABLE"
_ENGAGED = frozenset({"1", "true", "yes", "on"})


def kill_switch_engaged(environ: Mapping[str, str]) -> bool:
    """True when ``environ`` turns the RDMA path off. Pass ``os.environ`` once, at build."""
    value = environ.get(KILL_SWITCH_ENV)
    return value is not None and value.strip().lower() in _ENGAGED
