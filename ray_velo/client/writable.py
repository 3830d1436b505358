"""Memory of this node's agent that a process writes: a :class:`PinnedWriter` and a
:class:`SendBuffer`, each a producer's reservation seen as a writable numpy array (docs/api.md)."""

from __future__ import annotations

import functools
import logging
import math
import sys
import threading
import weakref
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import numpy as np

from ray_velo.client import session
from ray_velo.client.payload import as_bytes_view
from ray_velo.errors import StagingError, UnsupportedPayload
from ray_velo.local.records import Reservation
from ray_velo.protocol import DataHandle

__all__ = ["PinnedWriter", "SendBuffer", "alloc_pinned_writer", "empty"]

_log = logging.getLogger(__name__)


class _ReservationBytes:
    """Exports a reservation's memory, writable, to numpy: the ``base`` every array over it
    leads to. When it is collected the reservation goes back to the pool, unless its
    finalizer was detached first (the agent took the reservation as a slot)."""

    __slots__ = ("__array_interface__", "__weakref__", "_finalizer", "_view")

    def __init__(self, state: session.Session, reservation: Reservation) -> None:
        self._view = session.segment_view(
            state, reservation.path, reservation.offset, reservation.nbytes
        )
        self.__array_interface__ = {
            "data": (np.frombuffer(self._view, dtype=np.uint8).ctypes.data, False),
            "shape": (reservation.nbytes,),
            "typestr": "|u1",
            "version": 3,
        }
        self._finalizer = weakref.finalize(self, state.stage_abort, reservation.reservation_id)
        self._finalizer.atexit = False  # the agent reaps a dead producer's reservations


def _reservation_array(
    state: session.Session, reservation: Reservation, dtype: np.dtype[Any], shape: tuple[int, ...]
) -> tuple[np.ndarray[Any, Any], weakref.finalize[..., Any]]:
    """A writable array of ``dtype`` and ``shape`` over ``reservation``'s memory, and the
    finalizer that gives the reservation back once the last array over it is collected
    (``detach()`` it when the agent took the reservation as a slot)."""
    exporter = _ReservationBytes(state, reservation)
    return typed_array(exporter, dtype, shape), exporter._finalizer


def typed_array(
    exporter: Any, dtype: np.dtype[Any], shape: tuple[int, ...]
) -> np.ndarray[Any, Any]:
    """The array of ``dtype`` and ``shape`` over a flat uint8 ``exporter`` (an object with
    ``__array_interface__``), which every view of it leads to through ``base``."""
    return np.asarray(exporter).view(dtype).reshape(shape)


def held_elsewhere(array: np.ndarray[Any, Any]) -> bool:
    """Whether anything but the caller's one name for ``array`` still reaches its memory:
    another name, a view (whose ``base`` is ``array`` or one of its bases), a memoryview,
    a tensor over it. CPython reference counts; raw addresses are not seen. Always True
    where this interpreter's counts are not the ones checked here (assume held: copy)."""
    return not _counts_as_expected() or _more_than_one_name(array)


def _more_than_one_name(array: np.ndarray[Any, Any]) -> bool:
    # array: the caller's caller's name, the caller's parameter, this parameter,
    # getrefcount's argument
    if sys.getrefcount(array) > 4:
        return True
    link = array.base
    while link is not None:
        # link: its child's base, this name, getrefcount's argument
        if sys.getrefcount(link) > 3:
            return True
        link = link.base if isinstance(link, np.ndarray) else None
    return False


class _Probe:
    __slots__ = ("__array_interface__", "_memory")

    def __init__(self) -> None:
        self._memory = np.zeros(64, dtype=np.uint8)
        self.__array_interface__ = dict(self._memory.__array_interface__)


@functools.cache
def _counts_as_expected() -> bool:
    """Whether reference counts here are what :func:`_more_than_one_name` assumes (they are
    on CPython 3.10-3.13): a sole name reads as one, a name and a view as more."""
    array = typed_array(_Probe(), np.dtype(np.float32), (4, 4))
    alone = _sole_name_reads_as_held(array)
    view = array[1:]
    viewed = _sole_name_reads_as_held(array)
    del view
    if alone or not viewed:
        _log.warning(
            "ray_velo cannot tell from this interpreter's reference counts whether an array "
            "is still referenced: SendBuffer.seal() will always copy"
        )
    return not alone and viewed


def _sole_name_reads_as_held(array: np.ndarray[Any, Any]) -> bool:
    return _more_than_one_name(array)  # the same depth of calls as held_elsewhere


class PinnedWriter:
    """A writable buffer in this node's registered pool, from :func:`alloc_pinned_writer`.

    :func:`~ray_velo.get_into` lands fetched bytes in it with no further copy. Its memory
    goes back to the pool once the writer is closed (or dropped) and the last array over it
    (``array`` and any view of it) is collected.
    """

    def __init__(self, state: session.Session, reservation: Reservation) -> None:
        self._reservation = reservation
        self.array, _ = _reservation_array(
            state, reservation, np.dtype(np.uint8), (reservation.nbytes,)
        )
        self.nbytes = reservation.nbytes

    def memoryview(self) -> memoryview:
        return self.array.data

    @property
    def reservation_id(self) -> int:
        return self._reservation.reservation_id

    def close(self) -> None:
        """Let go of the buffer: it goes back to the pool now, or when the last array over
        it that the caller still holds is collected."""
        self.array = np.empty(0, dtype=np.uint8)
        self.nbytes = 0


def alloc_pinned_writer(nbytes: int) -> PinnedWriter:
    """A writable buffer of ``nbytes`` in this node's registered pool."""
    if nbytes <= 0:
        raise ValueError(f"nbytes must be > 0, got {nbytes}")
    state, reservation = session.reserve(nbytes, True)
    assert reservation is not None  # a reservation that may map is never declined
    return PinnedWriter(state, reservation)


def fetched_pinned_writer(
    handle: DataHandle, nbytes: int, timeout: float | None, mode: str = "detach"
) -> PinnedWriter:
    """A PinnedWriter of ``nbytes`` holding ``handle``'s bytes, from an owner on another
    node: the reservation and the GET into it in one call to this node's agent (``mode``
    as :func:`~ray_velo.client.session.fetch_into_writer`'s)."""
    return PinnedWriter(*session.fetch_into_writer(handle, nbytes, timeout, mode))


class SendBuffer:
    """An array to build a payload in, from :func:`empty`, staged by :meth:`seal` with no copy.

    Write the payload into ``array`` (``out=`` of a numpy call, slice assignment, a torch
    tensor over it), let go of every other reference to it, then :meth:`seal`. Until then
    the buffer holds a reservation in this node's pool (registered memory when ``pinned``
    and the budget allows, as for :func:`~ray_velo.put`). ``with rv.empty(...) as buf:``
    gives the reservation back if the block ends without a seal.
    """

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: np.dtype[Any],
        *,
        pinned: bool,
        ttl: float | None,
        lifetime: str | None,
    ) -> None:
        self._pinned, self._ttl, self._lifetime = pinned, ttl, lifetime
        self._job = session.staging_terms(ttl, lifetime)
        self._lock = threading.Lock()
        self._handle: DataHandle | None = None
        self._reservation: Reservation | None = None
        self._finalizer: weakref.finalize[..., Any] | None = None
        self._array: np.ndarray[Any, Any] | None
        nbytes = math.prod(shape) * dtype.itemsize
        if not nbytes:  # nothing to reserve: seal stages an empty payload
            self._array = np.empty(shape, dtype=dtype)
            return
        self._state, self._reservation = session.reserve(nbytes, pinned)
        assert self._reservation is not None  # a reservation that may map is never declined
        self._array, self._finalizer = _reservation_array(
            self._state, self._reservation, dtype, shape
        )

    @property
    def array(self) -> np.ndarray[Any, Any]:
        """The writable array; gone once sealed or aborted."""
        with self._lock:
            return self._live()

    @property
    def handle(self) -> DataHandle | None:
        """The handle :meth:`seal` returned; None before."""
        return self._handle

    def _live(self) -> np.ndarray[Any, Any]:
        if self._array is None:
            done = "sealed" if self._handle is not None else "aborted"
            raise StagingError(f"this SendBuffer was {done}: its array is no longer writable")
        return self._array

    def seal(self) -> DataHandle:
        """Stage the array's bytes as they are now; their handle (refcount 1).

        No copy when the buffer holds the only reference to its array. Otherwise the bytes
        are copied into a slot of their own (with a warning): a view still alive could write
        into bytes a reader is reading. Either way ``array`` is gone afterwards.

        Raises:
            StagingError: the buffer was sealed or aborted already.
        """
        with self._lock:
            array = self._live()
            self._array = None
            shared = held_elsewhere(array)
        if self._reservation is None or shared:
            if shared:
                _log.warning(
                    "ray_velo SendBuffer of %d bytes sealed while other references to its "
                    "array are alive: its bytes were copied (drop every view, memoryview or "
                    "tensor of the array before seal() to stage it without a copy)",
                    array.nbytes,
                )
            self._handle = session.stage(
                array, pinned=self._pinned, ttl=self._ttl, lifetime=self._lifetime
            )
            return self._handle
        header, _ = as_bytes_view(array)
        assert self._finalizer is not None
        self._finalizer.detach()  # the reservation becomes the slot: never given back here
        session.commit(self._state, self._reservation, header, self._ttl, 1, False, self._job)
        self._handle = self._reservation.handle
        return self._handle

    def abort(self) -> None:
        """Give the reservation back (once no array over it is left); a no-op once sealed."""
        with self._lock:
            self._array = None

    def __enter__(self) -> SendBuffer:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._handle is None:
            self.abort()


def empty(
    shape: int | Sequence[int],
    dtype: Any = np.float64,
    *,
    pinned: bool = True,
    ttl: float | None = None,
    lifetime: str | None = None,
) -> SendBuffer:
    """A :class:`SendBuffer`: an uninitialized array of ``shape`` and ``dtype`` in this
    node's shared (by default registered) memory, to build a payload in and :meth:`seal
    <SendBuffer.seal>` without the copy :func:`~ray_velo.put` makes. ``pinned``, ``ttl``
    and ``lifetime`` as in :func:`~ray_velo.put`.

    Raises:
        UnsupportedPayload: ``dtype`` holds Python objects.
        SharedMemoryTooSmall: the node's shm directory cannot hold the payload.
        ConfigError: ``ttl`` or ``lifetime`` is invalid.
        ValueError: ``shape`` has a negative dimension.
    """
    dims = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(map(int, shape))
    if any(d < 0 for d in dims):
        raise ValueError(f"shape {dims} has a negative dimension")
    kind = np.dtype(dtype)
    if kind.hasobject:
        raise UnsupportedPayload(type_name=f"numpy array of dtype {kind} (Python objects)")
    return SendBuffer(dims, kind, pinned=pinned, ttl=ttl, lifetime=lifetime)
