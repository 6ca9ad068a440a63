"""Per-tenant limits: everything a tenant makes is counted against its own policy, and a
refusal names the limit and changes nothing (``state_of`` compares the whole manager)."""

import gc
import tracemalloc

import pytest
from helpers import SCOPE, manager, state_of

from blockd.core import TenantPolicy
from blockd.core.errors import ResourceExhausted
from blockd.core.results import AdmitResult, DoesNotFit
from blockd.core.tenants import sequence_bytes


def two(**a_limits: object) -> tuple:  # type: ignore[type-arg]
    m = manager(num_blocks=16, tenants=[TenantPolicy("a", quota_blocks=8, **a_limits),
                                        TenantPolicy("b", quota_blocks=8)])
    return m, m.open_session("a"), m.open_session("b")


def test_a_fork_flood_is_refused_at_max_sequences_and_changes_nothing() -> None:
    m, a, _ = two(max_sequences=100)
    seq = m.admit(a, SCOPE, [1, 2, 3, 4, 5])
    assert isinstance(seq, AdmitResult)
    for _ in range(1, 100 // 33 + 1):
        m.fork(a, seq.seq_id, 33)
    assert len(m.sequences) == 100
    before = state_of(m)
    with pytest.raises(ResourceExhausted) as exc:
        m.fork(a, seq.seq_id, 1)
    assert exc.value.reason == "max_sequences" and "max_sequences" in exc.value.message
    assert state_of(m) == before
    out = m.admit(a, SCOPE, [9])
    assert isinstance(out, DoesNotFit) and out.reason == "max_sequences"
    assert out.unit == "sequences"
    assert state_of(m) == before
    m.check_invariants()


def test_one_tenants_limit_does_not_touch_another() -> None:
    m, a, b = two(max_sequences=1)
    assert isinstance(m.admit(a, SCOPE, [1]), AdmitResult)
    assert isinstance(m.admit(a, SCOPE, [2]), DoesNotFit)
    assert isinstance(m.admit(b, SCOPE, [2]), AdmitResult)


def test_released_sequences_give_their_counts_back() -> None:
    m, a, _ = two(max_sequences=2)
    s1 = m.admit(a, SCOPE, [1, 2, 3, 4, 5])
    assert isinstance(s1, AdmitResult)
    (child,) = m.fork(a, s1.seq_id)
    m.append(a, child, [7, 8, 9, 10])  # a new block: more table entries
    m.release(a, child)
    m.release(a, s1.seq_id)
    assert m.tenants.sequences == [0, 0] and m.tenants.sequence_bytes == [0, 0]
    m.close_session(a)
    assert m.tenants.sessions == [0, 1]


def test_metadata_bytes_bound_forks_of_long_sequences() -> None:
    quota = 8
    limit = 128 * quota + 10 * sequence_bytes(8, 4)
    m, a, _ = two(max_metadata_bytes=limit, max_sequences=1000)
    seq = m.admit(a, SCOPE, list(range(32)))  # 8 blocks
    assert isinstance(seq, AdmitResult)
    m.fork(a, seq.seq_id, 9)
    before = state_of(m)
    with pytest.raises(ResourceExhausted) as exc:
        m.fork(a, seq.seq_id, 1)
    assert exc.value.reason == "max_metadata_bytes"
    assert state_of(m) == before


def test_the_documented_sequence_cost_covers_what_a_fork_allocates() -> None:
    m, a, _ = two(max_sequences=10_000)
    seq = m.admit(a, SCOPE, list(range(30)))  # 8 blocks, the last partly filled
    assert isinstance(seq, AdmitResult)
    gc.collect()
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        m.fork(a, seq.seq_id, 64)
        gc.collect()
        grown, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    per_child = (grown - base) / 64
    assert per_child <= sequence_bytes(8, 4), per_child


def test_sessions_are_limited_per_tenant() -> None:
    m, a, b = two(max_sessions=2)
    m.open_session("a")
    before = state_of(m)
    with pytest.raises(ResourceExhausted) as exc:
        m.open_session("a")
    assert exc.value.reason == "max_sessions" and exc.value.field == "tenant_id"
    assert state_of(m) == before
    m.open_session("b")  # the other tenant is not locked out


def test_pending_fences_are_limited_per_session() -> None:
    m, a, _ = two(max_pending_fences=2)
    ids = []
    for t in range(3):
        r = m.admit(a, SCOPE, [t + 1])
        assert isinstance(r, AdmitResult)
        ids.append(r.seq_id)
    m.begin_step(a, 1)
    m.release(a, ids[0], 1)
    m.release(a, ids[1], 1)
    before = state_of(m)
    with pytest.raises(ResourceExhausted) as exc:
        m.release(a, ids[2], 2)
    assert exc.value.reason == "max_pending_fences"
    assert state_of(m) == before  # the fence 2 was not announced either
    m.complete_fence(a, 1)
    m.release(a, ids[2], 2)


def test_request_priority_above_the_cap_does_not_preempt_another_tenant() -> None:
    m = manager(num_blocks=4, tenants=[TenantPolicy("a", quota_blocks=4),
                                       TenantPolicy("b", quota_blocks=4)])
    a, b = m.open_session("a"), m.open_session("b")
    assert isinstance(m.admit(a, SCOPE, list(range(16))), AdmitResult)  # the whole pool
    before = state_of(m)
    out = m.admit(b, SCOPE, [1], priority=2**31 - 1)
    assert isinstance(out, DoesNotFit) and out.reason == "pool"
    assert state_of(m) == before


def test_request_priority_within_the_cap_still_orders_tenants() -> None:
    m = manager(num_blocks=4, tenants=[TenantPolicy("a", quota_blocks=4),
                                       TenantPolicy("b", quota_blocks=4,
                                                    max_request_priority=5)])
    a, b = m.open_session("a"), m.open_session("b")
    low = m.admit(a, SCOPE, list(range(16)))
    assert isinstance(low, AdmitResult)
    m.admit(b, SCOPE, [1], priority=5)
    assert low.seq_id not in m.sequences


def test_request_priority_orders_a_tenants_own_requests() -> None:
    m = manager(num_blocks=4, tenants=[TenantPolicy("a", quota_blocks=4)])
    a = m.open_session("a")
    low = m.admit(a, SCOPE, list(range(16)))
    assert isinstance(low, AdmitResult)
    assert isinstance(m.admit(a, SCOPE, [1], priority=100), AdmitResult)
    assert low.seq_id not in m.sequences


def test_a_guarantee_is_never_preempted_away() -> None:
    """Victims are taken most recent first: a's sequences come before c's, but preempting
    them would take a below its guarantee (and, reserved for a again, not help): only c's go."""
    m = manager(num_blocks=8, tenants=[
        TenantPolicy("c", quota_blocks=8), TenantPolicy("a", quota_blocks=8, guaranteed_blocks=4),
        TenantPolicy("hi", quota_blocks=8, priority=5)])
    c, a, hi = m.open_session("c"), m.open_session("a"), m.open_session("hi")
    held = {}
    for sid, t in ((c, 0), (c, 1), (a, 2), (a, 3)):
        r = m.admit(sid, SCOPE, [t] * 8)  # 2 blocks each: the whole pool
        assert isinstance(r, AdmitResult)
        held[r.seq_id] = sid
    out = m.admit(hi, SCOPE, list(range(16)))  # 4 blocks
    assert isinstance(out, AdmitResult)
    assert [held[q] for q in held if q in m.sequences] == [a, a]
    assert m.take_preempted(a) == [] and len(m.take_preempted(c)) == 2
    m.check_invariants()


@pytest.mark.parametrize("field,value", [("max_sequences", 0), ("max_sessions", -1),
                                         ("max_pending_fences", True),
                                         ("max_metadata_bytes", 100)])
def test_bad_limits_are_refused_naming_the_field(field: str, value: object) -> None:
    from blockd.core.errors import InvalidArgument

    with pytest.raises(InvalidArgument) as exc:
        TenantPolicy("a", quota_blocks=8, **{field: value})  # type: ignore[arg-type]
    assert exc.value.field == field
