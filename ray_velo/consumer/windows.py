"""The consumer's end of a windowed GET: asking the owner for each window one step ahead of the
GETs, from a thread of its own (docs/architecture.md §14)."""

from __future__ import annotations

import threading
from typing import Any

from ray_velo.agent.clock import Clock
from ray_velo.consumer.links import OwnerLink
from ray_velo.errors import DescriptorError, ProtocolError, UcxError, VeloError
from ray_velo.protocol import DataHandle, WindowAnswer, WindowRequest, decode, encode
from ray_velo.protocol.descriptor import RdmaDescriptor
from ray_velo.protocol.entry import RV_WINDOW

__all__ = ["WINDOW_CALL_S", "WindowFeed", "written_range"]

#: The most one ``_rv_window`` call may take (the owner only registers a window).
WINDOW_CALL_S = 10.0


class WindowFeed:
    """Window descriptors of one windowed GET, asked ahead."""

    def __init__(
        self,
        link: OwnerLink,
        handle: DataHandle,
        lease_id: int,
        rdma: Any,
        window_bytes: int,
        total_len: int,
        clock: Clock,
    ) -> None:
        """``clock``: the agent's; every ``until`` is on it."""
        self._clock = clock
        self._link = link
        self._handle = handle
        self._lease_id = lease_id
        self._rdma = rdma
        self._window_bytes = window_bytes
        self._total_len = total_len
        self._cond = threading.Condition(threading.Lock())
        self._asked: list[tuple[int, int, float]] = []  # (index, done, until)
        self._answers: dict[int, Any] = {}  # index -> RdmaDescriptor or the exception
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ray_velo-windows", daemon=True)
        self._thread.start()

    def __enter__(self) -> WindowFeed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ask(self, index: int, done: int, until: float) -> None:
        """Ask for window ``index`` (after the owner unregisters ``done``; -1: none), to be
        answered before ``until``."""
        with self._cond:
            self._asked.append((index, done, until))
            self._cond.notify_all()

    def take(self, index: int, until: float) -> Any:
        """The checked descriptor of window ``index`` (asked before), waiting until ``until``.

        Raises:
            UcxError: the owner did not register it (the lease ended, the owner is gone, a
                malformed answer) or no answer came in time: the GET fails, and the fetch
                falls back to chunks, where the owner says what became of the handle.
        """
        with self._cond:
            while index not in self._answers:
                left = until - self._clock()
                if left <= 0:
                    raise _failed(f"no descriptor for window {index} in time")
                self._cond.wait(left)
            answer = self._answers.pop(index)
        if isinstance(answer, BaseException):
            raise _failed(f"window {index}: {answer}") from answer
        return answer

    def close(self) -> None:
        """End the thread (after the call it may be in, bounded by :data:`WINDOW_CALL_S`)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(WINDOW_CALL_S + 1.0)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._asked and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                index, done, until = self._asked.pop(0)
            answer = self._call(index, done, until)
            with self._cond:
                self._answers[index] = answer
                self._cond.notify_all()

    def _call(self, index: int, done: int, until: float) -> Any:
        left = min(self._clock.left(until), WINDOW_CALL_S)
        request = WindowRequest(self._handle, self._lease_id, index, done)
        try:
            data = self._link.call(
                RV_WINDOW, encode(request), self._clock.deadline(left), self._handle
            )
            blob = decode(WindowAnswer, data).descriptor
            start = index * self._window_bytes
            length = min(self._total_len, start + self._window_bytes) - start
            return self._rdma.decode(blob, length)
        except (VeloError, DescriptorError, ProtocolError, OSError) as exc:
            return exc


def written_range(
    link: OwnerLink,
    handle: DataHandle,
    lease_id: int,
    rdma: Any,
    window_bytes: int,
    total_len: int,
    index: int,
    left_s: float,
    clock: Clock,
) -> tuple[Any, int]:
    """For a slot its producer is still writing (streamed staging): the checked descriptor
    of its bytes from window ``index`` to as far as they are written (the owner answers
    once that window is), and the payload offset where they end.

    Raises:
        UcxError: no such answer in time, or a malformed one: the GET fails, and the fetch
            falls back to chunks, where the owner says what became of the handle.
    """
    start = index * window_bytes
    request = WindowRequest(handle, lease_id, index, -1)
    try:
        data = link.call(
            RV_WINDOW, encode(request), clock.deadline(min(left_s, WINDOW_CALL_S)), handle
        )
        blob = decode(WindowAnswer, data).descriptor
        length = RdmaDescriptor.decode(blob).length
        if not min(window_bytes, total_len - start) <= length <= total_len - start:
            raise ProtocolError(f"{length} bytes from window {index} of {total_len}")
        return rdma.decode(blob, length), start + length
    except (VeloError, DescriptorError, ProtocolError, OSError) as exc:
        raise _failed(f"window {index}: {exc}") from exc


def _failed(why: str) -> UcxError:
    return UcxError(operation=RV_WINDOW.name, status=-1, status_text=why)
