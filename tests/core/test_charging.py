"""The charging rule (issue 28, finding 6; ``blockd.core.blocks``): a block is charged to every
tenant that holds it (a table names it, or a release of it waits for a fence), and a block no
one holds to its keeper, the last holder. A prefix hit costs the hitter quota; the tenant that
computed a block stops paying for it when it lets go; one sharing-group member's holds never
make another member's admit fail for quota.
"""

import itertools
from array import array

from helpers import SCOPE, snapshot, state_of
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from blockd.core import AdmitResult, BlockManager, DoesNotFit, PoolSpec, TenantPolicy
from blockd.core import snapshot as snapshots
from blockd.core.tenants import Sharing

B = 4


def group(quotas: list[int], num_blocks: int = 128) -> BlockManager:
    """Tenants g0, g1, ... of one sharing group, with these quotas."""
    return BlockManager(
        PoolSpec(block_size=B, num_blocks=num_blocks),
        [TenantPolicy(f"g{i}", q, sharing=Sharing.GROUP, group="team")
         for i, q in enumerate(quotas)], seed=7)


def prompt(blocks: int, first: int = 1) -> list[int]:
    """``blocks`` full blocks of distinct tokens."""
    return list(range(first, first + blocks * B))


def admit(m: BlockManager, sid: str, tokens: list[int]) -> AdmitResult:
    res = m.admit(sid, SCOPE, tokens)
    assert isinstance(res, AdmitResult), res
    m.check_invariants()
    return res


def computed(m: BlockManager, sid: str, blocks: int) -> AdmitResult:
    """``sid``'s tenant computes ``blocks`` full blocks, commits them and releases them."""
    res = admit(m, sid, prompt(blocks))
    m.commit(sid, res.seq_id)
    m.release(sid, res.seq_id)
    m.check_invariants()
    return res


def test_a_hit_is_charged_to_the_hitter_and_ends_the_keepers_charge() -> None:
    """The audit's attack: G2 holding 40 blocks G1 computed made G1's 20-block admit fail."""
    m = group([40, 60])
    s1, s2 = m.open_session("g0"), m.open_session("g1")
    mine = computed(m, s1, 40)
    assert (m.blocks.usage, m.blocks.cached) == ([40, 0], [40, 0])  # g0 keeps them, cached
    held = admit(m, s2, prompt(40) + [0])  # g1 hits all 40 and computes one more
    assert held.num_cached_tokens == 40 * B
    assert held.block_table[:40] == mine.block_table[:40]
    assert (m.blocks.usage, m.blocks.cached) == ([0, 41], [0, 0])
    # g0 holds nothing and keeps nothing: its whole quota is its own again.
    res = m.admit(s1, SCOPE, prompt(20, first=1000))
    assert isinstance(res, AdmitResult), res
    assert m.blocks.usage == [20, 41]
    m.check_invariants()


def test_every_holder_is_charged_once_and_the_last_one_keeps_the_block() -> None:
    m = group([10, 10])
    s1, s2 = m.open_session("g0"), m.open_session("g1")
    a = admit(m, s1, prompt(3))
    m.commit(s1, a.seq_id)
    b = admit(m, s2, prompt(2) + [0])  # both hold the first two blocks
    assert b.block_table[:2] == a.block_table[:2]
    assert m.blocks.usage == [3, 3]
    m.release(s1, a.seq_id)  # g0's charge of the shared blocks ends; its own third is cached
    assert (m.blocks.usage, m.blocks.cached) == ([1, 3], [1, 0])
    m.check_invariants()
    m.release(s2, b.seq_id)  # g1 held them last: it keeps them (cached, on its LRU)
    assert (m.blocks.usage, m.blocks.cached) == ([1, 2], [1, 2])
    assert sorted(m.blocks.lru_order(1)) == sorted(a.block_table[:2])
    m.check_invariants()


def test_a_hit_costs_quota_like_a_new_block_and_a_refusal_changes_nothing() -> None:
    m = group([40, 10])
    s1, s2 = m.open_session("g0"), m.open_session("g1")
    computed(m, s1, 30)
    before = snapshot(m)
    # 30 hits + 1 new block: 31 blocks g1 would be charged for, 10 allowed.
    assert m.admit(s2, SCOPE, prompt(30) + [0]) == DoesNotFit("quota", 31, 10)
    assert snapshot(m) == before
    # Its own cached hits cost nothing more: g0 (at 30 of 40) takes them back with 10 new.
    res = m.admit(s1, SCOPE, prompt(30) + list(range(5000, 5000 + 10 * B)))
    assert isinstance(res, AdmitResult) and res.num_cached_tokens == 30 * B
    assert m.blocks.usage == [40, 0]
    m.check_invariants()


def test_a_release_waiting_for_a_fence_stays_charged_to_its_tenant() -> None:
    """A member whose worker never reports the fence of its release cannot leave the block
    on the member that computed it: the charge stays with the one whose fence it waits for."""
    m = group([41, 60])
    s1, s2 = m.open_session("g0"), m.open_session("g1")
    a = admit(m, s1, prompt(40) + [0])
    m.commit(s1, a.seq_id)
    b = admit(m, s2, prompt(40) + [0])
    assert b.num_cached_tokens == 40 * B
    m.release(s2, b.seq_id, 5)  # its worker never reports fence 5
    m.release(s1, a.seq_id)  # g0's partial block is freed, its 40 shared ones pass to g1
    assert m.blocks.usage == [0, 41]
    assert m.state_counts()["pending"] == 41
    m.check_invariants()
    res = m.admit(s1, SCOPE, prompt(39, first=1000))
    assert isinstance(res, AdmitResult), res
    m.complete_fence(s2, 5)  # now g1 keeps the 40 full blocks (cached on its LRU)
    assert (m.blocks.cached[1], m.blocks.usage[1]) == (40, 40)
    m.check_invariants()


def test_forks_cost_nothing_more_and_the_charge_follows_the_last_reference() -> None:
    m = group([10, 10])
    s1, s2 = m.open_session("g0"), m.open_session("g1")
    a = admit(m, s1, prompt(3))
    m.commit(s1, a.seq_id)
    b = admit(m, s2, prompt(2) + [0])
    kids = m.fork(s2, b.seq_id, 3)
    assert m.blocks.usage == [3, 3]  # g1 is charged once for blocks it holds four times
    m.release(s2, b.seq_id)
    m.release(s1, a.seq_id)  # g1's children still hold the shared blocks: g1 pays for them
    assert m.blocks.usage == [1, 3]
    for k in kids:
        m.release(s2, k)
        m.check_invariants()
    assert (m.blocks.usage, m.blocks.cached) == ([1, 2], [1, 2])


def test_flush_by_tenant_still_means_the_tenant_that_computed_the_blocks() -> None:
    m = group([10, 10])
    s1, s2 = m.open_session("g0"), m.open_session("g1")
    computed(m, s1, 4)
    b = admit(m, s2, prompt(4) + [0])
    m.release(s2, b.seq_id)
    assert m.blocks.cached == [0, 4]  # g1 keeps g0's blocks now
    assert m.flush(tenant_id="g1") == 0  # g1 computed none of them
    assert m.flush(tenant_id="g0") == 4
    assert m.blocks.usage == [0, 0]
    m.check_invariants()


def test_a_keeper_evicts_what_it_keeps_for_its_own_quota() -> None:
    m = group([10, 6])
    s1, s2 = m.open_session("g0"), m.open_session("g1")
    computed(m, s1, 5)
    b = admit(m, s2, prompt(5) + [0])
    m.release(s2, b.seq_id)
    assert (m.blocks.usage, m.blocks.cached) == ([0, 5], [0, 5])
    # g1's 6 new blocks need room in its quota of 6: it evicts what it keeps.
    res = m.admit(s2, SCOPE, prompt(6, first=1000))
    assert isinstance(res, AdmitResult), res
    assert m.blocks.usage == [0, 6]
    m.check_invariants()


def _holds(m: BlockManager) -> list[int]:
    """Per tenant: the blocks it holds (tables, and releases waiting for a fence)."""
    by: list[set[int]] = [set() for _ in m.blocks.usage]
    for seq in m.sequences.values():
        by[seq.tenant].update(seq.table)
    for session in m.sessions.values():
        for _, _, payload in session.waiting:
            if isinstance(payload, array):
                by[session.tenant].update(payload)
    return [len(s) for s in by]


class ChargingMachine(RuleBasedStateMachine):
    """Three members of one group admit shared prompts, release (some under fences their
    workers report late or never), fork, append and reattach. After every step each tenant is
    charged for exactly the blocks it holds plus the cached blocks on its own LRU
    (``usage - cached == held``), never above its quota."""

    QUOTAS = (12, 12, 12)

    def __init__(self) -> None:
        super().__init__()
        self.m = group(list(self.QUOTAS), num_blocks=40)
        self.sessions = [self.m.open_session(f"g{t}", f"s{t}") for t in range(3)]
        self.live: list[list[str]] = [[], [], []]
        self.opened = itertools.count()
        self.shared = [prompt(n) for n in (2, 3, 5)]

    @rule(t=st.integers(0, 2), k=st.integers(0, 5), extra=st.integers(0, 3))
    def admit(self, t: int, k: int, extra: int) -> None:
        sid = self.sessions[t]
        res = self.m.admit(sid, SCOPE, self.shared[k % 3][:(k + 1) * B] + [extra])
        if isinstance(res, AdmitResult):
            self.m.commit(sid, res.seq_id)
            self.live[t].append(res.seq_id)

    @rule(t=st.integers(0, 2), k=st.integers(0, 5), fenced=st.booleans())
    def release(self, t: int, k: int, fenced: bool) -> None:
        if self.live[t]:
            sid = self.sessions[t]
            fence = self.m.sessions[sid].issued + 1 if fenced else 0
            self.m.release(sid, self.live[t].pop(k % len(self.live[t])), fence)

    @rule(t=st.integers(0, 2))
    def complete(self, t: int) -> None:
        sid = self.sessions[t]
        self.m.complete_fence(sid, self.m.sessions[sid].issued)

    @rule(t=st.integers(0, 2), k=st.integers(0, 5), n=st.integers(1, 2))
    def fork(self, t: int, k: int, n: int) -> None:
        if self.live[t]:
            self.live[t] += self.m.fork(self.sessions[t], self.live[t][k % len(self.live[t])], n)

    @rule(t=st.integers(0, 2), k=st.integers(0, 5), n=st.integers(1, 6))
    def append(self, t: int, k: int, n: int) -> None:
        if self.live[t]:
            self.m.append(self.sessions[t], self.live[t][k % len(self.live[t])], [k] * n)

    @rule(t=st.integers(0, 2))
    def reattach(self, t: int) -> None:
        self.m.close_session(self.sessions[t])
        self.sessions[t] = self.m.open_session(f"g{t}", f"s{t}.{next(self.opened)}")
        self.live[t] = []

    @rule()
    def restart_from_a_snapshot(self) -> None:
        """A restarted daemon restores every charge (payer, co-holders) from its snapshot."""
        restored = snapshots.load(snapshots.dump(self.m))
        assert state_of(restored) == state_of(self.m)
        self.m = restored

    @invariant()
    def each_tenant_pays_for_what_it_holds(self) -> None:
        m = self.m
        m.check_invariants()
        a = m.blocks
        assert [u - c for u, c in zip(a.usage, a.cached, strict=True)] == _holds(m)
        assert all(u <= q for u, q in zip(a.usage, self.QUOTAS, strict=True))

    def teardown(self) -> None:
        """A member that holds nothing can use its whole quota, whatever the others hold."""
        m = self.m
        for t in range(3):
            if not _holds(m)[t]:
                res = m.admit(self.sessions[t], SCOPE,
                              prompt(self.QUOTAS[t] - 1, first=10_000 * (t + 1)) + [0])
                assert not (isinstance(res, DoesNotFit) and res.reason == "quota"), res
                if isinstance(res, AdmitResult):
                    m.release(self.sessions[t], res.seq_id)
                m.check_invariants()


TestChargingMachine = ChargingMachine.TestCase
TestChargingMachine.settings = settings(stateful_step_count=60)
