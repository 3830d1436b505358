"""The agent's socket (ray_velo.local.channel): a process's waited-for calls reach the agent
and come back with the agent's answer or its error, and a gone agent reads as AgentDied.
A real Unix socket and a server on an event loop thread of this process; no Ray."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from ray_velo.errors import AgentDied, HandleNotFound, StagingError, TransferTimeout, VeloError
from ray_velo.local.channel import (
    AgentChannel,
    ChannelFull,
    ChannelServer,
    remove_stale_sockets,
    socket_path,
)
from tests.strangers import NOBODY, unix_socket_as


class Unpicklable(Exception):
    def __reduce__(self) -> Any:
        raise TypeError("no")


class LoopThread:
    """An event loop on a thread of its own, as the agent's."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        async def drain() -> None:  # a call still stalled in the fake agent ends here
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.run(drain())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


NOTICED: list[tuple[str, Any]] = []


async def dispatch(method: str, args: tuple[Any, ...]) -> Any:
    """What the agent's dispatch would do, for scenarios: echo, fail or stall."""
    (what,) = args
    NOTICED.append((method, what))
    if what == "missing":
        raise HandleNotFound(handle="h", reason="released by its last consumer")
    if what == "unpicklable":
        raise Unpicklable()
    if isinstance(what, float):
        await asyncio.sleep(what)
    return (method, what)


@pytest.fixture()
def served(tmp_path: Path) -> Iterator[tuple[LoopThread, ChannelServer, AgentChannel]]:
    loop = LoopThread()
    server = ChannelServer(socket_path(str(tmp_path), os.getpid(), 7), dispatch)
    loop.run(server.start())
    channel = AgentChannel(server.path)
    try:
        yield loop, server, channel
    finally:
        channel.close()
        loop.run(server.close(StagingError("closed")))
        loop.stop()


def never() -> BaseException:
    raise AssertionError("no timeout expected")


def test_a_call_comes_back_with_the_agents_answer(served: Any) -> None:
    _, server, channel = served
    assert channel.call("stage_reserve", (3,), 5.0, never) == ("stage_reserve", 3)
    assert channel.call("fetch_remote", ("x",), None, never) == ("fetch_remote", "x")
    mode = stat.S_IMODE(os.stat(server.path).st_mode)
    assert mode == 0o600, oct(mode)


def test_a_notice_reaches_the_agent_without_an_answer(served: Any) -> None:
    """A commit is sent and not waited for; the next call on the same connection reads its
    own answer (no answer of the notice's is in the way), and the notice ran first."""
    _, _, channel = served
    NOTICED.clear()
    assert channel.notify("stage_commit", ("c1",))
    assert channel.notify("stage_commit", ("missing",))  # its error goes nowhere
    assert channel.call("local_acquire", ("after",), 5.0, never) == ("local_acquire", "after")
    assert NOTICED[:3] == [("stage_commit", "c1"), ("stage_commit", "missing"),
                           ("local_acquire", "after")]  # fmt: skip
    NOTICED.clear()
    assert channel.notify("shutdown", ("x",))  # not a notice: the agent drops it
    assert channel.call("local_acquire", (2,), 5.0, never) == ("local_acquire", 2)
    assert NOTICED == [("local_acquire", 2)]


def test_a_notice_inside_a_call_on_the_same_thread_is_not_sent_here(served: Any) -> None:
    """A finalizer the garbage collector runs in the middle of a call must not write into
    that call's connection: notify says no, and the caller sends a Ray call instead."""
    _, _, channel = served
    channel._local.busy = True
    try:
        assert not channel.notify("end_lease", (1,))
    finally:
        channel._local.busy = False
    assert channel.notify("end_lease", (1,))


def test_the_agents_errors_come_back_as_themselves(served: Any) -> None:
    _, _, channel = served
    with pytest.raises(HandleNotFound, match="released by its last consumer"):
        channel.call("local_acquire", ("missing",), 5.0, never)
    with pytest.raises(VeloError, match="this node's agent failed: Unpicklable"):
        channel.call("local_acquire", ("unpicklable",), 5.0, never)
    with pytest.raises(ValueError, match="not served over the agent's socket"):
        channel.call("shutdown", (1,), 5.0, never)
    assert channel.call("local_acquire", (1,), 5.0, never) == ("local_acquire", 1)


def test_a_late_answer_is_never_read_as_the_next_calls(served: Any) -> None:
    """The caller gave up on a slow call: its connection is dropped, so the answer that
    arrives later cannot be taken for the answer to the next call."""
    _, _, channel = served

    def timed_out() -> BaseException:
        return TransferTimeout(handle="?", timeout_s=0.05, bound="test")

    with pytest.raises(TransferTimeout):
        channel.call("fetch_remote", (0.5,), 0.05, timed_out)
    assert channel.call("fetch_remote", ("next",), 5.0, never) == ("fetch_remote", "next")


def test_each_thread_has_its_own_connection(served: Any) -> None:
    _, _, channel = served
    with ThreadPoolExecutor(4) as pool:
        answers = list(
            pool.map(lambda i: channel.call("stage_reserve", (i,), 5.0, never), range(40))
        )
    assert answers == [("stage_reserve", i) for i in range(40)]


def test_a_gone_agent_reads_as_agent_died(served: Any, tmp_path: Path) -> None:
    loop, server, channel = served
    assert channel.call("stage_reserve", (1,), 5.0, never)
    loop.run(server.close(StagingError("closed")))
    assert not channel.notify("stage_commit", (1,))
    with pytest.raises(AgentDied):
        channel.call("stage_reserve", (1,), 5.0, never)
    with pytest.raises(AgentDied):  # and again: no socket file at all now
        channel.call("stage_reserve", (1,), 5.0, never)
    assert not os.path.exists(server.path)


def test_a_call_in_progress_when_the_agent_closes_gets_the_closing_error(served: Any) -> None:
    """The agent shuts down under a slow call: its caller is told so (not a dropped
    connection, which would read as a dead agent and be retried on this one)."""
    loop, server, channel = served
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(channel.call, "fetch_remote", (30.0,), 60.0, never)
        deadline = time.monotonic() + 10
        while not server._busy and time.monotonic() < deadline:
            time.sleep(0.01)  # until the call is in progress
        loop.run(server.close(StagingError("the agent on node n1 is shutting down")))
        with pytest.raises(StagingError, match="shutting down"):
            slow.result(10)


def test_a_malformed_frame_closes_only_its_connection(served: Any) -> None:
    _, server, channel = served
    rogue = socket.socket(socket.AF_UNIX)
    rogue.connect(server.path)
    rogue.sendall(struct.pack("!I", 5) + b"junk!")
    assert rogue.recv(1) == b""  # the agent closed it
    rogue.close()
    assert channel.call("stage_reserve", (9,), 5.0, never) == ("stage_reserve", 9)


def test_stale_sockets_of_dead_agents_are_removed(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    dead_path = Path(socket_path(str(tmp_path), int(dead.stdout), 1))
    live_path = Path(socket_path(str(tmp_path), os.getpid(), 2))
    other = tmp_path / "ray_velo-123-0000000000000001-0"  # an arena file: not ours to remove
    for path in (dead_path, live_path, other):
        path.write_bytes(b"")
    removed = remove_stale_sockets(str(tmp_path))  # other dead agents' too, if any
    assert str(dead_path) in removed and str(live_path) not in removed
    assert not dead_path.exists() and live_path.exists() and other.exists()


def test_a_directory_too_deep_for_a_socket_address_falls_back() -> None:
    deep = "/" + "d" * 120
    path = socket_path(deep, 42, 0xAB)
    assert len(path.encode()) <= 100 and path.endswith("ray_velo_agent-42-00000000000000ab.sock")


@pytest.mark.skipif(
    os.geteuid() != 0, reason="SKIPPED (needs root): runs a process as another user (nobody)"
)
def test_a_process_of_another_user_is_refused_unread() -> None:
    """The agent's socket as another user meets it: with the socket's own mode 0600 it cannot
    connect; with the mode opened by hand (0666) it connects, its call is closed unread (the
    agent asks the kernel who connected: SO_PEERCRED), nothing ran, and the refusal is
    counted. The agent's own user is served throughout."""
    import pickle
    import shutil
    import tempfile

    directory = tempfile.mkdtemp(dir="/dev/shm", prefix="rv-peercred-")
    os.chmod(directory, 0o755)  # nobody may reach the socket file, as in /dev/shm itself
    loop = LoopThread()
    refused: list[int] = []
    server = ChannelServer(
        socket_path(directory, os.getpid(), 9), dispatch, lambda: refused.append(1)
    )
    loop.run(server.start())
    channel = AgentChannel(server.path)
    data = pickle.dumps(("stage_reserve", ("from nobody",), True))
    frame = struct.pack("!I", len(data)) + data
    try:
        NOTICED.clear()
        assert unix_socket_as(NOBODY, server.path, frame) == "denied"
        os.chmod(server.path, 0o666)
        assert unix_socket_as(NOBODY, server.path, frame) == "closed"
        assert channel.call("stage_reserve", ("own",), 5.0, never) == ("stage_reserve", "own")
        assert NOTICED == [("stage_reserve", "own")]
        assert refused == [1]
    finally:
        channel.close()
        loop.run(server.close(StagingError("closed")))
        loop.stop()
        shutil.rmtree(directory, ignore_errors=True)


def test_a_threads_connection_closes_when_the_thread_ends(served: Any) -> None:
    """A pool that replaces its threads must not pile up connections in the agent: each
    thread's connection goes with its thread."""
    _, server, channel = served
    for n in range(20):
        worker = threading.Thread(
            target=lambda n=n: channel.call("local_acquire", (n,), 5.0, never)
        )
        worker.start()
        worker.join(10)
    deadline = time.monotonic() + 5.0
    while (channel.connections or len(server._serving)) and time.monotonic() < deadline:
        time.sleep(0.01)  # the agent sees each close as its connection's end
    assert channel.connections == 0 and len(server._serving) == 0


def test_a_process_holds_at_most_its_cap_of_connections(tmp_path: Path) -> None:
    """A thousand threads calling at once: at most ``max_connections`` connections reach the
    agent; the threads beyond are told ChannelFull (they make a Ray call), none is refused
    by the agent and every answer is right."""
    loop = LoopThread()
    server = ChannelServer(socket_path(str(tmp_path), os.getpid(), 8), dispatch)
    loop.run(server.start())
    channel = AgentChannel(server.path, max_connections=16)
    barrier = threading.Barrier(100)

    def one(n: int) -> str:
        barrier.wait(10)
        try:
            assert channel.call("local_acquire", (n,), 10.0, never) == ("local_acquire", n)
            return "socket"
        except ChannelFull:
            return "ray"

    try:
        with ThreadPoolExecutor(100) as pool:
            ways = list(pool.map(one, range(100)))
        assert ways.count("socket") >= 16 and "ray" in ways
        assert channel.connections <= 16 and len(server._serving) <= 16
    finally:
        channel.close()
        loop.run(server.close(StagingError("closed")))
        loop.stop()
