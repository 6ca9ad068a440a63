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
the block matched just before it (none for the first) *in the same incarnation* it had when the
child was indexed. Each block carries a generation, bumped whenever it is indexed; a child
records its parent's generation. A block id that was evicted and re-indexed with other content
therefore never vouches for the children of its former self, whose K/V were computed after the
old content. A forced collision of the hash yields a miss, never another prefix's K/V.

Only COMMITTED/PENDING/CACHED blocks whose commit fence has passed are in the index; the
caching room inserts them when that fence completes.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from operator import eq

import xxhash

from blockd.core.errors import Internal

NO_PARENT = -1

#: key(8, a pointer shared with the dict's key) + tokens(8) + parent(4) + parent's
#: generation(4) + generation(4) + namespace(4).
BYTES_PER_BLOCK = 32
_GEN_MASK = 0xFFFFFFFF

HashFactory = Callable[[int], "xxhash.xxh3_128"]


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
        self.map: dict[bytes, int] = {}
        #: The key a block is indexed under (None: not indexed).
        self.key: list[bytes | None] = [None] * num_blocks
        #: The block's token ids as uint32 LE bytes (None: not indexed).
        self.tokens: list[bytes | None] = [None] * num_blocks
        #: Block matched just before this one in its prefix, NO_PARENT for a first block.
        self.parent = array("i", [NO_PARENT]) * num_blocks
        #: Bumped whenever the block enters or leaves the index (mod 2^32): its incarnation.
        self.gen = array("I", bytes(4 * num_blocks))
        #: The parent's generation when this block was indexed.
        self.parent_gen = array("I", bytes(4 * num_blocks))
        #: Interned namespace id (0: not indexed).
        self.ns = array("I", bytes(4 * num_blocks))

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

    def match(self, ns_id: int, root_key: bytes, token_bytes: bytes, max_blocks: int
              ) -> list[int]:
        """Blocks holding the longest verified cached prefix (at most ``max_blocks`` blocks).

        Fast path: probe the key of the longest candidate prefix, then binary-search the
        longest prefix whose last key is indexed (each probe is one update and one digest), and
        verify it by walking parent pointers back to the root. The walk checks every block
        (tokens, parent, namespace), so it is as strict as matching block by block. Only when
        that verification fails (an orphaned block whose parent was evicted, or a collision)
        does it fall back to hashing and checking each block in turn.
        """
        if max_blocks <= 0:
            return []
        get = self.map.get
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

        NOTE: only the first block's namespace is compared. A child is indexed only under a
        parent of its own namespace (the block before it in its sequence, or a verified twin),
        and a parent's generation changes whenever it leaves or re-enters the index; so once
        every link's generation matches, every block of the chain has the first one's
        namespace. That saves a pass over the chain on every lookup.
        """
        parent = self.parent
        blocks: list[int] = []
        append = blocks.append
        b = last
        while b >= 0 and len(blocks) < n:
            append(b)
            b = parent[b]
        if b != NO_PARENT or len(blocks) != n:
            return None
        blocks.reverse()
        # Each parent must still be the incarnation its child was computed after (which also
        # means it is still indexed: leaving the index bumps the generation).
        if (n > 1 and list(map(self.parent_gen.__getitem__, blocks[1:]))
                != list(map(self.gen.__getitem__, blocks[:-1]))):
            return None
        if self.ns[blocks[0]] != ns_id:
            return None
        try:
            stored = b"".join(map(self.tokens.__getitem__, blocks))  # type: ignore[arg-type]
        except TypeError:  # not indexed (only possible for the first block)
            return None
        if stored != token_bytes[: n * self.chunk_bytes]:
            return None
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
        for i, key in enumerate(keys):
            b = self.map.get(key)
            if (b is None or not self.is_child(b, expect) or self.ns[b] != ns_id
                    or not eq(self.tokens[b], token_bytes[i * step:(i + 1) * step])):
                break
            out.append(b)
            expect = b
        return out

    # -- membership ---------------------------------------------------------------------------

    def insert(self, block: int, key: bytes, chunk: bytes, parent: int, ns_id: int) -> bool:
        """Index ``block`` under ``key``; False (nothing changed) if the key is taken."""
        if key in self.map:
            return False
        self.map[key] = block
        self.key[block] = key
        self.tokens[block] = chunk
        self.parent[block] = parent
        self.gen[block] = (self.gen[block] + 1) & _GEN_MASK
        self.parent_gen[block] = self.gen[parent] if parent >= 0 else 0
        self.ns[block] = ns_id
        return True

    def remove(self, block: int) -> int:
        """Drop ``block`` from the index; returns its namespace id."""
        key = self.key[block]
        if key is None:
            raise Internal(f"block {block} is not indexed")
        del self.map[key]
        self.key[block] = None
        self.tokens[block] = None
        self.parent[block] = NO_PARENT
        # A new incarnation: children indexed after the old one no longer chain to it.
        self.gen[block] = (self.gen[block] + 1) & _GEN_MASK
        ns_id = self.ns[block]
        self.ns[block] = 0
        return ns_id

    def is_child(self, block: int, parent: int) -> bool:
        """Whether ``block`` was indexed after exactly this incarnation of ``parent``."""
        if self.parent[block] != parent:
            return False
        return parent < 0 or self.parent_gen[block] == self.gen[parent]

    def __len__(self) -> int:
        return len(self.map)
