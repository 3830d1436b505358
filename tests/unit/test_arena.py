"""Shared-memory arenas: create, map from another process, close, and clean up after a crash."""

from __future__ import annotations

import ctypes
import errno
import os
import pickle
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import ray_velo
from ray_velo.errors import SharedMemoryTooSmall
from ray_velo.memory import arena as arena_mod
from ray_velo.memory.arena import (
    PAGE_BYTES,
    SegmentMap,
    ShmArena,
    page_round_up,
    remove_stale_segments,
    segment_name,
)

OWNER = 0x0123_4567_89AB_CDEF
REPO_ROOT = Path(ray_velo.__file__).resolve().parent.parent


def _mapped_paths() -> str:
    with open("/proc/self/maps") as maps:
        return maps.read()


def test_create_view_and_close(shm_dir: Path) -> None:
    """The agent creates an arena: a 0600 file with the spec's name, page-sized, mapped shared
    read-write at a page-aligned address; close unlinks and unmaps, and is idempotent."""
    arena = ShmArena(shm_dir, 10_000, OWNER)
    name = os.path.basename(arena.path)
    assert name.startswith(f"ray_velo-{os.getpid()}-{OWNER:016x}-")
    assert arena.name == name
    assert arena.nbytes == page_round_up(10_000) and arena.nbytes % PAGE_BYTES == 0
    info = os.stat(arena.path)
    assert stat.S_IMODE(info.st_mode) == 0o600
    assert info.st_size == arena.nbytes
    assert arena.address % PAGE_BYTES == 0

    view = arena.view(100, 5)
    view[:] = b"hello"
    holder = ctypes.c_char.from_buffer(view)
    assert ctypes.addressof(holder) == arena.address + 100
    del holder
    assert bytes(arena.view(100, 5)) == b"hello"
    with pytest.raises(ValueError):
        arena.view(arena.nbytes - 1, 2)
    with pytest.raises(ValueError):
        arena.view(-1, 1)
    view.release()

    assert arena.close() is True
    assert not os.path.exists(arena.path)
    assert arena.path not in _mapped_paths()
    assert arena.close() is True  # idempotent
    assert arena.closed
    with pytest.raises(ValueError):
        arena.view(0, 1)
    with pytest.raises(ValueError):
        _ = arena.address


def test_close_with_exported_view_defers_the_unmap(shm_dir: Path) -> None:
    """A slot's view outlives its arena: close unlinks at once but defers the munmap to the
    release of the last view, so the straggler reads its bytes instead of crashing."""
    arena = ShmArena(shm_dir, PAGE_BYTES, OWNER)
    view = arena.view(0, 3)
    view[:] = b"abc"
    assert arena.close() is False  # deferred
    assert not os.path.exists(arena.path)
    assert bytes(view) == b"abc"
    assert arena.path in _mapped_paths()  # shown as "(deleted)" until the view goes
    view.release()
    assert arena.path not in _mapped_paths()


def test_prefault_maps_zeroed_pages(shm_dir: Path) -> None:
    """An arena pre-faulted for the pinned pool is usable and zero from the first byte."""
    arena = ShmArena(shm_dir, 4 * PAGE_BYTES + 1, OWNER, prefault=True)
    try:
        assert arena.nbytes == 5 * PAGE_BYTES
        assert bytes(arena.view(0, arena.nbytes)) == bytes(arena.nbytes)
    finally:
        arena.close()


def test_another_process_maps_the_same_bytes(shm_dir: Path) -> None:
    """A Ray task on the owner's node maps the arena by path: it reads the producer's bytes
    in place and its writes land in the owner's mapping (MAP_SHARED, no copy)."""
    arena = ShmArena(shm_dir, 2 * PAGE_BYTES, OWNER)
    try:
        arena.view(PAGE_BYTES, 4)[:] = b"ping"
        script = (
            "import sys\n"
            "from ray_velo.memory.arena import SegmentMap, PAGE_BYTES\n"
            "segments = SegmentMap()\n"
            "seen = bytes(segments.view(sys.argv[1], PAGE_BYTES, 4))\n"
            "segments.view(sys.argv[1], 0, 4)[:] = b'pong'\n"
            "segments.close_all()\n"
            "print(seen.decode())\n"
        )
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        out = subprocess.run(
            [sys.executable, "-c", script, arena.path],
            capture_output=True,
            text=True,
            env=env,
            timeout=30,
            check=True,
        )
        assert out.stdout.strip() == "ping"
        assert bytes(arena.view(0, 4)) == b"pong"
    finally:
        arena.close()


def test_segment_map_caches_and_unmaps(shm_dir: Path) -> None:
    """A consumer process maps each segment once and sees the owner's writes live; a freed
    segment it never mapped is a FileNotFoundError, and close_all unmaps everything."""
    first = ShmArena(shm_dir, PAGE_BYTES, OWNER)
    second = ShmArena(shm_dir, 3 * PAGE_BYTES, OWNER)
    segments = SegmentMap()
    try:
        assert segments.size(first.path) == PAGE_BYTES
        assert segments.address(first.path) == segments.address(first.path)  # cached
        first.view(0, 2)[:] = b"hi"
        assert bytes(segments.view(first.path, 0, 2)) == b"hi"
        assert segments.size(second.path) == 3 * PAGE_BYTES
        assert len(segments) == 2 and segments.is_mapped(second.path)
        with pytest.raises(ValueError):
            segments.view(first.path, PAGE_BYTES - 1, 2)
        assert segments.unmap(first.path) is True
        assert segments.unmap(first.path) is False
        assert not segments.is_mapped(first.path)
        with pytest.raises(FileNotFoundError):
            segments.view(str(shm_dir / segment_name(1, OWNER, 999)), 0, 1)
    finally:
        segments.close_all()
        first.close()
        second.close()
    assert len(segments) == 0
    assert second.path not in _mapped_paths()


def test_too_small_directory_is_refused_before_creating(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A container with a tiny /dev/shm: statvfs says 8 pages are free, a 1 MiB arena is
    refused with SharedMemoryTooSmall naming the directory and both sizes; no file appears."""
    real_statvfs = os.statvfs

    class TinyFs:
        def __init__(self, real: Any) -> None:
            self.f_frsize = PAGE_BYTES
            self.f_bavail = 8
            self._real = real

    monkeypatch.setattr(os, "statvfs", lambda path: TinyFs(real_statvfs(path)))
    with pytest.raises(SharedMemoryTooSmall) as info:
        ShmArena(shm_dir, 1 << 20, OWNER)
    err = info.value
    assert isinstance(err, OSError)
    assert err.fields == {
        "directory": str(shm_dir),
        "free_bytes": 8 * PAGE_BYTES,
        "requested_bytes": 1 << 20,
    }
    assert str(shm_dir) in str(err)
    assert pickle.loads(pickle.dumps(err)).fields == err.fields
    # Eight pages still fit.
    ShmArena(shm_dir, 8 * PAGE_BYTES, OWNER).close()


def test_enospc_while_reserving_maps_to_too_small(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """statvfs said yes but another process filled the tmpfs first: reserving the pages fails
    with ENOSPC, which becomes SharedMemoryTooSmall (not a later SIGBUS in a Ray task), and
    the half-made file is removed."""

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(SharedMemoryTooSmall) as info:
        ShmArena(shm_dir, 4 * PAGE_BYTES, OWNER)
    assert isinstance(info.value.__cause__, OSError)
    assert info.value.fields["requested_bytes"] == 4 * PAGE_BYTES


def test_bad_arguments(shm_dir: Path) -> None:
    """Empty arenas and owner tags that do not fit 16 hex digits are caller bugs."""
    with pytest.raises(ValueError):
        ShmArena(shm_dir, 0, OWNER)
    with pytest.raises(ValueError):
        ShmArena(shm_dir, PAGE_BYTES, 1 << 64)
    with pytest.raises(ValueError):
        ShmArena(shm_dir, PAGE_BYTES, -1)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_remove_stale_segments_of_a_crashed_agent(shm_dir: Path) -> None:
    """A new agent starts where a crashed one left its arenas: files whose pid is dead are
    removed; a live process's arena and files that are not ours are left alone."""
    dead = _dead_pid()
    stale = [shm_dir / segment_name(dead, OWNER, seq) for seq in (0, 7)]
    for path in stale:
        path.write_bytes(b"x" * 16)
    unrelated = [shm_dir / "other.txt", shm_dir / "ray_velo-notours", shm_dir / "ray_velo-1-zz-0"]
    for path in unrelated:
        path.write_bytes(b"")
    live = ShmArena(shm_dir, PAGE_BYTES, OWNER)
    try:
        removed = remove_stale_segments(shm_dir)
        assert [s.path for s in removed] == sorted(str(p) for p in stale)
        assert [s.nbytes for s in removed] == [16, 16]
        assert os.path.exists(live.path)
        assert all(p.exists() for p in unrelated)
        assert remove_stale_segments(shm_dir) == []
    finally:
        live.close()
        for path in unrelated:
            path.unlink()


def test_arena_names_never_repeat_in_a_process(shm_dir: Path) -> None:
    """The pinned and the plain pool of one agent share its owner tag; the per-process
    sequence keeps their file names apart."""
    arenas = [ShmArena(shm_dir, PAGE_BYTES, OWNER) for _ in range(3)]
    try:
        assert len({a.path for a in arenas}) == 3
    finally:
        for arena in arenas:
            arena.close()


def test_module_constants() -> None:
    """Pages and names are what the pool and other processes assume."""
    assert os.sysconf("SC_PAGE_SIZE") == PAGE_BYTES
    assert segment_name(42, 0xAB, 3) == "ray_velo-42-00000000000000ab-3"
    assert arena_mod.SEGMENT_PREFIX == "ray_velo-"
