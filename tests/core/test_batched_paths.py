"""The batched block-array paths (core_perf) leave exactly the state of the one-block paths.

``take`` over a long run writes its fields with numpy, ``evict_oldest`` unlinks a run of the
LRU at once, ``cache_many`` / ``give_back_many`` link and free lists of blocks: each is
compared here, array by array, with a reference built from the per-block steps it replaced
(``oldest_cached`` + ``uncache``, a ``take`` loop below the vector threshold, ``cache`` and
``give_back`` one at a time).
"""

import random

import pytest
from helpers import SCOPE, manager

from blockd.core.blocks import CACHED, NO_OWNER, VECTOR_TAKE, BlockArrays
from blockd.core.snapshot import canonical


def _scattered(num_blocks: int, tenants: int, seed: int) -> BlockArrays:
    """A pool whose free stack is shuffled and whose free blocks were last owned by various
    tenants (some never owned), a quarter of the blocks CACHED on several tenants' LRUs."""
    rng = random.Random(seed)
    a = BlockArrays(num_blocks, tenants)
    taken = a.take(num_blocks, 0, [False] * tenants, False, [])
    rng.shuffle(taken)
    a.usage = [0] * tenants
    for b in taken:
        a.ref[b] = 0
        a.owner[b] = a.payer[b] = rng.randrange(tenants)
        a.usage[a.payer[b]] += 1
    cached, freed = taken[: num_blocks // 4], taken[num_blocks // 4:]
    for b in freed:
        _free_one(a, b)
        if rng.random() < 0.2:
            a.owner[b] = NO_OWNER  # never owned (a fresh block keeps this after its release)
    for b in cached:
        _cache_one(a, b)
    return a


def _free_one(a: BlockArrays, b: int) -> None:
    """``give_back`` as it was before the batch version (one block)."""
    a.state[b] = 0
    a.usage[a.payer[b]] -= 1
    a.next[b] = a.free_head
    a.free_head = b
    a.num_free += 1


def _cache_one(a: BlockArrays, b: int) -> None:
    """``cache`` as it was before the batch version (one block)."""
    t = a.payer[b]
    a.state[b] = CACHED
    a._clock = (a._clock + 1) & 0xFFFFFFFF
    a.stamp[b] = a._clock
    tail = a.tail[t]
    a.prev[b] = tail
    a.next[b] = -1
    if tail == -1:
        a.head[t] = b
    else:
        a.next[tail] = b
    a.tail[t] = b
    a.cached[t] += 1
    a.num_cached += 1


def _copy(a: BlockArrays) -> BlockArrays:
    import pickle

    return pickle.loads(pickle.dumps(a))


@pytest.mark.parametrize("scrub_all", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_long_take_matches_the_block_by_block_loop(seed: int, scrub_all: bool) -> None:
    n = 4 * VECTOR_TAKE + 3
    a = _scattered(8 * VECTOR_TAKE, 3, seed)
    b = _copy(a)
    scrub_owner = [True, False, True]
    got_scrub: list[int] = [7]  # an earlier entry stays first
    want_scrub: list[int] = [7]
    got = a.take(n, 1, scrub_owner, scrub_all, got_scrub)
    want = []
    for _ in range(n):  # below the threshold: the Python loop, one block at a time
        want += b.take(1, 1, scrub_owner, scrub_all, want_scrub)
    assert got == want
    assert got_scrub == want_scrub and len(want_scrub) > 1
    assert canonical(a) == canonical(b)


@pytest.mark.parametrize("tenant", [None, 0, 2])
@pytest.mark.parametrize("n", [1, 5, 10_000])
def test_evict_oldest_matches_oldest_cached_then_uncache(tenant: int | None, n: int) -> None:
    a = _scattered(256, 3, 5)
    b = _copy(a)
    got = a.evict_oldest(n, tenant)
    want = []
    while len(want) < n and (blk := b.oldest_cached(tenant)) != -1:
        b.uncache(blk)
        want.append(blk)
    assert got == want and got
    assert canonical(a) == canonical(b)


def test_evict_oldest_over_one_tenants_list_matches_the_reference() -> None:
    a = BlockArrays(64, 2)
    a.take(64, 1, [False, False], False, [])
    for blk in (5, 9, 3, 40, 41, 0):
        a.ref[blk] = 0
        _cache_one(a, blk)
    b = _copy(a)
    # Only tenant 1 has cached blocks: the one-list fast path, under tenant=None too.
    assert a.evict_oldest(4, None) == [5, 9, 3, 40]
    for blk in (5, 9, 3, 40):
        assert b.oldest_cached(None) == blk
        b.uncache(blk)
    assert canonical(a) == canonical(b)
    assert a.lru_order(1) == [41, 0]


def test_cache_many_and_give_back_many_match_one_at_a_time() -> None:
    a = BlockArrays(32, 2)
    a.take(32, 0, [False, False], False, [])
    for blk in range(16, 32):
        a.owner[blk] = a.payer[blk] = 1
    a.usage = [16, 16]
    for blk in range(32):
        a.ref[blk] = 0
    b = _copy(a)
    order = [3, 17, 4, 30, 0, 21]
    a.cache_many(order)
    for blk in order:
        _cache_one(b, blk)
    freed = [8, 25, 9]
    a.give_back_many(freed)
    for blk in freed:
        _free_one(b, blk)
    assert canonical(a) == canonical(b)


def test_a_long_prompt_admit_takes_the_same_blocks_as_short_ones() -> None:
    """Through the manager: one admit of a long prompt (the vector take) hands out the same
    table as the same blocks taken by many short admits would, after evictions scattered the
    free stack."""
    tables = []
    for long_first in (True, False):
        m = manager(block_size=4, num_blocks=4 * VECTOR_TAKE)
        s = m.open_session("acme")
        # Scatter the free stack: admit, commit and release prompts in an interleaved order.
        seqs = [m.admit(s, SCOPE, list(range(i * 1000, i * 1000 + 4 * 9 + 1))) for i in range(8)]
        for r in seqs:
            m.commit(s, r.seq_id)
        for r in seqs[::3] + seqs[1::3] + seqs[2::3]:
            m.release(s, r.seq_id)
        prompt = list(range(500_000, 500_000 + 4 * (2 * VECTOR_TAKE)))
        if long_first:
            r = m.admit(s, SCOPE, prompt)
            tables.append(r.block_table)
        else:
            # The same allocation, one block per append (each below the vector threshold).
            r = m.admit(s, SCOPE, prompt[:1])
            for t in prompt[1:]:
                m.append(s, r.seq_id, [t])
            tables.append(m.block_table(s, r.seq_id)[0])
        m.check_invariants()
    assert tables[0] == tables[1]
