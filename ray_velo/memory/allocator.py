"""O(1) offset allocator over an arena of 4 KiB granules, after Sebastian Aaltonen's OffsetAllocator.

It hands out contiguous granule ranges of one arena and takes them back; it knows nothing of
bytes, shared memory, UCX or Ray (the caller converts bytes with :func:`bytes_to_granules`).

Theory of operation
-------------------
Every range of the arena, free or allocated, is a *node*. Nodes sit in one physical chain
(``prev``/``next`` neighbour links in offset order) that always tiles ``[0, size)`` exactly.
Free nodes also sit in one of 256 *bins*, doubly linked lists keyed by a tiny float (3-bit
mantissa, 5-bit exponent, like TLSF): the bin of a size is its float rounded *down*, so every
node in bin ``b`` holds at least ``_BIN_SIZES[b]`` granules.

``allocate(n)`` rounds ``n`` *up* to its bin, finds the first non-empty bin at or above it with
two bit scans (a 32-bit top mask over 8-bit leaf masks), pops that bin's head, reserves exactly
the bin's size and puts the remainder back into the bins as a new node: no list is ever
walked. Reserving the rounded size (not ``n``) is what bounds the waste: a float with a 3-bit
mantissa over-states a size by less than 1/8, and reserved blocks then come in the same few
sizes, which keeps the free remainders reusable.

``free`` merges the node with free physical neighbours at once, so two free nodes are never
adjacent. Hence free nodes number at most live allocations + 1, and a node pool of
``min(size, 2 * max_allocs + 1)`` entries can never run dry: a fragmented arena that has room
never reports full for want of a node. The pool is materialised on demand, because a 64 GiB
arena is 16 Mi granules and seven eagerly built lists of that length would cost about 1 GB.

Node fields live in parallel Python lists indexed by node number, bound to locals on the hot
paths (attribute access dominates in CPython); :class:`Allocation` is only the caller's token.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Final

from ray_velo.errors import ConfigError

__all__ = [
    "GRANULE_BYTES",
    "MAX_ARENA_GRANULES",
    "Allocation",
    "OffsetAllocator",
    "bytes_to_granules",
]

GRANULE_BYTES: Final = 4096
"""Bytes in one granule, the allocator's unit."""

_MANTISSA_BITS: Final = 3
_MANTISSA_VALUE: Final = 1 << _MANTISSA_BITS
_MANTISSA_MASK: Final = _MANTISSA_VALUE - 1
_TOP_BINS: Final = 32
_LEAF_BINS: Final = 8  # bins under one top bit; _MANTISSA_BITS == log2(_LEAF_BINS)
_NUM_BINS: Final = _TOP_BINS * _LEAF_BINS
_NONE: Final = -1  # "no node" in every link list and "not allocated" in the token list


def _bin_round_up(size: int) -> int:
    """The smallest bin whose size is ``>= size`` (``size >= 1``, granules)."""
    if size < _MANTISSA_VALUE:
        return size  # denormal range: one bin per size, exact
    shift = size.bit_length() - 1 - _MANTISSA_BITS
    index = ((shift + 1) << _MANTISSA_BITS) + ((size >> shift) & _MANTISSA_MASK)
    if size & ((1 << shift) - 1):
        index += 1  # a mantissa overflow carries into the exponent, as it should
    return index


def _bin_round_down(size: int) -> int:
    """The largest bin whose size is ``<= size`` (``size >= 1``, granules)."""
    if size < _MANTISSA_VALUE:
        return size
    shift = size.bit_length() - 1 - _MANTISSA_BITS
    return ((shift + 1) << _MANTISSA_BITS) + ((size >> shift) & _MANTISSA_MASK)


def _bin_size(index: int) -> int:
    """The size in granules that bin ``index`` stands for."""
    exponent = index >> _MANTISSA_BITS
    mantissa = index & _MANTISSA_MASK
    if exponent == 0:
        return mantissa
    return (mantissa | _MANTISSA_VALUE) << (exponent - 1)


_BIN_SIZES: Final[tuple[int, ...]] = tuple(_bin_size(b) for b in range(_NUM_BINS))

MAX_ARENA_GRANULES: Final = _BIN_SIZES[-1]
"""The largest arena the 8-bit bin float can describe: 15 * 2**30 granules (60 TiB)."""


def bytes_to_granules(nbytes: int) -> int:
    """Granules needed to hold ``nbytes`` bytes: rounded up, and at least 1.

    Raises:
        ValueError: ``nbytes`` is negative.
        TypeError: ``nbytes`` is not an integer (numpy integers are accepted).
    """
    nbytes = operator.index(nbytes)  # a numpy size becomes a plain int the allocator can take
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    return max(1, -(-nbytes // GRANULE_BYTES))


@dataclass(frozen=True, slots=True)
class Allocation:
    """A live range of the arena, and the token that frees it.

    Attributes:
        offset: first granule of the range.
        size: granules actually reserved: the request rounded up to its bin (waste < 1/8).
        node: private free token (node index plus a serial, so a stale copy is refused).
    """

    offset: int
    size: int
    node: int


class OffsetAllocator:
    """Hands out contiguous granule ranges of an arena of ``size_granules`` granules in O(1).

    Not thread-safe: the owner store calls it under its own lock.
    """

    __slots__ = (
        "_bin_heads",
        "_bin_next",
        "_bin_of",
        "_bin_prev",
        "_count",
        "_free_granules",
        "_leaf_masks",
        "_max_allocs",
        "_nbr_next",
        "_nbr_prev",
        "_node_capacity",
        "_offsets",
        "_serial",
        "_size",
        "_sizes",
        "_spare",
        "_token_shift",
        "_tokens",
        "_top_mask",
    )

    def __init__(self, size_granules: int, max_allocs: int | None = None) -> None:
        """Create an allocator over ``size_granules`` granules, all free.

        Args:
            size_granules: arena size in granules, 1 .. :data:`MAX_ARENA_GRANULES`.
            max_allocs: most live allocations at once; defaults to ``size_granules`` (no cap
                beyond the arena's own).

        Raises:
            ConfigError: a size or count is out of range (a ``ValueError``).
        """
        if size_granules < 1 or size_granules > MAX_ARENA_GRANULES:
            raise ConfigError(
                field="size_granules",
                value=size_granules,
                rule=f"must be 1 .. {MAX_ARENA_GRANULES} granules",
            )
        if max_allocs is None:
            max_allocs = size_granules
        if max_allocs < 1:
            raise ConfigError(field="max_allocs", value=max_allocs, rule="must be >= 1")
        self._size = size_granules
        self._max_allocs = max_allocs
        # Nodes in use = live allocations + free blocks <= 2 * live + 1, and <= granules.
        self._node_capacity = min(size_granules, 2 * max_allocs + 1)
        self._token_shift = self._node_capacity.bit_length()
        self._serial = 0
        self._count = 0
        self._free_granules = size_granules
        # Node fields, one list each (see the module docstring for why not objects).
        self._offsets: list[int] = []
        self._sizes: list[int] = []
        self._tokens: list[int] = []  # live token of an allocated node, _NONE otherwise
        self._nbr_prev: list[int] = []
        self._nbr_next: list[int] = []
        self._bin_prev: list[int] = []
        self._bin_next: list[int] = []
        self._bin_of: list[int] = []  # bin a free node sits in; stale once allocated
        self._spare: list[int] = []  # released node indices, reused before the lists grow
        self._bin_heads: list[int] = [_NONE] * _NUM_BINS
        self._leaf_masks: list[int] = [0] * _TOP_BINS
        self._top_mask = 0
        whole = self._new_node(0, size_granules)
        self._link_free(whole, size_granules)

    # --- introspection --------------------------------------------------------------------

    @property
    def size(self) -> int:
        """Arena size in granules."""
        return self._size

    @property
    def used_granules(self) -> int:
        """Granules reserved by live allocations (rounded sizes, so waste counts as used)."""
        return self._size - self._free_granules

    @property
    def free_granules(self) -> int:
        """Granules in free blocks (not necessarily contiguous)."""
        return self._free_granules

    @property
    def allocation_count(self) -> int:
        """Number of live allocations."""
        return self._count

    def largest_free_granules(self) -> int:
        """Size in granules of the largest free block; 0 when the arena is full.

        O(length of the top non-empty bin), not O(1): it is for reporting, not the hot path.
        ``allocate`` of this many granules may still fail, since a request is rounded up to its
        bin first (a free block of 17 granules cannot serve 17, which reserves 18).
        """
        if not self._top_mask:
            return 0
        top = self._top_mask.bit_length() - 1
        index = (top << _MANTISSA_BITS) + self._leaf_masks[top].bit_length() - 1
        largest = 0
        node = self._bin_heads[index]
        while node != _NONE:
            largest = max(largest, self._sizes[node])
            node = self._bin_next[node]
        return largest

    def is_empty(self) -> bool:
        """True when no allocation is live (the arena is then one free block)."""
        return self._count == 0

    # --- the hot path ---------------------------------------------------------------------

    def allocate(self, granules: int) -> Allocation | None:
        """Reserve a contiguous range of at least ``granules`` granules.

        The reservation is ``granules`` rounded up to its bin size, so ``Allocation.size`` can
        exceed the request by less than 1/8 of it.

        Returns:
            The allocation, or ``None`` when no free block can hold the rounded request or
            ``max_allocs`` allocations are live. Nothing changes when it returns ``None``.

        Raises:
            ValueError: ``granules`` is below 1.
        """
        if granules < 1:
            raise ValueError(f"granules must be >= 1, got {granules}")
        if granules > self._free_granules or self._count >= self._max_allocs:
            return None
        # Round the request up to its bin (inlined _bin_round_up).
        if granules < _MANTISSA_VALUE:
            min_bin = granules
        else:
            shift = granules.bit_length() - 4  # 4 == 1 + _MANTISSA_BITS
            min_bin = ((shift + 1) << 3) + ((granules >> shift) & 7)
            if granules & ((1 << shift) - 1):
                min_bin += 1
        reserve = _BIN_SIZES[min_bin]
        found = self._first_bin_at_least(min_bin)
        if found == _NONE:
            return None
        node = self._pop_bin(found)  # its size is >= _BIN_SIZES[found] >= reserve
        offset = self._offsets[node]
        remainder = self._sizes[node] - reserve
        self._sizes[node] = reserve
        if remainder:
            self._split_off(node, offset + reserve, remainder)
        self._serial = serial = self._serial + 1
        token = (serial << self._token_shift) | node
        self._tokens[node] = token
        self._free_granules -= reserve
        self._count += 1
        return Allocation(offset, reserve, token)

    def _first_bin_at_least(self, min_bin: int) -> int:
        """The first non-empty bin >= ``min_bin`` (its own leaf first, then the next
        non-empty top bit), or _NONE."""
        top_mask = self._top_mask
        top = min_bin >> 3
        if (top_mask >> top) & 1:
            leaf = self._leaf_masks[top] >> (min_bin & 7)
            if leaf:
                return min_bin + (leaf & -leaf).bit_length() - 1
        higher = top_mask >> (top + 1)
        if not higher:
            return _NONE
        top += (higher & -higher).bit_length()  # lowest set bit above top, as an index
        leaf = self._leaf_masks[top]
        return (top << 3) + (leaf & -leaf).bit_length() - 1

    def _pop_bin(self, found: int) -> int:
        """Unlink and return the head node of non-empty bin ``found``."""
        node = self._bin_heads[found]
        after = self._bin_next[node]
        self._bin_heads[found] = after
        if after != _NONE:
            self._bin_prev[after] = _NONE
        else:
            top = found >> 3
            leaf = self._leaf_masks[top] & ~(1 << (found & 7))
            self._leaf_masks[top] = leaf
            if not leaf:
                self._top_mask &= ~(1 << top)
        return node

    def _split_off(self, node: int, offset: int, granules: int) -> None:
        """Make ``[offset, offset + granules)`` after ``node`` a free block of its own."""
        rest = self._new_node(offset, granules)
        nbr_next = self._nbr_next
        following = nbr_next[node]
        self._nbr_prev[rest] = node
        nbr_next[rest] = following
        nbr_next[node] = rest
        if following != _NONE:
            self._nbr_prev[following] = rest
        self._link_free(rest, granules)

    def free(self, allocation: Allocation) -> None:
        """Return ``allocation``'s granules, merging them with free neighbours.

        Raises:
            ValueError: the allocation is not live in this allocator (already freed, or a
                token from another allocator). Nothing changes then.
        """
        token = allocation.node
        node = token & ((1 << self._token_shift) - 1)
        tokens = self._tokens
        offsets = self._offsets
        sizes = self._sizes
        if (
            token < 0
            or node >= len(tokens)
            or tokens[node] != token
            or offsets[node] != allocation.offset
            or sizes[node] != allocation.size
        ):
            raise ValueError(
                f"{allocation} is not a live allocation of this allocator "
                "(double free, or a token from another allocator)"
            )
        tokens[node] = _NONE
        offset = offsets[node]
        size = sizes[node]
        self._free_granules += size
        self._count -= 1
        nbr_prev = self._nbr_prev
        nbr_next = self._nbr_next
        spare = self._spare
        # Merge with a free left neighbour: it disappears, this node takes its offset.
        left = nbr_prev[node]
        if left != _NONE and tokens[left] == _NONE:
            self._unlink_free(left)
            offset = offsets[left]
            size += sizes[left]
            before = nbr_prev[left]
            nbr_prev[node] = before
            if before != _NONE:
                nbr_next[before] = node
            spare.append(left)
        # Merge with a free right neighbour.
        right = nbr_next[node]
        if right != _NONE and tokens[right] == _NONE:
            self._unlink_free(right)
            size += sizes[right]
            beyond = nbr_next[right]
            nbr_next[node] = beyond
            if beyond != _NONE:
                nbr_prev[beyond] = node
            spare.append(right)
        offsets[node] = offset
        sizes[node] = size
        self._link_free(node, size)

    # --- node and bin plumbing ------------------------------------------------------------

    def _new_node(self, offset: int, size: int) -> int:
        """Take a node from the spare stack, or grow the lists by one; links are unset."""
        if self._spare:
            node = self._spare.pop()
            self._offsets[node] = offset
            self._sizes[node] = size
            self._tokens[node] = _NONE
            self._nbr_prev[node] = _NONE
            self._nbr_next[node] = _NONE
            return node
        # Growth cannot pass _node_capacity (see the module docstring); validate() checks it.
        node = len(self._offsets)
        self._offsets.append(offset)
        self._sizes.append(size)
        self._tokens.append(_NONE)
        self._nbr_prev.append(_NONE)
        self._nbr_next.append(_NONE)
        self._bin_prev.append(_NONE)
        self._bin_next.append(_NONE)
        self._bin_of.append(_NONE)
        return node

    def _link_free(self, node: int, size: int) -> None:
        """Push free ``node`` of ``size`` granules onto the head of its bin."""
        if size < _MANTISSA_VALUE:  # inlined _bin_round_down
            index = size
        else:
            shift = size.bit_length() - 4
            index = ((shift + 1) << 3) + ((size >> shift) & 7)
        heads = self._bin_heads
        head = heads[index]
        self._bin_of[node] = index
        self._bin_prev[node] = _NONE
        self._bin_next[node] = head
        if head != _NONE:
            self._bin_prev[head] = node
        else:
            top = index >> 3
            self._leaf_masks[top] |= 1 << (index & 7)
            self._top_mask |= 1 << top
        heads[index] = node

    def _unlink_free(self, node: int) -> None:
        """Take free ``node`` out of its bin, clearing the bin's bits when it empties."""
        before = self._bin_prev[node]
        after = self._bin_next[node]
        if before != _NONE:
            self._bin_next[before] = after
        else:
            index = self._bin_of[node]
            self._bin_heads[index] = after
            if after == _NONE:
                top = index >> 3
                leaf = self._leaf_masks[top] & ~(1 << (index & 7))
                self._leaf_masks[top] = leaf
                if not leaf:
                    self._top_mask &= ~(1 << top)
        if after != _NONE:
            self._bin_prev[after] = before

    # --- invariants -----------------------------------------------------------------------

    def validate(self) -> None:
        """Check every invariant; tests call it after each step.

        Checks: the physical chain tiles ``[0, size)`` with back links intact (so no free block
        overlaps a live one); no two free blocks are adjacent; every free block sits in the bin
        its size rounds down to, and only there; the bit masks say exactly which bins are
        non-empty; counters match the blocks (``free + used == size``); live, free and spare
        nodes partition the pool, which stays within its capacity.

        Raises:
            AssertionError: an invariant is broken; the message names it.
        """
        nodes = len(self._offsets)
        _check(nodes <= self._node_capacity, f"{nodes} nodes exceed capacity {self._node_capacity}")
        for name in ("_sizes", "_tokens", "_nbr_prev", "_nbr_next", "_bin_prev", "_bin_next"):
            length = len(getattr(self, name))
            _check(length == nodes, f"{name} has {length} entries, offsets has {nodes}")
        _check(len(self._bin_of) == nodes, "_bin_of length differs from the node count")
        free_nodes = self._validate_bins(nodes)
        live_nodes = self._validate_partition(nodes, free_nodes)
        self._validate_chain(nodes, live_nodes, free_nodes)

    def _validate_bins(self, nodes: int) -> set[int]:
        """Bins and masks agree; every free block sits in the bin its size rounds down to.
        Returns the free nodes."""
        free_nodes: set[int] = set()
        for index in range(_NUM_BINS):
            top, bit = index >> 3, 1 << (index & 7)
            has_bit = bool(self._leaf_masks[top] & bit)
            head = self._bin_heads[index]
            _check(has_bit == (head != _NONE), f"bin {index}: leaf bit {has_bit}, head {head}")
            previous, node = _NONE, head
            while node != _NONE:
                _check(0 <= node < nodes, f"bin {index} links to node {node} outside the pool")
                _check(node not in free_nodes, f"node {node} is in a bin twice (or a cycle)")
                free_nodes.add(node)
                _check(self._tokens[node] == _NONE, f"live node {node} sits in bin {index}")
                _check(self._bin_of[node] == index, f"node {node} in bin {index} records another")
                size = self._sizes[node]
                _check(
                    size >= 1 and _bin_round_down(size) == index,
                    f"node {node} of {size} granules sits in bin {index}",
                )
                _check(self._bin_prev[node] == previous, f"node {node}: broken bin back link")
                previous, node = node, self._bin_next[node]
        for top in range(_TOP_BINS):
            has_top = bool(self._top_mask >> top & 1)
            _check(has_top == bool(self._leaf_masks[top]), f"top bit {top} disagrees with leaf")
        _check(self._top_mask >> _TOP_BINS == 0, "top mask has bits above 32")
        return free_nodes

    def _validate_partition(self, nodes: int, free_nodes: set[int]) -> set[int]:
        """Live + free + spare == every materialised node. Returns the live nodes."""
        live_nodes = {n for n in range(nodes) if self._tokens[n] != _NONE}
        spare = set(self._spare)
        _check(len(spare) == len(self._spare), "a node is on the spare stack twice")
        _check(not spare & (live_nodes | free_nodes), "a spare node is also live or free")
        _check(
            len(live_nodes) + len(free_nodes) + len(spare) == nodes,
            "some node is neither live, free nor spare",
        )
        _check(len(live_nodes) == self._count, f"{len(live_nodes)} live nodes, count {self._count}")
        _check(self._count <= self._max_allocs, "more live allocations than max_allocs")
        mask = (1 << self._token_shift) - 1
        for node in live_nodes:
            _check(self._tokens[node] & mask == node, f"node {node} holds another node's token")
        return live_nodes

    def _validate_chain(self, nodes: int, live_nodes: set[int], free_nodes: set[int]) -> None:
        """The physical chain starts at 0, is contiguous, ends at size, visits every block,
        and never has two free blocks side by side; counters match it."""
        firsts = [n for n in live_nodes | free_nodes if self._nbr_prev[n] == _NONE]
        _check(len(firsts) == 1, f"{len(firsts)} blocks have no left neighbour, want 1")
        node, expected, visited, free_total, used_total = firsts[0], 0, 0, 0, 0
        previous, previous_free = _NONE, False
        while node != _NONE:
            _check(visited < nodes, "the physical chain has a cycle")
            visited += 1
            _check(self._nbr_prev[node] == previous, f"node {node}: broken neighbour back link")
            offset, size = self._offsets[node], self._sizes[node]
            _check(offset == expected, f"node {node} starts at {offset}, want {expected}")
            is_free = node in free_nodes
            _check(not (is_free and previous_free), f"free node {node} follows a free node")
            if is_free:
                free_total += size
            else:
                used_total += size
            expected = offset + size
            previous, previous_free, node = node, is_free, self._nbr_next[node]
        _check(expected == self._size, f"the chain ends at {expected}, arena is {self._size}")
        _check(visited == len(live_nodes) + len(free_nodes), "a block is off the chain")
        _check(
            free_total == self._free_granules,
            f"free blocks hold {free_total} granules, counter says {self._free_granules}",
        )
        _check(used_total + free_total == self._size, "free + used != size")


def _check(condition: bool, message: str) -> None:
    # Not `assert`: validate() must check under `python -O` as well.
    if not condition:
        raise AssertionError(message)
