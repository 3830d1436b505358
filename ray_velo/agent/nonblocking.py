"""What an agent may run on its event loop, where nothing may block: :func:`check` before a step
that might, :func:`defer` for slow effects (docs/architecture.md §4)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

__all__ = ["Offload", "WouldBlock", "active", "check", "defer", "on_loop"]

#: Runs a function on another thread without waiting for it.
Offload = Callable[[Callable[[], None]], None]


class WouldBlock(Exception):
    """A call running on the event loop reached a step that may block. Raised before the
    call changed anything; the agent runs the call again on a thread. Never reaches a user."""


_local = threading.local()


@contextlib.contextmanager
def on_loop(offload: Offload) -> Iterator[None]:
    """Run the body as a call on the event loop: :func:`check` raises, :func:`defer` hands
    its work to ``offload``."""
    previous = getattr(_local, "offload", None)
    _local.offload = offload
    try:
        yield
    finally:
        _local.offload = previous


def active() -> bool:
    """Whether this thread runs a call on the event loop right now."""
    return getattr(_local, "offload", None) is not None


def check(what: str) -> None:
    """About to do ``what``, which may block. Raises WouldBlock on the event loop."""
    if active():
        raise WouldBlock(what)


def defer(work: Callable[[], None]) -> None:
    """Run ``work`` (slow, its result not needed by the call) off the event loop: handed to
    a thread on the loop, run here otherwise."""
    offload = getattr(_local, "offload", None)
    if offload is None:
        work()
    else:
        offload(work)
