"""Process bodies for the two-process UCX tests.

Every function here runs in a process started with the ``spawn`` method (never ``fork`` after
UCX is up). Each applies its environment (``UCX_TLS`` ...) before anything loads UCX, and
reports back over a Pipe as a plain dict, so a crash shows up as a missing result and an
exit code instead of taking pytest down. The pytest process itself never loads UCX.
"""

from __future__ import annotations

import mmap
import os
import time
import traceback
import zlib
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

MiB = 1 << 20
PATTERN_K = 0x9E3779B97F4A7C15
OWNER_IDLE_LIMIT_S = 60.0  # an owner left alone this long gives up (no orphan processes)


def _pattern(nbytes: int) -> Any:
    import numpy as np

    words = np.arange(nbytes // 8, dtype=np.uint64) * np.uint64(PATTERN_K)
    return words.view(np.uint8)


class _Buffer:
    """A source/destination buffer of one kind, with an explicit free."""

    def __init__(self, kind: str, nbytes: int) -> None:
        import numpy as np

        self.kind = kind
        self.path: str | None = None
        self.map: mmap.mmap | None = None
        if kind == "numpy":
            self.obj: Any = np.empty(nbytes, dtype=np.uint8)
            self.view: Any = self.obj
        elif kind == "devshm":  # a file in /dev/shm, mapped MAP_SHARED (how arenas are built)
            self.path = f"/dev/shm/ray_velo_test_{os.getpid()}_{nbytes}"
            fd = os.open(self.path, os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, nbytes)
                self.map = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            self.obj = self.map
            self.view = np.frombuffer(self.map, dtype=np.uint8)
        elif kind == "anon":  # anonymous mmap: close() is a guaranteed munmap
            self.map = mmap.mmap(-1, nbytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.obj = self.map
            self.view = np.frombuffer(self.map, dtype=np.uint8)
        else:
            raise ValueError(kind)

    @property
    def address(self) -> int:
        return int(self.view.ctypes.data)

    def free(self) -> None:
        """Release the memory itself (munmap for the mmap kinds)."""
        self.view = None
        self.obj = None
        if self.map is not None:
            self.map.close()
            self.map = None
        if self.path is not None:
            os.unlink(self.path)
            self.path = None


def owner_main(
    conn: Connection, env: dict[str, str], kind: str, nbytes: int, progress: bool
) -> None:
    """Owner: map a buffer, publish (worker address, addr, len, packed rkey, crc32), serve."""
    os.environ.update(env)
    from ray_velo.ucx import MemoryRegistration, UcxContext, UcxWorker

    ctx = UcxContext()
    worker = UcxWorker(ctx, progress_thread=progress)
    buf = _Buffer(kind, nbytes)
    buf.view[:] = _pattern(nbytes)
    reg = MemoryRegistration(ctx, buf.obj)
    assert reg.address == buf.address
    conn.send(
        {
            "address": worker.address,
            "addr": reg.address,
            "nbytes": nbytes,
            "rkey": reg.packed_rkey,
            "crc": zlib.crc32(buf.view),
            "pid": os.getpid(),
        }
    )
    try:
        while conn.poll(OWNER_IDLE_LIMIT_S):
            msg = conn.recv()
            if msg == "unmap_keep":  # registration gone, memory still allocated, rewritten
                reg.unmap()
                buf.view[:] = 0xAB
                conn.send("ok")
            elif msg == "unmap_free":  # registration gone and the pages unmapped
                reg.unmap()
                buf.free()
                conn.send("ok")
            elif msg == "stop":
                break
        ctx.close()
        if buf.obj is not None:
            buf.free()
        conn.send("bye")
    except (BrokenPipeError, EOFError):
        pass


def _consumer_objects(info: dict[str, Any], blocking: bool = True) -> tuple[Any, ...]:
    from ray_velo.ucx import Endpoint, RemoteKey, UcxContext, UcxWorker

    ctx = UcxContext()
    worker = UcxWorker(ctx, blocking=blocking)
    ep = Endpoint(worker, info["address"])
    rkey = RemoteKey(ep, info["rkey"])
    return ctx, worker, ep, rkey


def consumer_get(owner: Connection, dest_kind: str) -> dict[str, Any]:
    """Consumer: GET the whole buffer into a registered destination; crc and GB/s."""
    import numpy as np

    from ray_velo.ucx import MemoryRegistration, get

    info = owner.recv()
    nbytes = info["nbytes"]
    ctx, _worker, ep, rkey = _consumer_objects(info)
    dest = _Buffer(dest_kind, nbytes)
    dest.view[:] = 0
    dreg = MemoryRegistration(ctx, dest.obj)
    t0 = time.perf_counter()
    get(ep, dest.address, MiB, info["addr"], rkey, 10.0, local_memh=dreg)  # wireup
    first_s = time.perf_counter() - t0
    best = float("inf")
    for _ in range(3):
        dest.view[:MiB] = 0
        t0 = time.perf_counter()
        get(ep, dest.address, nbytes, info["addr"], rkey, 20.0, local_memh=dreg)
        best = min(best, time.perf_counter() - t0)
    crc_ok = zlib.crc32(dest.view) == info["crc"]
    # A GET of an inner range lands at the right offset.
    off, n = 3 * MiB + 8, 4096
    part = np.zeros(n, dtype=np.uint8)
    get(ep, int(part.ctypes.data), n, info["addr"] + off, rkey, 10.0)
    inner_ok = bool((part == _pattern(off + n)[off:]).all())
    result = {
        "crc_ok": crc_ok,
        "inner_ok": inner_ok,
        "gbps": nbytes / best / 1e9,
        "first_get_ms": first_s * 1e3,
        "error_status": ep.error_status,
        "rkey_len": len(info["rkey"]),
        "address_len": len(info["address"]),
    }
    ctx.close()
    result["all_closed"] = ctx.closed and ep.closed and rkey.closed and not dreg.mapped
    dest.free()
    owner.send("stop")
    result["owner_reply"] = owner.recv() if owner.poll(10) else None
    return result


def consumer_handoff(owner: Connection, dest_kind: str) -> dict[str, Any]:
    """Consumer: GET the whole buffer once per wait policy (hand the worker to its progress
    thread at once, after ``SELF_PROGRESS_S``, never) and once on a worker without a progress
    thread told to hand off at once (so it must progress throughout itself); crc per GET."""
    from ray_velo.ucx import Endpoint, MemoryRegistration, RemoteKey, UcxWorker, get
    from ray_velo.ucx.binding import SELF_PROGRESS_S

    info = owner.recv()
    nbytes = info["nbytes"]
    ctx, worker, ep, rkey = _consumer_objects(info)
    dest = _Buffer(dest_kind, nbytes)
    dreg = MemoryRegistration(ctx, dest.obj)
    crc_ok: dict[str, bool] = {}
    for name, self_progress_s in (("at_once", 0.0), ("default", SELF_PROGRESS_S), ("never", -1.0)):
        dest.view[:] = 0
        get(ep, dest.address, nbytes, info["addr"], rkey, 20.0, local_memh=dreg,
            self_progress_s=self_progress_s)  # fmt: skip
        crc_ok[name] = zlib.crc32(dest.view) == info["crc"]
    threadless = UcxWorker(ctx, progress_thread=False)
    ep2 = Endpoint(threadless, info["address"])
    rkey2 = RemoteKey(ep2, info["rkey"])
    dest.view[:] = 0
    get(ep2, dest.address, nbytes, info["addr"], rkey2, 20.0, local_memh=dreg, self_progress_s=0.0)
    crc_ok["no_progress_thread"] = zlib.crc32(dest.view) == info["crc"]
    result = {"crc_ok": crc_ok, "progress_thread": worker.progress_thread_alive}
    ctx.close()
    dest.free()
    owner.send("stop")
    result["owner_reply"] = owner.recv() if owner.poll(10) else None
    return result


def consumer_stale(owner: Connection, how: str) -> dict[str, Any]:
    """Consumer: GET once, have the owner unmap (and maybe free), GET again."""
    import numpy as np

    from ray_velo.errors import UcxError
    from ray_velo.ucx import get

    info = owner.recv()
    ctx, _worker, ep, rkey = _consumer_objects(info)
    dest = np.zeros(MiB, dtype=np.uint8)
    get(ep, int(dest.ctypes.data), MiB, info["addr"], rkey, 10.0)
    result: dict[str, Any] = {"first_ok": bool((dest == _pattern(MiB)).all())}
    owner.send(how)
    result["owner_ack"] = owner.recv() if owner.poll(10) else None
    dest[:] = 0
    try:
        get(ep, int(dest.ctypes.data), MiB, info["addr"], rkey, 5.0)
        result["stale_get"] = "ok"
        result["stale_data"] = (
            "rewritten"
            if (dest == 0xAB).all()
            else "old"
            if (dest == _pattern(MiB)).all()
            else "other"
        )
    except UcxError as exc:
        result["stale_get"] = "error"
        result["status"] = exc.fields["status"]
        result["status_text"] = exc.fields["status_text"]
    result["error_status"] = ep.error_status
    ctx.close()
    try:
        owner.send("stop")
        result["owner_reply"] = owner.recv() if owner.poll(10) else None
    except (BrokenPipeError, EOFError, ConnectionResetError) as exc:
        result["owner_reply"] = f"pipe: {type(exc).__name__}"
    return result


def consumer_timeout(owner: Connection, timeout_s: float) -> dict[str, Any]:
    """Consumer: GET from an owner that never progresses; the GET must time out cleanly."""
    import numpy as np

    from ray_velo.errors import UcxError
    from ray_velo.ucx import get

    info = owner.recv()
    ctx, _worker, ep, rkey = _consumer_objects(info)
    dest = np.zeros(MiB, dtype=np.uint8)
    t0 = time.perf_counter()
    result: dict[str, Any] = {}
    try:
        get(ep, int(dest.ctypes.data), MiB, info["addr"], rkey, timeout_s)
        result["outcome"] = "ok"
    except UcxError as exc:
        result["outcome"] = "error"
        result["status"] = exc.fields["status"]
        result["status_text"] = exc.fields["status_text"]
    result["elapsed_s"] = time.perf_counter() - t0
    result["error_status"] = ep.error_status
    try:
        get(ep, int(dest.ctypes.data), 8, info["addr"], rkey, 1.0)
        result["after"] = "ok"
    except UcxError as exc:
        result["after"] = exc.fields["status"]
    t0 = time.perf_counter()
    ctx.close()
    result["close_s"] = time.perf_counter() - t0
    owner.send("stop")
    result["owner_reply"] = owner.recv() if owner.poll(10) else None
    return result


def run_consumer(
    owner: Connection, results: Connection, env: dict[str, str], name: str, arg: Any
) -> None:
    """Consumer process entry: run one scenario, send its dict (or the exception) back."""
    os.environ.update(env)
    scenarios: dict[str, Callable[[Connection, Any], dict[str, Any]]] = {
        "get": consumer_get,
        "handoff": consumer_handoff,
        "stale": consumer_stale,
        "timeout": consumer_timeout,
    }
    try:
        out = scenarios[name](owner, arg)
    except BaseException as exc:
        out = {"exception": repr(exc), "traceback": traceback.format_exc()}
    results.send(out)


# --- single-process scenarios ---------------------------------------------------------------


def _loopback(env: dict[str, str]) -> tuple[Any, ...]:
    """A worker with an endpoint to itself, and a registered 1 MiB pattern (RMA to self)."""
    os.environ.update(env)
    from ray_velo.ucx import Endpoint, MemoryRegistration, UcxContext, UcxWorker

    ctx = UcxContext()
    worker = UcxWorker(ctx)
    src = _pattern(MiB).copy()
    reg = MemoryRegistration(ctx, src)
    ep = Endpoint(worker, worker.address)
    return ctx, worker, ep, reg, src


def single_preparse(results: Connection, env: dict[str, str]) -> None:
    """Corrupt keys are refused by the pre-parse; had one reached UCX, 0x7f would crash us."""
    try:
        import numpy as np

        from ray_velo.errors import DescriptorError
        from ray_velo.ucx import RemoteKey, get

        ctx, _worker, ep, reg, src = _loopback(env)
        good = reg.packed_rkey
        cases = {
            "truncated_5": good[:5],
            "empty": b"",
            "mem_type_0x7f": good[:8] + b"\x7f" + good[9:],
            "mem_type_cuda": good[:8] + b"\x01" + good[9:],
            "md_bit40_no_body": (1 << 40).to_bytes(8, "little") + b"\x00",
            "md_map_all_ones": b"\xff" * 8 + b"\x00",
            "trailing_byte": good + b"\x00",
            "sys_dev_unterminated": (1).to_bytes(8, "little") + b"\x00\x00" + b"\x01\x10\x10",
            "oversize": b"\x00" * 2000,
        }
        refused: dict[str, str] = {}
        for name, blob in cases.items():
            try:
                RemoteKey(ep, blob)
                refused[name] = "ACCEPTED"
            except DescriptorError as exc:
                refused[name] = str(exc)
        rkey = RemoteKey(ep, good)  # the process is intact and the real key still works
        dest = np.zeros(MiB, dtype=np.uint8)
        get(ep, int(dest.ctypes.data), MiB, reg.address, rkey, 10.0)
        out: dict[str, Any] = {
            "refused": refused,
            "good_key_hex": good.hex(),
            "get_ok": bool((dest == src).all()),
            "open_children": len(ep._children),
        }
        ctx.close()
    except BaseException as exc:
        out = {"exception": repr(exc), "traceback": traceback.format_exc()}
    results.send(out)


def single_idle(results: Connection, env: dict[str, str], idle_s: float) -> None:
    """An idle worker whose progress thread sleeps in poll(): CPU used over idle_s seconds."""
    try:
        import resource

        import numpy as np

        from ray_velo.ucx import RemoteKey, get

        ctx, worker, ep, reg, src = _loopback(env)
        rkey = RemoteKey(ep, reg.packed_rkey)
        dest = np.zeros(MiB, dtype=np.uint8)
        get(ep, int(dest.ctypes.data), MiB, reg.address, rkey, 10.0)  # transports are live
        time.sleep(0.2)
        wake0 = worker.progress_wakeups
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        time.sleep(idle_s)
        cpu = time.process_time() - cpu0
        wall = time.perf_counter() - wall0
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        dest[:] = 0
        t0 = time.perf_counter()
        get(ep, int(dest.ctypes.data), MiB, reg.address, rkey, 10.0)  # still serves after idling
        out: dict[str, Any] = {
            "cpu_s": cpu,
            "rusage_cpu_s": (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime),
            "wall_s": wall,
            "wakeups": worker.progress_wakeups - wake0,
            "thread_alive": worker.progress_thread_alive,
            "get_after_idle_ok": bool((dest == src).all()),
            "get_after_idle_ms": (time.perf_counter() - t0) * 1e3,
        }
        ctx.close()
        out["thread_stopped"] = not worker.progress_thread_alive
    except BaseException as exc:
        out = {"exception": repr(exc), "traceback": traceback.format_exc()}
    results.send(out)


def single_lifecycle(results: Connection, env: dict[str, str]) -> None:
    """Closing order, idempotent close, use-after-close errors, pages pinned by registration."""
    out: dict[str, Any] = {}
    try:
        import numpy as np

        from ray_velo.errors import ConfigError, UcxError
        from ray_velo.ucx import Endpoint, MemoryRegistration, RemoteKey, UcxContext, UcxWorker, get

        os.environ.update(env)
        for bad in ({"RNDV_THRESH": "8192"}, {"UCX_MEM_EVENTS": "y"}):
            try:
                UcxContext(bad)
                out[f"config {bad}"] = "accepted"
            except ConfigError:
                out[f"config {bad}"] = "ConfigError"
        ctx = UcxContext({"UCX_RNDV_THRESH": "inf"})
        out["options"] = ctx.options
        worker = UcxWorker(ctx)
        page = mmap.mmap(-1, MiB)
        reg = MemoryRegistration(ctx, page)
        try:
            page.close()
            out["mmap_close_while_mapped"] = "closed"
        except BufferError:
            out["mmap_close_while_mapped"] = "BufferError"
        ep = Endpoint(worker, worker.address)
        rkey = RemoteKey(ep, reg.packed_rkey)
        dest = np.zeros(4096, dtype=np.uint8)
        get(ep, int(dest.ctypes.data), 4096, reg.address, rkey, 10.0)
        rkey.close()
        rkey.close()  # idempotent
        try:
            get(ep, int(dest.ctypes.data), 4096, reg.address, rkey, 10.0)
            out["get_closed_rkey"] = "ok"
        except UcxError as exc:
            out["get_closed_rkey"] = exc.fields["status"]
        rkey2 = RemoteKey(ep, reg.packed_rkey)
        ctx.close()  # cascades: registrations, then worker -> endpoint -> rkey2
        ctx.close()
        out["closed"] = [ctx.closed, worker.closed, ep.closed, rkey2.closed, not reg.mapped]
        out["thread_stopped"] = not worker.progress_thread_alive
        page.close()  # the registration let go of the pages after its confirmed unmap
        out["mmap_close_after_unmap"] = page.closed
        for name, make in (
            ("worker_on_closed_ctx", lambda: UcxWorker(ctx)),
            ("reg_on_closed_ctx", lambda: MemoryRegistration(ctx, bytearray(4096))),
            ("ep_on_closed_worker", lambda: Endpoint(worker, worker.address)),
            ("rkey_on_closed_ep", lambda: RemoteKey(ep, reg.packed_rkey)),
        ):
            try:
                make()
                out[name] = "created"
            except UcxError as exc:
                out[name] = exc.fields["status"]
        with UcxContext() as other:
            try:
                MemoryRegistration(other, b"read-only bytes")
                out["readonly_buffer"] = "mapped"
            except UcxError as exc:
                out["readonly_buffer"] = exc.fields["status"]
        # Last, as it poisons this process: what a fork()ed copy of a UCX process may do.
        from ray_velo.ucx import loader

        survivor = UcxContext()
        survivor_worker = UcxWorker(survivor)
        loader._after_fork_in_child()  # what os.register_at_fork runs in a forked child
        survivor.close()  # must not touch UCX state that belongs to the parent
        out["fork_close_touched_nothing"] = (
            survivor.closed and survivor_worker.progress_thread_alive
        )
        for name, call in (
            ("fork_new_context", lambda: UcxContext()),
            ("fork_get", lambda: get(ep, int(dest.ctypes.data), 8, reg.address, rkey2, 1.0)),
        ):
            try:
                call()
                out[name] = "ran"
            except UcxError as exc:
                out[name] = exc.fields["status"]
    except BaseException as exc:
        out = {"exception": repr(exc), "traceback": traceback.format_exc()}
    results.send(out)


def single_concurrent(results: Connection, env: dict[str, str], threads: int, gets: int) -> None:
    """Several threads GET at once on one MULTI worker beside its progress thread."""
    try:
        import random
        import threading

        import numpy as np

        os.environ.update(env)
        from ray_velo.ucx import Endpoint, MemoryRegistration, RemoteKey, UcxContext, UcxWorker, get

        ctx = UcxContext()
        worker = UcxWorker(ctx)
        src = _pattern(16 * MiB).copy()
        reg = MemoryRegistration(ctx, src)
        ep = Endpoint(worker, worker.address)
        rkey = RemoteKey(ep, reg.packed_rkey)
        chunk = 64 * 1024
        errors: list[str] = []
        done = [0] * threads

        def issue(index: int) -> None:
            rnd = random.Random(index)
            dest = np.zeros(chunk, dtype=np.uint8)
            for _ in range(gets):
                off = rnd.randrange(0, src.nbytes - chunk, 8)
                try:
                    get(ep, int(dest.ctypes.data), chunk, reg.address + off, rkey, 20.0)
                except Exception as exc:
                    errors.append(repr(exc))
                    return
                if not np.array_equal(dest, src[off : off + chunk]):
                    errors.append(f"thread {index}: wrong bytes at offset {off}")
                done[index] += 1

        t0 = time.perf_counter()
        pool = [threading.Thread(target=issue, args=(i,)) for i in range(threads)]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join(30)
        elapsed = time.perf_counter() - t0
        out: dict[str, Any] = {
            "done": sum(done),
            "errors": errors[:5],
            "elapsed_s": elapsed,
            "stuck_threads": sum(t.is_alive() for t in pool),
        }
        ctx.close()
    except BaseException as exc:
        out = {"exception": repr(exc), "traceback": traceback.format_exc()}
    results.send(out)
