"""Shared-memory arenas: page-aligned files in a tmpfs directory, every page committed up front,
that the node's processes map by path (docs/deployment.md §2)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import logging
import mmap
import os
import re
import threading
from typing import Final, NamedTuple

from ray_velo.errors import SharedMemoryTooSmall

__all__ = [
    "PAGE_BYTES",
    "SEGMENT_PREFIX",
    "SegmentMap",
    "ShmArena",
    "StaleSegment",
    "page_round_up",
    "pid_alive",
    "remove_stale_segments",
    "segment_name",
]

_log = logging.getLogger(__name__)

PAGE_BYTES: Final = mmap.PAGESIZE
"""The system page size in bytes; arenas are whole pages."""

SEGMENT_PREFIX: Final = "ray_velo-"
"""Every arena file's name starts with this."""

_SEGMENT_RE: Final = re.compile(r"^ray_velo-(\d+)-([0-9a-f]{16})-(\d+)$")

# Linux madvise advice, absent from Python's mmap module before 3.13 (asm-generic value).
# Kernels before 5.14 answer EINVAL; we then reserve with posix_fallocate and touch pages.
_MADV_POPULATE_WRITE: Final = 23

# errno values that mean "the tmpfs (or memory) cannot hold this arena".
_NO_ROOM_ERRNOS: Final = frozenset({errno.ENOSPC, errno.ENOMEM, errno.EFBIG, errno.EDQUOT})

# Per-process arena counter: two pools of one agent (pinned and plain) share an owner tag.
_sequence = itertools.count()


def page_round_up(nbytes: int) -> int:
    """``nbytes`` rounded up to a whole number of pages (bytes)."""
    return -(-nbytes // PAGE_BYTES) * PAGE_BYTES


def segment_name(pid: int, owner_tag: int, seq: int) -> str:
    """The file name of arena ``seq`` of owner ``owner_tag`` in process ``pid``."""
    return f"{SEGMENT_PREFIX}{pid}-{owner_tag:016x}-{seq}"


def _address_of(buffer: mmap.mmap) -> int:
    # from_buffer exports the mapping; drop the ctypes object at once so close() can munmap.
    anchor = ctypes.c_char.from_buffer(buffer)
    address = ctypes.addressof(anchor)
    del anchor
    return address


def _release_mapping(buffer: mmap.mmap) -> bool:
    """munmap now if no view is exported; else leave it to the last view's release."""
    try:
        buffer.close()
    except BufferError:
        # Views still point into the mapping. Dropping our reference (the caller does) lets
        # CPython munmap when the last view goes; unmapping now would turn them into a crash.
        return False
    return True


def _no_room(directory: str, requested: int, exc: OSError | None = None) -> SharedMemoryTooSmall:
    try:
        st = os.statvfs(directory)
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = -1
    err = SharedMemoryTooSmall(directory=directory, free_bytes=free, requested_bytes=requested)
    if exc is not None:
        err.__cause__ = exc
    return err


def _map_new_segment(directory: str, path: str, size: int, prefault: bool) -> mmap.mmap:
    """Create the file at ``path`` (``O_EXCL``, mode 0600), size and reserve it, and map it
    shared read-write: the mapping (its fd closed). When it fails, nothing is left behind.

    Raises:
        SharedMemoryTooSmall: reserving or pre-faulting found no room (ENOSPC, ENOMEM, ...).
        OSError: any other failure to create, size or map the file.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    buffer: mmap.mmap | None = None
    try:
        os.ftruncate(fd, size)
        if not prefault:
            _reserve(fd, size)
        buffer = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        with contextlib.suppress(OSError, AttributeError):
            buffer.madvise(mmap.MADV_HUGEPAGE)
        if prefault:
            _populate(buffer, fd, size)
    except OSError as exc:
        if buffer is not None:
            buffer.close()
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        if exc.errno in _NO_ROOM_ERRNOS or exc.errno == errno.EFAULT:
            raise _no_room(directory, size, exc) from exc
        raise
    os.close(fd)  # the mmap object holds its own duplicate
    return buffer


class ShmArena:
    """One page-aligned shared-memory segment owned by this process.

    The file is created with ``O_EXCL`` and mode 0600, sized, reserved (docs/architecture.md
    §14), mapped ``MAP_SHARED`` read-write and advised ``MADV_HUGEPAGE`` (ignored where the
    kernel refuses). Not thread-safe for ``close``; the pool serialises it.

    Closing with exported views: :meth:`close` *defers* the munmap, it does not refuse. The
    file is unlinked at once (no new process can map it); the mapping goes away when the last
    view into it is released. A view that outlives the arena therefore stays readable instead
    of crashing the process. Callers that must know (tests) read :meth:`close`'s return value.
    """

    __slots__ = ("_address", "_buffer", "_closed", "_nbytes", "_path")

    def __init__(
        self,
        directory: str | os.PathLike[str],
        nbytes: int,
        owner_tag: int,
        *,
        prefault: bool = False,
    ) -> None:
        """Create, reserve and map a new segment of ``nbytes`` bytes (rounded up to pages).

        Args:
            directory: a tmpfs directory (``/dev/shm`` in production).
            nbytes: requested size in bytes, >= 1; rounded up to whole pages.
            owner_tag: the owning agent's 64-bit worker id (named in the file name).
            prefault: also map every page into this process now (``MADV_POPULATE_WRITE``, or a
                write per page on old kernels), so first-touch faults do not land on the first
                transfer. Registration touches every page anyway; this only moves the cost.

        Raises:
            SharedMemoryTooSmall: the directory cannot hold the segment (checked with
                ``statvfs`` before creating; ENOSPC/ENOMEM while reserving maps here too).
                Nothing is left behind.
            OSError: any other failure to create or map the file (e.g. permissions). Nothing
                is left behind.
            ValueError: ``nbytes`` < 1 or ``owner_tag`` is not a 64-bit unsigned integer.
        """
        if nbytes < 1:
            raise ValueError(f"nbytes must be >= 1, got {nbytes}")
        if not 0 <= owner_tag < 1 << 64:
            raise ValueError(f"owner_tag must be a 64-bit unsigned integer, got {owner_tag}")
        directory = os.fspath(directory)
        size = page_round_up(nbytes)
        st = os.statvfs(directory)
        free = st.f_bavail * st.f_frsize
        if size > free:
            raise SharedMemoryTooSmall(directory=directory, free_bytes=free, requested_bytes=size)

        path = os.path.join(directory, segment_name(os.getpid(), owner_tag, next(_sequence)))
        buffer = _map_new_segment(directory, path, size, prefault)
        self._path = path
        self._nbytes = size
        self._buffer: mmap.mmap | None = buffer
        self._address = _address_of(buffer)
        self._closed = False

    @property
    def path(self) -> str:
        """Absolute or directory-relative path of the segment file (what others map)."""
        return self._path

    @property
    def name(self) -> str:
        """The segment's file name (``ray_velo-<pid>-<owner_tag>-<seq>``)."""
        return os.path.basename(self._path)

    @property
    def nbytes(self) -> int:
        """Size of the mapping in bytes (a whole number of pages)."""
        return self._nbytes

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._closed

    @property
    def address(self) -> int:
        """Base address of the mapping in this process (page-aligned), for registration.

        Raises:
            ValueError: the arena is closed.
        """
        if self._closed:
            raise ValueError(f"arena {self.name} is closed")
        return self._address

    def view(self, offset: int, length: int) -> memoryview:
        """A writable view of ``length`` bytes at byte ``offset``.

        Raises:
            ValueError: the arena is closed, or the range leaves the arena.
        """
        buffer = self._buffer
        if buffer is None:
            raise ValueError(f"arena {self.name} is closed")
        if offset < 0 or length < 0 or offset + length > self._nbytes:
            raise ValueError(
                f"range [{offset}, {offset + length}) outside arena {self.name} of "
                f"{self._nbytes} bytes"
            )
        return memoryview(buffer)[offset : offset + length]

    def unlink(self) -> None:
        """Remove the file now and keep the mapping (shutdown abandons memory a GET may
        still write: the pages go with the process)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)

    def close(self) -> bool:
        """Unlink the file and unmap; idempotent.

        The caller unregisters the memory first (the pool does): pages outlive their
        registration, never the reverse.

        Returns:
            True when the mapping is gone now, False when exported views defer the munmap to
            the release of the last one (see the class docstring). A second call returns True.
        """
        if self._closed:
            return True
        self._closed = True
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)
        buffer, self._buffer = self._buffer, None
        return buffer is None or _release_mapping(buffer)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"at 0x{self._address:x}"
        return f"<ShmArena {self.name} {self._nbytes} bytes {state}>"


def _reserve(fd: int, size: int) -> None:
    """Allocate every page of the file now, so running out is ENOSPC here, not SIGBUS later."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        # A filesystem that cannot preallocate: the statvfs check is the only guard left.
        _log.debug("cannot preallocate arena pages (%s); relying on the statvfs check", exc)


def _populate(buffer: mmap.mmap, fd: int, size: int) -> None:
    """Reserve and map every page of a fresh mapping (after MADV_HUGEPAGE, so huge pages stick)."""
    while True:
        try:
            buffer.madvise(_MADV_POPULATE_WRITE)
            return
        except OSError as exc:
            if exc.errno == errno.EINTR:
                continue
            if exc.errno != errno.EINVAL:
                raise  # ENOMEM/EFAULT: the tmpfs ran out; the caller maps it
            break
    # Kernel before 5.14: reserve first (a failed touch would be a SIGBUS), then touch.
    _reserve(fd, size)
    view = memoryview(buffer)
    try:
        for offset in range(0, size, PAGE_BYTES):
            view[offset] = 0  # a fresh segment is zero: the write only faults the page in
    finally:
        view.release()


class SegmentMap:
    """Per-process cache of arena files mapped by path (producers and consumers of a node).

    The first use of a path maps the whole file read-write and shared; later uses reuse the
    mapping. Thread-safe. Unmapping follows :class:`ShmArena`'s rule: with views still
    exported the munmap waits for the last one.
    """

    def __init__(self) -> None:
        """An empty cache."""
        self._lock = threading.Lock()
        self._maps: dict[str, tuple[mmap.mmap, int]] = {}

    def _mapping(self, path: str) -> tuple[mmap.mmap, int]:
        with self._lock:
            found = self._maps.get(path)
            if found is not None:
                return found
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            try:
                size = os.fstat(fd).st_size
                if size == 0:
                    raise ValueError(f"segment {path} is empty")
                buffer = mmap.mmap(
                    fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
                )
            finally:
                os.close(fd)
            with contextlib.suppress(OSError, AttributeError):
                buffer.madvise(mmap.MADV_HUGEPAGE)
            entry = (buffer, _address_of(buffer))
            self._maps[path] = entry
            return entry

    def view(self, path: str, offset: int, length: int) -> memoryview:
        """A writable view of ``length`` bytes at byte ``offset`` of segment ``path``.

        Raises:
            FileNotFoundError: the segment is gone (its owner freed it or died).
            ValueError: the range leaves the segment.
            OSError: the file cannot be opened or mapped.
        """
        buffer, _ = self._mapping(path)
        if offset < 0 or length < 0 or offset + length > len(buffer):
            raise ValueError(
                f"range [{offset}, {offset + length}) outside segment {path} of {len(buffer)} bytes"
            )
        return memoryview(buffer)[offset : offset + length]

    def address(self, path: str) -> int:
        """Base address of segment ``path`` in this process (maps it on first use).

        Raises:
            FileNotFoundError: the segment is gone. OSError: it cannot be mapped.
        """
        return self._mapping(path)[1]

    def size(self, path: str) -> int:
        """Size in bytes of segment ``path`` (maps it on first use)."""
        return len(self._mapping(path)[0])

    def is_mapped(self, path: str) -> bool:
        """True when ``path`` is in the cache."""
        with self._lock:
            return path in self._maps

    def __len__(self) -> int:
        with self._lock:
            return len(self._maps)

    def unmap(self, path: str) -> bool:
        """Drop ``path`` from the cache and unmap it (deferred while views are exported).

        Returns:
            True when ``path`` was mapped.
        """
        with self._lock:
            entry = self._maps.pop(path, None)
        if entry is None:
            return False
        _release_mapping(entry[0])
        return True

    def prune_missing(self) -> int:
        """Unmap cached segments whose file is gone (their owner unmapped and unlinked them).

        A mapping keeps a deleted tmpfs file's memory alive; dropping it gives that memory
        back once the last view into it goes. Returns how many were dropped.
        """
        with self._lock:
            gone = [path for path in self._maps if not os.path.exists(path)]
        return sum(self.unmap(path) for path in gone)

    def close_all(self) -> None:
        """Unmap every cached segment (deferred for those with exported views)."""
        with self._lock:
            entries, self._maps = list(self._maps.values()), {}
        for buffer, _ in entries:
            _release_mapping(buffer)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (this process always does)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


class StaleSegment(NamedTuple):
    """A segment file :func:`remove_stale_segments` removed, and its size."""

    path: str
    nbytes: int


def remove_stale_segments(directory: str | os.PathLike[str]) -> list[StaleSegment]:
    """Remove the arena files of dead processes in ``directory`` (a crashed agent's).

    A file is stale when the pid in its name is not alive (``os.kill(pid, 0)``). Pids only
    mean something inside one pid namespace, so give each node (container) its own directory.
    A recycled pid keeps a dead owner's files until that process exits too; that leaks, it
    never removes a live segment.

    Returns:
        The segments removed (path, bytes), sorted by path.

    Raises:
        OSError: ``directory`` cannot be listed.
    """
    directory = os.fspath(directory)
    removed: list[StaleSegment] = []
    alive: dict[int, bool] = {}
    for entry in os.scandir(directory):
        match = _SEGMENT_RE.match(entry.name)
        if match is None or not entry.is_file(follow_symlinks=False):
            continue
        pid = int(match.group(1))
        if pid not in alive:
            alive[pid] = pid_alive(pid)
        if alive[pid]:
            continue
        try:
            nbytes = entry.stat(follow_symlinks=False).st_size
            os.unlink(entry.path)
        except FileNotFoundError:
            continue  # another cleaner got there first
        _log.info("removed stale shared-memory segment %s of dead process %d", entry.path, pid)
        removed.append(StaleSegment(entry.path, nbytes))
    return sorted(removed)
