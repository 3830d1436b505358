"""Caller-owned registered memory: a :class:`Region` on the owner, a :class:`RegionGuard` for the
caller, with in-flight anchors, a copy gate and drain-then-unmap (docs/architecture.md §14)."""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Final, TypeAlias

from ray_velo.errors import BudgetExceeded, RegionDeregistered
from ray_velo.memory.pool import Registrar, Registration, RegistrationBudget, page_range

__all__ = [
    "COPY_GATE_CHUNK_BYTES",
    "Deregistered",
    "DeregisteredSignal",
    "DrainTimedOut",
    "Drained",
    "InFlight",
    "Region",
    "RegionGuard",
    "RegionState",
    "RegionWatch",
]

_log = logging.getLogger(__name__)

COPY_GATE_CHUNK_BYTES: Final = 512 * 1024
"""Bytes copied per pass through the copy gate: bounds how long one copy delays the latch."""

_ids = itertools.count(1)


class RegionState(Enum):
    """Where a region is in its lifecycle (only ever moves forward)."""

    REGISTERED = "registered"
    DEREGISTERING = "deregistering"  # latched: no new anchor or copy; draining, unmapping
    DEREGISTERED = "deregistered"  # unmap confirmed, budget released, signal fired


@dataclass(frozen=True, slots=True)
class Drained:
    """``unregister`` waited for every in-flight anchor, then unmapped. Memory released."""


@dataclass(frozen=True, slots=True)
class DrainTimedOut:
    """``unregister`` stopped waiting and unmapped anyway. Memory released.

    Attributes:
        in_flight: anchors still held when the drain timed out (their reads now refuse).
    """

    in_flight: int


Deregistered: TypeAlias = Drained | DrainTimedOut
"""What ``unregister`` returns: both mean the memory is released and may be freed."""


class DeregisteredSignal:
    """Read-only view of the single release signal: set once the unmap is confirmed."""

    __slots__ = ("_event",)

    def __init__(self, event: threading.Event) -> None:
        """Observe ``event`` (only the region sets it)."""
        self._event = event

    def is_set(self) -> bool:
        """True once the memory is released (the caller may free it)."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until released or ``timeout`` seconds pass; True when released."""
        return self._event.wait(timeout)


class InFlight:
    """An anchor in a region: while held, ``unregister`` waits (up to its timeout).

    Taken by :meth:`Region.enter`; usable as a context manager or held by a slot and
    released with :meth:`release` (idempotent).
    """

    __slots__ = ("_region", "_released")

    def __init__(self, region: Region) -> None:
        """Only :meth:`Region.enter` makes these."""
        self._region = region
        self._released = False

    @property
    def region(self) -> Region:
        """The region this anchor holds."""
        return self._region

    @property
    def released(self) -> bool:
        """True once :meth:`release` ran."""
        return self._released

    def release(self) -> None:
        """Drop the anchor; idempotent."""
        if not self._released:
            self._released = True
            self._region._leave()

    def __enter__(self) -> InFlight:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Region:
    """Owner side of one caller-owned registered range. Thread-safe.

    Offsets are relative to the registered pointer ``address``, never to the page-rounded
    effective range: a caller cannot name a byte that is pinned but outside its allocation.
    """

    def __init__(
        self,
        address: int,
        nbytes: int,
        registrar: Registrar,
        budget: RegistrationBudget | None = None,
        *,
        on_released: Callable[[], object] | None = None,
    ) -> None:
        """Charge the budget and register ``nbytes`` bytes at ``address``.

        Args:
            address: start of the caller's memory (valid for reads and writes of ``nbytes``
                until the region is deregistered: the caller's promise).
            nbytes: length in bytes, >= 1.
            registrar: the backend (UCX, or :class:`~ray_velo.memory.pool.NoopRegistrar`).
            budget: the shared registered-bytes budget; charged the pinned pages.
            on_released: called once after the confirmed unmap (e.g. to free memory that velo
                owns, the protocol's ``register_owned``, docs/protocol.md §10); its result is
                ignored, its errors logged.

        Raises:
            BudgetExceeded: the pages do not fit the budget. Nothing was registered.
            ValueError: an empty or wrapping range.
            Exception: whatever the registrar raises; the budget charge is given back.
        """
        if nbytes < 1:
            raise ValueError(f"nbytes must be >= 1, got {nbytes}")
        if address <= 0 or address + nbytes > 1 << 64:
            raise ValueError(
                f"range of {nbytes} bytes at {address:#x} is not a valid address range"
            )
        self._id = next(_ids)
        self._address = address
        self._nbytes = nbytes
        self._registrar = registrar
        self._budget = budget
        self._on_released = on_released
        self._registration, self._charged = _register_charged(address, nbytes, registrar, budget)
        self._cond = threading.Condition(threading.Lock())
        self._state = RegionState.REGISTERED
        self._in_flight = 0
        self._copies = 0
        self._event = threading.Event()

    # --- facts ---------------------------------------------------------------------------

    @property
    def region_id(self) -> int:
        """A process-unique id, for logs and errors."""
        return self._id

    @property
    def address(self) -> int:
        """The registered pointer (offsets count from here)."""
        return self._address

    @property
    def nbytes(self) -> int:
        """Length of the caller's range in bytes."""
        return self._nbytes

    @property
    def effective_range(self) -> tuple[int, int]:
        """``[start, end)`` addresses the backend pinned: whole pages, remotely writable."""
        return self._registration.effective_range

    @property
    def registration(self) -> Registration:
        """The backend's registration (packed key for descriptors)."""
        return self._registration

    @property
    def charged_bytes(self) -> int:
        """Bytes charged to the budget (the effective range)."""
        return self._charged

    @property
    def state(self) -> RegionState:
        """The lifecycle state now."""
        with self._cond:
            return self._state

    @property
    def in_flight(self) -> int:
        """Anchors held now."""
        with self._cond:
            return self._in_flight

    @property
    def signal(self) -> DeregisteredSignal:
        """The release signal (fires after the confirmed unmap)."""
        return DeregisteredSignal(self._event)

    def _describe(self) -> str:
        return f"{self._id} ({self._nbytes} bytes at {self._address:#x})"

    def check_range(self, offset: int, length: int) -> None:
        """Refuse a range that leaves the caller's ``nbytes`` (offsets from ``address``).

        Raises:
            ValueError: negative, or past ``nbytes``.
        """
        if offset < 0 or length < 0 or offset + length > self._nbytes:
            raise ValueError(
                f"range [{offset}, {offset + length}) is outside region {self._describe()}: "
                f"offsets count from the registered pointer and stop at {self._nbytes}"
            )

    # --- anchors and the copy gate --------------------------------------------------------

    def enter(self) -> InFlight:
        """Take an in-flight anchor (a slot staged in this region holds one).

        Raises:
            RegionDeregistered: the region is deregistering or deregistered.
        """
        with self._cond:
            # Count first, then read the state (docs/protocol.md §9). The lock makes the pair
            # atomic today; the order is what stays correct if the count ever becomes
            # lock-free.
            self._in_flight += 1
            if self._state is not RegionState.REGISTERED:
                self._in_flight -= 1
                self._cond.notify_all()
                raise RegionDeregistered(region=self._describe())
        return InFlight(self)

    def _leave(self) -> None:
        with self._cond:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._cond.notify_all()

    def copy_into(self, offset: int, dest: memoryview | bytearray) -> int:
        """Copy ``len(dest)`` bytes at ``offset`` into ``dest``, 512 KiB per gate pass.

        The zero-extra-copy form of :meth:`copy_out` for large reads.

        Returns:
            Bytes copied (``dest``'s length).

        Raises:
            RegionDeregistered: the latch fell before (or between pieces of) the copy; part of
                ``dest`` may then hold region bytes.
            ValueError: the range leaves the region. TypeError: ``dest`` is not writable.
        """
        view = memoryview(dest).cast("B")
        length = view.nbytes
        try:
            self.check_range(offset, length)
            target = (ctypes.c_char * length).from_buffer(view) if length else None
        except BaseException:
            view.release()
            raise
        if target is None:
            view.release()
            return 0
        try:
            dest_address = ctypes.addressof(target)
            done = 0
            while done < length:
                piece = min(COPY_GATE_CHUNK_BYTES, length - done)
                self._gate_enter()
                try:
                    ctypes.memmove(dest_address + done, self._address + offset + done, piece)
                finally:
                    self._gate_leave()
                done += piece
        finally:
            del target
            view.release()
        return length

    def copy_out(self, offset: int, length: int) -> bytes:
        """A fresh copy of ``length`` bytes at ``offset`` (from the registered pointer).

        Raises:
            RegionDeregistered: the latch fell before or during the copy.
            ValueError: the range leaves the region.
        """
        self.check_range(offset, length)
        if length <= COPY_GATE_CHUNK_BYTES:
            self._gate_enter()
            try:
                return ctypes.string_at(self._address + offset, length)
            finally:
                self._gate_leave()
        buffer = bytearray(length)
        self.copy_into(offset, buffer)
        return bytes(buffer)

    def _gate_enter(self) -> None:
        with self._cond:
            if self._state is not RegionState.REGISTERED:
                raise RegionDeregistered(region=self._describe())
            self._copies += 1

    def _gate_leave(self) -> None:
        with self._cond:
            self._copies -= 1
            if self._copies == 0:
                self._cond.notify_all()

    # --- deregistration -------------------------------------------------------------------

    def deregister(self, timeout_s: float) -> Drained | DrainTimedOut:
        """Latch, wait for copies, drain anchors (up to ``timeout_s``), unregister, release.

        Blocks for at most ``timeout_s`` seconds of drain, plus the copies in progress (each
        at most 512 KiB) and the backend's unmap.

        Returns:
            :class:`Drained` or :class:`DrainTimedOut`; either way the memory is released
            and the signal has fired.

        Raises:
            RegionDeregistered: another call already deregisters (or deregistered) it.
            Exception: whatever the registrar raises when it cannot confirm the unmap. The
                region then stays latched and registered, the budget charged and the signal
                unfired: do not free the memory.
        """
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._cond:
            if self._state is not RegionState.REGISTERED:
                raise RegionDeregistered(region=self._describe())
            self._state = RegionState.DEREGISTERING  # the latch
            # Copies in progress finish first: unmapping under a memmove is a crash, and each
            # is one bounded piece, so this wait is not part of the timeout.
            self._cond.wait_for(lambda: self._copies == 0)
            drained = self._cond.wait_for(
                lambda: self._in_flight == 0, timeout=max(0.0, deadline - time.monotonic())
            )
            left = self._in_flight
        result: Drained | DrainTimedOut = Drained() if drained else DrainTimedOut(left)
        if not drained:
            _log.warning(
                "region %s: %d in-flight anchors still held after %.3f s; unmapping anyway",
                self._describe(),
                left,
                timeout_s,
            )
        try:
            self._registrar.unregister(self._registration)
        except BaseException:
            _log.error(
                "region %s: unregistration failed; it stays registered and deregistered() "
                "will not fire (do not free the memory)",
                self._describe(),
                exc_info=True,
            )
            raise
        if self._budget is not None:
            self._budget.release(self._charged)
        with self._cond:
            self._state = RegionState.DEREGISTERED
        if self._on_released is not None:
            try:
                self._on_released()
            except Exception:
                _log.exception("region %s: on_released callback failed", self._describe())
        self._event.set()
        return result


class RegionWatch:
    """Observers of a region without the release (``unregister`` belongs to the guard)."""

    __slots__ = ("_region",)

    def __init__(self, region: Region) -> None:
        """Watch ``region``."""
        self._region = region

    @property
    def effective_range(self) -> tuple[int, int]:
        """``[start, end)`` addresses pinned (whole pages, remotely writable)."""
        return self._region.effective_range

    @property
    def state(self) -> RegionState:
        """The lifecycle state now."""
        return self._region.state

    def deregistered(self) -> DeregisteredSignal:
        """The single release signal."""
        return self._region.signal


class RegionGuard:
    """The caller's handle on a registered region; it owns the release.

    Call :meth:`unregister` and free the memory only after it returns (or after
    :meth:`deregistered` fires). Dropping the guard (or :meth:`close`) without unregistering
    starts a background deregistration bounded by ``drop_dereg_timeout``, logs a warning and
    returns at once; the memory stays pinned until the signal fires.
    """

    def __init__(self, region: Region, *, drop_dereg_timeout: float = 30.0) -> None:
        """Guard ``region``; a drop deregisters it within ``drop_dereg_timeout`` seconds of drain."""
        self._region = region
        self._drop_dereg_timeout = drop_dereg_timeout
        self._lock = threading.Lock()
        self._consumed = False

    @property
    def region(self) -> Region:
        """The owner-side region (what ``register_data_in_region`` stages from)."""
        return self._region

    @property
    def effective_range(self) -> tuple[int, int]:
        """``[start, end)`` addresses pinned: bytes next to the allocation share the pinning
        and the remote writability."""
        return self._region.effective_range

    def deregistered(self) -> DeregisteredSignal:
        """The single release signal: set on the confirmed unmap."""
        return self._region.signal

    def watch(self) -> RegionWatch:
        """Observers that do not own the release."""
        return RegionWatch(self._region)

    def _consume(self) -> bool:
        with self._lock:
            first, self._consumed = not self._consumed, True
            return first

    def unregister(self, timeout_s: float) -> Drained | DrainTimedOut:
        """Gate new use, drain in-flight work for up to ``timeout_s`` seconds, unmap.

        Returns:
            :class:`Drained` (every anchor left) or :class:`DrainTimedOut` (velo did not wait
            for them); both mean the memory is released and may be freed.

        Raises:
            RegionDeregistered: this guard was already unregistered or closed.
            Exception: the registrar could not confirm the unmap; do not free the memory.
        """
        if not self._consume():
            raise RegionDeregistered(region=self._region._describe())
        return self._region.deregister(timeout_s)

    def close(self) -> None:
        """Deregister in the background without blocking (a drop); idempotent.

        Logs a warning: the memory stays pinned until :meth:`deregistered` fires, at most
        ``drop_dereg_timeout`` seconds of drain later.
        """
        if not self._consume():
            return
        _log.warning(
            "region %s dropped without unregister(); deregistering in the background "
            "(drain bounded by %.1f s); the memory stays pinned until deregistered() fires",
            self._region._describe(),
            self._drop_dereg_timeout,
        )
        thread = threading.Thread(
            target=_background_deregister,
            args=(self._region, self._drop_dereg_timeout),
            name=f"ray_velo-region-dereg-{self._region.region_id}",
            daemon=True,
        )
        thread.start()

    def __del__(self) -> None:
        # At interpreter shutdown no thread can start: the memory then leaks, on purpose.
        with contextlib.suppress(Exception):
            self.close()


def _background_deregister(region: Region, timeout_s: float) -> None:
    try:
        region.deregister(timeout_s)
    except RegionDeregistered:
        pass  # the shutdown sweep (or another owner of the region) got there first
    except Exception:
        _log.exception("background deregistration of region %s failed", region._describe())


def _register_charged(
    address: int, nbytes: int, registrar: Registrar, budget: RegistrationBudget | None
) -> tuple[Registration, int]:
    """Charge the budget for the pages, register them, and correct the charge to what the
    backend really pinned: (registration, bytes charged). Nothing stays charged if the
    registration fails; BudgetExceeded when the pages do not fit."""
    start, end = page_range(address, nbytes)
    estimate = end - start
    if budget is not None and not budget.reserve(estimate):
        raise BudgetExceeded(
            requested_bytes=estimate,
            registered_bytes=budget.registered_bytes,
            budget_bytes=budget.budget_bytes,
        )
    try:
        registration = registrar.register(address, nbytes)
    except BaseException:
        if budget is not None:
            budget.release(estimate)
        raise
    start, end = registration.effective_range
    charged = end - start
    if budget is not None and charged != estimate:
        budget.adjust(charged - estimate)  # count what the backend really pinned
    return registration, charged
