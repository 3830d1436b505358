"""Fuzz at scale: each decoder a peer can reach takes 100,000 generated inputs, and only its
own error ever escapes (after h11: a fuzzer's one invariant is that nothing else does).

The hypothesis fuzzers next door (test_descriptor, test_rkey, test_protocol_fuzz) explore
shapes and shrink what they find; these trade shrinking for volume. A seeded ``random.Random``
drives plain generators fast enough for 100k inputs in seconds, and a fixed seed makes every
run (and so CI) see the same inputs. The inputs mix random bytes, mutations (bit flips,
truncations, extensions, byte replacements) of valid encodings made by encoding real objects,
and, for control messages, well-formed msgpack of the wrong shapes. The first foreign exception
fails the test with the input in hex; a decoder that succeeds must also round-trip.

Each test also counts how the mutated valid encodings came out and requires a fair share of
both outcomes, so a generator that only ever makes garbage (or only valid input) cannot pass
vacuously.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import msgpack
import pytest

from ray_velo.errors import DescriptorError, ProtocolError
from ray_velo.protocol import messages
from ray_velo.protocol.descriptor import MAX_DESCRIPTOR_RKEY_BYTES, RdmaDescriptor
from ray_velo.protocol.handle import DataHandle
from ray_velo.protocol.memtype import SUPPORTED_MEMORY_TYPES
from ray_velo.ucx.rkey import MAX_MD_MAP_BITS, PACKED_RKEY_MAX_BYTES, parse_packed_rkey

INPUTS_PER_DECODER = 100_000
MIN_OUTCOME_SHARE = 0.05
"""Of the mutated valid encodings, at least this share must decode, and this share be refused."""

U64_MAX = (1 << 64) - 1
I64_MIN = -(1 << 63)
RANDOM_BYTES_MAX = 300

#: Bytes that mean something to a parser: zero, sign and length edges, and msgpack type
#: markers (nil, never-used 0xc1, bools, bin/ext/float/int/str headers, arrays, maps).
INTERESTING_BYTES = bytes.fromhex(
    "00 01 02 7f 80 90 a0 c0 c1 c2 c3 c4 c7 ca cb cc cf d0 d3 d4 d6 d8 d9 db dc dd de df fe ff"
)

#: Integer edges, each side of the msgpack widths (fixint, 8, 16, 32, 64 bits). Ints beyond
#: u64 or below i64 have no msgpack encoding (``packb`` raises OverflowError), so no peer can
#: send one; the widest the wire carries are these edges.
EDGE_U64 = [0, 1, 2, *((1 << k) + d for k in (7, 8, 16, 31, 32, 63) for d in (-1, 0)), U64_MAX]
EDGE_NEGATIVE = [-1, -32, -33, *(-(1 << k) + d for k in (7, 15, 31) for d in (0, -1)), I64_MIN]
EDGE_INTS = [*EDGE_U64, *EDGE_NEGATIVE]
EDGE_FLOATS = [0.0, -0.0, 1.5, -1.0, math.inf, -math.inf, math.nan, 1e308, 5e-324]

Decode = Callable[[bytes], object]


class Case(NamedTuple):
    """One generated input: where it came from, the bytes, and which decoder to feed them."""

    source: str
    blob: bytes
    decoder: str


def run_fuzz(
    cases: Iterator[Case], decoders: dict[str, Decode], own_error: type[Exception]
) -> Counter[tuple[str, str, str]]:
    """Feed every case to its decoder. Returns counts by (decoder, source, outcome), outcome
    being ``decoded`` or ``refused``; fails at the first exception other than ``own_error``."""
    outcomes: Counter[tuple[str, str, str]] = Counter()
    for index, case in enumerate(cases):
        try:
            decoders[case.decoder](case.blob)
        except own_error:
            outcomes[case.decoder, case.source, "refused"] += 1
        except Exception as exc:
            pytest.fail(
                f"input {index} ({case.source}) made {case.decoder} raise "
                f"{type(exc).__name__}, not {own_error.__name__}: {str(exc)[:300]}\n"
                f"input hex ({len(case.blob)} bytes): {case.blob.hex()}",
                pytrace=False,
            )
        else:
            outcomes[case.decoder, case.source, "decoded"] += 1
    return outcomes


def assert_scale_and_both_outcomes(
    outcomes: Counter[tuple[str, str, str]], decoder: str, elapsed_s: float
) -> None:
    """``decoder`` saw at least 100k inputs, and its mutated inputs went both ways."""
    total = sum(n for (name, _, _), n in outcomes.items() if name == decoder)
    decoded = outcomes[decoder, "mutated", "decoded"]
    refused = outcomes[decoder, "mutated", "refused"]
    by_source = {f"{s} {o}": n for (name, s, o), n in sorted(outcomes.items()) if name == decoder}
    print(f"{decoder}: {total:,} inputs in {elapsed_s:.1f} s: {by_source}")
    assert total >= INPUTS_PER_DECODER
    mutated = decoded + refused
    assert decoded >= MIN_OUTCOME_SHARE * mutated, f"{decoder}: too few mutants decode"
    assert refused >= MIN_OUTCOME_SHARE * mutated, f"{decoder}: too few mutants are refused"


# --- generic generators ------------------------------------------------------------------


def random_bytes(rng: random.Random) -> bytes:
    return rng.randbytes(rng.randint(0, RANDOM_BYTES_MAX))


def mutate(rng: random.Random, blob: bytes) -> bytes:
    """One to three of: flip a bit, replace a byte, truncate, extend, insert, delete a run,
    overwrite a window with random bytes (which hits whole length and map fields)."""
    data = bytearray(blob)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        op = rng.randrange(7)
        size = len(data)
        if op == 0 and size:
            data[rng.randrange(size)] ^= 1 << rng.randrange(8)
        elif op == 1 and size:
            data[rng.randrange(size)] = rng.choice(INTERESTING_BYTES)
        elif op == 2:
            del data[rng.randint(0, size) :]
        elif op == 3:
            data += rng.randbytes(rng.randint(1, 16))
        elif op == 4:
            at = rng.randint(0, size)
            data[at:at] = rng.randbytes(rng.randint(1, 8))
        elif op == 5 and size:
            at = rng.randrange(size)
            del data[at : at + rng.randint(1, 8)]
        elif size:
            at = rng.randrange(size)
            width = min(rng.choice((1, 2, 4, 8)), size - at)
            data[at : at + width] = rng.randbytes(width)
    return bytes(data)


def u64(rng: random.Random) -> int:
    return rng.choice(EDGE_U64) if rng.random() < 0.3 else rng.getrandbits(rng.choice((8, 32, 64)))


def mixed_cases(
    rng: random.Random, valid: Callable[[random.Random], bytes], decoder: str
) -> Iterator[Case]:
    """A quarter random bytes, three quarters mutated valid encodings."""
    for _ in range(INPUTS_PER_DECODER):
        if rng.random() < 0.25:
            yield Case("random", random_bytes(rng), decoder)
        else:
            yield Case("mutated", mutate(rng, valid(rng)), decoder)


# --- the RDMA descriptor -----------------------------------------------------------------


def valid_descriptor(rng: random.Random) -> bytes:
    """A real descriptor's encoding; a few carry keys at the 4096-byte bound."""
    if rng.random() < 0.01:
        rkey_len = rng.randint(MAX_DESCRIPTOR_RKEY_BYTES - 4, MAX_DESCRIPTOR_RKEY_BYTES)
    else:
        rkey_len = rng.randint(0, 48)
    length = u64(rng) or 1
    return RdmaDescriptor(u64(rng), u64(rng), length, rng.randbytes(rkey_len)).encode()


def decode_descriptor(blob: bytes) -> None:
    decoded = RdmaDescriptor.decode(blob)
    assert decoded.encode() == blob, "a descriptor that decodes re-encodes byte for byte"


@pytest.mark.slow
def test_descriptor_decoder_at_scale() -> None:
    """A peer sends 100k RDMA descriptors, most of them near-misses of real ones: each one
    decodes (and re-encodes to the same bytes) or is refused with DescriptorError."""
    rng = random.Random(0x5EED_0001)
    start = time.perf_counter()
    outcomes = run_fuzz(
        mixed_cases(rng, valid_descriptor, "descriptor"),
        {"descriptor": decode_descriptor},
        DescriptorError,
    )
    assert_scale_and_both_outcomes(outcomes, "descriptor", time.perf_counter() - start)


# --- the packed rkey pre-parse -----------------------------------------------------------


def valid_rkey(rng: random.Random) -> bytes:
    """A packed key in UCX's >= 1.20 layout, as ``ucp_rkey_pack_memh`` writes it."""
    md_count = 0 if rng.random() < 0.1 else rng.choice((1, 1, 2, 2, 3, 4, MAX_MD_MAP_BITS))
    md_bits = sorted(rng.sample(range(64), md_count))
    out = bytearray(sum(1 << bit for bit in md_bits).to_bytes(8, "little"))
    out.append(0)  # host memory
    for _ in md_bits:
        size = rng.randint(0, 40)
        out.append(size)
        out += rng.randbytes(size)
    if md_bits:
        sys_dev = rng.choice((0xFF, 0xFF, rng.randrange(0xFF)))
        out.append(sys_dev)
        if sys_dev != 0xFF:
            for _ in range(rng.randint(0, 5)):
                out += bytes((rng.randrange(0xFF), rng.randrange(256), rng.randrange(256)))
            out.append(0xFF)
    return bytes(out)


def decode_rkey(blob: bytes) -> None:
    layout = parse_packed_rkey(blob)
    assert layout.length == len(blob) <= PACKED_RKEY_MAX_BYTES
    assert (
        layout.mem_type in SUPPORTED_MEMORY_TYPES
        and len(layout.tl_rkey_sizes) == layout.md_map.bit_count()
    )


@pytest.mark.slow
def test_rkey_preparse_at_scale() -> None:
    """A peer sends 100k packed keys, most of them near-misses of UCX's own layout: each one
    is framed inside its bytes or refused with DescriptorError, before UCX would see it."""
    rng = random.Random(0x5EED_0002)
    start = time.perf_counter()
    outcomes = run_fuzz(
        mixed_cases(rng, valid_rkey, "rkey"), {"rkey": decode_rkey}, DescriptorError
    )
    assert_scale_and_both_outcomes(outcomes, "rkey", time.perf_counter() - start)


# --- the control messages ----------------------------------------------------------------

MESSAGE_CLASSES: list[type[Any]] = [
    messages.MetadataRequest,
    messages.MetadataResponse,
    messages.AcquireRequest,
    messages.Ready,
    messages.Rdma,
    messages.PullRequest,
    messages.RefRequest,
    messages.DetachRequest,
    messages.ReleaseRequest,
    messages.LeaseRenewRequest,
    messages.TypeHeader,
    messages.RdmaOffer,
]
ACQUIRE_ANSWER = "decode_acquire_response"

#: Every field name the decoder knows, plus the nested ones: random maps hit real fields.
FIELD_NAMES = sorted(
    {f.name for cls in MESSAGE_CLASSES for f in dataclasses.fields(cls)} | {"hi", "lo", "kind"}
)


def random_text(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return rng.choice((*FIELD_NAMES, "", "ucx", "ready", "rdma", "C", "|u1", "numpy"))
    # Any code point but the surrogates, which have no UTF-8 encoding.
    return "".join(
        chr(
            rng.choice((rng.randrange(128), rng.randrange(0xD800), rng.randrange(0xE000, 0x110000)))
        )
        for _ in range(rng.randint(0, 8))
    )


def random_leaf(rng: random.Random) -> Any:
    kind = rng.randrange(9)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice(EDGE_INTS)
    if kind == 3:
        return rng.randint(I64_MIN, U64_MAX)
    if kind == 4:
        return rng.choice(EDGE_FLOATS) if rng.random() < 0.5 else rng.uniform(-1e9, 1e9)
    if kind == 5:
        return random_text(rng)
    if kind == 6:
        return rng.randbytes(rng.randint(0, 12))
    if kind == 7:
        return msgpack.ExtType(rng.randrange(128), rng.randbytes(rng.randint(0, 9)))
    return msgpack.Timestamp(rng.randint(-(1 << 33), 1 << 33), rng.randrange(10**9))


def random_value(rng: random.Random, depth: int = 0) -> Any:
    """A leaf, or a list / map / handle-shaped map of random values, at most four deep."""
    kind = rng.randrange(10) if depth < 4 else 0
    if kind <= 5:
        return random_leaf(rng)
    if kind <= 7:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if kind == 8:
        return {"hi": random_value(rng, depth + 1), "lo": random_value(rng, depth + 1)}
    return random_map(rng, depth + 1)


def random_map(rng: random.Random, depth: int = 0) -> dict[Any, Any]:
    """Mostly real field names; a few maps carry a random, an int or a bytes key (refused:
    the decoder unpacks with strict_map_key)."""
    wire: dict[Any, Any] = {}
    for _ in range(rng.randint(0, 6)):
        roll = rng.random()
        if roll < 0.8:
            key: Any = rng.choice(FIELD_NAMES)
        elif roll < 0.95:
            key = random_text(rng)
        else:
            key = rng.choice((rng.choice(EDGE_INTS), rng.randbytes(3)))
        wire[key] = random_value(rng, depth)
    return wire


def deeply_nested_map(rng: random.Random) -> bytes:
    """``{field: [[...[leaf]...]]}`` (or nested maps), or a handle whose ``hi`` is nested so,
    around msgpack's 1024-level limit: in raw bytes, as packb refuses to nest that deep."""
    depth = rng.randint(1, 1100)
    level = b"\x91" if rng.random() < 0.5 else b"\x81\xa1a"  # [x] or {"a": x}
    if rng.random() < 0.2:
        prefix = b"\x81\xa6handle\x82\xa2lo\x01\xa2hi"  # {"handle": {"lo": 1, "hi": ...}}
    else:
        field = rng.choice(FIELD_NAMES).encode()
        prefix = b"\x81" + bytes([0xA0 | len(field)]) + field
    return prefix + level * depth + b"\x01"


def valid_field(rng: random.Random, kind: str) -> Any:
    """A value of the field type ``kind`` (as the decoder spells it) that must decode."""
    if kind == "DataHandle":
        return DataHandle(u64(rng), u64(rng))
    if kind == "RdmaOffer | None":
        return None if rng.random() < 0.3 else valid_message(rng, messages.RdmaOffer)
    if kind == "TypeHeader":
        return valid_message(rng, messages.TypeHeader)
    if kind == "tuple[str, ...]":
        return tuple(random_text(rng) for _ in range(rng.randint(0, 3)))
    if kind == "tuple[int, ...]":
        return tuple(rng.choice(EDGE_INTS) for _ in range(rng.randint(0, 4)))
    if kind == "int":
        return rng.choice(EDGE_INTS) if rng.random() < 0.5 else rng.getrandbits(32)
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "str":
        return random_text(rng)
    if kind == "bytes":
        return valid_descriptor(rng) if rng.random() < 0.5 else rng.randbytes(rng.randint(0, 16))
    raise AssertionError(f"no generator for field type {kind}: add one")


def valid_message(rng: random.Random, cls: type[Any]) -> Any:
    """A real message of ``cls``; each field set with probability 3/4 (else its default)."""
    kwargs = {
        f.name: valid_field(rng, str(f.type))
        for f in dataclasses.fields(cls)
        if rng.random() < 0.75
    }
    return cls(**kwargs)


def message_cases(rng: random.Random) -> Iterator[Case]:
    """Each input goes to one message class and to the acquire-answer decoder.

    20% random bytes, 40% mutated real messages (fed to their own class, so mutants that
    survive msgpack reach its field checks), 35% random maps (a few random non-maps), 5%
    nested around msgpack's depth limit.
    """
    for _ in range(INPUTS_PER_DECODER):
        cls = rng.choice(MESSAGE_CLASSES)
        roll = rng.random()
        if roll < 0.2:
            case = Case("random", random_bytes(rng), cls.__name__)
        elif roll < 0.6:
            case = Case(
                "mutated", mutate(rng, messages.encode(valid_message(rng, cls))), cls.__name__
            )
        elif roll < 0.95:
            wire = random_map(rng) if rng.random() < 0.95 else random_value(rng)
            case = Case("structured", msgpack.packb(wire, use_bin_type=True), cls.__name__)
        else:
            case = Case("deep", deeply_nested_map(rng), cls.__name__)
        yield case
        yield case._replace(decoder=ACQUIRE_ANSWER)


def message_decoder(cls: type[Any]) -> Decode:
    def decode(blob: bytes) -> None:
        decoded = messages.decode(cls, blob)
        assert isinstance(decoded, cls)
        assert messages.decode(cls, messages.encode(decoded)) == decoded, "round trip"

    return decode


def decode_acquire_answer(blob: bytes) -> None:
    answer = messages.decode_acquire_response(blob)
    assert isinstance(answer, (messages.Ready, messages.Rdma))
    assert messages.decode_acquire_response(messages.encode(answer)) == answer, "round trip"


@pytest.mark.slow
def test_message_decoders_at_scale() -> None:
    """A peer that speaks msgpack but not our protocol sends 100k control messages, to every
    message class and to the acquire-answer decoder: each decodes (and round-trips) or is
    refused with ProtocolError."""
    rng = random.Random(0x5EED_0003)
    decoders = {cls.__name__: message_decoder(cls) for cls in MESSAGE_CLASSES}
    decoders[ACQUIRE_ANSWER] = decode_acquire_answer
    start = time.perf_counter()
    outcomes = run_fuzz(message_cases(rng), decoders, ProtocolError)
    elapsed_s = time.perf_counter() - start

    by_class = Counter({name: 0 for name in decoders})
    for (name, _, _), n in outcomes.items():
        by_class[name] += n
    assert all(by_class.values()), f"a decoder got no input: {by_class}"
    # Every class decodes some mutant: the mutations reach the field checks of each.
    assert all(outcomes[cls.__name__, "mutated", "decoded"] for cls in MESSAGE_CLASSES)

    # messages.decode over all classes together, and decode_acquire_response, each 100k.
    merged: Counter[tuple[str, str, str]] = Counter()
    for (name, source, outcome), n in outcomes.items():
        merged["decode" if name != ACQUIRE_ANSWER else ACQUIRE_ANSWER, source, outcome] += n
    assert_scale_and_both_outcomes(merged, "decode", elapsed_s)
    assert_scale_and_both_outcomes(merged, ACQUIRE_ANSWER, elapsed_s)
