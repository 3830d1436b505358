"""The wire at scale: 100,000 random and mutated frames at the owner's TCP wire, before and
after the handshake, with the real owner's handlers behind it.

Before the handshake (a peer without the secret, or one whose handshake failed) the only
outcome allowed is a closed connection with no handler run; after it (an agent of the
cluster) only answers and protocol errors, and the owner's state still checks every
invariant. Never a crash: nothing escapes the server. The connections are in-memory streams
fed to the server's per-connection coroutine (the same one the listener runs), so 100k
frames take seconds; tests/unit/test_wire_server.py covers the real sockets. A seeded
``random.Random`` makes every run see the same inputs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from ray_velo.errors import ProtocolError
from ray_velo.protocol import messages
from ray_velo.protocol.entry import BY_NAME
from ray_velo.protocol.frames import HEADER, WIRE_METHODS, decode_answer, encode_request
from ray_velo.protocol.handle import DataHandle
from ray_velo.protocol.handshake import (
    ACCEPTED_BYTES,
    CHALLENGE_BYTES,
    MAGIC,
    NONCE_BYTES,
    ClientHandshake,
)
from ray_velo.testing import AgentPair
from ray_velo.wire.auth import WireAuth
from ray_velo.wire.server import WireServer
from tests.unit.test_fuzz_at_scale import mutate, random_bytes, random_map, valid_message

SECRET = bytes(range(100, 132))
BEFORE_CONNECTIONS = 50_000
AFTER_CONNECTIONS = 1_000
FRAMES_PER_CONNECTION = 50  # 50k frames after the handshake, 100k in all with the ones before
#: The request each wire method decodes.
REQUESTS: dict[str, type[Any]] = {
    "_rv_metadata": messages.MetadataRequest,
    "_rv_acquire": messages.AcquireRequest,
    "_rv_ref": messages.RefRequest,
    "_rv_detach": messages.DetachRequest,
    "_rv_release": messages.ReleaseRequest,
    "_rv_lease_renew": messages.LeaseRenewRequest,
    "_rv_copy": messages.CopyNotice,
    "_rv_relay": messages.RelayRequest,
    "_rv_relay_end": messages.RelayEnd,
    "_rv_window": messages.WindowRequest,
}


class MemoryWriter:
    """The writing half of an in-memory connection (what the server uses of a StreamWriter)."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        if not self.closed:
            self.data += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("198.51.100.7", 40000) if name == "peername" else default


def frame(rng: random.Random, handles: list[DataHandle], last: bool = True) -> bytes:
    """A request frame: a real message of a random method, often about a live handle, perhaps
    mutated, or random bytes or msgpack in its body. Only as a connection's ``last`` frame,
    often random bytes altogether or a frame mutated in its header too: a length past the
    limit ends the connection, so earlier frames keep their framing to reach the handlers."""
    roll = rng.random() if last else 1.0
    if roll < 0.5:
        return random_bytes(rng)
    method = rng.choice(WIRE_METHODS)
    message = valid_message(rng, REQUESTS[method])
    if handles and hasattr(message, "handle") and rng.random() < 0.7:
        message = dataclasses.replace(message, handle=rng.choice(handles))
    body = messages.encode(message)
    shape = rng.random()
    if shape < 0.3:
        body = mutate(rng, body)
    elif shape < 0.4:
        body = random_bytes(rng) if rng.random() < 0.5 else msgpack.packb(random_map(rng))
    request = encode_request(method, rng.getrandbits(rng.choice((8, 64))), body)
    if rng.random() < 0.02:  # a method number past the table
        request = request[:4] + bytes([rng.randrange(len(WIRE_METHODS), 256)]) + request[5:]
    return mutate(rng, request) if roll < 0.75 else request


async def settled(reader: asyncio.StreamReader, serving: asyncio.Future[Any], server: Any) -> None:
    """Wait until the server has read all it can of ``reader`` and every handler it started
    has answered."""
    # it stops when all is read, or when it waits for bytes a frame's length promised
    while not serving.done() and reader._buffer and reader._waiter is None:  # type: ignore[attr-defined]
        await asyncio.sleep(0)
    for _ in range(3):  # a handler's answer may start another step
        await asyncio.sleep(0)
        if server._tasks:
            await asyncio.wait(list(server._tasks))


def test_nothing_before_the_handshake_reaches_a_handler() -> None:
    """50,000 connections whose first bytes are a frame of a wire method, random bytes, a
    mutated hello, or a hello followed by a wrong proof and frames: each ends closed, with at
    most the handshake's challenge written, and no handler ran."""
    ran: list[str] = []
    refused: Counter[str] = Counter()

    async def dispatch(method: str, message: bytes) -> Any:
        ran.append(method)
        return None

    server = WireServer(
        "127.0.0.1", dispatch, WireAuth(SECRET, on_refusal=lambda reason: refused.update([reason]))
    )
    rng = random.Random(25)
    shapes: Counter[str] = Counter()

    async def main() -> None:
        for _ in range(BEFORE_CONNECTIONS):
            roll = rng.random()
            hello = ClientHandshake(os.urandom(32), rng.randbytes(NONCE_BYTES)).hello()
            if roll < 0.5:
                shape, data = "frame", frame(rng, [])
            elif roll < 0.7:
                shape, data = "random", random_bytes(rng)
            elif roll < 0.85:
                shape, data = "mutated hello", mutate(rng, hello) + frame(rng, [])
            else:  # a handshake of the right shape with another secret's proof, then frames
                shape = "failed handshake"
                data = hello + rng.randbytes(32) + frame(rng, []) + frame(rng, [])
            shapes[shape] += 1
            reader, writer = asyncio.StreamReader(), MemoryWriter()
            reader.feed_data(data)
            reader.feed_eof()
            await server.serve_connection(reader, writer)  # type: ignore[arg-type]
            assert writer.closed
            written = bytes(writer.data)
            assert written == b"" or (len(written) == CHALLENGE_BYTES and written[:4] == MAGIC)

    asyncio.run(main())
    assert ran == [], f"{len(ran)} handlers ran for unauthenticated peers: {ran[:5]}"
    assert server.calls == 0 and server.peers == 0
    assert sum(refused.values()) == BEFORE_CONNECTIONS
    # every way to fail was met: not a hello, a short one, a wrong proof
    assert refused["malformed"] > 0 and refused["closed"] > 0 and refused["bad_proof"] > 0
    assert min(shapes.values()) > BEFORE_CONNECTIONS // 10


def test_an_agents_frames_reach_only_the_owners_own_errors(tmp_path: Path) -> None:
    """1,000 authenticated connections of 50 random or mutated frames each, many about live
    handles, served by a real owner: the server never raises, every answer is a well-formed
    frame (a value or one of our errors), and the owner's state checks every invariant."""
    pair = AgentPair(tmp_path / "shm")
    try:
        handles = [pair.put(np.full(n, 7, dtype=np.uint8)) for n in (100, 70_000, 300_000)]
        agent = pair.owner

        async def dispatch(method: str, message: bytes) -> Any:
            return await asyncio.to_thread(agent.serve(BY_NAME[method]), message)

        server = WireServer("127.0.0.1", dispatch, WireAuth(SECRET))
        rng = random.Random(26)
        statuses: Counter[int] = Counter()

        async def one_connection() -> None:
            reader, writer = asyncio.StreamReader(), MemoryWriter()
            client = ClientHandshake(SECRET, rng.randbytes(NONCE_BYTES))
            reader.feed_data(client.hello())
            serving = asyncio.ensure_future(server.serve_connection(reader, writer))  # type: ignore[arg-type]
            while len(writer.data) < CHALLENGE_BYTES:
                await asyncio.sleep(0)
            reader.feed_data(client.prove(bytes(writer.data[:CHALLENGE_BYTES])))
            frames = b"".join(
                frame(rng, handles, last=i == FRAMES_PER_CONNECTION - 1)
                for i in range(FRAMES_PER_CONNECTION)
            )
            while len(writer.data) < CHALLENGE_BYTES + ACCEPTED_BYTES:
                await asyncio.sleep(0)
            reader.feed_data(frames)
            await settled(reader, serving, server)
            reader.feed_eof()  # the peer closes once every answer came back
            await serving
            answers = bytes(writer.data[CHALLENGE_BYTES + ACCEPTED_BYTES :])
            while answers:
                length, status, _ = HEADER.unpack_from(answers)
                body = answers[HEADER.size : 4 + length]
                try:
                    ok, _value = decode_answer(status, body)
                    statuses[0 if ok else 1] += 1
                except ProtocolError:
                    raise AssertionError(
                        f"a malformed answer frame: {answers[:64].hex()}"
                    ) from None
                answers = answers[4 + length :]

        async def main() -> None:
            for _ in range(AFTER_CONNECTIONS):
                await one_connection()

        asyncio.run(main())
        assert server.peers == AFTER_CONNECTIONS
        # the handlers did run (most frames), and both answers and errors came back
        assert server.calls > 0.9 * AFTER_CONNECTIONS * FRAMES_PER_CONNECTION
        assert statuses[0] > 5000 and statuses[1] > 5000, statuses
        pair.validate()
    finally:
        with pair.clock.passing():  # the leases the fuzz took and never ended: to the bound
            pair.owner.shutdown(timeout_s=1.0)
        pair.close()
