"""The partition coordinator in process: every core behaviour inside a dedicated partition,
ids local to it.

The daemon's ``PartitionCoordinator`` routes each session to its partition's own
``BlockManager``; these tests drive it as the runtime does (session ids first) and check exact
block ids, that nothing crosses a partition (allocation, hits, eviction, scrub, preemption),
that a reload changing the partitions is refused with nothing changed, and that a snapshot
restores every partition.
"""

from __future__ import annotations

import pytest

from blockd.core.coordinator import PartitionCoordinator
from blockd.core.errors import InvalidArgument
from blockd.core.namespace import PrefixScope
from blockd.core.results import DoesNotFit
from blockd.core.spec import PoolSpec
from blockd.core.tenants import Isolation, Sharing, TenantPolicy

B = 4
SPEC = PoolSpec(block_size=B, num_blocks=8)
NS = PrefixScope("m", "r")
DED = Isolation.DEDICATED


def _policies() -> list[TenantPolicy]:
    return [TenantPolicy("shared-a", quota_blocks=8, scrub_on_reuse=True),
            TenantPolicy("shared-b", quota_blocks=8, priority=1),
            TenantPolicy("ded", quota_blocks=6, isolation=DED),
            TenantPolicy("g1", quota_blocks=3, isolation=DED, sharing=Sharing.GROUP,
                         group="lab"),
            TenantPolicy("g2", quota_blocks=2, isolation=DED, sharing=Sharing.GROUP,
                         group="lab")]


def _commit(p: PartitionCoordinator, sid: str, tokens: list[int], fence: int) -> str:
    p.begin_step(sid, fence)
    res = p.admit(sid, NS, tokens)
    assert not isinstance(res, DoesNotFit)
    p.commit(sid, res.seq_id, fence)
    p.complete_fence(sid, fence)
    return res.seq_id


def test_layout_sizes_and_local_block_ids() -> None:
    p = PartitionCoordinator(SPEC, _policies())
    assert p.layout == {"shared": 8, "tenant-ded": 6, "group-lab": 5}
    assert p.num_blocks == 19
    a, d, g = (p.open_session(t) for t in ("shared-a", "ded", "g1"))
    for sid in (a, d, g):
        p.begin_step(sid, 1)
        res = p.admit(sid, NS, list(range(8)))
        assert res.block_table == [0, 1]  # each partition's ids start at 0
    assert p.state_counts_of(["tenant-ded"])["free"] == 4
    assert p.state_counts()["free"] == 8 - 2 + 6 - 2 + 5 - 2
    p.check_invariants()


def test_prefixes_never_cross_a_partition_but_a_group_shares_one() -> None:
    p = PartitionCoordinator(SPEC, _policies())
    tokens = list(range(100, 109))
    ded, a = p.open_session("ded"), p.open_session("shared-a")
    seq = _commit(p, ded, tokens, 1)
    p.release(ded, seq, 0)
    assert p.lookup(ded, NS, tokens) == 8
    assert p.lookup(a, NS, tokens) == 0
    g1, g2 = p.open_session("g1"), p.open_session("g2")
    seq = _commit(p, g1, tokens, 1)
    p.release(g1, seq, 0)
    assert p.lookup(g2, NS, tokens) == 8  # one partition per group: its members hit
    p.check_invariants()


def test_a_dedicated_partition_evicts_and_refuses_only_within_itself() -> None:
    p = PartitionCoordinator(SPEC, _policies())
    ded, b = p.open_session("ded"), p.open_session("shared-b")
    p.begin_step(b, 1)
    assert not isinstance(p.admit(b, NS, list(range(32))), DoesNotFit)  # the shared region full
    p.begin_step(ded, 1)
    first = p.admit(ded, NS, list(range(24)))  # the whole partition, despite the full region
    assert not isinstance(first, DoesNotFit) and len(first.block_table) == 6
    before = p.state_counts()
    p.begin_step(ded, 2)
    more = p.admit(ded, NS, [1])  # no room in its partition: higher-priority b is untouched
    assert isinstance(more, DoesNotFit) and more.reason == "pool"
    assert p.state_counts() == before and p.take_preempted(b) == []
    p.check_invariants()


def test_fork_cow_and_scrub_inside_a_dedicated_partition() -> None:
    pol = [TenantPolicy("d1", quota_blocks=4, isolation=DED),
           TenantPolicy("s", quota_blocks=8, scrub_on_reuse=True)]
    p = PartitionCoordinator(SPEC, pol, scrub_always=True)
    d = p.open_session("d1")
    p.begin_step(d, 1)
    seq = p.admit(d, NS, [1, 2, 3, 4, 5, 6]).seq_id
    (child,) = p.fork(d, seq)
    p.begin_step(d, 2)
    res = p.append(d, child, [7], 2)
    assert res.copy is not None and (res.copy.src, res.copy.dst) == (1, 2)
    p.release(d, seq, 2)
    p.release(d, child, 2)
    p.complete_fence(d, 2)
    p.begin_step(d, 3)
    p.admit(d, NS, list(range(50, 66)))  # all 4 blocks: every one used before is zeroed
    assert sorted(p.take_scrubbed()) == [0, 1, 2]  # (block 3 never held anything)
    p.check_invariants()


def test_a_reload_that_changes_the_partitions_is_refused_and_changes_nothing() -> None:
    pol = _policies()
    p = PartitionCoordinator(SPEC, pol)
    before = p.tenant_policies()
    grown = [*pol[:2], TenantPolicy("ded", quota_blocks=7, isolation=DED), *pol[3:]]
    with pytest.raises(InvalidArgument) as e:
        p.set_tenants(grown)
    assert e.value.field == "isolation"
    moved = [TenantPolicy("ded", quota_blocks=6), *pol[:2], *pol[3:]]
    with pytest.raises(InvalidArgument):
        p.set_tenants(moved)
    assert p.tenant_policies() == before
    # A shared tenant may change (and a new shared one appear) without a restart.
    p.set_tenants([TenantPolicy("shared-a", quota_blocks=4), *pol[1:],
                   TenantPolicy("new", quota_blocks=2)])
    assert p.tenant_policy("shared-a").quota_blocks == 4 and p.has_tenant("new")


def test_a_snapshot_restores_every_partition() -> None:
    from blockd.core.ids import SequenceIds
    from blockd.core.snapshot import canonical

    ids = SequenceIds()
    p = PartitionCoordinator(SPEC, _policies(), ids=ids)
    d, a = p.open_session("ded"), p.open_session("shared-a")
    _commit(p, d, list(range(9)), 1)
    _commit(p, a, list(range(20, 29)), 1)
    q = PartitionCoordinator.load(p.dump(), SPEC, ids=SequenceIds())
    assert q.layout == p.layout
    assert canonical(q.managers) == canonical(p.managers)
    assert q.partition_of_session(d) == "tenant-ded" and q.partition_of_tenant("g2") == \
        "group-lab"
    q.check_invariants()


def test_a_removal_is_shown_to_the_audience_that_saw_its_block_stored() -> None:
    """Block ids repeat across partitions: the dedicated tenant's block 0 and a shared
    tenant's block 0 are two blocks. Each removal must carry its own namespace and sharing
    domain, so that only the audience that saw the block stored sees it go (a mirror keyed by
    block id gave the shared removal the dedicated tenant's labels, or the reverse)."""
    from blockd.runtime.events import REMOVED, STORED, EventLog

    log = EventLog()
    p = PartitionCoordinator(SPEC, _policies())
    p.set_event_sink(log.on_core_event)
    a, d = p.open_session("shared-a"), p.open_session("ded")
    _commit(p, d, list(range(5)), 1)  # ded's block 0 is indexed
    _commit(p, a, list(range(100, 105)), 1)  # so is shared-a's block 0
    ded_view = log.audience([p.tenant_policy("ded").sharing_domain])
    shared_view = log.audience([p.tenant_policy("shared-a").sharing_domain])
    assert p.flush(tenant_id="ded") == 1  # ded's block 0 leaves the index
    removed = [ev for ev in log.since(1) if ev.kind == REMOVED]
    assert len(removed) == 1
    assert ded_view.view(removed[0]) is not None  # ded saw it stored, sees it go
    assert shared_view.view(removed[0]) is None  # shared-a never saw ded's block
    stored = {ev.block_hashes: ev for ev in log.since(1) if ev.kind == STORED}
    assert removed[0].tenant == stored[removed[0].block_hashes].tenant
    assert removed[0].namespace == stored[removed[0].block_hashes].namespace
