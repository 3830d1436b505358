"""Two real processes, one-sided UCX GET, and the failure modes research/ucx.md §8 measured.

Every UCX-touching body runs in a spawned child (``ucx_peers``); this process only starts
them, waits with its own timeouts, and checks the dicts they send back. A UCX crash therefore
shows up as a dead child with an exit code, and nothing here can hang past its timeout.
"""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from ray_velo.ucx.status import UcsStatus

from . import ucx_peers

pytestmark = pytest.mark.ucx

SPAWN = multiprocessing.get_context("spawn")
MiB = 1 << 20
RESULT_TIMEOUT_S = 45.0


def _finish(procs: list[Any]) -> list[int | None]:
    codes = []
    for proc in procs:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        codes.append(proc.exitcode)
    return codes


def _receive(conn: Any, timeout_s: float) -> dict[str, Any]:
    try:
        if conn.poll(timeout_s):
            result: dict[str, Any] = conn.recv()
            return result
        return {"exception": f"no result within {timeout_s} s"}
    except EOFError:
        return {"exception": "the child died without a result"}


def run_pair(
    env: dict[str, str],
    kind: str,
    nbytes: int,
    scenario: str,
    arg: Any,
    *,
    owner_progress: bool = True,
) -> tuple[dict[str, Any], int | None, int | None]:
    """Start an owner and a consumer joined by a Pipe; (consumer result, owner rc, consumer rc)."""
    owner_end, consumer_end = SPAWN.Pipe()
    results_r, results_w = SPAWN.Pipe(duplex=False)
    owner = SPAWN.Process(
        target=ucx_peers.owner_main,
        args=(owner_end, env, kind, nbytes, owner_progress),
        daemon=True,
    )
    consumer = SPAWN.Process(
        target=ucx_peers.run_consumer,
        args=(consumer_end, results_w, env, scenario, arg),
        daemon=True,
    )
    owner.start()
    consumer.start()
    for end in (owner_end, consumer_end, results_w):
        end.close()  # the children hold their own copies; EOF then means "child gone"
    result = _receive(results_r, RESULT_TIMEOUT_S)
    consumer_rc, owner_rc = _finish([consumer, owner])
    return result, owner_rc, consumer_rc


def run_single(target: Any, *args: Any) -> tuple[dict[str, Any], int | None]:
    """Run one single-process scenario; (its result, its exit code)."""
    results_r, results_w = SPAWN.Pipe(duplex=False)
    proc = SPAWN.Process(target=target, args=(results_w, *args), daemon=True)
    proc.start()
    results_w.close()
    result = _receive(results_r, RESULT_TIMEOUT_S)
    (rc,) = _finish([proc])
    return result, rc


def _probe(results: Any) -> None:
    from ray_velo.ucx import ucx_available

    results.send({"available": ucx_available()})


@pytest.fixture(scope="module", autouse=True)
def ucx_ok() -> Iterator[None]:
    """Skip (loudly) where UCX or the compiled binding is missing; probed in a child."""
    result, _ = run_single(_probe)
    available = result.get("available")
    if not available or not available[0]:
        pytest.skip(f"UCX unavailable: {available[1] if available else result}")
    yield


def _no_exception(result: dict[str, Any]) -> None:
    assert "exception" not in result, result.get("traceback", result["exception"])


@pytest.mark.parametrize("tls", ["cma,tcp", "tcp"])
@pytest.mark.parametrize("source", ["numpy", "devshm"])
def test_consumer_gets_owner_buffer(
    tls: str, source: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An owner process stages 64 MiB (a numpy array, or an mmap of a /dev/shm file as the
    arenas are) and sends worker address, address, length, packed key and crc32 over a pipe;
    a consumer process in another address space GETs all of it into a registered buffer over
    UCX_TLS=tls, and the crc matches; an inner range lands at the right offset; then both
    sides close everything in order and exit 0."""
    nbytes = 64 * MiB
    result, owner_rc, consumer_rc = run_pair({"UCX_TLS": tls}, source, nbytes, "get", "numpy")
    _no_exception(result)
    assert result["crc_ok"] and result["inner_ok"]
    assert result["error_status"] == UcsStatus.OK
    assert result["all_closed"]
    assert result["owner_reply"] == "bye"
    assert (owner_rc, consumer_rc) == (0, 0)
    with capsys.disabled():
        sys.stdout.write(
            f"\n  [ucx] GET 64 MiB {source:>6} over {tls:<7}: {result['gbps']:.2f} GB/s "
            f"(first 1 MiB GET incl. wireup {result['first_get_ms']:.1f} ms, "
            f"rkey {result['rkey_len']} B, worker address {result['address_len']} B)\n"
        )


@pytest.mark.parametrize("tls", ["cma,tcp", "tcp"])
def test_a_get_completes_whoever_progresses_its_worker(tls: str) -> None:
    """A GET's thread progresses its worker for SELF_PROGRESS_S, then only checks back while
    the worker's progress thread completes it (two threads contending for the worker cost a
    core): 64 MiB arrives whole when the thread hands off at once, after the default, or
    never, and on a worker without a progress thread (progressed by the GET's thread
    throughout, whatever it was told)."""
    result, owner_rc, consumer_rc = run_pair(
        {"UCX_TLS": tls}, "devshm", 64 * MiB, "handoff", "numpy"
    )
    _no_exception(result)
    assert result["progress_thread"]
    assert result["crc_ok"] == {
        "at_once": True, "default": True, "never": True, "no_progress_thread": True
    }  # fmt: skip
    assert result["owner_reply"] == "bye"
    assert (owner_rc, consumer_rc) == (0, 0)


def test_stale_key_after_owner_freed_memory_cma() -> None:
    """The owner unmaps a region and munmaps its pages while a consumer still holds the key
    (what a lease bug would do). Over cma, with PEER error mode + RNDV_THRESH=inf + the C error
    callback, the consumer's GET fails with UCS_ERR_IO_ERROR and the endpoint is marked
    failed; neither process crashes (without those settings the consumer aborts)."""
    result, owner_rc, consumer_rc = run_pair(
        {"UCX_TLS": "cma,tcp"}, "anon", 4 * MiB, "stale", "unmap_free"
    )
    _no_exception(result)
    assert result["first_ok"] and result["owner_ack"] == "ok"
    assert result["stale_get"] == "error", result
    assert result["status"] == UcsStatus.ERR_IO_ERROR, result
    assert result["error_status"] != UcsStatus.OK
    assert result["owner_reply"] == "bye"
    assert (owner_rc, consumer_rc) == (0, 0)


@pytest.mark.parametrize("tls", ["tcp", "cma,tcp"])
def test_stale_key_after_unmap_memory_still_allocated(tls: str) -> None:
    """The owner unmaps a region but its memory stays allocated and is rewritten (0xAB).
    Unmap revokes nothing on tcp or cma: the consumer's GET either returns the live bytes or
    fails with a UcxError, and both processes stay up. (Over tcp the owner must not free the
    pages: its software-emulated GET would then segfault the owner, research/ucx.md §8.)"""
    result, owner_rc, consumer_rc = run_pair(
        {"UCX_TLS": tls}, "numpy", 4 * MiB, "stale", "unmap_keep"
    )
    _no_exception(result)
    assert result["first_ok"] and result["owner_ack"] == "ok"
    if result["stale_get"] == "ok":
        assert result["stale_data"] in ("rewritten", "old")
    else:
        assert result["status"] < 0
    assert result["owner_reply"] == "bye"
    assert (owner_rc, consumer_rc) == (0, 0)


def test_get_times_out_when_owner_never_progresses() -> None:
    """A hung owner: its worker is never progressed, so a tcp GET (emulated by the owner's
    worker) cannot complete. The consumer's GET gives up at its 1 s timeout with
    UCS_ERR_TIMED_OUT, the endpoint is force-closed (the request completes) and marked failed,
    later GETs fail fast, and closing takes well under the close timeouts."""
    result, owner_rc, consumer_rc = run_pair(
        {"UCX_TLS": "tcp"}, "numpy", 4 * MiB, "timeout", 1.0, owner_progress=False
    )
    _no_exception(result)
    assert result["outcome"] == "error" and result["status"] == UcsStatus.ERR_TIMED_OUT, result
    assert 1.0 <= result["elapsed_s"] < 4.0, result
    assert "force-closed" in result["status_text"]
    assert "did not complete" not in result["status_text"]
    assert result["error_status"] == UcsStatus.ERR_TIMED_OUT
    assert result["after"] == UcsStatus.ERR_TIMED_OUT
    assert result["close_s"] < 2.0, result
    assert result["owner_reply"] == "bye"
    assert (owner_rc, consumer_rc) == (0, 0)


def test_corrupt_packed_keys_are_refused_before_ucx() -> None:
    """A buggy or hostile peer sends corrupt packed keys: truncated, empty, mem_type 0x7f
    (which segfaults inside ucp_ep_rkey_unpack), a non-host mem_type, md bits with no body,
    trailing bytes, an unterminated distance list, an oversize blob. Each is refused with
    DescriptorError before UCX sees it, and the same process then GETs with the real key."""
    result, rc = run_single(ucx_peers.single_preparse, {"UCX_TLS": "cma,tcp"})
    _no_exception(result)
    accepted = [name for name, why in result["refused"].items() if why == "ACCEPTED"]
    assert not accepted, result["refused"]
    assert result["get_ok"]
    assert result["open_children"] == 1  # refused keys left nothing behind
    assert rc == 0


def test_idle_worker_uses_no_cpu() -> None:
    """An agent's worker sits idle between transfers with its progress thread running: the
    thread sleeps in poll() on the worker's event fd, so over 2 s the process uses < 1% of a
    core; a GET right after the idle period still completes (submit signals the worker)."""
    result, rc = run_single(ucx_peers.single_idle, {"UCX_TLS": "cma,tcp"}, 2.0)
    _no_exception(result)
    assert result["thread_alive"]
    assert result["cpu_s"] < 0.01 * result["wall_s"], result
    assert result["rusage_cpu_s"] < 0.01 * result["wall_s"] + 0.004, result  # tick granularity
    assert result["get_after_idle_ok"]
    assert result["thread_stopped"]
    assert rc == 0


def test_close_cascades_in_order_and_is_idempotent() -> None:
    """An agent shuts down with a registration, a worker, an endpoint and a remote key still
    open: closing the context closes them all (registrations, then worker -> endpoint -> key),
    twice is harmless, the registration held the mmap open until its unmap was confirmed, and
    every later use of a closed object is a UcxError instead of a crash. Options that would
    break PEER error handling (RNDV_THRESH) or that UCX silently ignores (MEM_*) are refused.
    Finally, as a fork()ed copy of the process would: close() leaves the parent's UCX state
    alone and every new use is refused (simulated with the at-fork hook; no real fork)."""
    result, rc = run_single(ucx_peers.single_lifecycle, {"UCX_TLS": "cma,tcp"})
    _no_exception(result)
    assert result["config {'RNDV_THRESH': '8192'}"] == "ConfigError"
    assert result["config {'UCX_MEM_EVENTS': 'y'}"] == "ConfigError"
    assert result["options"]["RNDV_THRESH"] == "inf"
    assert result["options"]["RCACHE_ENABLE"] == "n"
    assert result["mmap_close_while_mapped"] == "BufferError"
    assert result["get_closed_rkey"] == UcsStatus.ERR_INVALID_PARAM
    assert result["closed"] == [True] * 5
    assert result["thread_stopped"]
    assert result["mmap_close_after_unmap"]
    for name in (
        "worker_on_closed_ctx",
        "reg_on_closed_ctx",
        "ep_on_closed_worker",
        "rkey_on_closed_ep",
    ):
        assert result[name] == UcsStatus.ERR_INVALID_PARAM, (name, result[name])
    assert result["readonly_buffer"] == UcsStatus.ERR_INVALID_PARAM
    assert result["fork_close_touched_nothing"]
    assert result["fork_new_context"] == UcsStatus.ERR_UNSUPPORTED
    assert result["fork_get"] == UcsStatus.ERR_UNSUPPORTED
    assert rc == 0


@pytest.mark.parametrize("tls", ["cma,tcp", "tcp"])
def test_concurrent_gets_from_several_threads(tls: str) -> None:
    """The consumer agent serves several fetches at once: 4 threads each post 100 GETs of
    64 KiB at random offsets on one MULTI worker while its blocking progress thread runs
    (SINGLE mode aborted in UCX's arbiter here, research/ucx.md §7). Every GET completes in
    time with the right bytes."""
    result, rc = run_single(ucx_peers.single_concurrent, {"UCX_TLS": tls}, 4, 100)
    _no_exception(result)
    assert result["errors"] == [] and result["stuck_threads"] == 0
    assert result["done"] == 400
    assert rc == 0
