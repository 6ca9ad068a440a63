"""Per-block state: refcounts, lifecycle state, owner and payer, the free stack and the cached
LRUs.

This room owns bytes of metadata, never policy: admission decides *whether* a tenant may
allocate, the manager *which* sequence holds a block; ``BlockArrays`` makes the chosen
transition in O(1) per block and keeps the arrays consistent.

Memory: every per-block field lives in a flat ``array``/``bytearray`` (no Python object per
block), so these arrays cost ``BYTES_PER_BLOCK`` bytes per block whatever the pool size.

Lifecycle (design.md section 2)::

    FREE ──allocate──▶ WRITING ──commit──▶ COMMITTED ──ref→0 under fence──▶ PENDING
    PENDING ──last covering fence complete──▶ CACHED (indexed) or FREE (not indexed)
    CACHED ──hit──▶ COMMITTED        CACHED ──evict (LRU, chain tails first)──▶ FREE

Invariants (checked by ``blockd.core.invariants.check_invariants``):

* ``state`` is exactly one of the five states; FREE blocks are exactly those on the free stack,
  CACHED blocks exactly those on an LRU list (both lists are threaded through ``next``);
* FREE and CACHED blocks have ``ref == 0`` and ``pend == 0``; PENDING blocks ``ref == 0`` and
  ``pend > 0``; WRITING and COMMITTED blocks ``ref >= 1``;
* ``usage[t]`` counts the blocks tenant ``t`` is charged for (the charging rule below);
  ``cached[t]`` its CACHED ones.

The charging rule (issue 28, finding 6), enforced here and only here (``take``, ``hold``,
``drop_holds``): **a block is charged once to every tenant that holds it, and a block no one
holds (CACHED) to one tenant, its keeper**: the last one that held it. A tenant *holds* a
block while a table of one of its sequences names it or one of its sessions' releases of it
waits for a fence (a kernel of its worker may still read it). ``payer[b]`` is one tenant charged
for block ``b`` (a holder while anyone holds it, the keeper after: a CACHED block is on its
payer's LRU); the other holders and their counts of holds are ``co_holders[b]``.

So a prefix hit costs the hitter quota exactly like a new block would, and the tenant that
computed a block stops paying for it once it no longer holds it: one sharing-group member's
hits, or its releases left waiting on fences its worker never reports, can never pin another
member's quota. Before, a block stayed charged to the tenant that allocated it: a member that
held 40 blocks another member had computed and released made that member's 20-block admit
fail for quota. ``owner[b]`` still names the allocating tenant, whose bytes the block holds
(scrub-on-reuse, flushes by tenant, lower-tier entries). A block held by several tenants is
charged to each, so ``sum(usage)`` exceeds the blocks in use by the co-holders; a charge
only ever moves (a hold ends) to a tenant already charged for the block, so letting go of
blocks never takes a tenant over its quota.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence as Seq

import numpy as np

FREE = 0
WRITING = 1
COMMITTED = 2
PENDING = 3
CACHED = 4
STATE_NAMES = ("free", "writing", "committed", "pending", "cached")

#: Owner value of a block that no tenant has held yet (never scrubbed on first use).
NO_OWNER = 0xFFFF
_NIL = -1

#: ref(4) + pend(4) + state(1) + owner(2) + payer(2) + prev(4) + next(4) + stamp(4)
#: (``co_holders`` holds an entry only per block held by more than one tenant).
BYTES_PER_BLOCK = 25
_STAMP_MASK = 0xFFFFFFFF
#: From this many blocks on, ``take`` writes the per-block fields with numpy, one call per
#: field for the whole run; below it the views and index array cost more than the Python
#: loop they replace (measured in bench/results/core_perf.md).
VECTOR_TAKE = 64


class BlockArrays:
    """Flat per-block arrays plus the free stack and per-tenant LRU lists of CACHED blocks.

    Each field's comment says which room may write it; everything not named there is written
    only by this class's methods.
    """

    def __init__(self, num_blocks: int, num_tenants: int = 1) -> None:
        n = num_blocks
        self.num_blocks = n
        #: Number of block tables naming the block. Written by: fences (drop_refs), this class
        #: (take; hold, for hits and forks, which charges them).
        self.ref = array("i", bytes(4 * n))
        #: Releases of the block whose fence has not completed yet. Written by: fences only.
        self.pend = array("i", bytes(4 * n))
        #: Lifecycle state (FREE .. CACHED). Written by: this class, manager (commit), caching
        #: (hits), fences (PENDING).
        self.state = bytearray(n)
        #: Tenant slot that allocated the block, whose bytes it holds (kept after free, for
        #: scrub-on-reuse, flushes by tenant and lower-tier room). Written by: this class only.
        self.owner = array("H", [NO_OWNER]) * n
        #: Tenant slot charged for the block in ``usage``, whose LRU it is on while CACHED (the
        #: charging rule in the module docstring). Written by: this class only.
        self.payer = array("H", [NO_OWNER]) * n
        #: block -> {tenant slot: holds (references and releases waiting for a fence)} of the
        #: tenants other than ``payer[b]`` that hold it; each is charged for it too. Only
        #: blocks held by several tenants have an entry. Written by: this class only.
        self.co_holders: dict[int, dict[int, int]] = {}
        # Intrusive doubly linked LRU lists (one per tenant) over CACHED blocks. A list moves
        # blocks by rewriting two ints; an OrderedDict would cost ~100 bytes per entry.
        self.prev = array("i", [_NIL]) * n
        #: LRU successor of a CACHED block, or the next block down the free stack of a FREE one
        #: (a block is on one list at a time, so the two lists share the array).
        self.next = array("i", range(1, n + 1))
        self.next[n - 1] = _NIL
        #: Logical time (mod 2^32) the block last became CACHED; orders eviction across
        #: tenants by age ``(clock - stamp) mod 2^32``. A block left cached through 2^32 later
        #: cachings would look young again: an LRU imprecision, never a correctness issue.
        self.stamp = array("I", bytes(4 * n))
        # The free stack hands out block 0 first: small ids first, like a fresh heap.
        self.free_head = 0
        self.num_free = n
        self.usage: list[int] = []
        self.cached: list[int] = []
        self.head: list[int] = []
        self.tail: list[int] = []
        self.num_cached = 0
        self._clock = 0
        self.ensure_tenants(num_tenants)

    def ensure_tenants(self, num_tenants: int) -> None:
        """Grow the per-tenant counters to ``num_tenants`` slots."""
        grow = num_tenants - len(self.usage)
        if grow > 0:
            self.usage += [0] * grow
            self.cached += [0] * grow
            self.head += [_NIL] * grow
            self.tail += [_NIL] * grow

    # -- allocation ---------------------------------------------------------------------------

    def take(self, n: int, tenant: int, scrub_owner: list[bool], scrub_all: bool,
             scrub: list[int]) -> list[int]:
        """Pop ``n`` FREE blocks and make them WRITING, ref 1, owned by ``tenant``.

        The caller has checked that ``n <= num_free``. A block whose previous owner is another
        tenant with ``scrub_owner[prev]`` set (or any previous owner, with ``scrub_all``) is
        appended to ``scrub``: it must be zeroed before the worker sees it. Returns the ids in
        table order.
        """
        if n >= VECTOR_TAKE:
            return self._take_vector(n, tenant, scrub_owner, scrub_all, scrub)
        ids = [0] * n
        ref = self.ref
        state = self.state
        owner = self.owner
        payer = self.payer
        nxt = self.next
        b = self.free_head
        for i in range(n):
            ids[i] = b
            prev = owner[b]
            if prev != NO_OWNER and (scrub_all or (prev != tenant and scrub_owner[prev])):
                scrub.append(b)
            ref[b] = 1
            state[b] = WRITING
            owner[b] = tenant
            payer[b] = tenant
            b = nxt[b]
            nxt[ids[i]] = _NIL
        self.free_head = b
        self.num_free -= n
        self.usage[tenant] += n
        return ids

    def _take_vector(self, n: int, tenant: int, scrub_owner: list[bool], scrub_all: bool,
                     scrub: list[int]) -> list[int]:
        """``take`` for a long run (a long prompt): only the walk down the free stack stays a
        Python loop; the scrub test and the four field writes are one numpy call each over
        views of the arrays (never resized, so a view cannot block a resize)."""
        ids = [0] * n
        nxt = self.next
        b = self.free_head
        for i in range(n):
            ids[i] = b
            b = nxt[b]
        idx = np.array(ids, dtype=np.intp)
        owner = np.frombuffer(self.owner, dtype=np.uint16)
        prev = owner[idx]
        dirty = prev != NO_OWNER
        if not scrub_all:
            # Another tenant's block, and that tenant asked for scrub-on-reuse.
            other = dirty & (prev != tenant)
            dirty = other.copy()
            dirty[other] = np.array(scrub_owner, dtype=bool)[prev[other]]
        if dirty.any():
            scrub.extend(idx[dirty].tolist())  # in table order, as the loop appends them
        np.frombuffer(self.ref, dtype=np.int32)[idx] = 1
        np.frombuffer(self.state, dtype=np.uint8)[idx] = WRITING
        owner[idx] = tenant
        np.frombuffer(self.payer, dtype=np.uint16)[idx] = tenant
        np.frombuffer(nxt, dtype=np.int32)[idx] = _NIL
        self.free_head = b
        self.num_free -= n
        self.usage[tenant] += n
        return ids

    def give_back(self, block: int) -> None:
        """Make an unreferenced, unindexed block with no pending fence FREE."""
        self.give_back_many((block,))

    def give_back_many(self, blocks: Seq[int]) -> None:
        """``give_back`` each block in order (the last one is handed out first)."""
        state = self.state
        usage = self.usage
        payer = self.payer
        nxt = self.next
        head = self.free_head
        for b in blocks:
            state[b] = FREE
            usage[payer[b]] -= 1
            nxt[b] = head
            head = b
        self.free_head = head
        self.num_free += len(blocks)

    def free_list(self) -> list[int]:
        """The free stack, next block handed out first (for tests and invariant checks)."""
        out: list[int] = []
        b = self.free_head
        while b != _NIL and len(out) <= self.num_blocks:
            out.append(b)
            b = self.next[b]
        return out

    # -- holds and charges (the charging rule, module docstring) ----------------------------

    def hold(self, blocks: Seq[int], tenant: int, n: int = 1) -> None:
        """``tenant`` takes ``n`` more references on each of ``blocks`` (a hit or a fork),
        charged to it unless it already is. A block no one holds (CACHED: the caller unlinked
        it from its LRU first) passes from its keeper to ``tenant``. State is the caller's."""
        ref = self.ref
        pend = self.pend
        payer = self.payer
        usage = self.usage
        co = self.co_holders
        for b in blocks:
            p = payer[b]
            if p == tenant:
                pass
            elif ref[b] == 0 and pend[b] == 0:
                usage[p] -= 1
                usage[tenant] += 1
                payer[b] = tenant
            else:
                others = co.get(b)
                if others is None:
                    co[b] = {tenant: n}
                    usage[tenant] += 1
                elif tenant in others:
                    others[tenant] += n
                else:
                    others[tenant] = n
                    usage[tenant] += 1
            ref[b] += n

    def drop_holds(self, blocks: Seq[int], tenant: int) -> None:
        """One hold of ``tenant`` on each of ``blocks`` ends; the caller decrements ``ref`` (a
        release whose fence is complete) or ``pend`` (its fence completes) right after. A
        co-holder's last hold ends its charge; the payer's last one, while others still hold
        the block, hands the charge to the first of them (already charged: nobody's usage
        grows). A block its last holder lets go stays charged to that holder, its keeper."""
        co = self.co_holders
        if not co:
            return
        ref = self.ref
        pend = self.pend
        payer = self.payer
        usage = self.usage
        for b in blocks:
            others = co.get(b)
            if others is None:
                continue
            if payer[b] != tenant:
                left = others[tenant] - 1
                if left:
                    others[tenant] = left
                    continue
                del others[tenant]
                usage[tenant] -= 1
            elif ref[b] + pend[b] - 1 == sum(others.values()):
                heir = next(iter(others))
                del others[heir]
                payer[b] = heir
                usage[tenant] -= 1
            else:
                continue
            if not others:
                del co[b]

    def charged(self, block: int) -> list[int]:
        """The tenants ``block`` is charged to: its payer first, then its co-holders."""
        others = self.co_holders.get(block)
        p = self.payer[block]
        return [p, *others] if others else [p]

    # -- the cached LRU -----------------------------------------------------------------------

    def cache(self, block: int) -> None:
        """Make an unreferenced indexed block CACHED at the most-recently-used end."""
        self.cache_many((block,))

    def cache_many(self, blocks: Seq[int]) -> None:
        """``cache`` each block in order (the last one becomes the most recently used)."""
        state = self.state
        stamp = self.stamp
        payer = self.payer
        prev = self.prev
        nxt = self.next
        head = self.head
        tails = self.tail
        cached = self.cached
        clock = self._clock
        for b in blocks:
            t = payer[b]
            state[b] = CACHED
            clock = (clock + 1) & _STAMP_MASK
            stamp[b] = clock
            tail = tails[t]
            prev[b] = tail
            nxt[b] = _NIL
            if tail == _NIL:
                head[t] = b
            else:
                nxt[tail] = b
            tails[t] = b
            cached[t] += 1
        self._clock = clock
        self.num_cached += len(blocks)

    def uncache(self, block: int) -> None:
        """Unlink a CACHED block from its LRU (a hit or an eviction). State is the caller's."""
        t = self.payer[block]
        p = self.prev[block]
        nx = self.next[block]
        if p == _NIL:
            self.head[t] = nx
        else:
            self.next[p] = nx
        if nx == _NIL:
            self.tail[t] = p
        else:
            self.prev[nx] = p
        self.prev[block] = _NIL
        self.next[block] = _NIL
        self.cached[t] -= 1
        self.num_cached -= 1

    def oldest_cached(self, tenant: int | None = None) -> int:
        """The least recently cached block of ``tenant`` (or of any tenant); -1 when none."""
        if tenant is not None:
            return self.head[tenant]
        best = _NIL
        best_age = -1
        stamp = self.stamp
        clock = self._clock
        for b in self.head:
            if b != _NIL:
                age = (clock - stamp[b]) & _STAMP_MASK
                if age > best_age:
                    best = b
                    best_age = age
        return best

    def evict_oldest(self, n: int, tenant: int | None = None) -> list[int]:
        """Unlink the ``n`` least recently cached blocks (of ``tenant``, or of any tenant) from
        their LRUs, oldest first, as ``n`` calls of ``oldest_cached`` and ``uncache`` would
        (fewer if fewer are cached). Their state is the caller's: they are about to be FREE.
        """
        if tenant is None:
            lists = [t for t, b in enumerate(self.head) if b != _NIL]
            if len(lists) != 1:
                # Several tenants' lists: the age order interleaves them, block by block.
                out: list[int] = []
                while len(out) < n and (b := self.oldest_cached(None)) != _NIL:
                    self.uncache(b)
                    out.append(b)
                return out
            tenant = lists[0]
        # One list: its ``n`` first blocks, unlinked as one run.
        nxt = self.next
        prev = self.prev
        out = []
        b = self.head[tenant]
        while b != _NIL and len(out) < n:
            out.append(b)
            b = nxt[b]
        for c in out:
            prev[c] = _NIL
            nxt[c] = _NIL
        self.head[tenant] = b
        if b == _NIL:
            self.tail[tenant] = _NIL
        else:
            prev[b] = _NIL
        self.cached[tenant] -= len(out)
        self.num_cached -= len(out)
        return out

    def lru_order(self, tenant: int) -> list[int]:
        """A tenant's CACHED blocks, least recently used first (for tests and Inspect)."""
        out = []
        b = self.head[tenant]
        while b != _NIL:
            out.append(b)
            b = self.next[b]
        return out

    def count_states(self) -> list[int]:
        """Blocks per state, indexed by state value."""
        counts = [0] * len(STATE_NAMES)
        for s in range(len(STATE_NAMES)):
            counts[s] = self.state.count(s)
        return counts
