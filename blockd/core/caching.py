"""The prefix cache's side of the block lifecycle: commit batches, hits, idling, eviction, flushes.

This room moves blocks between the prefix index and the LRU of cached blocks, and emits the
typed events (``blockd.core.events``) for every change of the index:

* ``commit_batch`` turns a sequence's newly full blocks into a :class:`CommitBatch`; the fence
  ledger applies it (``apply_commit``) once its fence completes, or drops it (``drop_commit``).
* ``touch`` takes a reference on prefix-hit blocks (cached ones leave the LRU).
* ``idle`` makes unreferenced blocks with no pending fence CACHED (indexed) or FREE.
* ``evict`` frees the least recently cached blocks, chain tails first.
* ``flush`` drops every indexed block of some namespaces.

NOTE: duplicates. Two sequences can compute the same prefix block concurrently; the second one
to commit finds the key taken. Its block is not indexed, but later blocks of its prefix must
chain to the indexed twin (``_dup``), or they could never be found by a lookup that walks the
index from the root. A twin is trusted only after its tokens, parent and namespace are verified,
so a colliding key never becomes a parent.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from blockd.core.blocks import CACHED, COMMITTED, FREE, BlockArrays
from blockd.core.errors import Internal
from blockd.core.events import AllBlocksCleared, BlockRemoved, BlockStored, EventSink
from blockd.core.namespace import NamespaceTable, namespace_label
from blockd.core.prefix_index import NO_PARENT, PINNED, STALE, PrefixIndex
from blockd.core.results import Counters
from blockd.core.sequence import Sequence
from blockd.core.tiering import Tiering


@dataclass(slots=True)
class CommitBatch:
    """Full blocks of one sequence to index, in order, once their fence completes."""

    #: The committing sequence's chain list (shared with the sequence while it lives).
    chain: list[int]
    #: Logical index of ``blocks[0]`` in the sequence.
    start: int
    blocks: list[int]
    keys: list[bytes]
    chunks: list[bytes]
    ns_id: int
    #: The serial ``blocks[0]``'s parent (``chain[start - 1]``) had when the batch was made,
    #: or ``PINNED`` when that parent is the sequence's own table entry (held, so it cannot
    #: change while the batch waits). Checked by pending hits (``Session.pending``).
    parent_serial: int = -1



class PrefixCache:
    """The index, the namespaces and the cached LRU, kept consistent. Owned by the manager."""

    def __init__(self, blocks: BlockArrays, index: PrefixIndex, namespaces: NamespaceTable,
                 counters: Counters, events: EventSink | None = None) -> None:
        self.blocks = blocks
        self.index = index
        self.namespaces = namespaces
        self.counters = counters
        #: Where index changes are reported; not part of a snapshot (see ``__getstate__``).
        self.events = events
        #: The lower tiers evicted prefixes spill into (set by the manager; None: none).
        self.tiers: Tiering | None = None
        #: Committed blocks whose content was already indexed in another block: block ->
        #: (that block, its serial). Holds only such duplicates, and only while allocated.
        self.dup: dict[int, tuple[int, int]] = {}

    def __getstate__(self) -> dict[str, object]:
        state = self.__dict__.copy()
        state["events"] = None  # a callback into the runtime; ``snapshot.load`` sets it again
        return state

    def load_into(self, blocks: Seq[int], entries: Seq[tuple[bytes, bytes, int, int]],
                  parent: int) -> None:
        """Index pool ``blocks`` (held by the admitting sequence, COMMITTED) whose bytes were
        just loaded from a lower tier: ``entries`` are their (key, token ids, namespace id,
        serial), the first block chains to pool block ``parent`` (or NO_PARENT)."""
        index = self.index
        state = self.blocks.state
        emit = self.events
        for b, (key, chunk, ns_id, serial) in zip(blocks, entries, strict=True):
            state[b] = COMMITTED
            if not index.insert(b, key, chunk, parent, ns_id, serial):
                raise Internal(f"a loaded block {b} could not be indexed")
            self.namespaces.incref(self.namespaces.get(ns_id))
            if emit is not None:
                emit(self._stored(b))
            parent = b

    # -- commits ------------------------------------------------------------------------------

    def commit_batch(self, seq: Sequence, start: int, blocks: list[int]) -> CommitBatch:
        """The batch that indexes ``blocks`` (the sequence's blocks ``start..``) later.

        Consumes the sequence's tokens and keys of those blocks. The batch holds a namespace
        reference until it is applied or dropped.
        """
        count = len(blocks)
        index = self.index
        if seq.stream is None:
            raise Internal("a commit batch needs the sequence's key stream")
        if len(seq.keys) < count:
            index.extend_keys(seq.stream, seq.tokens, len(seq.keys), count, seq.keys)
        step = index.chunk_bytes
        tokens = seq.tokens
        chunks = [bytes(tokens[i * step:(i + 1) * step]) for i in range(count)]
        parent_serial = PINNED
        if start:
            # A parent other than the table's own block is a verified indexed twin (see the
            # NOTE on duplicates), not held by this sequence: remember its incarnation.
            parent = seq.chain[start - 1]
            if parent != seq.table[start - 1]:
                parent_serial = index.serial[parent] if index.ns[parent] else STALE
        seq.chain.extend(blocks)
        batch = CommitBatch(seq.chain, start, blocks, seq.keys[:count], chunks, seq.ns.id,
                            parent_serial)
        del seq.keys[:count]
        del tokens[:count * step]
        self.namespaces.incref(seq.ns)
        return batch

    def apply_commit(self, batch: CommitBatch) -> None:
        """Index a committed batch whose K/V is now written."""
        index = self.index
        chain = batch.chain
        ns_id = batch.ns_id
        ns = self.namespaces.get(ns_id)
        state = self.blocks.state
        indexed = index.ns
        insert = index.insert
        incref = self.namespaces.incref
        keys = batch.keys
        chunks = batch.chunks
        emit = self.events
        dup = self.dup
        i = batch.start - 1
        for j, b in enumerate(batch.blocks):
            i += 1  # ``batch.start + j``
            parent = chain[i - 1] if i > 0 else NO_PARENT
            if dup and parent in dup:
                # The parent turned out to duplicate an indexed block (possibly found through a
                # fork sibling's chain): chain to that one while it is the same incarnation.
                canon, serial = dup[parent]
                if indexed[canon] and index.serial[canon] == serial:
                    parent = canon
            if state[b] == FREE or indexed[b]:
                continue  # flushed meanwhile, or already indexed through a sibling
            key = keys[j]
            chunk = chunks[j]
            if insert(b, key, chunk, parent, ns_id):
                # Indexed itself now (its twin may have been flushed): no longer a duplicate.
                if dup:
                    dup.pop(b, None)
                incref(ns)
                if emit is not None:
                    emit(self._stored(b))
                continue
            # Not indexed: the parent left the index meanwhile (flushed), so this block's
            # prefix is no longer hittable; or the key is taken: an identical block was
            # indexed first. Chain later blocks to that one, but only after verifying it, so
            # a colliding key can never become our parent.
            other = index.find(key)
            if (other is not None and index.tokens_of(other) == chunk
                    and index.is_child(other, parent) and index.ns[other] == batch.ns_id):
                chain[i] = other
                dup[b] = (other, index.serial[other])
        self.namespaces.decref(ns)

    def drop_commit(self, batch: CommitBatch) -> None:
        """A batch that will never be applied (its K/V may be half written)."""
        self.namespaces.decref(self.namespaces.get(batch.ns_id))

    # -- references and idling ----------------------------------------------------------------

    def touch(self, hits: Seq[int], tenant: int) -> None:
        """``tenant`` takes a reference on each hit block, charged to it (``BlockArrays.hold``);
        cached ones leave the LRU."""
        blocks = self.blocks
        state = blocks.state
        for b in hits:
            if state[b] == CACHED:
                blocks.uncache(b)
            state[b] = COMMITTED
        blocks.hold(hits, tenant)

    def idle(self, idle: Iterable[int]) -> None:
        """Unreferenced blocks with no pending fence: CACHED if indexed, else FREE.

        In order: the LRU and the free stack are separate lists, so caching the indexed ones
        and freeing the others in two batches leaves both exactly as block-by-block would.
        """
        indexed = self.index.ns
        idle = idle if isinstance(idle, list) else list(idle)
        cached = [b for b in idle if indexed[b]]
        if len(cached) < len(idle):
            freed = [b for b in idle if not indexed[b]]
            dup = self.dup
            if dup:
                for b in freed:
                    dup.pop(b, None)
            self.blocks.give_back_many(freed)
        if cached:
            self.blocks.cache_many(cached)

    def evict(self, n: int, tenant: int | None) -> None:
        """Free ``n`` cached blocks, least recently used first (of ``tenant``, or of anyone)."""
        blocks = self.blocks
        victims = blocks.evict_oldest(n, tenant)
        tiers = self.tiers
        if tiers is not None and tiers.enabled:
            for b in victims:
                tiers.spill(b)  # before its key and tokens leave the index
        if self.events is None:
            # ``unindex`` without the key lookup that only its event needs.
            remove = self.index.remove
            get = self.namespaces.get
            decref = self.namespaces.decref
            for b in victims:
                decref(get(remove(b)))
        else:
            for b in victims:
                self.unindex(b)
        blocks.give_back_many(victims)
        self.counters.evictions += len(victims)
        if len(victims) < n:
            raise Internal("eviction found no cached block although the fit check passed")

    def unindex(self, block: int) -> None:
        key = self.index.key_of(block) if self.events is not None else None
        ns = self.namespaces.get(self.index.remove(block))
        if self.events is not None and key is not None:
            self.events(BlockRemoved(block, key, namespace_label(ns), ns.fields.sharing_domain))
        self.namespaces.decref(ns)

    # -- flushes and queries ------------------------------------------------------------------

    def flush(self, namespace_ids: set[int], owner_slot: int | None) -> int:
        """Drop every indexed block of ``namespace_ids`` (allocated by ``owner_slot``, if given),
        in the pool and in every lower tier.

        Cached blocks become FREE; blocks still referenced (or pending) stay with their
        sequences but are never hit again. Returns how many entries left the index.
        """
        owner = self.blocks.owner
        ns_arr = self.index.ns
        victims = [
            b for b in self.index.blocks()
            if ns_arr[b] in namespace_ids and (owner_slot is None or owner[b] == owner_slot)
        ]
        blocks = self.blocks
        for b in victims:
            if blocks.state[b] == CACHED:
                blocks.uncache(b)
                self.unindex(b)
                blocks.give_back(b)
            else:
                self.unindex(b)
        lower = self.tiers.flush(namespace_ids, owner_slot) if self.tiers is not None else 0
        if ((victims or lower) and self.events is not None and len(self.index) == 0
                and (self.tiers is None or len(self.tiers) == 0)):
            self.events(AllBlocksCleared())
        return len(victims) + lower

    def indexed_events(self) -> list[BlockStored]:
        """A ``BlockStored`` for every indexed block, each after its parent, then every lower
        tier's entries."""
        index = self.index
        out: list[BlockStored] = []
        seen: set[int] = set()
        for b in index.blocks():
            chain = []
            while b >= 0 and b not in seen and index.ns[b]:
                chain.append(b)
                seen.add(b)
                b = index.parent[b]
            out.extend(self._stored(c) for c in reversed(chain))
        if self.tiers is not None:
            out.extend(self.tiers.indexed_events())
        return out

    def _stored(self, b: int) -> BlockStored:
        index = self.index
        ns = self.namespaces.get(index.ns[b])
        parent = index.parent[b]
        parent_key = index.key_of(parent) if parent >= 0 else None
        tokens = index.tokens_of(b)
        first = index.parent_serial[b] == 0
        return BlockStored(b, index.key_of(b) or b"", parent_key or b"", tokens or b"",
                           namespace_label(ns), ns.fields.lora_id or "",
                           ns.fields.sharing_domain, root_key=ns.root_key if first else b"")
