"""Ids that are capabilities: unpredictable from each other, and never repeated
(docs/architecture.md §1). Pure: the key is an argument."""

from __future__ import annotations

import hashlib

__all__ = ["ID_KEY_BYTES", "IdSequence"]

#: The key's size (BLAKE2b takes keys of up to 64 bytes).
ID_KEY_BYTES = 16
_ROUNDS = 4
_HALF = 0xFFFF_FFFF


class IdSequence:
    """Non-zero 64-bit ids, each new one a permutation of the next counter value.

    ``purpose`` (at most 8 bytes) keeps sequences of one key apart: the slot ids and the
    lease ids of one store share its key, and neither may reveal the other.
    """

    def __init__(self, key: bytes, purpose: bytes) -> None:
        if not ID_KEY_BYTES <= len(key) <= 64:
            raise ValueError(f"an id key is {ID_KEY_BYTES} to 64 bytes, got {len(key)}")
        if not 0 < len(purpose) <= 8:
            raise ValueError(f"an id purpose is 1 to 8 bytes, got {purpose!r}")
        self._round_keys = [
            hashlib.blake2b(key, digest_size=32, salt=bytes([i]) * 16, person=purpose).digest()
            for i in range(_ROUNDS)
        ]
        self._counter = 0

    def __next__(self) -> int:
        while True:
            self._counter += 1
            value = self.permute(self._counter)
            if value:  # 0 means "none" on the wire
                return value

    def __iter__(self) -> IdSequence:
        return self

    def permute(self, n: int) -> int:
        """The id for counter value ``n`` (0 <= n < 2**64)."""
        left, right = n >> 32, n & _HALF
        for key in self._round_keys:
            mixed = hashlib.blake2b(right.to_bytes(4, "big"), digest_size=4, key=key).digest()
            left, right = right, left ^ int.from_bytes(mixed, "big")
        return (left << 32) | right
