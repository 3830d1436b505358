"""Registered windows: RDMA for bytes in plain memory, with registered bytes still bounded by the
budget (docs/tuning.md "registered windows", docs/architecture.md §14)."""

from __future__ import annotations

import threading
from typing import Any

from ray_velo.errors import LeaseNotFound
from ray_velo.memory.pool import Registrar, Registration, RegistrationBudget, page_range

__all__ = ["WINDOW_DEPTH", "WindowSet"]

#: Windows an owner keeps registered per transfer: the one moving and the next.
WINDOW_DEPTH = 2


class WindowSet:
    """The windows of ``nbytes`` at ``address``. Thread-safe.

    Window ``index`` is bytes ``[index * window_bytes, (index + 1) * window_bytes)`` of the
    buffer (the last one shorter). ``window_bytes`` is a multiple of the page size.
    """

    def __init__(
        self,
        registrar: Registrar,
        budget: RegistrationBudget,
        address: int,
        nbytes: int,
        window_bytes: int,
        *,
        depth: int = WINDOW_DEPTH,
    ) -> None:
        if nbytes <= 0 or window_bytes <= 0 or depth <= 0:
            raise ValueError(f"bad window set: {nbytes} bytes, windows of {window_bytes}")
        self._registrar = registrar
        self._budget = budget
        self.address = address
        self.nbytes = nbytes
        self.window_bytes = window_bytes
        self.count = -(-nbytes // window_bytes)
        self.depth = min(depth, self.count)
        self._lock = threading.Lock()
        self._live: dict[int, Registration] = {}
        self._charged = 0
        self._closed = False

    def charge_bytes(self) -> int:
        """What opening charges: the ``depth`` largest windows' whole pages."""
        spans = sorted((self._pages(i) for i in range(self.count)), reverse=True)
        return sum(spans[: self.depth])

    def _pages(self, index: int) -> int:
        start, stop = self.bounds(index)
        first, end = page_range(self.address + start, stop - start)
        return end - first

    def bounds(self, index: int) -> tuple[int, int]:
        """Bytes ``[start, stop)`` of the buffer that window ``index`` covers."""
        if not 0 <= index < self.count:
            raise IndexError(f"window {index} of {self.count}")
        start = index * self.window_bytes
        return start, min(self.nbytes, start + self.window_bytes)

    def open(self) -> bool:
        """Charge the budget for ``depth`` windows, once; False (nothing charged) when it
        cannot, or when the set was closed already."""
        with self._lock:
            if self._charged:
                raise RuntimeError("a window set opens once")
            if self._closed:
                return False
        charge = self.charge_bytes()
        if not self._budget.reserve(charge):
            return False
        with self._lock:
            if not self._closed:
                self._charged = charge
                return True
        self._budget.release(charge)  # closed meanwhile: the charge has no owner
        return False

    @property
    def live(self) -> int:
        """Windows registered now."""
        with self._lock:
            return len(self._live)

    def window(self, index: int) -> tuple[Registration, int, int]:
        """Register window ``index`` (if it is not already): its registration, address and
        length.

        Raises:
            LeaseNotFound: the set was closed (its transfer ended).
            RuntimeError: ``depth`` windows are registered already (a caller's bug: it must
                say which it finished first).
        """
        start, stop = self.bounds(index)
        with self._lock:
            if self._closed:
                raise LeaseNotFound(handle="window", lease_id=index)
            registration = self._live.get(index)
            if registration is None:
                if len(self._live) >= self.depth:
                    raise RuntimeError(f"{self.depth} windows registered already")
                registration = self._registrar.register(self.address + start, stop - start)
                self._live[index] = registration
        return registration, self.address + start, stop - start

    def done_through(self, index: int) -> None:
        """Unregister every window up to ``index`` (their GETs completed)."""
        with self._lock:
            for finished in [i for i in self._live if i <= index]:
                self._registrar.unregister(self._live.pop(finished))

    def close(self) -> None:
        """Unregister every window and give the charge back (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            live, self._live = list(self._live.values()), {}
            charged, self._charged = self._charged, 0
            for registration in live:
                self._registrar.unregister(registration)
        if charged:
            self._budget.release(charged)

    def abandon(self) -> list[Any]:
        """Close without unregistering: a GET may still write the windows. Returns the
        registrations, for the caller to keep alive until UCX goes; the charge stays."""
        with self._lock:
            self._closed = True
            live, self._live = list(self._live.values()), {}
            self._charged = 0
        return live
