"""Tiers in the core: exact scenarios with a simulated pool and lower store (``tier_sim``).

Pool of a few 4-token blocks; each ``run`` is one request as a worker drives it: admit, write
K/V bytes for the blocks it computes, commit under a fence, complete it, release. A request of
5 tokens has one full block (cached after it ends) and a partial one. The invariants are
checked after every request (``check_invariants`` covers the lower tiers too).
"""

from __future__ import annotations

import pytest
from helpers import SCOPE, manager, state_of
from tier_sim import SimIO

from blockd.core import BlockManager, PoolSpec, PrefixScope, TenantPolicy
from blockd.core import snapshot as snap
from blockd.core.coordinator import PartitionCoordinator
from blockd.core.events import BlockRemoved, BlockStored
from blockd.core.results import DoesNotFit
from blockd.core.tenants import Isolation
from blockd.core.tier_io import RecordingIO, ReplayIO
from blockd.core.tiering import TierLimits

B = 4
SLOT = PoolSpec(block_size=B, num_blocks=1).slot_bytes


def toks(base: int, n: int) -> list[int]:
    return list(range(base, base + n))


def data_of(tokens: list[int], i: int) -> bytes:
    """What a worker writes into the block holding tokens ``i*B..``: derived from them."""
    return bytes(t % 251 for t in tokens[i * B:(i + 1) * B]) * 8


class Driver:
    def __init__(self, m: BlockManager | PartitionCoordinator, io: SimIO) -> None:
        self.m = m
        self.io = io
        self.fence: dict[str, int] = {}

    def run(self, sid: str, tokens: list[int], scope: PrefixScope = SCOPE,
            release: bool = True) -> tuple[int, list[int], str]:
        """One request; returns (cached tokens, its block table, sequence id)."""
        m = self.m
        f = self.fence[sid] = self.fence.get(sid, 0) + 1
        m.begin_step(sid, f)
        res = m.admit(sid, scope, tokens)
        assert not isinstance(res, DoesNotFit), res
        for i in range(res.num_cached_tokens // B, len(tokens) // B):
            self.io.write(res.block_table[i], data_of(tokens, i))
        m.commit(sid, res.seq_id, f)
        m.complete_fence(sid, f)
        if release:
            m.release(sid, res.seq_id)
        m.check_invariants()
        return res.num_cached_tokens, res.block_table, res.seq_id


def tiered(num_blocks: int = 2, host: int = 4, disk: int = 0,
           tenants: list[TenantPolicy] | None = None, **limits: int
           ) -> tuple[BlockManager, SimIO, Driver]:
    m = manager(block_size=B, num_blocks=num_blocks, tenants=tenants,
                tiers=TierLimits(host_slots=host, disk_slots=disk, **limits))
    io = SimIO()
    m.set_tier_io(io)
    return m, io, Driver(m, io)


def test_an_evicted_prefix_spills_to_host_and_a_hit_loads_it_back_with_its_bytes() -> None:
    m, io, d = tiered(num_blocks=4, host=8)
    s = m.open_session("acme")
    a = toks(0, 9)  # blocks 0 and 1 full, block 2 partial
    assert d.run(s, a)[:2] == (0, [0, 1, 2])
    assert m.state_counts()["cached"] == 2
    # 13 tokens need 4 blocks: the free one and the two cached, least recent first (A's tail
    # block 1, then its first block 0), each copied into the next free host slot first.
    d.run(s, toks(100, 13))
    assert [c for c in io.calls if c[0] == "spill"] == [("spill", "1", "host", "0"),
                                                         ("spill", "0", "host", "1")]
    assert m.num_lower == 2 and len(m.index) == 3  # B's three full blocks are in the pool
    # A again: nothing of it is in the pool; its two blocks load from the host tier into
    # fresh pool blocks before the admit returns, with the bytes A's worker wrote.
    other = m.open_session("acme")
    assert m.lookup(other, SCOPE, a) == 8
    cached, table, _ = d.run(s, a, release=False)
    assert cached == 8
    assert io.pool[table[0]] == data_of(a, 0) and io.pool[table[1]] == data_of(a, 1)
    assert [c[:3] for c in io.calls if c[0] == "load"] == [("load", "host", "1"),
                                                           ("load", "host", "0")]
    assert m.counters.tier_hit_tokens["host"] == 8 and m.counters.tier_loaded_blocks["host"] == 2
    # The loaded blocks are in the pool's index now and their host copies stay (B's two
    # blocks this admit evicted spilled beside them).
    assert m.block_state(table[0]) == "committed" and m.num_lower == 4
    m.check_invariants()


def test_a_prefix_with_a_lower_copy_is_not_copied_again() -> None:
    m, io, d = tiered(num_blocks=2, host=4)
    s = m.open_session("acme")
    p = toks(0, 5)
    d.run(s, p)
    d.run(s, toks(50, 5))  # evicts p: one spill
    assert d.run(s, p)[0] == 4  # loaded back; evicts the other prefix: a second spill
    spills = [c for c in io.calls if c[0] == "spill"]
    assert len(spills) == 2
    d.run(s, toks(90, 5))  # evicts p again: it has its host copy, nothing is copied
    assert [c for c in io.calls if c[0] == "spill"] == spills
    assert m.num_lower == 2


def test_another_tenants_private_prefix_on_a_lower_tier_is_never_hit() -> None:
    tenants = [TenantPolicy("acme", quota_blocks=2), TenantPolicy("beta", quota_blocks=2)]
    m, io, d = tiered(num_blocks=2, host=4, tenants=tenants)
    a, b = m.open_session("acme"), m.open_session("beta")
    p = toks(0, 5)
    d.run(a, p)
    d.run(a, toks(50, 5))  # p spills
    assert m.num_lower == 1
    assert m.lookup(b, SCOPE, p) == 0
    assert d.run(b, p)[0] == 0
    assert not [c for c in io.calls if c[0] == "load"]
    assert m.lookup(a, SCOPE, p) == 4  # still there for its own tenant


def test_a_slot_that_fails_its_check_is_a_miss_counted_and_dropped() -> None:
    m, io, d = tiered(num_blocks=3, host=4)
    s = m.open_session("acme")
    p = toks(0, 9)  # two full blocks
    d.run(s, p)
    d.run(s, toks(50, 9))  # both of p's blocks spill: its tail to slot 0, its head to slot 1
    io.corrupt("host", 0)  # the tail's bytes changed on the tier
    cached, table, _ = d.run(s, p, release=False)
    assert cached == 4  # the head loaded; the tail failed its check and is computed
    assert io.pool[table[0]] == data_of(p, 0)
    assert m.counters.tier_load_failures["host"] == 1
    assert m.num_lower == 3  # the bad slot's entry is gone (p's head and the two spilled now)
    assert m.block_state(table[1]) == "committed"  # computed and committed by this request
    m.check_invariants()


def test_loads_past_the_steps_budget_are_computed_and_counted() -> None:
    m, io, d = tiered(num_blocks=3, host=4, max_load_blocks=1)
    s = m.open_session("acme")
    p = toks(0, 9)
    d.run(s, p)
    d.run(s, toks(50, 9))
    assert m.lookup(s, SCOPE, p) == 4  # what one Step could load
    assert d.run(s, p)[0] == 4
    assert m.counters.tier_loads_skipped["budget"] == 1


def test_spills_past_the_steps_budget_are_dropped_and_counted() -> None:
    m, io, d = tiered(num_blocks=3, host=4, max_spill_blocks=1)
    s = m.open_session("acme")
    d.run(s, toks(0, 9))
    d.run(s, toks(50, 9))  # evicts two blocks in one Step: only one is copied
    assert m.num_lower == 1 and m.counters.tier_spill_skipped["budget"] == 1


def test_a_full_host_tier_demotes_its_oldest_entry_to_disk_and_both_tiers_hit() -> None:
    m, io, d = tiered(num_blocks=3, host=1, disk=4)
    s = m.open_session("acme")
    p = toks(0, 9)
    d.run(s, p)
    d.run(s, toks(50, 9))  # p's tail spills to host, then its head: the tail goes to disk
    assert ("move", "host", "0", "disk", "0") in io.calls
    assert [u.used_slots for u in m.tier_usage()] == [1, 1]
    cached, table, _ = d.run(s, p, release=False)
    assert cached == 8 and io.pool[table[1]] == data_of(p, 1)
    assert m.counters.tier_hit_tokens == {"host": 4, "disk": 4}


def test_a_tenant_at_its_host_quota_evicts_its_own_oldest_entry() -> None:
    tenants = [TenantPolicy("acme", quota_blocks=2, host_quota_bytes=SLOT)]
    m, io, d = tiered(num_blocks=2, host=4, tenants=tenants)
    s = m.open_session("acme")
    p1, p2 = toks(0, 5), toks(50, 5)
    d.run(s, p1)
    d.run(s, p2)  # p1 spills
    d.run(s, toks(90, 5))  # p2 spills: acme is at its one slot, p1 makes room
    assert m.num_lower == 1
    assert m.lookup(s, SCOPE, p1) == 0 and m.lookup(s, SCOPE, p2) == 4


def test_a_lower_priority_tenant_cannot_push_out_a_higher_ones_prefixes() -> None:
    tenants = [TenantPolicy("hi", quota_blocks=2, priority=1),
               TenantPolicy("lo", quota_blocks=2, priority=0)]
    m, io, d = tiered(num_blocks=2, host=2, tenants=tenants)
    hi, lo = m.open_session("hi"), m.open_session("lo")
    h1, h2 = toks(0, 5), toks(50, 5)
    d.run(hi, h1)
    d.run(hi, h2)  # h1 spills
    d.run(lo, toks(100, 5))  # h2 spills: the host tier is full (h1, h2)
    d.run(lo, toks(200, 5))  # lo's prefix is evicted: the only entries are hi's
    assert m.counters.tier_spill_skipped["no_room"] == 1
    assert m.lookup(hi, SCOPE, h1) == 4 and m.lookup(hi, SCOPE, h2) == 4
    # ... while hi, at the same or higher priority, takes the oldest entry: its next spill.
    d.run(hi, toks(300, 5))  # evicts lo's prefix: dropped again
    d.run(hi, toks(400, 5))  # evicts hi's toks(300): it takes h1's slot
    assert m.counters.tier_spill_skipped["no_room"] == 2
    assert m.lookup(hi, SCOPE, h1) == 0 and m.lookup(hi, SCOPE, h2) == 4
    assert m.lookup(hi, SCOPE, toks(300, 5)) == 4


def test_a_flush_reaches_every_tier_and_scrubs_the_slots_of_tenants_that_ask() -> None:
    m, io, d = tiered(num_blocks=2, host=1, disk=2)
    s = m.open_session("acme")
    events: list[object] = []
    m.set_event_sink(events.append)
    d.run(s, toks(0, 5))
    d.run(s, toks(50, 5))
    d.run(s, toks(90, 5))  # host holds the second prefix, disk the first
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [e.tier for e in stored] == ["pool", "host", "pool", "disk", "host", "pool"]
    assert m.num_lower == 2
    events.clear()
    assert m.flush(model_revision="r1") == 3  # the pool's one and both lower entries
    assert m.num_lower == 0 and len(m.index) == 0
    assert sorted(io.scrubbed) == [("disk", 0), ("host", 0)]
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert sorted(e.tier for e in removed) == ["disk", "host", "pool"]
    assert type(events[-1]).__name__ == "AllBlocksCleared"
    m.check_invariants()


def test_without_a_mover_evicted_prefixes_are_dropped_as_before() -> None:
    m = manager(block_size=B, num_blocks=2, tiers=TierLimits(host_slots=4))
    d = Driver(m, SimIO())
    s = m.open_session("acme")
    d.run(s, toks(0, 5))
    d.run(s, toks(50, 5))
    assert m.num_lower == 0 and m.lookup(s, SCOPE, toks(0, 5)) == 0


def test_a_snapshot_keeps_the_lower_tiers_and_a_restored_manager_hits_them() -> None:
    m, io, d = tiered(num_blocks=2, host=4)
    s = m.open_session("acme")
    p = toks(0, 5)
    d.run(s, p)
    d.run(s, toks(50, 5))
    again = snap.load(snap.dump(m))
    assert again.num_lower == 1
    assert again.lookup(s, SCOPE, p) == 0  # no mover yet: lower entries are not offered
    again.set_tier_io(io)
    d2 = Driver(again, io)
    d2.fence = dict(d.fence)
    assert d2.run(s, p)[0] == 4


def test_a_replay_with_the_recorded_outcomes_takes_the_same_decisions() -> None:
    """A journal replay moves no byte: ``ReplayIO`` answers each call as ``RecordingIO`` saw
    it answered (here a load that failed its check), so the state comes out the same."""
    m, io, d = tiered(num_blocks=3, host=2, disk=2)
    s = m.open_session("acme")
    before = snap.dump(m)
    rec = RecordingIO(io)
    m.set_tier_io(rec)
    d.run(s, toks(0, 9))
    d.run(s, toks(50, 9))
    io.corrupt("host", 1)
    d.run(s, toks(0, 9))
    failed = rec.take_failures()
    assert len(failed) == 1
    replayed = snap.load(before)
    replayed.set_tier_io(ReplayIO(failed))
    r = Driver(replayed, SimIO())
    r.run(s, toks(0, 9))
    r.run(s, toks(50, 9))
    r.run(s, toks(0, 9))
    assert state_of(replayed) == state_of(m)
    assert snap.canonical(replayed.tiers.lower) == snap.canonical(m.tiers.lower)


def test_a_dedicated_partition_spills_only_into_tiers_of_its_own() -> None:
    tenants = [TenantPolicy("shared-a", quota_blocks=2),
               TenantPolicy("ded", quota_blocks=2, isolation=Isolation.DEDICATED,
                            host_quota_bytes=2 * SLOT)]
    c = PartitionCoordinator(PoolSpec(block_size=B, num_blocks=2), tenants,
                             tiers=TierLimits(host_slots=4))
    assert c.tiers["tenant-ded"].host_slots == 2 and c.tiers["shared"].host_slots == 4
    io_shared, io_ded = SimIO(), SimIO()
    c.set_tier_io("shared", io_shared)
    c.set_tier_io("tenant-ded", io_ded)
    d = Driver(c, io_shared)
    dd = Driver(c, io_ded)
    a, x = c.open_session("shared-a"), c.open_session("ded")
    d.run(a, toks(0, 5))
    d.run(a, toks(50, 5))
    dd.run(x, toks(0, 5))
    dd.run(x, toks(50, 5))
    dd.run(x, toks(90, 5))
    assert len(io_shared.slots["host"]) == 1 and len(io_ded.slots["host"]) == 2
    assert sorted((u.tier, u.num_slots, u.used_slots) for u in c.tier_usage()) == [
        ("host", 2, 2), ("host", 4, 1)]
    assert c.lookup(a, SCOPE, toks(0, 5)) == 4 and c.lookup(x, SCOPE, toks(0, 5)) == 4


def test_a_reload_that_resizes_a_dedicated_partitions_tier_is_refused() -> None:
    tenants = [TenantPolicy("ded", quota_blocks=2, isolation=Isolation.DEDICATED,
                            host_quota_bytes=2 * SLOT)]
    c = PartitionCoordinator(PoolSpec(block_size=B, num_blocks=2), tenants,
                             tiers=TierLimits(host_slots=4))
    bigger = [TenantPolicy("ded", quota_blocks=2, isolation=Isolation.DEDICATED,
                           host_quota_bytes=3 * SLOT)]
    with pytest.raises(Exception, match="lower tiers of partitions") as err:
        c.set_tenants(bigger)
    assert getattr(err.value, "field", "") == "host_quota_bytes"
    assert c.tiers["tenant-ded"].host_slots == 2


def test_all_blocks_cleared_waits_for_every_partitions_tiers() -> None:
    """A flush that empties one partition announces AllBlocksCleared only once no partition
    holds an entry in its pool or a lower tier."""
    tenants = [TenantPolicy("shared-a", quota_blocks=2),
               TenantPolicy("ded", quota_blocks=2, isolation=Isolation.DEDICATED,
                            host_quota_bytes=2 * SLOT)]
    c = PartitionCoordinator(PoolSpec(block_size=B, num_blocks=2), tenants,
                             tiers=TierLimits(host_slots=4))
    io_shared, io_ded = SimIO(), SimIO()
    c.set_tier_io("shared", io_shared)
    c.set_tier_io("tenant-ded", io_ded)
    events: list[object] = []
    c.set_event_sink(events.append)
    a, x = c.open_session("shared-a"), c.open_session("ded")
    ded = Driver(c, io_ded)
    ded.run(x, toks(0, 5))
    ded.run(x, toks(50, 5))  # ded: one prefix in its pool, one on its host tier
    c.begin_step(x, 9)
    held = c.admit(x, SCOPE, toks(90, 8), cache=False)  # the whole pool: the other spills
    assert not isinstance(held, DoesNotFit)
    assert c.num_indexed == 0 and c.num_lower == 2  # ded's prefixes are only on its tier
    Driver(c, io_shared).run(a, toks(0, 5))
    assert c.flush(tenant_id="shared-a") == 1
    assert not [e for e in events if type(e).__name__ == "AllBlocksCleared"]
    assert c.flush(tenant_id="ded") == 2
    assert type(events[-1]).__name__ == "AllBlocksCleared"
