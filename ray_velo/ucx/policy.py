"""Which UCX transports an agent may use: every one the hardware or the kernel guards, and
``tcp`` only where an operator opted in (docs/deployment.md §8). Pure: strings in, strings out.

UCX's software RMA over TCP checks no key and no identity: a peer that reaches one of its
ports can GET any address of the process (measured with UCX 1.22: an all-zero key read memory
that was never registered). Shared memory and ``cma`` are guarded by the kernel (same uid),
InfiniBand and RoCE by the NIC (memory keys). So an agent's UCX context leaves ``tcp`` out
unless :data:`UCX_TCP_ENV` (or ``UcxConfig.tcp``) lets it in; between hosts on a TCP network
the payload bytes then move over the agents' authenticated wire instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["UCX_TCP_ENV", "TransportChoice", "choose_transports", "ucx_tcp_allowed"]

#: Set to 1 (true, yes, on) in an agent's environment to let its UCX use TCP between hosts.
UCX_TCP_ENV = "VELO_UCX_TCP"
_ON = frozenset({"1", "true", "yes", "on"})
#: The one UCX transport that opens TCP ports (its connection manager listens only for
#: ``ucp_listener``, which ray_velo never creates).
_TCP = "tcp"


def ucx_tcp_allowed(configured: bool, environ: Mapping[str, str]) -> bool:
    """Whether UCX may use TCP: ``configured`` (``UcxConfig.tcp``) or :data:`UCX_TCP_ENV` on.
    Read once, when an agent is built."""
    value = environ.get(UCX_TCP_ENV)
    return configured or (value is not None and value.strip().lower() in _ON)


@dataclass(frozen=True, slots=True)
class TransportChoice:
    """The ``TLS`` setting an agent's UCX context gets (None: UCX's own default), whether to
    start UCX at all, and, when the operator's own setting was narrowed or refused, why (for
    the log)."""

    tls: str | None
    start: bool = True
    note: str = ""


def choose_transports(requested: str | None, tcp_allowed: bool) -> TransportChoice:
    """The transports for an agent's UCX context from the operator's ``UCX_TLS`` (or the
    ``TLS`` option; None: UCX's default, every transport).

    With TCP allowed the request stands. Otherwise ``tcp`` is taken out: ``all`` (or nothing
    set) becomes ``^tcp``, an exclusion list (``^...``) gains ``tcp``, and an explicit list
    loses it; a list that named only ``tcp`` leaves nothing, and the agent runs no UCX.
    """
    if tcp_allowed:
        return TransportChoice(requested)
    value = (requested or "all").strip()
    if value.lower() in ("", "all"):
        return TransportChoice(f"^{_TCP}")
    names = [part.strip() for part in value.removeprefix("^").split(",") if part.strip()]
    named_tcp = [n for n in names if n.split(":")[0].lower() == _TCP]
    if value.startswith("^"):
        return TransportChoice("^" + ",".join([*names, *([] if named_tcp else [_TCP])]))
    if not named_tcp:
        return TransportChoice(value)
    kept = [n for n in names if n not in named_tcp]
    why = (
        f"UCX_TLS={value} names tcp, which an agent uses only where {UCX_TCP_ENV}=1 "
        "(UCX over TCP lets anyone who reaches its ports read this process's memory)"
    )
    if not kept:
        return TransportChoice(
            None, start=False, note=f"{why}; nothing else is left, so this agent runs no UCX"
        )
    return TransportChoice(",".join(kept), note=f"{why}; using {','.join(kept)}")
