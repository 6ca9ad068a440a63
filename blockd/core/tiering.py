"""Tiers: where a cached prefix goes when the pool evicts it, and how a hit brings it back.

The pool is the top tier. Below it, ``blockd.core.lower_tiers`` holds the host and disk slots.
The moves, each decided here and carried out at once by the injected ``TierIO``
(``blockd.core.tier_io``):

* **spill** (pool -> top lower tier): a pool block the LRU evicts is CACHED (no reference, no
  release waiting for a fence: no kernel reads or writes it any more), so its bytes are final;
  they are copied into a slot before the block is reused. A prefix that already has a lower
  copy (it was loaded back) is not copied again.
* **demote** (host -> disk): the slot a spill needs is taken from the host tier's LRU; its entry
  moves to the disk tier (the write goes to the page cache: the kernel writes it behind) or,
  without a disk tier, is dropped. The disk tier's LRU entries are dropped.
* **load** (lower -> pool): an admit whose prefix continues on a lower tier gets fresh pool blocks
  for those positions; each is filled from its slot, *checked* (the slot's header names the
  entry, a checksum covers the bytes), before the admit returns. A check that fails is a miss
  (the entry is dropped, counted): the worker computes those tokens. A hit is still verified
  against the tokens, the namespace and the parent's serial, whichever tier holds it.

Which slot a spill may take (``_room``): a tenant at its quota of the tier (``host_quota_bytes``,
``disk_quota_bytes``) evicts its own least recently used entry; otherwise a free slot, else the
least recently used entry of a tenant whose priority is not above its own (a lower-priority
tenant cannot push a higher-priority tenant's prefixes out); if there is none, the evicted
prefix is dropped. An entry counts against the tenant that computed its bytes (the pool
block's ``owner``, not the tenant that kept it cached: ``blockd.core.blocks``' charging rule
is about holds, and no one holds a lower entry), which is also whom a flush by tenant and
scrub-on-reuse mean; a prefix has one lower copy at most, so another tenant's hits cannot
multiply it, and a tenant at its quota of the tier is never refused for it (it evicts its
own). Dedicated partitions have their own managers, so their own tiers.

Bounded copies: per Step at most ``TierLimits.max_spill_blocks`` spills and demotions and
``max_load_blocks`` loads; beyond them an evicted prefix is dropped and a lower hit is a miss
(counted), so a Step never holds the daemon's loop for more than a bounded copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from blockd.core.blocks import BlockArrays
from blockd.core.events import BlockRemoved, BlockStored, EventSink
from blockd.core.lower_tiers import DISK, HOST, LowerTiers, TierShape
from blockd.core.namespace import NamespaceTable, namespace_label
from blockd.core.prefix_index import PendingHits, PrefixIndex, next_serial
from blockd.core.results import Counters, TierUsage
from blockd.core.tenants import TenantPolicy, TenantTable
from blockd.core.tier_io import TierIO

__all__ = ["TierLimits", "Tiering"]


@dataclass(frozen=True, slots=True)
class TierLimits:
    """The lower tiers' sizes and the per-Step copy bounds, in blocks."""

    host_slots: int = 0
    disk_slots: int = 0
    #: Spills and demotions one Step may copy.
    max_spill_blocks: int = 1024
    #: Loads one Step may copy.
    max_load_blocks: int = 4096

    @property
    def enabled(self) -> bool:
        return self.host_slots > 0 or self.disk_slots > 0


class Tiering:
    """The lower tiers of one manager. Owned by the manager; ``caching`` calls ``spill``."""

    def __init__(self, limits: TierLimits, index: PrefixIndex, blocks: BlockArrays,
                 namespaces: NamespaceTable, tenants: TenantTable, counters: Counters,
                 block_bytes: int) -> None:
        self.limits = limits
        self.lower = (LowerTiers([TierShape(HOST, limits.host_slots),
                                  TierShape(DISK, limits.disk_slots)], index.block_size,
                                 max(1, len(tenants)))
                      if limits.enabled else None)
        self.index = index
        self.blocks = blocks
        self.namespaces = namespaces
        self.tenants = tenants
        self.counters = counters
        #: Bytes of one slot (a block across every plane and shard): quotas are in bytes.
        self.block_bytes = block_bytes
        #: The bytes' mover; not part of a snapshot (``__getstate__``): injected again.
        self.io: TierIO | None = None
        self.events: EventSink | None = None
        self._spills_left = limits.max_spill_blocks
        self._loads_left = limits.max_load_blocks

    def __getstate__(self) -> dict[str, object]:
        state = {k: getattr(self, k) for k in self.__dict__}
        state["io"] = None
        state["events"] = None
        return state

    @property
    def enabled(self) -> bool:
        """Whether evicted prefixes go down a tier (lower tiers configured, bytes movable)."""
        return self.lower is not None and self.io is not None

    def tenants_changed(self) -> None:
        if self.lower is not None:
            self.lower.ensure_tenants(len(self.tenants))

    def begin_step(self) -> None:
        """A Step's copy budgets start again."""
        self._spills_left = self.limits.max_spill_blocks
        self._loads_left = self.limits.max_load_blocks

    # -- spills -------------------------------------------------------------------------------

    def spill(self, block: int) -> None:
        """The pool evicts indexed ``block`` (CACHED, bytes final): keep its prefix below."""
        lower, io, index = self.lower, self.io, self.index
        if lower is None or io is None:
            return
        key = index.key_of(block)
        if key is None:
            return
        serial = index.serial[block]
        have = lower.find(key)
        if have is not None:
            if lower.serial[have] != serial:
                self.counters.tier_spill_skipped["duplicate"] += 1
            return  # its lower copy is already there (it was loaded back)
        if self._spills_left <= 0:
            self.counters.tier_spill_skipped["budget"] += 1
            return
        owner = self.blocks.owner[block]
        slot = self._room(0, owner)
        if slot is None:
            self.counters.tier_spill_skipped["no_room"] += 1
            return
        self._spills_left -= 1
        name = lower.names[lower.tier_of(slot)]
        if not io.spill(block, name, lower.local(slot), serial, key):
            lower.give_back(slot)
            self.counters.tier_errors[f"{name}_write"] += 1
            return
        parent = index.parent[block]
        parent_key = (index.key_of(parent) or b"") if parent >= 0 else b""
        ns_id = index.ns[block]
        lower.insert(slot, key, index.tokens_of(block) or b"", parent_key, ns_id, serial,
                     index.parent_serial[block])
        self.namespaces.incref(self.namespaces.get(ns_id))
        self.counters.tier_stored_blocks[name] += 1
        self._emit_stored(slot)

    def _room(self, t: int, owner: int) -> int | None:
        """A taken slot of tier ``t`` for an entry of tenant slot ``owner`` (module docstring's
        rule), demoting or dropping an entry to make it; None if the rule gives none."""
        lower = self.lower
        assert lower is not None
        policy = self.tenants.policies[owner]
        quota = self._quota_slots(policy, lower.names[t], lower.num_slots[t])
        if quota <= 0:
            return None
        victim = None
        if lower.used[t][owner] >= quota:
            allowed = [slot == owner for slot in range(len(self.tenants))]
            victim = lower.oldest(t, allowed)
            if victim is None:
                return None
        elif not lower.num_free[t]:
            mine = policy.priority
            allowed = [p.priority <= mine for p in self.tenants.policies]
            victim = lower.oldest(t, allowed)
            if victim is None:
                return None
        if victim is not None:
            self._evict(victim)
        return lower.take(t, owner)

    def _quota_slots(self, policy: TenantPolicy, tier: str, capacity: int) -> int:
        quota = policy.host_quota_bytes if tier == HOST else policy.disk_quota_bytes
        return capacity if quota is None else quota // self.block_bytes

    def _evict(self, slot: int) -> None:
        """Make ``slot`` free: its entry goes one tier down if there is one (and budget), else
        it is dropped."""
        lower, io = self.lower, self.io
        assert lower is not None and io is not None
        t = lower.tier_of(slot)
        name = lower.names[t]
        self.counters.tier_evictions[name] += 1
        if t + 1 < len(lower.names) and self._spills_left > 0:
            owner = lower.owner[slot]
            lower.pinned[slot] = 1  # not its own victim
            try:
                dst = self._room(t + 1, owner)
            finally:
                lower.pinned[slot] = 0
            if dst is not None:
                self._spills_left -= 1
                down = lower.names[t + 1]
                key = lower.key_of(slot)
                if io.move(name, lower.local(slot), down, lower.local(dst), lower.serial[slot],
                           key):
                    tokens, parent_key = lower.tokens_of(slot), lower.parent_key_of(slot)
                    ns_id, serial = lower.ns[slot], lower.serial[slot]
                    parent_serial = lower.parent_serial[slot]
                    # The demoted entry's reference, taken before the old one goes (that may
                    # be the namespace's last: its id would be recycled).
                    self.namespaces.incref(self.namespaces.get(ns_id))
                    self._drop(slot, scrub=False)
                    lower.insert(dst, key, tokens, parent_key, ns_id, serial, parent_serial)
                    self.counters.tier_stored_blocks[down] += 1
                    self._emit_stored(dst)
                    return
                lower.give_back(dst)
                self.counters.tier_errors[f"{down}_write"] += 1
        self._drop(slot, scrub=False)  # the slot is reused at once: nothing to scrub

    def _drop(self, slot: int, *, scrub: bool) -> None:
        """Remove a lower entry (its slot becomes free), telling the event sink."""
        lower = self.lower
        assert lower is not None
        name = lower.names[lower.tier_of(slot)]
        key = lower.key_of(slot)
        owner = lower.owner[slot]
        ns = self.namespaces.get(lower.remove(slot))
        if self.events is not None:
            self.events(BlockRemoved(slot, key, namespace_label(ns), ns.fields.sharing_domain,
                                     name))
        self.namespaces.decref(ns)
        if scrub and self.io is not None and self.tenants.policies[owner].scrub_on_reuse:
            self.io.scrub(name, lower.local(slot))

    # -- hits ---------------------------------------------------------------------------------

    def match_prefix(self, ns_id: int, root_key: bytes, token_bytes: bytes, max_blocks: int,
                     pending: PendingHits | None, *, in_step: bool
                     ) -> tuple[list[int], list[int]]:
        """The prompt's longest verified cached prefix (at most ``max_blocks`` blocks): the
        pool blocks holding its start (with the session's ``pending`` commits:
        ``PrefixIndex.match``), then the lower slots holding what follows. ``in_step``: an
        admit, bound by what is left of the Step's load budget (and counting what it cuts);
        otherwise a Lookup, told what one Step could load."""
        hits = self.index.match(ns_id, root_key, token_bytes, max_blocks, pending)
        if len(hits) >= max_blocks or not self.enabled:
            return hits, []
        last = self.index.serial[hits[-1]] if hits else 0
        loads = self._loads_left if in_step else self.limits.max_load_blocks
        return hits, self._match_lower(ns_id, root_key, token_bytes, len(hits), max_blocks,
                                       last, max(0, loads), count_cut=in_step)

    def _match_lower(self, ns_id: int, root_key: bytes, token_bytes: bytes, start: int,
                     max_blocks: int, prev_serial: int, loads: int, count_cut: bool
                     ) -> list[int]:
        """Lower slots holding blocks ``start..`` of the prompt's verified prefix (at most
        ``max_blocks - start`` and ``loads`` of them), after ``start`` blocks found in the
        pool, the last of which has serial ``prev_serial`` (0: a session's pending commit,
        which has none yet, so nothing below can be its child)."""
        lower = self.lower
        if (lower is None or not len(lower) or start >= max_blocks
                or (start and not prev_serial)):
            return []
        index = self.index
        prev = prev_serial
        stop = min(max_blocks, start + loads)
        step = index.chunk_bytes
        h = index.new_stream(root_key)
        if start:
            h.update(memoryview(token_bytes)[:start * step])
        out: list[int] = []
        find = lower.find
        in_pool = index.find
        for pos in range(start, stop):
            chunk = token_bytes[pos * step:(pos + 1) * step]
            h.update(chunk)
            key = h.digest()
            s = find(key)
            if (s is None or lower.ns[s] != ns_id or lower.parent_serial[s] != prev
                    or lower.tokens_of(s) != chunk):
                break
            if in_pool(key) is not None:
                # The pool indexes this key under a block whose chain is broken (its parent
                # left): a loaded copy could not be indexed beside it. Computed instead.
                break
            out.append(s)
            prev = lower.serial[s]
        else:
            if count_cut and stop < max_blocks:  # cut short by the budget: was there more?
                h.update(token_bytes[stop * step:(stop + 1) * step])
                if find(h.digest()) is not None:
                    self.counters.tier_loads_skipped["budget"] += 1
        return out

    def load(self, slots: Sequence[int], blocks: Sequence[int]) -> int:
        """Fill pool ``blocks`` from lower ``slots`` (pinned by the caller), in order, stopping
        at the first that fails its check (that entry is dropped); returns how many loaded."""
        lower, io = self.lower, self.io
        assert lower is not None and io is not None
        done = 0
        for s, b in zip(slots, blocks, strict=True):
            name = lower.names[lower.tier_of(s)]
            if not io.load(name, lower.local(s), b, lower.serial[s], lower.key_of(s)):
                self.counters.tier_load_failures[name] += 1
                lower.pinned[s] = 0
                self._drop(s, scrub=True)
                break
            lower.touch(s)
            self.counters.tier_loaded_blocks[name] += 1
            done += 1
        self._loads_left -= done
        return done

    def adopt(self, ns_id: int, root_key: bytes, token_bytes: bytes, owner: int, start: int,
              count: int) -> int:
        """Blocks ``start..start+count-1`` of a prompt, fetched from outside the node (the
        remote tier) and checked there, become entries of the first lower tier owned by
        tenant slot ``owner``, continuing the prompt's verified prefix: each with a fresh
        serial, chained to the one before. Only if that prefix (pool, then lower tiers) still
        reaches ``start``, and only past what it already holds; stops at a key the index
        already has (a broken chain's entry), a tier with no room by the slot rule, or a write
        that fails. ``source`` ``i`` of the ``TierIO`` is block ``start + i``'s bytes.
        Returns how many joined."""
        lower, io, index = self.lower, self.io, self.index
        if lower is None or io is None or count <= 0:
            return 0
        self.begin_step()  # its own bounded budget of demotions (``_room``)
        stop = start + count
        hits = index.match(ns_id, root_key, token_bytes, stop, None)
        prev = index.serial[hits[-1]] if hits else 0
        lows = self._match_lower(ns_id, root_key, token_bytes, len(hits), stop, prev, stop,
                                 count_cut=False)
        pos = len(hits) + len(lows)
        if lows:
            prev = lower.serial[lows[-1]]
        if pos < start:  # an earlier block left meanwhile: nothing to chain to
            self.counters.tier_adopt_skipped["gap"] += 1
            return 0
        step = index.chunk_bytes
        h = index.new_stream(root_key)
        h.update(memoryview(token_bytes)[:pos * step])
        parent_key = h.digest() if pos else b""
        ns = self.namespaces.get(ns_id)
        done: list[int] = []
        self.pin(lows, True)
        try:
            for p in range(pos, stop):
                chunk = token_bytes[p * step:(p + 1) * step]
                h.update(chunk)
                key = h.digest()
                if index.find(key) is not None or lower.find(key) is not None:
                    self.counters.tier_adopt_skipped["key_taken"] += 1
                    break
                slot = self._room(0, owner)
                if slot is None:
                    self.counters.tier_adopt_skipped["no_room"] += 1
                    break
                name = lower.names[lower.tier_of(slot)]
                serial = index.next_serial
                if not io.store(name, lower.local(slot), p - start, serial, key):
                    lower.give_back(slot)
                    self.counters.tier_errors[f"{name}_write"] += 1
                    break
                index.next_serial = next_serial(serial)
                lower.insert(slot, key, chunk, parent_key, ns_id, serial, prev)
                lower.pinned[slot] = 1  # a later block's room must not evict its parent
                done.append(slot)
                self.namespaces.incref(ns)
                self.counters.tier_stored_blocks[name] += 1
                self.counters.tier_adopted_blocks[name] += 1
                self._emit_stored(slot)
                parent_key, prev = key, serial
        finally:
            self.pin(lows, False)
            self.pin(done, False)
        return len(done)

    def pin(self, slots: Sequence[int], on: bool) -> None:
        lower = self.lower
        if lower is not None:
            for s in slots:
                lower.pinned[s] = on

    def tier_names(self, slots: Sequence[int]) -> list[str]:
        lower = self.lower
        assert lower is not None
        return [lower.names[lower.tier_of(s)] for s in slots]

    def entry(self, slot: int) -> tuple[bytes, bytes, int, int]:
        """(key, token ids, namespace id, serial) of a lower slot's entry."""
        lower = self.lower
        assert lower is not None
        return lower.key_of(slot), lower.tokens_of(slot), lower.ns[slot], lower.serial[slot]

    # -- flushes and queries ------------------------------------------------------------------

    def flush(self, namespace_ids: set[int], owner_slot: int | None) -> int:
        """Drop every lower entry of ``namespace_ids`` (owned by ``owner_slot``, if given);
        their slots are scrubbed for tenants that ask for it. Returns how many."""
        lower = self.lower
        if lower is None:
            return 0
        victims = [s for s in lower.occupied() if lower.ns[s] in namespace_ids
                   and (owner_slot is None or lower.owner[s] == owner_slot)]
        for s in victims:
            self._drop(s, scrub=True)
        return len(victims)

    def __len__(self) -> int:
        return len(self.lower) if self.lower is not None else 0

    def indexed_events(self) -> list[BlockStored]:
        """A ``BlockStored`` of every lower entry, tier by tier (a subscriber's resync)."""
        lower = self.lower
        if lower is None:
            return []
        return [self._stored(s) for s in lower.occupied()]

    def usage(self) -> list[TierUsage]:
        """Every lower tier's slots, used and by whom (tenant ids)."""
        lower = self.lower
        if lower is None:
            return []
        out = []
        for t, name in enumerate(lower.names):
            by_tenant = {self.tenants.policies[slot].tenant_id: n
                         for slot, n in enumerate(lower.used[t]) if n}
            out.append(TierUsage(name, lower.num_slots[t], lower.num_slots[t]
                                 - lower.num_free[t], self.block_bytes, by_tenant))
        return out

    def check(self) -> None:
        if self.lower is not None:
            self.lower.check()

    def _emit_stored(self, slot: int) -> None:
        if self.events is not None:
            self.events(self._stored(slot))

    def _stored(self, slot: int) -> BlockStored:
        lower = self.lower
        assert lower is not None
        ns = self.namespaces.get(lower.ns[slot])
        parent_key = lower.parent_key_of(slot) if lower.parent_serial[slot] else b""
        return BlockStored(slot, lower.key_of(slot), parent_key, lower.tokens_of(slot),
                           namespace_label(ns), ns.fields.lora_id or "",
                           ns.fields.sharing_domain, lower.names[lower.tier_of(slot)],
                           ns.root_key if not lower.parent_serial[slot] else b"")
