"""A sequence: one request's block table and what the prefix index needs to know about it."""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from collections.abc import Sequence as Seq

import xxhash

from blockd.core.errors import InvalidArgument
from blockd.core.namespace import Namespace

_MAX_TOKEN = 2**32 - 1
_EMPTY_TOKENS = bytearray()
_EMPTY_KEYS: list[bytes] = []
_EMPTY_CHAIN: list[int] = []


class TailWaste:
    """Unused token slots in the last blocks of live sequences: ``len(table) * block_size -
    num_tokens`` summed over them, kept as a running total so a metrics scrape is O(1), not a
    walk of every sequence (issue 17). The manager's operations adjust it wherever a table or
    ``num_tokens`` changes; ``check_invariants`` compares it with the walk."""

    __slots__ = ("tokens",)

    def __init__(self, tokens: int = 0) -> None:
        self.tokens = tokens

    @staticmethod
    def walk(sequences: Iterable[Sequence], block_size: int) -> int:
        return sum(len(s.table) * block_size - s.num_tokens for s in sequences)


def as_token_bytes(tokens: bytes | bytearray | memoryview | Seq[int], field: str) -> bytes:
    """Token ids as uint32 little-endian bytes (what keys hash and what blocks store).

    Accepts the bytes themselves (zero conversion on the hot path) or any sequence of ints.
    """
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        raw = bytes(tokens)
        if len(raw) % 4:
            raise InvalidArgument("token bytes must be a multiple of 4 long", field=field)
        return raw
    try:
        return array("I", tokens).tobytes()
    except (OverflowError, TypeError) as exc:
        raise InvalidArgument(f"token ids must be integers in 0..{_MAX_TOKEN}: {exc}",
                              field=field) from None


class Sequence:
    """One request's blocks. Owned and mutated only by the BlockManager.

    ``table[i]`` is the physical block of logical block ``i``; every block but the last is full.
    ``chain[i]`` is the block the prefix index holds for this sequence's prefix up to block
    ``i`` (this sequence's own block, or an identical one indexed earlier); it is the parent a
    later block of this sequence is indexed under.
    """

    __slots__ = (
        "id", "session", "tenant", "ns", "table", "num_tokens", "tokens", "stream", "keys",
        "chain", "num_committed", "cache", "priority",
    )

    def __init__(self, seq_id: str, session: str, tenant: int, ns: Namespace,
                 stream: xxhash.xxh3_128 | None, cache: bool, priority: int) -> None:
        self.id = seq_id
        self.session = session
        self.tenant = tenant
        self.ns = ns
        self.table = array("i")
        self.num_tokens = 0
        # Without prefix caching nothing reads tokens, keys or chain: such sequences share one
        # empty instance of each (never mutated: every write is guarded by ``cache``), which
        # saves ~170 bytes per sequence.
        #: Token ids (uint32 LE) from the first uncommitted block on.
        self.tokens = bytearray() if cache else _EMPTY_TOKENS
        #: Key stream positioned after the last block whose key is known.
        self.stream = stream
        #: Keys of full blocks from the first uncommitted block on.
        self.keys: list[bytes] = [] if cache else _EMPTY_KEYS
        self.chain: list[int] = [] if cache else _EMPTY_CHAIN
        #: Leading full blocks that are committed (hit, or commit scheduled).
        self.num_committed = 0
        #: Prefix caching on for this sequence (lookups and commits).
        self.cache = cache
        self.priority = priority

    def fork(self, child_id: str) -> Sequence:
        """A child sharing every block (the caller bumps the refcounts)."""
        child = Sequence(child_id, self.session, self.tenant, self.ns,
                         self.stream.copy() if self.stream is not None else None,
                         self.cache, self.priority)
        child.table = self.table[:]
        child.num_tokens = self.num_tokens
        if self.cache:
            child.tokens = self.tokens.copy()
            child.keys = self.keys.copy()
            child.chain = self.chain.copy()
        child.num_committed = self.num_committed
        return child
