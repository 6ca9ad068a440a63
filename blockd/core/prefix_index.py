"""The prefix index: which full, committed blocks hold which token prefix.

Keys (design.md section 3). A namespace's 16-byte root key starts a keyed XXH3-128 stream; the
key of full block ``i`` is the digest of that stream after feeding the token ids of blocks
``0..i``::

    key_i = XXH3_128(seed, root || tokens[0 : (i + 1) * block_size])

This is the chained key of the design (each key commits to the namespace and every earlier token)
computed with one streaming state instead of re-hashing ``key_{i-1} || tokens_i``. It makes the
key of *any* block one ``update`` of the prompt's bytes plus one ``digest`` (C speed), instead
of one Python-level step per earlier block; lookups exploit that (see ``match``, and
docs/decisions.md).

Verification. A key only *finds* a candidate. A hit is accepted only if every block of the
matched prefix has the request's token ids, the request's namespace id, and the right parent:
the entry matched just before it (none for the first) *in the same incarnation* it had when the
child was indexed. Each indexed entry has a serial (``next_serial``), kept when its bytes move
between tiers (``blockd.core.lower_tiers``); a child records its parent's serial.
A block id that was evicted and re-indexed with other content has a new serial, so it never
vouches for the children of its former self, whose K/V were computed after the old content; a
prefix spilled to a lower tier keeps its serial, so its children still chain to it there. A
forced collision of the hash yields a miss, never another prefix's K/V.

Only COMMITTED/PENDING/CACHED blocks whose commit fence has passed are in the index; the
caching room inserts them when that fence completes.

Memory (issue 17: at most 150 bytes per indexed block at 1M blocks, verification kept). No
Python object per block: the key -> block map is a ``KeyTable`` (``blockd.core.key_table``), the
token ids a flat arena indexed by block id (``4 * block_size`` bytes per block, grown to the
highest block id indexed so far), the rest flat arrays.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator
from itertools import chain
from operator import eq

import xxhash

from blockd.core.errors import Internal
from blockd.core.key_table import KeyTable

NO_PARENT = -1
#: A pending entry's parent serial when the parent is held by the committing sequence's own
#: table (it cannot change while the entry waits); ``STALE``: a parent that was no longer
#: indexed, so the entry is never hit (``match``, pending hits).
PINNED = -1
STALE = -2

#: Preallocated per block: parent(4) + parent's serial(4) + serial(4) + namespace(4) + linked
#: to the id below (1, ``_linked``) + the key table's slots (4 bytes each, 2 to 4 slots per
#: block: ``key_table.table_size``; 2.1 at 1M blocks).
BYTES_PER_BLOCK = 33
#: Serials are 32-bit and wrap (skipping 0, "not indexed"): a stale child could chain to a
#: wrapped serial only if its parent pointer also named the block now holding it *and* its
#: key collided with the request's, as the per-block generations they replace did.
SERIAL_MASK = 0xFFFFFFFF


def next_serial(serial: int) -> int:
    """The serial after ``serial`` (mod 2^32, never 0)."""
    return (serial & SERIAL_MASK) + 1 if serial < SERIAL_MASK else 1

HashFactory = Callable[[int], "xxhash.xxh3_128"]
#: A session's pending commits by key: (block, parent, parent serial or ``PINNED``,
#: token ids, namespace id); see ``blockd.core.fences.Session.pending``.
PendingHits = dict[bytes, tuple[int, int, int, bytes, int]]


def _xxh3(seed: int) -> xxhash.xxh3_128:
    return xxhash.xxh3_128(seed=seed)


class PrefixIndex:
    """Key -> block map plus, per block, what a hit must match to be accepted."""

    def __init__(self, num_blocks: int, block_size: int, seed: int,
                 hasher_factory: HashFactory | None = None) -> None:
        self.block_size = block_size
        #: Bytes of one block's token ids (uint32 little-endian).
        self.chunk_bytes = 4 * block_size
        self._seed = seed
        # Tests inject a weak hash here to force collisions; production uses keyed XXH3-128.
        self._new_hasher: HashFactory = hasher_factory or _xxh3
        self.num_blocks = num_blocks
        #: Key -> indexed block.
        self.keys = KeyTable(num_blocks)
        #: Token ids (uint32 LE) by block id, valid only while the block is indexed
        #: (``ns[b] != 0``); grown by ``_reserve``.
        self._tokens = bytearray()
        #: Block matched just before this one in its prefix, NO_PARENT for a first block (a
        #: pool block: it may have left the pool since, see ``parent_serial``).
        self.parent = array("i", [NO_PARENT]) * num_blocks
        #: The serial of the entry indexed at the block, 0 while none is: its incarnation.
        self.serial = array("I", bytes(4 * num_blocks))
        #: The parent's serial when this block was indexed (0 for a first block).
        self.parent_serial = array("I", bytes(4 * num_blocks))
        #: The next serial ``insert`` mints (``next_serial``).
        self.next_serial = 1
        #: Interned namespace id (0: not indexed).
        self.ns = array("I", bytes(4 * num_blocks))
        #: 1 where ``parent[b] == b - 1`` (b >= 1): ``_verify_chain`` finds where a run of
        #: consecutive block ids starts with one ``rfind`` (a byte per block).
        self._linked = bytearray(num_blocks)

    def __getstate__(self) -> dict[str, object]:
        state = self.__dict__.copy()
        if state["_new_hasher"] is not _xxh3:
            state["_new_hasher"] = None  # a test's weak hash: ``snapshot.load`` re-injects it
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        if self._new_hasher is None:
            self._new_hasher = _xxh3

    def set_hasher_factory(self, hasher_factory: HashFactory) -> None:
        """Tests only: the weak hash of a restored snapshot (see ``blockd.core.snapshot``)."""
        self._new_hasher = hasher_factory

    # -- keys ---------------------------------------------------------------------------------

    def new_stream(self, root_key: bytes) -> xxhash.xxh3_128:
        """A hash stream positioned at the start of a namespace."""
        h = self._new_hasher(self._seed)
        h.update(root_key)
        return h

    def extend_keys(self, stream: xxhash.xxh3_128, token_bytes: bytes | bytearray | memoryview,
                    start_block: int, end_block: int, out: list[bytes]) -> None:
        """Append the keys of full blocks ``start_block..end_block-1`` to ``out``.

        ``token_bytes`` holds the sequence's token ids from position 0; ``stream`` has consumed
        blocks ``0..start_block-1`` and is advanced past ``end_block - 1``.
        """
        step = self.chunk_bytes
        update = stream.update
        digest = stream.digest
        mv = memoryview(token_bytes)
        append = out.append
        for off in range(start_block * step, end_block * step, step):
            update(mv[off:off + step])
            append(digest())

    # -- matching -----------------------------------------------------------------------------

    def key_at(self, root_key: bytes, token_bytes: bytes, num_blocks: int) -> bytes:
        """The key of block ``num_blocks - 1`` of a prompt: one update, one digest."""
        h = self._new_hasher(self._seed)
        h.update(root_key)
        h.update(memoryview(token_bytes)[: num_blocks * self.chunk_bytes])
        return h.digest()

    def match(self, ns_id: int, root_key: bytes, token_bytes: bytes, max_blocks: int,
              pending: PendingHits | None = None) -> list[int]:
        """Blocks holding the longest verified cached prefix (at most ``max_blocks`` blocks).

        ``pending``: the asking session's own commits whose fence has not completed
        (``blockd.core.fences.Session.pending``); the prefix found in the index is extended
        with them (``_match_pending``). No other session's pending commit is ever seen.

        Fast path: probe the key of the longest candidate prefix, then binary-search the
        longest prefix whose last key is indexed (each probe is one update and one digest), and
        verify it by walking parent pointers back to the root. The walk checks every block
        (tokens, parent, namespace), so it is as strict as matching block by block. Only when
        that verification fails (an orphaned block whose parent was evicted, or a collision)
        does it fall back to hashing and checking each block in turn.
        """
        if max_blocks <= 0:
            return []
        hits = self._match_indexed(ns_id, root_key, token_bytes, max_blocks)
        if pending and len(hits) < max_blocks:
            self._match_pending(pending, ns_id, root_key, token_bytes, max_blocks, hits)
        return hits

    def _match_pending(self, pending: PendingHits, ns_id: int, root_key: bytes,
                       token_bytes: bytes, max_blocks: int, hits: list[int]) -> None:
        """Extend ``hits`` block by block with the session's pending commits.

        The same verification as the index's: the entry's key finds it, then its token ids,
        its namespace and its parent (the block matched just before it, in the incarnation it
        had at commit time, unless the committing sequence holds it) must all match.
        """
        step = self.chunk_bytes
        n = len(hits)
        h = self._new_hasher(self._seed)
        h.update(root_key)
        if n:
            h.update(memoryview(token_bytes)[: n * step])
        prev = hits[-1] if n else NO_PARENT
        get = pending.get
        serial = self.serial
        for off in range(n * step, max_blocks * step, step):
            chunk = token_bytes[off:off + step]
            h.update(chunk)
            entry = get(h.digest())
            if entry is None:
                return
            b, parent, parent_serial, stored, ns = entry
            if parent != prev or ns != ns_id or stored != chunk:
                return
            if parent_serial != PINNED and serial[parent] != parent_serial:
                return
            hits.append(b)
            prev = b

    def _match_indexed(self, ns_id: int, root_key: bytes, token_bytes: bytes, max_blocks: int
                       ) -> list[int]:
        get = self.keys.find
        lo, hi = 0, max_blocks
        found = get(self.key_at(root_key, token_bytes, hi))
        if found is not None:
            lo = hi
        else:
            hi -= 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                b = get(self.key_at(root_key, token_bytes, mid))
                if b is None:
                    hi = mid - 1
                else:
                    lo, found = mid, b
        if found is None:
            return []
        blocks = self._verify_chain(ns_id, found, lo, token_bytes)
        if blocks is not None:
            return blocks
        return self._match_linear(ns_id, root_key, token_bytes, max_blocks)

    def _verify_chain(self, ns_id: int, last: int, n: int, token_bytes: bytes
                      ) -> list[int] | None:
        """The ``n`` blocks ending at ``last``, if they hold exactly this prompt's prefix.

        NOTE: only the first block's namespace is compared. A child is indexed only under an
        indexed parent of its own namespace (the block before it in its sequence, or a
        verified twin), and a block's serial changes whenever it leaves or re-enters the
        index; so once every link's serial matches, every block of the chain has the first
        one's namespace. That saves a pass over the chain on every lookup.

        Cost (issue 17): walked as runs of consecutive ids (what the LIFO free stack mostly
        hands a prompt), each run found by one ``rfind`` in ``_linked`` and checked by one
        serial and one token comparison: a few C calls per run, not per block.
        """
        parent = self.parent
        parent_serial = self.parent_serial
        serial = self.serial
        run_start = self._linked.rfind
        step = self.chunk_bytes
        arena = self._tokens
        runs: list[range] = []  # the chain's runs of consecutive ids, last run first
        hi = last
        pos = n  # blocks of the prefix not yet covered by a run
        while True:
            # The run ``lo..hi`` (at most ``pos`` blocks): from the highest block at or below
            # ``hi`` not linked to the id below it (block 0 never is), else ``pos`` blocks.
            floor = hi - pos + 1
            lo = max(run_start(0, max(floor + 1, 0), hi + 1), floor)
            length = hi - lo + 1
            pos -= length
            # Inside the run, each parent must still be the incarnation its child was computed
            # after (which also means it is still indexed: a block that is not has serial 0,
            # no child's parent serial); the token ids must be the prompt's.
            if (parent_serial[lo + 1:hi + 1] != serial[lo:hi]
                    or arena[lo * step:(hi + 1) * step]
                    != token_bytes[pos * step:(pos + length) * step]):
                return None
            runs.append(range(lo, hi + 1))
            hi = parent[lo]
            if not pos or hi < 0:
                break
            if parent_serial[lo] != serial[hi]:  # the link into this run from the one before
                return None
        if pos or hi != NO_PARENT:
            return None
        runs.reverse()
        blocks = list(chain.from_iterable(runs))
        if self.ns[blocks[0]] != ns_id:
            return None
        # (The first block is indexed: its namespace id, never 0 for an indexed block, matched.)
        return blocks

    def _match_linear(self, ns_id: int, root_key: bytes, token_bytes: bytes, max_blocks: int
                      ) -> list[int]:
        """Block-by-block matching: the slow path, correct however the index looks."""
        keys: list[bytes] = []
        h = self._new_hasher(self._seed)
        h.update(root_key)
        self.extend_keys(h, token_bytes, 0, max_blocks, keys)
        step = self.chunk_bytes
        out: list[int] = []
        expect = NO_PARENT
        find = self.keys.find
        for i, key in enumerate(keys):
            b = find(key)
            if (b is None or not self.is_child(b, expect) or self.ns[b] != ns_id
                    or not eq(self._tokens[b * step:(b + 1) * step],
                              token_bytes[i * step:(i + 1) * step])):
                break
            out.append(b)
            expect = b
        return out

    # -- membership ---------------------------------------------------------------------------

    def find(self, key: bytes) -> int | None:
        """The block indexed under ``key``, or None."""
        return self.keys.find(key)

    def is_indexed(self, block: int) -> bool:
        return self.ns[block] != 0

    def key_of(self, block: int) -> bytes | None:
        """The key ``block`` is indexed under (None: not indexed)."""
        if not self.ns[block]:
            return None
        return self.keys.key_of(block)

    def tokens_of(self, block: int) -> bytes | None:
        """The token ids (uint32 LE) of an indexed block (None: not indexed)."""
        if not self.ns[block]:
            return None
        step = self.chunk_bytes
        return bytes(self._tokens[block * step:(block + 1) * step])

    def blocks(self) -> list[int]:
        """Every indexed block, in block-id order."""
        ns = self.ns
        return [b for b in range(self.num_blocks) if ns[b]]

    def _reserve(self, block: int) -> None:
        """Grow the token arena to hold ``block`` (doubling, capped at the pool: at most
        ``chunk_bytes`` per block ever indexed, never more than the pool's)."""
        have = len(self._tokens) // self.chunk_bytes
        if block < have:
            return
        grow = min(self.num_blocks, max(block + 1, 2 * have, 1024)) - have
        self._tokens.extend(bytes(grow * self.chunk_bytes))

    def insert(self, block: int, key: bytes, chunk: bytes, parent: int, ns_id: int,
               serial: int = 0) -> bool:
        """Index ``block`` under ``key`` as the child of ``parent`` (an indexed block, or
        NO_PARENT); False (nothing changed) if the key is taken or the parent is not indexed
        (the chain is broken: a child must never vouch for a prefix that left the index).

        ``serial``: the entry's serial when it already has one (its bytes come back from a
        lower tier); 0 mints a new one."""
        if parent >= 0 and not self.ns[parent]:
            return False
        if not self.keys.insert(block, key):
            return False
        self._reserve(block)
        step = self.chunk_bytes
        self._tokens[block * step:(block + 1) * step] = chunk
        self.parent[block] = parent
        self._linked[block] = parent >= 0 and parent == block - 1
        if not serial:
            serial = self.next_serial
            self.next_serial = next_serial(serial)
        self.serial[block] = serial
        self.parent_serial[block] = self.serial[parent] if parent >= 0 else 0
        self.ns[block] = ns_id
        return True

    def remove(self, block: int) -> int:
        """Drop ``block`` from the index; returns its namespace id."""
        ns_id = self.ns[block]
        if not ns_id:
            raise Internal(f"block {block} is not indexed")
        if not self.keys.remove(block):
            raise Internal(f"block {block} is missing from the key table")
        self.parent[block] = NO_PARENT
        self._linked[block] = 0
        # A new incarnation: children indexed after this one no longer chain to the block.
        self.serial[block] = 0
        self.parent_serial[block] = 0
        self.ns[block] = 0
        return ns_id

    def is_child(self, block: int, parent: int) -> bool:
        """Whether ``block`` was indexed after exactly this incarnation of ``parent``."""
        if self.parent[block] != parent:
            return False
        return parent < 0 or self.parent_serial[block] == self.serial[parent]

    def __len__(self) -> int:
        return len(self.keys)

    # -- read views (invariant checks, snapshots, tests; not the hot paths) --------------------

    @property
    def key(self) -> _BlockView:
        """``key[b]``: the key block ``b`` is indexed under, or None."""
        return _BlockView(self.key_of, self.num_blocks)

    @property
    def tokens(self) -> _BlockView:
        """``tokens[b]``: the token ids of indexed block ``b``, or None."""
        return _BlockView(self.tokens_of, self.num_blocks)

    @property
    def map(self) -> _KeyMap:
        """The key -> block map as a read-only mapping."""
        return _KeyMap(self)


class _BlockView:
    """A read-only per-block sequence computed by ``get`` (never stored: not in snapshots)."""

    __slots__ = ("_get", "_n")

    def __init__(self, get: Callable[[int], bytes | None], n: int) -> None:
        self._get = get
        self._n = n

    def __getitem__(self, block: int) -> bytes | None:
        return self._get(block)

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[bytes | None]:
        return map(self._get, range(self._n))


class _KeyMap:
    """Key -> block, read-only, over the key table (in block-id order)."""

    __slots__ = ("_index",)

    def __init__(self, index: PrefixIndex) -> None:
        self._index = index

    def get(self, key: bytes, default: int | None = None) -> int | None:
        b = self._index.find(key)
        return default if b is None else b

    def __getitem__(self, key: bytes) -> int:
        b = self._index.find(key)
        if b is None:
            raise KeyError(key)
        return b

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self._index.find(key) is not None

    def __len__(self) -> int:
        return len(self._index)

    def values(self) -> list[int]:
        return self._index.blocks()

    def items(self) -> list[tuple[bytes, int]]:
        index = self._index
        return [(index.key_of(b), b) for b in index.blocks()]  # type: ignore[misc]
