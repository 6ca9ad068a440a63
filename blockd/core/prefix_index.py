"""The prefix index: which full, committed blocks hold which token prefix.

Keys (design.md section 3). A namespace's 16-byte root key starts a keyed XXH3-128 stream; the
key of full block ``i`` is the digest of that stream after feeding the token ids of blocks
``0..i``::

    key_i = XXH3_128(seed, root || tokens[0 : (i + 1) * block_size])

This is the chained key of the design (each key commits to the namespace and every earlier token)
computed with one streaming state instead of re-hashing ``key_{i-1} || tokens_i``: the state is
carried per sequence, so each block costs one ``update`` plus one ``digest`` and no byte
concatenation (see docs/decisions.md).

Verification. A key only *finds* a candidate. A hit is accepted only if the candidate's stored
token ids equal the request's, its parent block is the block matched just before it (or, for the
first block, it has no parent), and its namespace id equals the request's. A forced collision of
the hash therefore yields a miss, never another prefix's K/V.

Only COMMITTED/PENDING/CACHED blocks whose commit fence has passed are in the index; the
BlockManager inserts them when that fence completes.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from operator import eq

import xxhash

NO_PARENT = -1

#: key(8, a pointer shared with the dict key) + tokens(8) + parent(4) + namespace(4).
BYTES_PER_BLOCK = 24

HashFactory = Callable[[int], "xxhash.xxh3_128"]


class PrefixIndex:
    """Key -> block map plus, per block, what a hit must match to be accepted."""

    def __init__(self, num_blocks: int, block_size: int, seed: int,
                 hasher_factory: HashFactory | None = None) -> None:
        self.block_size = block_size
        #: Bytes of one block's token ids (uint32 little-endian).
        self.chunk_bytes = 4 * block_size
        self._seed = seed
        # Tests inject a weak hash here to force collisions; production uses keyed XXH3-128.
        self._new_hasher: HashFactory = hasher_factory or (lambda s: xxhash.xxh3_128(seed=s))
        self.map: dict[bytes, int] = {}
        #: The key a block is indexed under (None: not indexed).
        self.key: list[bytes | None] = [None] * num_blocks
        #: The block's token ids as uint32 LE bytes (None: not indexed).
        self.tokens: list[bytes | None] = [None] * num_blocks
        #: Block matched just before this one in its prefix, NO_PARENT for a first block.
        self.parent = array("i", [NO_PARENT]) * num_blocks
        #: Interned namespace id (0: not indexed).
        self.ns = array("I", bytes(4 * num_blocks))

    # -- keys ---------------------------------------------------------------------------------

    def new_stream(self, root_key: bytes) -> xxhash.xxh3_128:
        """A hash stream positioned at the start of a namespace."""
        h = self._new_hasher(self._seed)
        h.update(root_key)
        return h

    def extend_keys(self, stream: xxhash.xxh3_128, token_bytes: bytes | memoryview,
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

    def match(self, ns_id: int, keys: list[bytes], token_bytes: bytes) -> list[int]:
        """Blocks holding the longest verified prefix whose keys are ``keys``.

        Runs as a few C-level passes (map/compare) rather than a Python loop per block.
        """
        found = list(map(self.map.get, keys))
        try:
            found = found[: found.index(None)]
        except ValueError:
            pass
        if not found:
            return found
        n = len(found)
        step = self.chunk_bytes
        chunks = [token_bytes[o:o + step] for o in range(0, n * step, step)]
        ok = list(map(eq, map(self.tokens.__getitem__, found), chunks))
        parents = list(map(self.parent.__getitem__, found))
        namespaces = list(map(self.ns.__getitem__, found))
        expect_parent = [NO_PARENT]
        expect_parent += found[:-1]
        if False in ok or parents != expect_parent or namespaces.count(ns_id) != n:
            n = 0
            for i in range(len(found)):
                if not ok[i] or parents[i] != expect_parent[i] or namespaces[i] != ns_id:
                    break
                n += 1
            found = found[:n]
        return found

    # -- membership ---------------------------------------------------------------------------

    def insert(self, block: int, key: bytes, chunk: bytes, parent: int, ns_id: int) -> bool:
        """Index ``block`` under ``key``; False (nothing changed) if the key is taken."""
        if key in self.map:
            return False
        self.map[key] = block
        self.key[block] = key
        self.tokens[block] = chunk
        self.parent[block] = parent
        self.ns[block] = ns_id
        return True

    def remove(self, block: int) -> int:
        """Drop ``block`` from the index; returns its namespace id."""
        key = self.key[block]
        assert key is not None
        del self.map[key]
        self.key[block] = None
        self.tokens[block] = None
        self.parent[block] = NO_PARENT
        ns_id = self.ns[block]
        self.ns[block] = 0
        return ns_id

    def is_indexed(self, block: int) -> bool:
        return self.key[block] is not None

    def __len__(self) -> int:
        return len(self.map)
