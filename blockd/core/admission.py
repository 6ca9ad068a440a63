"""Admission: whether new blocks fit for a tenant, and handing them out.

``fits`` and ``allocate`` are a check-then-commit pair (nano-vllm's ``can_allocate`` /
``allocate``): every caller asks ``fits`` first, changes nothing when it says no, and only then
calls ``allocate``, which cannot fail.

Three limits, checked in this order, each a bounded ``DoesNotFit.reason``:

* ``pool``: free plus evictable (cached) blocks, less the cached blocks the request itself hits
  (they leave the LRU);
* ``quota``: the blocks the tenant is charged for (live, pending and cached: the charging rule
  in ``blockd.core.blocks``), plus the hits it is not charged for yet (a hit costs quota like a
  new block), after evicting its own cached ones;
* ``guarantee``: blocks other tenants are guaranteed and do not hold right now stay available
  to them.

Per-tenant limits on what a request makes besides blocks (``limits``, checked before any
block is allocated; ``blockd.core.tenants`` documents the costs): ``max_sequences`` (live
sequences, fork children included) and ``max_metadata_bytes`` (their metadata). Their
``DoesNotFit`` counts sequences or bytes, not blocks (``DoesNotFit.unit``).

Scrubbing: a block last owned by a tenant that asks for scrub-on-reuse (or any block, with
``scrub_always``) is listed when it is handed to someone else; the runtime zeroes those blocks
before the worker learns of them (``take_scrubbed``).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from blockd.core.blocks import CACHED, BlockArrays
from blockd.core.caching import PrefixCache
from blockd.core.errors import ResourceExhausted
from blockd.core.results import Counters, DoesNotFit
from blockd.core.tenants import TenantTable, sequence_bytes


class Admission:
    """The fit check and the allocation of new blocks. Owned by the manager."""

    def __init__(self, blocks: BlockArrays, tenants: TenantTable, cache: PrefixCache,
                 counters: Counters, scrub_always: bool = False) -> None:
        self.blocks = blocks
        self.tenants = tenants
        self.cache = cache
        self.counters = counters
        self.scrub_always = scrub_always
        #: Blocks handed out since the last ``take_scrubbed`` that must be zeroed first.
        self._scrub: list[int] = []
        self._scrub_owner = [p.scrub_on_reuse for p in tenants.policies]

    def tenants_changed(self) -> None:
        """The tenant table was reloaded: refresh what is derived from it."""
        self._scrub_owner = [p.scrub_on_reuse for p in self.tenants.policies]

    def fits(self, tenant: int, need: int, hits: Seq[int], extra: int = 0,
             freed: Seq[int] | None = None) -> DoesNotFit | None:
        """Whether ``need`` new blocks fit for ``tenant`` once ``hits`` are revived.

        ``extra`` and ``freed`` ask a hypothetical question (preemption): ``extra`` more blocks
        reusable, ``freed[slot]`` of them released by tenant ``slot`` (no longer live).
        """
        if need <= 0:
            return None
        blocks = self.blocks
        # Cached blocks about to be hit leave the LRU: they are no longer evictable. They are
        # counted only where a bound that assumes every hit is cached does not settle the
        # answer (a prompt's hits are scanned only when the pool or quota is nearly spent).
        hit_cached = None
        available = blocks.num_free + blocks.num_cached + extra
        if hits and available - len(hits) < need:
            hit_cached = self._cached_hits(hits)
            available -= len(hit_cached)
        if available < need:
            return DoesNotFit("pool", need, available)
        policy = self.tenants.policies[tenant]
        over = blocks.usage[tenant] + need - policy.quota_blocks
        # Blocks of its own that a preemption frees stop counting against the quota once
        # their fences complete (they are then free, or cached and evictable).
        own_evictable = blocks.cached[tenant] + (freed[tenant] if freed else 0)
        # Each hit either costs the tenant quota (it is not charged for it yet: the charging
        # rule, blocks.py) or, if it is its own cached block, stops being evictable: at most
        # one of the two, so the hits are scanned only when that bound does not settle it.
        if over + len(hits) > own_evictable:
            if hits and hit_cached is None:
                hit_cached = self._cached_hits(hits)
                available -= len(hit_cached)
            new, own_cached = self._hit_charges(tenant, hits)
            over += new
            own_evictable -= own_cached
            if over > own_evictable:
                return DoesNotFit("quota", need + new, policy.quota_blocks - blocks.usage[tenant]
                                  + own_evictable)
        reserved = 0
        for slot, p in enumerate(self.tenants.policies):
            if slot != tenant and p.guaranteed_blocks:
                live = blocks.usage[slot] - blocks.cached[slot] - (freed[slot] if freed else 0)
                reserved += max(0, p.guaranteed_blocks - live)
        if reserved and hit_cached is None and hits:
            available -= len(self._cached_hits(hits))
        if reserved and available - reserved < need:
            return DoesNotFit("guarantee", need, max(0, available - reserved))
        return None

    def _hit_charges(self, tenant: int, hits: Seq[int]) -> tuple[int, int]:
        """(hits not yet charged to ``tenant``, its own CACHED hits): what taking ``hits``
        adds to its charge and takes from what it can evict (``BlockArrays.hold``)."""
        blocks = self.blocks
        payer = blocks.payer
        state = blocks.state
        co = blocks.co_holders
        new = own_cached = 0
        for b in hits:
            if payer[b] == tenant:
                own_cached += state[b] == CACHED
            elif not co or tenant not in co.get(b, ()):
                new += 1
        return new, own_cached

    def _cached_hits(self, hits: Seq[int]) -> list[int]:
        state = self.blocks.state
        return [b for b in hits if state[b] == CACHED]

    def limits(self, tenant: int, new_sequences: int, table_blocks: int, block_size: int
               ) -> DoesNotFit | None:
        """Whether ``new_sequences`` more sequences, each with ``table_blocks`` blocks in its
        table (or, with ``new_sequences`` 0, ``table_blocks`` more table entries of one live
        sequence), stay within the tenant's ``max_sequences`` and ``max_metadata_bytes``."""
        t = self.tenants
        policy = t.policies[tenant]
        if new_sequences:
            live = t.sequences[tenant]
            if live + new_sequences > policy.max_sequences:
                return DoesNotFit("max_sequences", new_sequences, policy.max_sequences - live)
        cost = self.sequence_cost(new_sequences, table_blocks, block_size)
        left = policy.sequence_metadata_bytes - t.sequence_bytes[tenant]
        if cost > left:
            return DoesNotFit("max_metadata_bytes", cost, max(0, left))
        return None

    @staticmethod
    def sequence_cost(new_sequences: int, table_blocks: int, block_size: int) -> int:
        """Metadata bytes of ``limits``' question (see there); negative for ended ones."""
        if new_sequences:
            return new_sequences * sequence_bytes(table_blocks, block_size)
        return sequence_bytes(table_blocks, block_size) - sequence_bytes(0, block_size)

    def refusal(self, verdict: DoesNotFit, field: str) -> ResourceExhausted:
        """A limit's ``DoesNotFit`` as the error of an operation that raises (a fork)."""
        self.counters.alloc_failures[verdict.reason] += 1
        return ResourceExhausted(f"tenant limit {verdict.reason} reached: needs "
                                 f"{verdict.needed} {verdict.unit}, {verdict.available} left",
                                 reason=verdict.reason, field=field)

    def charge(self, tenant: int, sequences: int, table_blocks: int, block_size: int) -> None:
        """Count what ``limits`` allowed as made (``sequences`` < 0: ended ones)."""
        self.tenants.sequences[tenant] += sequences
        self.tenants.sequence_bytes[tenant] += self.sequence_cost(sequences, table_blocks,
                                                                  block_size)

    def allocate(self, tenant: int, n: int) -> list[int]:
        """Hand out ``n`` blocks (the caller checked ``fits``), evicting cached ones as needed."""
        if n <= 0:
            return []
        blocks = self.blocks
        over = blocks.usage[tenant] + n - self.tenants.policies[tenant].quota_blocks
        if over > 0:
            self.cache.evict(over, tenant)
        short = n - blocks.num_free
        if short > 0:
            self.cache.evict(short, None)
        scrub = self._scrub
        before = len(scrub)
        ids = blocks.take(n, tenant, self._scrub_owner, self.scrub_always, scrub)
        self.counters.scrubbed_blocks += len(scrub) - before
        self.counters.allocated_blocks += n
        return ids

    def unscrub(self, blocks: Seq[int]) -> None:
        """``blocks`` were just overwritten whole (loaded from a lower tier): no zeroing."""
        if self._scrub:
            drop = set(blocks)
            self._scrub = [b for b in self._scrub if b not in drop]

    def take_scrubbed(self) -> list[int]:
        """Blocks that must be zeroed before the worker uses them (drained by the runtime)."""
        out, self._scrub = self._scrub, []
        return out
