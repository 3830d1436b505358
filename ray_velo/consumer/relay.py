"""Copies read by other nodes as they fill: the serving end (``_rv_relay``) and the reading end
inside a GET (docs/tuning.md, "One payload, many consumers")."""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Callable
from typing import Any

from ray_velo.agent import nonblocking
from ray_velo.agent.core import AgentCore
from ray_velo.consumer.bulk import WireSource
from ray_velo.errors import HandleNotFound, ProtocolError, UcxError, VeloError, WireAuthError
from ray_velo.memory.pool import Placement
from ray_velo.protocol import (
    CopyNotice,
    DataHandle,
    RelayEnd,
    RelayProgress,
    RelayRequest,
    decode,
    encode,
)
from ray_velo.protocol.entry import RV_RELAY, RV_RELAY_END, Entry
from ray_velo.protocol.frames import HEADER, MAX_FRAME_BYTES, decode_answer, encode_request
from ray_velo.state.relays import RELAY_PIECE_BYTES, RELAY_WAIT_S
from ray_velo.wire.auth import WireAuth
from ray_velo.wire.io import receive_exactly

__all__ = ["OwnRelayLink", "RelayLink", "RelayServer", "copy_gone_notice", "read_relay"]

_log = logging.getLogger(__name__)
#: How long past its wait a copy's agent may take to answer before the reader gives up on it.
_ANSWER_S = 2.0


class RelayServer:
    """``_rv_relay`` and ``_rv_relay_end`` on a copy's agent. ``filling(handle)``: whether a
    fetch of that handle is in flight here (its copy may open in a moment)."""

    def __init__(self, core: AgentCore, filling: Callable[[DataHandle], bool]) -> None:
        self.core = core
        self._filling = filling
        #: Answers to readers already holding a lease: each follows a GET of what they were
        #: told had landed (``ray-velo status``, and the tests' sign of a read under way).
        self.renewals = 0

    def serve(self, data: bytes) -> bytes:
        """Take or renew a relay lease, wait (at most :data:`RELAY_WAIT_S`) until
        ``at_least`` bytes landed, answer the progress.

        Raises:
            HandleNotFound: no copy of that handle here, or it failed (read the owner's).
            LeaseNotFound: the relay lease ended (it expired).
        """
        request = decode(RelayRequest, data)
        nonblocking.check("waiting for a copy's bytes")
        core, remote = self.core, request.handle
        state, lease_timeout = core.consumer_state, core.config.rdma.rendezvous.lease_timeout
        until = core.clock() + RELAY_WAIT_S
        lease_id, first = request.lease_id, request.lease_id == 0
        self.renewals += not first
        if first:  # a copy may be a moment from opening: its fetch is still acquiring
            core.wait_until(
                lambda: state.relay(remote) is not None or not self._filling(remote), until
            )
            with core.lock:
                lease_id, _ = state.relay_join(remote, core.clock(), lease_timeout)

        def ready() -> bool:
            relay = state.relay(remote)
            return relay is None or relay.failed or relay.landed >= request.at_least

        core.wait_until(ready, until)
        with core.changing() as fx:
            relay = state.relay_renew(remote, lease_id, core.clock(), lease_timeout)
            if relay.failed:
                state.relay_leave(remote, lease_id, core.clock(), fx)
                raise HandleNotFound(
                    handle=str(remote), node=core.node_id, reason="its copy here failed"
                )
            descriptor = b""
            if first:  # where the bytes are, once: they stay there while the copy lives
                buffer = state.relay_buffer(relay)
                if not isinstance(buffer, Placement):  # its bytes went meanwhile
                    state.relay_leave(remote, lease_id, core.clock(), fx)
                    raise HandleNotFound(
                        handle=str(remote), node=core.node_id, reason="its copy here is gone"
                    )
                where = (buffer.registration, buffer.address, relay.total_len)
                # a UCX reader GETs it there; a wire reader asks this agent's bulk port
                descriptor = (core.rdma.descriptor(*where) if core.rdma else None) or b""
            progress = RelayProgress(
                lease_id, relay.landed, relay.total_len, int(lease_timeout * 1000), descriptor
            )
            return encode(progress)

    def buffer_of(self, remote: DataHandle) -> Placement:
        """Where this agent's copy of ``remote`` is (a reader on this node copies from it;
        its relay lease keeps it).

        Raises:
            HandleNotFound: no copy of it here any more.
        """
        state = self.core.consumer_state
        with self.core.lock:
            relay = state.relay(remote)
            buffer = None if relay is None else state.relay_buffer(relay)
        if not isinstance(buffer, Placement):
            raise HandleNotFound(
                handle=str(remote), node=self.core.node_id, reason="its copy here is gone"
            )
        return buffer

    def end(self, data: bytes) -> None:
        """``_rv_relay_end``: a reader is done with the copy."""
        request = decode(RelayEnd, data)
        with self.core.changing() as fx:
            self.core.consumer_state.relay_leave(
                request.handle, request.lease_id, self.core.clock(), fx
            )


class RelayLink:
    """A copy's agent over its TCP wire, called from an agent thread: blocking calls on one
    connection (a relay read makes a handful, then closes it), opened only once that agent
    proved it holds the cluster's secret (``auth``)."""

    def __init__(self, address: str, auth: WireAuth) -> None:
        self.address = address
        self.auth = auth
        self._sock: socket.socket | None = None
        self._ids = 0

    def call(self, entry: Entry, message: bytes, timeout_s: float) -> Any:
        """Run ``entry`` there and return its answer. Raises what it raised (a VeloError),
        OSError when the connection fails, WireAuthError when that agent fails the
        handshake, ProtocolError for a malformed answer."""
        sock = self._connected(timeout_s)
        sock.settimeout(timeout_s)
        self._ids += 1
        sock.sendall(encode_request(entry.name, self._ids, message))
        while True:
            length, status, call_id = HEADER.unpack(receive_exactly(sock, HEADER.size))
            if not HEADER.size - 4 <= length <= MAX_FRAME_BYTES:
                raise ProtocolError(f"relay answer frame of {length} bytes")
            body = receive_exactly(sock, length - (HEADER.size - 4))
            if call_id == self._ids:
                break
        ok, value = decode_answer(status, body)
        if not ok:
            raise value
        return value

    def notify(self, entry: Entry, message: bytes, timeout_s: float) -> None:
        """Run ``entry`` there without an answer, connecting first if need be. Raises
        OSError when the agent cannot be reached, WireAuthError when it fails the
        handshake."""
        self._connected(timeout_s).sendall(encode_request(entry.name, 0, message))

    def send(self, entry: Entry, message: bytes) -> None:
        """Run ``entry`` there without an answer on the open connection (never raises)."""
        try:
            if self._sock is not None:
                self._sock.sendall(encode_request(entry.name, 0, message))
        except OSError:
            pass

    def _connected(self, timeout_s: float) -> socket.socket:
        if self._sock is None:
            try:
                self._sock = self.auth.connect_blocking(self.address, timeout_s)
            except WireAuthError as exc:
                self.auth.refused(exc)
                raise
        return self._sock

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


class OwnRelayLink:
    """This agent's own copy, read by another receiver on its node: the relay's entry points
    called in process (no wire); the reader copies what landed instead of GETting it."""

    def __init__(self, server: RelayServer) -> None:
        self.server = server

    def call(self, entry: Entry, message: bytes, timeout_s: float) -> Any:
        return self.server.serve(message)  # read_relay calls only RV_RELAY

    def send(self, entry: Entry, message: bytes) -> None:
        with contextlib.suppress(VeloError):  # the relay lease ended already
            self.server.end(message)  # read_relay sends only RV_RELAY_END

    def close(self) -> None:
        return None


def read_relay(
    core: AgentCore,
    link: RelayLink | OwnRelayLink,
    copy: tuple[DataHandle, str],
    dest: Any,
    until: float,
    get_range: Callable[[str, Any, int, int, float], None],
    bulk: str | None = None,
) -> int:
    """Read the copy of ``handle`` on ``node`` (``copy``: its agent is ``link``) into ``dest``
    as it fills, by ``until`` on the agent's clock: ``get_range(node, source, start, stop,
    timeout_s)`` GETs each landed range (``source``: the copy's descriptor), or, with
    ``bulk`` (that agent's bulk port), reads it over the wire under the relay lease, or,
    from this agent's own copy (``OwnRelayLink``), copies it (``source``: its buffer). Returns
    how many bytes from the start are in ``dest`` (all of them, or as far as it got before
    the copy failed). A GET that may still write ``dest`` raises (UcxError)."""
    handle, node = copy
    total, done, lease_id = dest.nbytes, 0, 0
    try:
        wait_s = min(RELAY_WAIT_S + _ANSWER_S, core.clock.left(until))
        request = RelayRequest(handle, 0, min(total, RELAY_PIECE_BYTES))
        progress = decode(RelayProgress, link.call(RV_RELAY, encode(request), wait_s))
        lease_id = progress.lease_id
        descriptor: Any
        if isinstance(link, OwnRelayLink):
            descriptor = link.server.buffer_of(handle)
        elif bulk is not None:
            descriptor = WireSource(bulk, handle, lease_id, copy=True)
        else:
            descriptor = core.ucx().decode(progress.descriptor, total)
        piece_s = max(progress.lease_timeout_ms / 2000, 0.001)  # within the relay lease
        while True:
            if progress.landed > done:
                left = core.clock.left(until)
                get_range(node, descriptor, done, progress.landed, min(left, piece_s))
                done = progress.landed
            if done >= total:
                return done
            request = RelayRequest(handle, lease_id, min(total, done + RELAY_PIECE_BYTES))
            progress = decode(RelayProgress, link.call(RV_RELAY, encode(request), wait_s))
    except UcxError as exc:
        if exc.fields.get("destination_unsafe"):
            raise
        _log.info("ray_velo: a GET from the copy of %s on %s failed: %s", handle, node, exc)
    except (VeloError, OSError) as exc:
        _log.info("ray_velo: the copy of %s on %s cannot serve: %s", handle, node, exc)
    finally:
        if lease_id:
            link.send(RV_RELAY_END, encode(RelayEnd(handle, lease_id)))
        link.close()
    return done


def copy_gone_notice(handle: DataHandle, node: str, worker: int) -> bytes:
    """The ``_rv_copy`` message saying that copy of ``handle`` is gone."""
    return encode(CopyNotice(handle, node, worker))
