"""Daemon-side preemption (blockd.core.preemption): who gives way when the pool is exhausted.

Scenario tests with exact victims, then a randomized test (hypothesis, derandomised by the
``ci`` profile) with several sessions and priorities: invariants after every call, nothing
preempted when it cannot help, and no admission waits forever.
"""

from __future__ import annotations

import pytest
from helpers import SCOPE, state_of
from hypothesis import given
from hypothesis import strategies as st

from blockd.core import (
    Aborted,
    AdmitResult,
    AppendResult,
    BlockManager,
    DoesNotFit,
    InvalidArgument,
    NotFound,
    PoolSpec,
    TenantPolicy,
)
from blockd.core import preemption as pre

B = 4


def make(num_blocks: int = 8, tenants: list[TenantPolicy] | None = None,
         **kw: object) -> BlockManager:
    if tenants is None:
        tenants = [TenantPolicy("lo", quota_blocks=num_blocks, priority=0),
                   TenantPolicy("hi", quota_blocks=num_blocks, priority=1)]
    return BlockManager(PoolSpec(block_size=B, num_blocks=num_blocks), tenants, seed=7, **kw)


def snapshot(m: BlockManager) -> object:
    """All the manager's state (``helpers.state_of``), and its preemption counts."""
    return state_of(m), dict(m.counters.preemptions)


def admit(m: BlockManager, sid: str, blocks: int, *, token: int = 0, priority: int = 0,
          cache: bool = False) -> AdmitResult | DoesNotFit:
    """Admit a prompt of ``blocks`` full blocks (distinct tokens per ``token``)."""
    out = m.admit(sid, SCOPE, [token * 1000 + i for i in range(blocks * B)], cache=cache,
                  priority=priority)
    m.check_invariants()
    return out


def ok(out: AdmitResult | DoesNotFit) -> str:
    assert isinstance(out, AdmitResult), out
    return out.seq_id


# -- victim order ------------------------------------------------------------------------------

def test_lowest_priority_first_then_most_recent_first() -> None:
    m = make(num_blocks=8)
    lo = m.open_session("lo")
    hi = m.open_session("hi")
    a = ok(admit(m, lo, 2, token=1, priority=0))
    b = ok(admit(m, lo, 2, token=2, priority=-1))  # lowest: first victim
    c = ok(admit(m, lo, 2, token=3, priority=0))  # most recent of priority 0: second victim
    d = ok(admit(m, lo, 2, token=4, priority=5))
    before = m.sequences.copy()
    out = admit(m, hi, 4, token=9)  # tenant hi outranks every sequence of tenant lo
    ok(out)
    assert set(before) - set(m.sequences) == {b, c}
    assert a in m.sequences and d in m.sequences
    assert m.sessions[lo].preempted == [b, c]
    assert m.counters.preemptions == {"lo": 2}
    m.check_invariants()


def test_choose_victims_order_is_priority_then_lifo() -> None:
    m = make(num_blocks=12)
    lo = m.open_session("lo")
    hi = m.open_session("hi")
    ids = [ok(admit(m, lo, 2, token=t, priority=p)) for t, p in enumerate([1, 0, 1, 0, 2, 0])]
    # Needs every block of the pool but 2: all victims except one are needed.
    victims = m.victims.choose(m.admission.fits, m.sessions[hi].tenant, (1, 0, 0), 10, ())
    assert [v.id for v in victims] == [ids[5], ids[3], ids[1], ids[2], ids[0]]
    assert len(m.sequences) == 6  # choosing changes nothing


def test_tenant_priority_outranks_sequence_priority() -> None:
    m = make(num_blocks=4)
    lo = m.open_session("lo")
    hi = m.open_session("hi")
    victim = ok(admit(m, lo, 4, priority=1000))  # a high request of the low tenant
    # A low request of the high tenant still outranks it: (1, -5) > (0, 1000).
    ok(admit(m, hi, 2, token=2, priority=-5))
    assert victim not in m.sequences
    assert m.sessions[lo].preempted == [victim]


def test_sequence_priority_orders_within_a_tenant_and_ties_are_never_preempted() -> None:
    m = make(num_blocks=4)
    s = m.open_session("lo")
    first = ok(admit(m, s, 2, token=1, priority=3))
    second = ok(admit(m, s, 2, token=2, priority=3))
    before = snapshot(m)
    # Same effective priority: not strictly lower, nobody is preempted.
    out = admit(m, s, 1, token=3, priority=3)
    assert isinstance(out, DoesNotFit) and out.reason == "pool"
    assert snapshot(m) == before
    # Strictly higher within the same tenant and session: the latest of priority 3 goes.
    ok(admit(m, s, 1, token=4, priority=4))
    assert first in m.sequences and second not in m.sequences
    assert m.sessions[s].preempted == [second]


def test_the_requesting_sequence_is_never_its_own_victim() -> None:
    m = make(num_blocks=4)
    lo = m.open_session("lo")
    other = ok(admit(m, lo, 2, token=1, priority=0))
    me = ok(admit(m, lo, 2, token=2, priority=1))
    out = m.append(lo, me, [1] * B)  # needs one more block: the other (lower) one gives way
    m.check_invariants()
    assert isinstance(out, AppendResult)
    assert other not in m.sequences and me in m.sequences
    # Now alone and still out of blocks: nothing lower to preempt, the append waits.
    before = snapshot(m)
    out = m.append(lo, me, [1] * (2 * B + 1))
    assert isinstance(out, DoesNotFit) and out.reason == "pool"
    assert snapshot(m) == before
    m.check_invariants()


# -- what counts as freed ------------------------------------------------------------------------

def test_blocks_shared_with_a_survivor_are_not_counted() -> None:
    m = make(num_blocks=6)
    s = m.open_session("lo")
    prompt = list(range(4 * B))
    low = m.admit(s, SCOPE, prompt, priority=0)
    assert isinstance(low, AdmitResult)
    m.commit(s, low.seq_id)
    # A priority-5 request hits all four blocks of the low one (and takes one more).
    survivor = m.admit(s, SCOPE, prompt + [1], priority=5)
    assert isinstance(survivor, AdmitResult) and survivor.num_cached_tokens == 4 * B
    m.check_invariants()
    before = snapshot(m)
    out = admit(m, s, 2, token=3, priority=3)  # 1 free block, 2 needed
    # Preempting ``low`` (priority 0 < 3) would free nothing, since the survivor (5 > 3) still
    # holds each of its blocks: nothing happens.
    assert isinstance(out, DoesNotFit) and out.reason == "pool"
    assert snapshot(m) == before
    assert m.victims.choose(m.admission.fits, 0, (0, 3, 3), 2, ()) == []


def test_fork_siblings_that_are_both_victims_free_their_shared_blocks() -> None:
    m = make(num_blocks=4)
    lo = m.open_session("lo")
    hi = m.open_session("hi")
    parent = ok(admit(m, lo, 4, token=1))
    child = m.fork(lo, parent)[0]
    m.check_invariants()
    ok(admit(m, hi, 2, token=2))
    assert parent not in m.sequences and child not in m.sequences
    assert m.sessions[lo].preempted == [child, parent]  # the fork is the latest admission


def test_an_admits_own_prefix_hits_are_not_counted_as_freed() -> None:
    m = make(num_blocks=5)
    lo = m.open_session("lo")
    hi = m.open_session("hi")
    tenants = [TenantPolicy("lo", quota_blocks=5, priority=0, sharing=pre_public()),
               TenantPolicy("hi", quota_blocks=5, priority=1, sharing=pre_public())]
    m.set_tenants(tenants)
    prompt = list(range(4 * B))
    low = m.admit(lo, SCOPE, prompt + [99])  # 5 blocks, the last one partly filled
    assert isinstance(low, AdmitResult)
    m.commit(lo, low.seq_id)
    m.check_invariants()
    # The hi admit hits the 4 full blocks of low and needs 1 more: preempting low frees only
    # its last block (the hits are not freed: the admit takes them), which is enough.
    chosen = m.victims.choose(m.admission.fits, 1, (1, 0, 0), 1, low.block_table[:4])
    assert [v.id for v in chosen] == [low.seq_id]
    assert m.victims.choose(m.admission.fits, 1, (1, 0, 0), 2, low.block_table[:4]) == []
    out = m.admit(hi, SCOPE, prompt + [7])
    m.check_invariants()
    assert isinstance(out, AdmitResult)
    assert out.num_cached_tokens == 4 * B
    assert low.seq_id not in m.sequences


def pre_public():  # type: ignore[no-untyped-def]
    from blockd.core import Sharing

    return Sharing.PUBLIC


# -- nothing when it cannot help ---------------------------------------------------------------

def test_nothing_is_preempted_when_all_victims_cannot_cover_the_shortfall() -> None:
    m = make(num_blocks=8)
    lo = m.open_session("lo")
    hi = m.open_session("hi")
    ok(admit(m, lo, 2, token=1))
    ok(admit(m, hi, 6, token=2))
    before = snapshot(m)
    out = admit(m, hi, 3, token=3)  # 0 free, the only victim frees 2 of the 3 needed
    assert isinstance(out, DoesNotFit) and out.reason == "pool"
    assert (out.needed, out.available) == (3, 0)
    assert snapshot(m) == before
    assert m.counters.alloc_failures["pool"] == 1


def test_nothing_is_preempted_when_the_quota_would_refuse_anyway() -> None:
    tenants = [TenantPolicy("lo", quota_blocks=8, priority=0),
               TenantPolicy("hi", quota_blocks=2, priority=1)]
    m = make(num_blocks=8, tenants=tenants)
    lo = m.open_session("lo")
    hi = m.open_session("hi")
    ok(admit(m, lo, 6, token=1))
    ok(admit(m, hi, 2, token=2))
    before = snapshot(m)
    out = admit(m, hi, 1, token=3)
    assert isinstance(out, DoesNotFit) and out.reason in ("pool", "quota")
    assert snapshot(m) == before


def test_pending_blocks_count_as_coming_and_preempt_nobody_else() -> None:
    m = make(num_blocks=4)
    lo = m.open_session("lo")
    hi = m.open_session("hi")
    m.begin_step(lo, 1)
    a = ok(admit(m, lo, 2, token=1))
    b = ok(admit(m, lo, 2, token=2))
    out = admit(m, hi, 2, token=3)
    assert isinstance(out, DoesNotFit) and out.reason == "preempting"
    assert a in m.sequences and b not in m.sequences
    # A retry while the victim's fence is pending preempts nobody else.
    before = snapshot(m)
    again = admit(m, hi, 2, token=3)
    assert isinstance(again, DoesNotFit) and again.reason == "pool"
    assert snapshot(m) == before
    m.complete_fence(lo, 1)
    m.check_invariants()
    ok(admit(m, hi, 2, token=3))
    assert a in m.sequences


# -- fences --------------------------------------------------------------------------------------

def test_victims_with_pending_fences_answer_preempting_then_succeed() -> None:
    m = make(num_blocks=4)
    lo = m.open_session("lo")
    hi = m.open_session("hi")
    m.begin_step(lo, 5)  # the low worker's kernels of fence 5 may read the blocks
    victim = ok(admit(m, lo, 4, token=1))
    out = admit(m, hi, 3, token=2)
    assert isinstance(out, DoesNotFit)
    assert (out.reason, out.needed, out.available) == ("preempting", 3, 0)
    assert victim not in m.sequences
    assert m.state_counts()["pending"] == 4  # reclaimed, not reusable before fence 5
    assert m.counters.alloc_failures["preempting"] == 1
    assert m.take_preempted(lo) == [victim]
    assert m.take_preempted(lo) == []
    m.complete_fence(lo, 5)
    m.check_invariants()
    ok(admit(m, hi, 3, token=2))


def test_victims_with_complete_fences_make_room_at_once() -> None:
    m = make(num_blocks=4)
    lo = m.open_session("lo")
    hi = m.open_session("hi")
    m.begin_step(lo, 5)
    victim = ok(admit(m, lo, 4, token=1))
    m.complete_fence(lo, 5)
    ok(admit(m, hi, 3, token=2))
    assert victim not in m.sequences
    assert m.sessions[lo].preempted == [victim]


def test_a_preempted_append_in_a_batch_and_ops_on_preempted_ids_are_aborted() -> None:
    m = make(num_blocks=4)
    lo = m.open_session("lo")
    low = ok(admit(m, lo, 1, token=1, priority=0))
    high = ok(admit(m, lo, 3, token=2, priority=1))
    # high's append needs one more block: low (later in the batch) is preempted for it.
    out = m.append_batch(lo, [high, low], bytes(8))
    m.check_invariants()
    assert out.num_tokens[0] == 3 * B + 1
    assert [i for i, _ in out.errors] == [1]
    err = out.errors[0][1]
    assert isinstance(err, Aborted) and err.field == "sequence_id"
    assert "preempted by a higher-priority request" in err.message
    for call in (lambda: m.release(lo, low), lambda: m.commit(lo, low),
                 lambda: m.append(lo, low, [1]), lambda: m.fork(lo, low),
                 lambda: m.block_table(lo, low)):
        with pytest.raises(Aborted):
            call()
    with pytest.raises(NotFound):
        m.release(lo, "never-existed")
    m.check_invariants()


def test_the_preempted_record_is_bounded() -> None:
    m = make(num_blocks=4)
    lo = m.open_session("lo")
    s = m.sessions[lo]
    ids = [f"id{i}" for i in range(pre.MAX_REMEMBERED + 3)]
    for seq_id in ids:  # the bounded record, exercised without 4,099 real preemptions
        s.preempted_ids[seq_id] = None
        if len(s.preempted_ids) > pre.MAX_REMEMBERED:
            del s.preempted_ids[next(iter(s.preempted_ids))]
    with pytest.raises(NotFound):
        m.release(lo, ids[0])
    with pytest.raises(Aborted):
        m.release(lo, ids[-1])
    # And the real path keeps it bounded too.
    hi = m.open_session("hi")
    victim = ok(admit(m, lo, 4, token=1))
    ok(admit(m, hi, 1, token=2))
    assert len(s.preempted_ids) == pre.MAX_REMEMBERED
    assert next(reversed(s.preempted_ids)) == victim


# -- policy off ----------------------------------------------------------------------------------

def test_policy_off_keeps_todays_behaviour() -> None:
    m = make(num_blocks=4, preemption="off")
    lo = m.open_session("lo")
    hi = m.open_session("hi")
    ok(admit(m, lo, 4, token=1))
    before = snapshot(m)
    out = admit(m, hi, 1, token=2, priority=100)
    assert isinstance(out, DoesNotFit) and out.reason == "pool"
    assert snapshot(m) == before
    with pytest.raises(InvalidArgument):
        make(preemption="lowest")


def test_take_preempted_drains_every_notice_in_preemption_order() -> None:
    m = make(num_blocks=4)
    lo = m.open_session("lo")
    hi = m.open_session("hi")
    ids = [ok(admit(m, lo, 1, token=t)) for t in range(4)]
    ok(admit(m, hi, 4, token=9))
    assert m.take_preempted(lo) == ids[::-1]  # latest admitted preempted first
    assert m.take_preempted(lo) == []
    assert m.take_preempted(hi) == []


# -- randomized ----------------------------------------------------------------------------------

TENANTS = [TenantPolicy("t0", quota_blocks=16, priority=0),
           TenantPolicy("t1", quota_blocks=16, priority=1),
           TenantPolicy("t2", quota_blocks=10, guaranteed_blocks=2, priority=0)]

STEP = st.tuples(st.just("step"), st.integers(0, 3), st.booleans(), st.just(0), st.just(0))
ADMIT = st.tuples(st.just("admit"), st.integers(0, 3), st.integers(1, 5), st.integers(-1, 2),
                  st.integers(0, 3))
OPS = st.lists(
    st.one_of(
        ADMIT, ADMIT, ADMIT,
        st.tuples(st.just("append"), st.integers(0, 3), st.integers(0, 40), st.integers(1, 6),
                  st.integers(0, 0)),
        st.tuples(st.just("release"), st.integers(0, 3), st.integers(0, 40), st.just(0),
                  st.just(0)),
        st.tuples(st.just("fork"), st.integers(0, 3), st.integers(0, 40), st.just(0),
                  st.just(0)),
        st.tuples(st.just("commit"), st.integers(0, 3), st.integers(0, 40), st.just(0),
                  st.just(0)),
        STEP, STEP,
    ),
    min_size=10, max_size=80)


@given(OPS)
def test_random_workloads_keep_invariants_and_never_starve(ops: list[tuple]) -> None:
    m = BlockManager(PoolSpec(block_size=B, num_blocks=14), TENANTS, seed=3)
    sessions = [m.open_session(t) for t in ("t0", "t1", "t2", "t0")]
    live: list[str] = []
    fences = [0] * len(sessions)
    for kind, si, a, b, c in ops:
        sid = sessions[si]
        mine = [q for q in live if q in m.sequences and m.sequences[q].session == sid]
        if kind == "admit":
            before = snapshot(m)
            out = m.admit(sid, pre_scope(c), [c * 97 + i for i in range(a * B - 1)],
                          priority=b)
            if isinstance(out, AdmitResult):
                live.append(out.seq_id)
            elif out.reason != "preempting":
                assert snapshot(m) == before  # a plain refusal changed nothing
            else:
                assert m.sessions[sid] is not None
        elif kind == "append" and mine:
            seq = mine[a % len(mine)]
            before = snapshot(m)
            res = m.append(sid, seq, list(range(b)))
            if isinstance(res, DoesNotFit) and res.reason != "preempting":
                assert snapshot(m) == before
        elif kind == "release" and mine:
            m.release(sid, mine[a % len(mine)])
        elif kind == "fork" and mine:
            live.extend(m.fork(sid, mine[a % len(mine)]))
        elif kind == "commit" and mine:
            m.commit(sid, mine[a % len(mine)])
        elif kind == "step":
            fences[si] += 1
            m.begin_step(sid, fences[si], fences[si] - 1 if a else 0)
        m.check_invariants()
        # Every preempted sequence is gone, announced exactly once and remembered.
        for s in sessions:
            for q in m.take_preempted(s):
                assert q not in m.sequences
                assert q in m.sessions[s].preempted_ids
        live = [q for q in live if q in m.sequences]
    # No admission waits forever: once every fence completes, a retried admit of the highest
    # priority that fits with the lower-priority sequences gone succeeds.
    for s, f in zip(sessions, fences, strict=True):
        m.complete_fence(s, f)
    m.check_invariants()
    sid = sessions[1]
    me = m.sessions[sid].tenant
    top = m.victims.requester(me, 10)  # (1, 0, 10): the request priority counts as its cap, 0
    for need in range(1, 8):
        lower = [q for q in m.sequences.values() if m.victims.below(q, me, top)]
        freeable = sorted({blk for q in lower for blk in q.table
                           if all(m.victims.below(o, me, top)
                                  for o in m.sequences.values() if blk in o.table)})
        freed = [0] * len(m.blocks.usage)
        for blk in freeable:
            freed[m.blocks.owner[blk]] += 1
        tenant = m.sessions[sid].tenant
        now = m.admission.fits(tenant, need, ())  # noqa: SLF001
        # Preemption answers a "pool" refusal only ("quota" and "guarantee" are policy).
        fits = now is None or (now.reason == "pool" and m.admission.fits(  # noqa: SLF001
            tenant, need, (), len(freeable), freed) is None)
        before = snapshot(m)
        out = m.admit(sid, pre_scope(3), [5000 + i for i in range(need * B)], priority=10,
                      cache=False)
        m.check_invariants()
        # Victims that would take t2 below its guarantee are never chosen (order-dependent):
        # the model only judges requests that need none of t2's blocks.
        if fits and all(m.blocks.owner[blk] != 2 for blk in freeable):
            assert isinstance(out, AdmitResult), (need, out)
            m.release(sid, out.seq_id)
            m.complete_fence(sid, m.sessions[sid].issued)
        elif not fits:
            assert isinstance(out, DoesNotFit) and out.reason != "preempting"
            assert snapshot(m) == before
        elif isinstance(out, AdmitResult):
            m.release(sid, out.seq_id)
            m.complete_fence(sid, m.sessions[sid].issued)
        m.check_invariants()


def pre_scope(i: int):  # type: ignore[no-untyped-def]
    from blockd.core import PrefixScope

    return PrefixScope("m", model_revision=str(i % 2))


def test_refusals_that_preemption_cannot_help_do_not_rescan_every_sequence(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the gRPC fuzzer: a Step of ~2,000 admissions, each refused for lack of blocks
    while thousands of forked sequences of lower priority ran, scanned every sequence and
    block once per admission (minutes). A request larger than the pool is answered without
    any scan, and one that victims cannot help is scanned once per unchanged pool."""
    scans = []
    real = pre.VictimChooser._scan

    def counting(*args: object) -> list[object]:
        scans.append(args[4])  # need (after self and fits)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(pre.VictimChooser, "_scan", counting)
    m = make(num_blocks=16, tenants=[TenantPolicy("lo", quota_blocks=64, priority=0),
                                     TenantPolicy("hi", quota_blocks=64, priority=1)])
    lo = m.open_session("lo")
    hi = m.open_session("hi")
    base = ok(admit(m, lo, 4, token=1))
    for _ in range(20):
        m.fork(lo, base, 64)  # 1,281 sequences sharing 4 blocks
    ok(admit(m, hi, 10, token=2))  # the rest of the pool is the high tenant's
    for i in range(300):
        assert admit(m, hi, 17, token=3 + i) == DoesNotFit("pool", 17, 2)  # > the pool
    assert scans == []
    before = snapshot(m)
    for i in range(300):
        # Fits the pool, but the low tenant's 4 shared blocks are all victims could free.
        out = admit(m, hi, 7, token=3 + i)
        assert isinstance(out, DoesNotFit) and out.reason == "pool"
    assert scans == [7]
    assert snapshot(m) == before
    ok(admit(m, hi, 5, token=9))  # enough: the forks are preempted, all of them
    assert len(m.sessions[lo].preempted) == 1281


def test_a_step_scans_for_victims_at_most_scans_per_step_times(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Refusals from requesters of distinct priorities are distinct questions (no memo hit):
    one Step pays at most ``SCANS_PER_STEP`` scans; the next Step gets a fresh budget."""
    scans = []
    real = pre.VictimChooser._scan
    monkeypatch.setattr(pre.VictimChooser, "_scan", lambda *a: scans.append(1) or real(*a))
    m = make(num_blocks=16, tenants=[TenantPolicy("lo", quota_blocks=64, priority=0),
                                     TenantPolicy("hi", quota_blocks=64, priority=1)])
    lo = m.open_session("lo")
    hi = m.open_session("hi")
    base = ok(admit(m, lo, 4, token=1))
    m.fork(lo, base, 8)
    ok(admit(m, hi, 10, token=2, priority=1000))  # outranks every requester below
    m.begin_step(hi, 0)
    for i in range(50):
        out = admit(m, hi, 7, token=3 + i, priority=i)  # a new question every time
        assert isinstance(out, DoesNotFit) and out.reason == "pool"
    assert len(scans) == pre.SCANS_PER_STEP
    m.begin_step(hi, 0)
    assert isinstance(admit(m, hi, 7, token=99, priority=99), DoesNotFit)
    assert len(scans) == pre.SCANS_PER_STEP + 1
