"""Tenant policy: quotas, guaranteed blocks, own-cache eviction before a quota failure, scrub."""

from helpers import SCOPE, snapshot

from blockd.core import BlockManager, DoesNotFit, PoolSpec, TenantPolicy
from blockd.core.tenants import Sharing


def make(tenants: list[TenantPolicy], num_blocks: int = 8, **kw: object) -> BlockManager:
    return BlockManager(PoolSpec(block_size=4, num_blocks=num_blocks), tenants, seed=9, **kw)


def test_quota_failure_changes_nothing_and_the_other_tenant_continues() -> None:
    m = make([TenantPolicy("a", quota_blocks=2), TenantPolicy("b", quota_blocks=8)])
    sa = m.open_session("a")
    sb = m.open_session("b")
    m.admit(sa, SCOPE, [1] * 8)  # a: 2 blocks, at quota
    before = snapshot(m)
    out = m.admit(sa, SCOPE, [2])
    assert out == DoesNotFit("quota", 1, 0)
    assert snapshot(m) == before
    assert not isinstance(m.admit(sb, SCOPE, [3] * 20), DoesNotFit)  # b: 5 blocks
    assert m.blocks.usage == [2, 5]
    m.check_invariants()


def test_own_cached_blocks_are_evicted_before_a_quota_failure() -> None:
    m = make([TenantPolicy("a", quota_blocks=3), TenantPolicy("b", quota_blocks=8)])
    sa = m.open_session("a")
    sb = m.open_session("b")
    # b leaves two cached blocks; a leaves two cached blocks (blocks 2, 3).
    rb = m.admit(sb, SCOPE, [5] * 8 + [0])
    m.commit(sb, rb.seq_id)
    m.release(sb, rb.seq_id)
    ra = m.admit(sa, SCOPE, [6] * 8 + [0])
    assert ra.block_table == [2, 3, 4]  # block 2 was b's partial block: freed, handed out first
    m.commit(sa, ra.seq_id)
    m.release(sa, ra.seq_id)
    assert (m.blocks.cached, m.blocks.usage) == ([2, 2], [2, 2])
    # a needs 3 blocks; its quota is 3 and 2 of its blocks are cached: both of a's cached blocks
    # are evicted (not b's, although the pool has free blocks too) and a still fits.
    out = m.admit(sa, SCOPE, [7] * 12)
    assert not isinstance(out, DoesNotFit)
    assert m.blocks.cached == [0, 2]
    assert m.blocks.usage == [3, 2]
    m.check_invariants()


def test_guaranteed_blocks_stay_available_for_their_tenant() -> None:
    m = make([TenantPolicy("vip", quota_blocks=8, guaranteed_blocks=3),
              TenantPolicy("bulk", quota_blocks=8)])
    sv = m.open_session("vip")
    sb = m.open_session("bulk")
    # bulk may take 5 of 8 blocks; the 6th would eat into vip's guarantee.
    assert not isinstance(m.admit(sb, SCOPE, [1] * 20), DoesNotFit)
    before = snapshot(m)
    assert m.admit(sb, SCOPE, [2]) == DoesNotFit("guarantee", 1, 0)
    assert snapshot(m) == before
    # vip gets its three.
    assert not isinstance(m.admit(sv, SCOPE, [3] * 12), DoesNotFit)
    assert m.blocks.num_free == 0
    m.check_invariants()


def test_scrub_on_reuse_only_across_tenants_with_the_policy() -> None:
    m = make([TenantPolicy("a", quota_blocks=4, scrub_on_reuse=True),
              TenantPolicy("b", quota_blocks=4, scrub_on_reuse=False)], num_blocks=2)
    sa = m.open_session("a")
    sb = m.open_session("b")
    r = m.admit(sa, SCOPE, [1, 2, 3, 4, 5])  # a holds blocks 0 and 1
    assert m.take_scrubbed() == []  # never-used blocks need no scrub
    m.release(sa, r.seq_id, fence=3)
    assert isinstance(m.admit(sb, SCOPE, [9]), DoesNotFit)  # nothing scrubbed before the fence
    assert m.take_scrubbed() == []
    m.complete_fence(sa, 3)
    r = m.admit(sb, SCOPE, [9])
    assert m.take_scrubbed() == r.block_table  # a's block, handed to b: zeroed first
    m.release(sb, r.seq_id)
    r = m.admit(sa, SCOPE, [9])  # b's block back to a: b does not ask for scrubbing
    assert m.take_scrubbed() == []
    assert m.counters.scrubbed_blocks == 1
    m.check_invariants()


def test_scrub_always_zeroes_every_reused_block() -> None:
    m = make([TenantPolicy("a", quota_blocks=4, scrub_on_reuse=False)], num_blocks=2,
             scrub_always=True)
    s = m.open_session("a")
    r = m.admit(s, SCOPE, [1])
    m.release(s, r.seq_id)
    r2 = m.admit(s, SCOPE, [2])
    assert m.take_scrubbed() == r2.block_table == r.block_table


def test_private_prefixes_never_hit_across_tenants_but_groups_share() -> None:
    m = make([TenantPolicy("a", quota_blocks=8), TenantPolicy("b", quota_blocks=8),
              TenantPolicy("c", quota_blocks=8, sharing=Sharing.GROUP, group="g"),
              TenantPolicy("d", quota_blocks=8, sharing=Sharing.GROUP, group="g")],
             num_blocks=16)
    ss = {t: m.open_session(t) for t in "abcd"}
    prompt = [4, 4, 4, 4, 5]
    for t in "ac":
        r = m.admit(ss[t], SCOPE, prompt)
        m.commit(ss[t], r.seq_id)
    assert m.lookup(ss["b"], SCOPE, prompt) == 0
    assert m.admit(ss["b"], SCOPE, prompt).num_cached_tokens == 0
    hit = m.admit(ss["d"], SCOPE, prompt)
    assert hit.num_cached_tokens == 4
    m.check_invariants()


def test_reload_keeps_slots_and_refuses_removed_tenants() -> None:
    m = make([TenantPolicy("a", quota_blocks=4), TenantPolicy("b", quota_blocks=4)])
    s = m.open_session("a")
    m.admit(s, SCOPE, [1, 2, 3])
    m.set_tenants([TenantPolicy("b", quota_blocks=6), TenantPolicy("c", quota_blocks=2)])
    assert m.tenants.slot("b") == 1 and m.tenants.slot("c") == 2
    assert "a" not in m.tenants
    assert m.blocks.usage[0] == 1  # a's live block keeps its owner
    m.check_invariants()
