"""Key-partition conformance (design.md section 3).

Every field of the prefix-cache namespace (model id, revision, LoRA, tokenizer digest, the
tenant's sharing domain, the request salt) partitions the cache: two requests that differ only in
that field never share a block, and requests that agree on every field do (positive control).
Missing (``None``) and empty values are different values.

The key hash must not matter for safety: with a deliberately colliding hash injected through
``hasher_factory``, a prompt whose key collides with another prompt's (or another namespace's)
gets a miss, never someone else's K/V.
"""

from __future__ import annotations

import dataclasses

import pytest
from colliding_hashers import ConstHasher, LenHasher
from hypothesis import given
from hypothesis import strategies as st

from blockd.core import (
    AdmitResult,
    BlockManager,
    PoolSpec,
    PrefixScope,
    Sharing,
    TenantPolicy,
)

B = 4
#: 3 full blocks plus one token: three blocks can be hits.
PROMPT = list(range(100, 100 + 3 * B + 1))
FULL_HIT = 3 * B

BASE = PrefixScope("model-a", model_revision="r1", lora_id="lora-1",
                   tokenizer_digest=b"\x01tok", salt=b"salt")

TENANTS = [
    TenantPolicy("alice", 64, sharing=Sharing.PRIVATE),
    TenantPolicy("bob", 64, sharing=Sharing.PRIVATE),
    TenantPolicy("g1a", 64, sharing=Sharing.GROUP, group="g1"),
    TenantPolicy("g1b", 64, sharing=Sharing.GROUP, group="g1"),
    TenantPolicy("g2a", 64, sharing=Sharing.GROUP, group="g2"),
    TenantPolicy("pub1", 64, sharing=Sharing.PUBLIC),
    TenantPolicy("pub2", 64, sharing=Sharing.PUBLIC),
    # Private tenants named like a group and like the public domain.
    TenantPolicy("g1", 64, sharing=Sharing.PRIVATE),
    TenantPolicy("public", 64, sharing=Sharing.PRIVATE),
]


def manager(hasher: object = None, num_blocks: int = 96,
            tenants: list[TenantPolicy] | None = None) -> BlockManager:
    return BlockManager(PoolSpec(block_size=B, num_blocks=num_blocks), tenants or TENANTS,
                        seed=77, hasher_factory=hasher)  # type: ignore[arg-type]


def session(m: BlockManager, tenant: str) -> str:
    return m.open_session(tenant)


def admit(m: BlockManager, sid: str, scope: PrefixScope, prompt: list[int]) -> AdmitResult:
    res = m.admit(sid, scope, prompt)
    assert isinstance(res, AdmitResult), res
    return res


def admit_commit(m: BlockManager, sid: str, scope: PrefixScope, prompt: list[int]
                 ) -> AdmitResult:
    """Admit, let the worker write the prompt, commit its full blocks (fence 0: at once)."""
    res = admit(m, sid, scope, prompt)
    m.commit(sid, res.seq_id)
    m.check_invariants()
    return res


def assert_not_shared(m: BlockManager, sid_a: str, scope_a: PrefixScope, sid_b: str,
                      scope_b: PrefixScope, prompt: list[int] = PROMPT) -> None:
    first = admit_commit(m, sid_a, scope_a, prompt)
    assert m.lookup(sid_b, scope_b, prompt) == 0
    second = admit(m, sid_b, scope_b, prompt)
    assert second.num_cached_tokens == 0
    assert not set(first.block_table) & set(second.block_table)
    # The same holds once the first sequence is gone and its blocks sit in the cache.
    m.release(sid_a, first.seq_id)
    m.release(sid_b, second.seq_id)
    assert m.lookup(sid_b, scope_b, prompt) == 0
    third = admit(m, sid_b, scope_b, prompt)
    assert third.num_cached_tokens == 0
    assert not set(first.block_table) & set(third.block_table)
    m.check_invariants()


def assert_shared(m: BlockManager, sid_a: str, scope_a: PrefixScope, sid_b: str,
                  scope_b: PrefixScope, prompt: list[int] = PROMPT) -> None:
    first = admit_commit(m, sid_a, scope_a, prompt)
    hit = (len(prompt) - 1) // B * B
    assert m.lookup(sid_b, scope_b, prompt) == hit
    second = admit(m, sid_b, scope_b, prompt)
    assert second.num_cached_tokens == hit > 0
    assert second.block_table[: hit // B] == first.block_table[: hit // B]
    m.check_invariants()


# -- PrefixScope fields -----------------------------------------------------------------------

SCOPE_VARIANTS = [
    ("model_id", "model-b"),
    ("model_revision", "r2"),
    ("lora_id", "lora-2"),
    ("tokenizer_digest", b"\x02tok"),
    ("salt", b"pepper"),
]


@pytest.mark.parametrize(("field", "other"), SCOPE_VARIANTS)
def test_a_differing_scope_field_never_shares(field: str, other: object) -> None:
    m = manager()
    sid = session(m, "pub1")
    assert_not_shared(m, sid, BASE, sid, dataclasses.replace(BASE, **{field: other}))


@pytest.mark.parametrize(("field", "other"), SCOPE_VARIANTS)
def test_a_differing_scope_field_never_shares_across_sessions(field: str, other: object
                                                              ) -> None:
    m = manager()
    assert_not_shared(m, session(m, "pub1"), BASE, session(m, "pub2"),
                      dataclasses.replace(BASE, **{field: other}))


def test_equal_scopes_share() -> None:
    m = manager()
    sid = session(m, "pub1")
    assert_shared(m, sid, BASE, sid, dataclasses.replace(BASE))


@pytest.mark.parametrize("field", ["model_revision", "lora_id", "tokenizer_digest", "salt"])
def test_missing_and_empty_are_different(field: str) -> None:
    empty = b"" if field in ("tokenizer_digest", "salt") else ""
    m = manager()
    sid = session(m, "pub1")
    assert_not_shared(m, sid, dataclasses.replace(BASE, **{field: None}),
                      sid, dataclasses.replace(BASE, **{field: empty}))
    m = manager()
    sid = session(m, "pub1")
    assert_not_shared(m, sid, dataclasses.replace(BASE, **{field: empty}),
                      sid, dataclasses.replace(BASE, **{field: None}))
    # Positive controls: missing == missing, empty == empty.
    for value in (None, empty):
        m = manager()
        sid = session(m, "pub1")
        scope = dataclasses.replace(BASE, **{field: value})
        assert_shared(m, sid, scope, sid, dataclasses.replace(scope))


@pytest.mark.parametrize(("a", "b"), [
    # Bytes moved across a field boundary: length prefixes keep them apart.
    (PrefixScope("ab", model_revision="c"), PrefixScope("a", model_revision="bc")),
    (PrefixScope("m", lora_id="x"), PrefixScope("m", model_revision="x")),
    (PrefixScope("m", tokenizer_digest=b"s"), PrefixScope("m", salt=b"s")),
    (PrefixScope("m", lora_id="", tokenizer_digest=None),
     PrefixScope("m", lora_id=None, tokenizer_digest=b"")),
    (PrefixScope("m", salt=b"\x00"), PrefixScope("m", salt=b"")),
])
def test_fields_cannot_be_confused(a: PrefixScope, b: PrefixScope) -> None:
    m = manager()
    sid = session(m, "pub1")
    assert_not_shared(m, sid, a, sid, b)


def _field_values(field: str) -> st.SearchStrategy[object]:
    if field == "model_id":
        return st.text(max_size=6)
    if field in ("tokenizer_digest", "salt"):
        return st.none() | st.binary(max_size=6)
    return st.none() | st.text(max_size=6)


@given(data=st.data())
def test_random_field_values_partition_the_cache(data: st.DataObject) -> None:
    field = data.draw(st.sampled_from(["model_id", "model_revision", "lora_id",
                                       "tokenizer_digest", "salt"]), label="field")
    values = _field_values(field)
    a = data.draw(values, label="a")
    b = data.draw(st.one_of(st.just(a), values), label="b")
    m = manager()
    sid = session(m, "pub1")
    scope_a = dataclasses.replace(BASE, **{field: a})
    scope_b = dataclasses.replace(BASE, **{field: b})
    if a == b and type(a) is type(b):
        assert_shared(m, sid, scope_a, sid, scope_b)
    else:
        assert_not_shared(m, sid, scope_a, sid, scope_b)


# -- sharing domains --------------------------------------------------------------------------

@pytest.mark.parametrize(("a", "b"), [
    ("alice", "bob"),     # two private tenants
    ("g1a", "g2a"),       # different groups
    ("g1a", "pub1"),      # group vs public
    ("pub1", "g1a"),
    ("alice", "pub1"),    # private vs public
    ("pub1", "alice"),
    ("g1", "g1a"),        # private tenant named like the group
    ("public", "pub1"),   # private tenant named "public"
])
def test_different_sharing_domains_never_share(a: str, b: str) -> None:
    m = manager()
    assert_not_shared(m, session(m, a), BASE, session(m, b), BASE)


@pytest.mark.parametrize(("a", "b"), [
    ("alice", "alice"),   # a private tenant shares with itself (another session)
    ("g1a", "g1b"),       # same group
    ("pub1", "pub2"),     # public
])
def test_same_sharing_domain_shares(a: str, b: str) -> None:
    m = manager()
    assert_shared(m, session(m, a), BASE, session(m, b), BASE)


# -- colliding hashes -------------------------------------------------------------------------

@pytest.mark.parametrize("hasher", [LenHasher, ConstHasher], ids=["len", "const"])
def test_colliding_hash_gives_a_miss_not_foreign_blocks(hasher: type) -> None:
    m = manager(hasher)
    sid = session(m, "pub1")
    first = admit_commit(m, sid, BASE, PROMPT)
    other = [t + 1000 for t in PROMPT]  # same length: every key collides with PROMPT's
    assert m.lookup(sid, BASE, other) == 0
    miss = admit(m, sid, BASE, other)
    assert miss.num_cached_tokens == 0
    assert not set(miss.block_table) & set(first.block_table)
    # The identical prompt still hits (the const hash can only index one block).
    want = FULL_HIT if hasher is LenHasher else B
    assert m.lookup(sid, BASE, PROMPT) == want
    again = admit(m, sid, BASE, PROMPT)
    assert again.num_cached_tokens == want
    assert again.block_table[: want // B] == first.block_table[: want // B]
    m.check_invariants()


@pytest.mark.parametrize("hasher", [LenHasher, ConstHasher], ids=["len", "const"])
def test_colliding_hash_diverging_in_a_later_block(hasher: type) -> None:
    m = manager(hasher)
    sid = session(m, "pub1")
    first = admit_commit(m, sid, BASE, PROMPT)
    other = PROMPT[:B] + [t + 1000 for t in PROMPT[B:]]  # first block equal, rest differ
    res = admit(m, sid, BASE, other)
    assert res.num_cached_tokens == B
    assert res.block_table[0] == first.block_table[0]
    assert not set(res.block_table[1:]) & set(first.block_table)


@pytest.mark.parametrize(("tenant_b", "scope_b"), [
    ("bob", BASE),                                          # another private tenant
    ("g1a", BASE),                                          # another domain
    ("alice", dataclasses.replace(BASE, lora_id="lora-2")),  # another LoRA
    ("alice", dataclasses.replace(BASE, salt=None)),         # salt missing
    ("alice", dataclasses.replace(BASE, model_revision="r2")),
])
@pytest.mark.parametrize("hasher", [LenHasher, ConstHasher], ids=["len", "const"])
def test_colliding_hash_across_namespaces_and_tenants(hasher: type, tenant_b: str,
                                                      scope_b: PrefixScope) -> None:
    m = manager(hasher)
    sa = session(m, "alice")
    sb = session(m, tenant_b)
    first = admit_commit(m, sa, BASE, PROMPT)
    # Identical tokens, colliding keys, different namespace: a miss.
    assert m.lookup(sb, scope_b, PROMPT) == 0
    res = admit(m, sb, scope_b, PROMPT)
    assert res.num_cached_tokens == 0
    assert not set(res.block_table) & set(first.block_table)
    # Also once alice's blocks are only cached.
    m.release(sa, first.seq_id)
    assert m.lookup(sb, scope_b, PROMPT) == 0
    assert admit(m, sb, scope_b, PROMPT).num_cached_tokens == 0
    m.check_invariants()


def _common_blocks(a: list[int], b: list[int]) -> int:
    n = 0
    while (n + 1) * B <= min(len(a), len(b)) and a[n * B:(n + 1) * B] == b[n * B:(n + 1) * B]:
        n += 1
    return n


@given(
    hasher=st.sampled_from([None, LenHasher, ConstHasher]),
    first=st.lists(st.integers(0, 2), min_size=1, max_size=4 * B),
    second=st.lists(st.integers(0, 2), min_size=1, max_size=4 * B),
)
def test_hits_are_exactly_the_common_prefix(hasher: type | None, first: list[int],
                                            second: list[int]) -> None:
    """Whatever the hash: a hit covers exactly the common full-block prefix (capped so the last
    token is computed), and its blocks are the first prompt's. A const hash indexes one block."""
    m = manager(hasher)
    sid = session(m, "pub1")
    a = admit_commit(m, sid, BASE, first)
    want = min(_common_blocks(first, second), (len(second) - 1) // B)
    if hasher is ConstHasher:
        want = min(want, 1)
    assert m.lookup(sid, BASE, second) == want * B
    res = admit(m, sid, BASE, second)
    assert res.num_cached_tokens == want * B
    assert res.block_table[:want] == a.block_table[:want]
    assert not set(res.block_table[want:]) & set(a.block_table)
    m.check_invariants()


# -- regressions: stale parent pointers and recycled namespace ids under a colliding hash ----
#
# A hit is verified by walking parent pointers (block ids). When a parent block is dropped from
# the index (flush, or eviction of the parent before its child) and its id is reused for other
# tokens at the same position, the orphaned child's parent pointer names the reused block; the
# walk must not accept [reused parent, stale child]: the child's K/V was computed after the *old*
# parent's tokens. (Fixed with per-block generations; these tests failed before.)


def _public_pair(hasher: object, quota_a: int = 16) -> tuple[BlockManager, str, str]:
    m = BlockManager(
        PoolSpec(block_size=1, num_blocks=16),
        [TenantPolicy("a", quota_a, sharing=Sharing.PUBLIC),
         TenantPolicy("b", 16, sharing=Sharing.PUBLIC)],
        seed=1, hasher_factory=hasher,  # type: ignore[arg-type]
    )
    return m, m.open_session("a", "sa"), m.open_session("b", "sb")


def test_colliding_hash_after_flush_never_hits_a_stale_child() -> None:
    m, sa, sb = _public_pair(LenHasher)
    scope = PrefixScope("m")
    p = admit_commit(m, sa, scope, [1])                  # a computes block P = [1]
    m.release(sa, p.seq_id)
    c = admit_commit(m, sb, scope, [1, 2, 60])          # b hits P, computes C = [2 after 1]
    assert c.num_cached_tokens == 1
    m.release(sb, c.seq_id)
    assert m.flush(tenant_id="a") == 1                   # P leaves the index; C stays
    q = admit_commit(m, sa, scope, [7])                  # P's id is reused for [7]
    assert q.block_table == p.block_table[:1]
    m.release(sa, q.seq_id)
    res = admit(m, sb, scope, [7, 2, 99])
    # C holds K/V of token 2 computed after token 1, not after token 7.
    assert res.num_cached_tokens <= 1, (
        f"stale child block {c.block_table[1]} (K/V of [1, 2]) served for prefix [7, 2]: "
        f"table {res.block_table}")


def test_colliding_hash_after_parent_eviction_never_hits_a_stale_child() -> None:
    m, sa, sb = _public_pair(LenHasher, quota_a=2)
    scope = PrefixScope("m")
    p = admit_commit(m, sa, scope, [1])
    m.release(sa, p.seq_id)
    c = admit_commit(m, sb, scope, [1, 2, 60])
    assert c.num_cached_tokens == 1
    m.release(sb, c.seq_id)
    # b held P last, so b keeps it (the charging rule); a hit gives it back to a.
    r = admit_commit(m, sa, scope, [1, 5])
    assert r.block_table[:1] == p.block_table[:1]
    m.release(sa, r.seq_id)
    # a is at its quota of 2 (P and [5] cached): this admit evicts both and reuses P's id
    # for [7].
    q = admit_commit(m, sa, scope, [7, 8])
    assert q.block_table[:1] == p.block_table[:1]
    m.release(sa, q.seq_id)
    res = admit(m, sb, scope, [7, 2, 99])
    assert res.num_cached_tokens <= 1, (
        f"stale child block {c.block_table[1]} (K/V of [1, 2]) served for prefix [7, 2]: "
        f"table {res.block_table}")


def test_namespace_dropped_by_admits_own_eviction_never_leaks_across_tenants() -> None:
    """An admit whose eviction drops the last reference to its own namespace keeps using the
    dropped namespace object; its id is then recycled for another tenant's namespace, and the
    sequence's commit indexes its blocks under that other namespace's id.

    Ops: a (quota 1) admits [1], commits, releases (block cached, namespace A held only by it);
    a admits [2]: the quota eviction drops that block and with it namespace A, id 1 is freed;
    b (private) admits [5, 7]: its namespace B gets id 1; a commits [2]: indexed under id 1.
    With a colliding key hash, b's [2, 9] then hits a's block.
    """
    m = BlockManager(PoolSpec(block_size=1, num_blocks=8),
                     [TenantPolicy("a", 1), TenantPolicy("b", 6)], seed=1,
                     hasher_factory=LenHasher)  # type: ignore[arg-type]
    sa = m.open_session("a", "sa")
    sb = m.open_session("b", "sb")
    scope = PrefixScope("m")
    first = admit_commit(m, sa, scope, [1])
    m.release(sa, first.seq_id)
    s = admit(m, sa, scope, [2])
    admit(m, sb, scope, [5, 7])
    m.commit(sa, s.seq_id)
    assert m.lookup(sb, scope, [2, 9]) == 0, "b (private) sees a's block"
    res = admit(m, sb, scope, [2, 9])
    assert res.num_cached_tokens == 0
    assert s.block_table[0] not in res.block_table
