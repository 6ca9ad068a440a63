"""Narrated scenarios with exact block ids (block size 4 throughout).

Each test tells a short story of the block lifecycle of design.md section 2 and asserts every
block id, state and refcount along the way.
"""

from helpers import SCOPE, manager

from blockd.core import DoesNotFit

SYSTEM = [11, 12, 13, 14, 15, 16, 17, 18]  # two full blocks of "system prompt"


def test_prefix_hit_reuses_committed_blocks() -> None:
    m = manager(num_blocks=8)
    s = m.open_session("acme")
    # Request 1: system prompt + 3 tokens -> blocks 0, 1 (full) and 2 (partial).
    r1 = m.admit(s, SCOPE, SYSTEM + [1, 2, 3])
    assert (r1.block_table, r1.num_cached_tokens) == ([0, 1, 2], 0)
    # The worker writes K/V in the step with fence 1 and commits the full blocks under it.
    assert m.commit(s, r1.seq_id, fence=1) == 2
    # Before fence 1 completes the blocks are sealed but invisible to every other session
    # (another worker's kernels are not ordered after this step's): its lookup misses.
    other = m.open_session("acme")
    assert m.lookup(other, SCOPE, SYSTEM + [7, 7, 7]) == 0
    assert m.block_state(0) == "committed"
    m.complete_fence(s, 1)
    assert m.lookup(other, SCOPE, SYSTEM + [7, 7, 7]) == 8
    # Request 2 shares the system prompt: it gets blocks 0 and 1, refcount 2, and a new block.
    r2 = m.admit(s, SCOPE, SYSTEM + [4, 5])
    assert (r2.block_table, r2.num_cached_tokens) == ([0, 1, 3], 8)
    assert (m.blocks.ref[0], m.blocks.ref[1], m.blocks.ref[3]) == (2, 2, 1)
    assert m.counters.hit_tokens == 8 and m.counters.queried_tokens == 21
    m.check_invariants()


def test_a_full_hit_still_computes_the_last_token() -> None:
    m = manager(num_blocks=8)
    s = m.open_session("acme")
    r1 = m.admit(s, SCOPE, SYSTEM)
    m.commit(s, r1.seq_id)
    # The same 8 tokens again: block 0 hits, block 1 is recomputed into a fresh block so the
    # worker gets the last token's logits.
    r2 = m.admit(s, SCOPE, SYSTEM)
    assert (r2.block_table, r2.num_cached_tokens) == ([0, 2], 4)
    m.check_invariants()


def test_partial_block_is_never_a_hit() -> None:
    m = manager(num_blocks=8)
    s = m.open_session("acme")
    r1 = m.admit(s, SCOPE, SYSTEM + [1, 2])  # blocks 0, 1 full; block 2 holds 2 of 4 tokens
    m.commit(s, r1.seq_id)
    assert m.commit(s, r1.seq_id) == 0  # nothing new to commit; the partial block never is
    # A prompt that continues exactly past the partial block's two tokens hits only the two
    # full blocks: partial blocks are never indexed.
    r2 = m.admit(s, SCOPE, SYSTEM + [1, 2, 3, 4, 5])
    assert (r2.block_table, r2.num_cached_tokens) == ([0, 1, 3, 4], 8)
    # A prompt differing inside block 1 hits only block 0.
    r3 = m.admit(s, SCOPE, SYSTEM[:4] + [0, 0, 0, 0, 9])
    assert (r3.block_table, r3.num_cached_tokens) == ([0, 5, 6], 4)
    m.check_invariants()


def test_eviction_order_is_lru_with_chain_tails_first() -> None:
    m = manager(num_blocks=6)
    s = m.open_session("acme")
    # Two finished requests leave cached chains: A = blocks 0, 1 (then 2 partial, freed) and
    # B = blocks 3, 4 (then 5 partial, freed).
    a = m.admit(s, SCOPE, [1] * 8 + [0])
    b = m.admit(s, SCOPE, [2] * 8 + [0])
    assert (a.block_table, b.block_table) == ([0, 1, 2], [3, 4, 5])
    for r in (a, b):
        m.commit(s, r.seq_id)
        m.release(s, r.seq_id)
    # Released tails first: A's block 1 is older than block 0, then B's 4, then 3.
    assert m.blocks.lru_order(0) == [1, 0, 4, 3]
    assert m.state_counts()["cached"] == 4 and m.state_counts()["free"] == 2
    # A 12-token prompt needs 3 blocks: the two free ones (2 and 5) and one eviction: block 1,
    # the tail of the least recently used chain. Its parent, block 0, stays cached. (The evicted
    # block goes on top of the free stack, so it is handed out first.)
    c = m.admit(s, SCOPE, [3] * 12)
    assert c.block_table == [1, 5, 2]
    assert m.blocks.lru_order(0) == [0, 4, 3]
    assert m.counters.evictions == 1
    # A's prefix still hits its first block.
    assert m.lookup(s, SCOPE, [1] * 8 + [0]) == 4
    # A hit on block 0 takes it off the LRU; the new block for the rest evicts B's tail, 4.
    d = m.admit(s, SCOPE, [1] * 4 + [6])
    assert (d.block_table, d.num_cached_tokens) == ([0, 4], 4)
    # Released again, block 0 is the most recently used; block 4 (partial) is simply free.
    m.release(s, d.seq_id)
    assert m.blocks.lru_order(0) == [3, 0]
    assert m.counters.evictions == 2
    m.check_invariants()


def test_copy_on_write_after_fork_then_append() -> None:
    m = manager(num_blocks=8)
    s = m.open_session("acme")
    parent = m.admit(s, SCOPE, [5, 6, 7, 8, 9, 10])  # block 0 full, block 1 holds 2 tokens
    assert parent.block_table == [0, 1]
    c1, c2 = m.fork(s, parent.seq_id, 2)
    assert [m.blocks.ref[b] for b in (0, 1)] == [3, 3]
    # The parent writes first: block 1 is shared, so it gets a copy in block 2.
    out = m.append(s, parent.seq_id, [11], fence=1)
    assert (out.start_index, out.block_ids, out.copy.src, out.copy.dst) == (1, [2], 1, 2)
    assert m.block_table(s, parent.seq_id) == ([0, 2], 7)
    assert [m.blocks.ref[b] for b in (0, 1, 2)] == [3, 2, 1]
    # Child 1 still shares block 1 with child 2: another copy, into block 3.
    out = m.append(s, c1, [21, 22], fence=1)
    assert (out.copy.src, out.copy.dst) == (1, 3)
    # Child 2 is now block 1's only holder and writes in place: no copy.
    out = m.append(s, c2, [31], fence=1)
    assert out.copy is None and m.block_table(s, c2) == ([0, 1], 7)
    # The full, shared block 0 never needed copying; appending past it allocates normally.
    out = m.append(s, c2, [32, 33], fence=1)
    assert (out.start_index, out.block_ids, out.copy) == (2, [4], None)
    assert m.counters.cow_copies == 2
    m.check_invariants()


def test_release_under_incomplete_fence_delays_reuse() -> None:
    m = manager(num_blocks=2)
    s = m.open_session("acme")
    r1 = m.admit(s, SCOPE, [1, 2, 3, 4, 5])  # blocks 0 and 1: the whole pool
    assert r1.block_table == [0, 1]
    # The step with fence 7 still reads the blocks on the GPU when the sequence finishes.
    m.release(s, r1.seq_id, fence=7)
    assert m.state_counts() == {"free": 0, "writing": 0, "committed": 0, "pending": 2,
                                "cached": 0}
    # Nothing can be reused yet: a new request does not fit, and nothing changed.
    assert isinstance(m.admit(s, SCOPE, [9]), DoesNotFit)
    assert m.state_counts()["pending"] == 2
    m.complete_fence(s, 6)  # an earlier fence changes nothing
    assert m.state_counts()["pending"] == 2
    m.complete_fence(s, 7)
    assert m.state_counts()["free"] == 2
    r2 = m.admit(s, SCOPE, [9])
    assert r2.block_table == [0]
    m.check_invariants()


def test_shared_block_waits_for_every_covering_fence() -> None:
    """A block released by two sessions is reused only after both fences complete."""
    m = manager(num_blocks=3)
    s1 = m.open_session("acme")
    s2 = m.open_session("acme")
    r1 = m.admit(s1, SCOPE, [1, 2, 3, 4, 5])
    m.commit(s1, r1.seq_id)
    r2 = m.admit(s2, SCOPE, [1, 2, 3, 4, 6])
    assert r2.block_table[0] == 0 and m.blocks.ref[0] == 2
    m.release(s1, r1.seq_id, fence=3)  # session 1's kernels may still read block 0
    m.release(s2, r2.seq_id, fence=5)
    m.complete_fence(s2, 5)
    assert m.block_state(0) == "pending"
    m.complete_fence(s1, 3)
    assert m.block_state(0) == "cached"
    m.check_invariants()


def test_zero_fence_waits_for_the_sessions_earlier_fences() -> None:
    m = manager(num_blocks=2)
    s = m.open_session("acme")
    r = m.admit(s, SCOPE, [1, 2, 3])
    m.append(s, r.seq_id, [4], fence=2)  # step 2's kernels read and write block 0
    m.release(s, r.seq_id, fence=0)  # a later step with no GPU work of its own
    assert m.block_state(0) == "pending"
    m.complete_fence(s, 2)
    assert m.block_state(0) == "free"
    m.check_invariants()


def test_commit_of_a_dead_worker_is_never_indexed() -> None:
    m = manager(num_blocks=4)
    s = m.open_session("acme")
    r = m.admit(s, SCOPE, [1, 2, 3, 4, 5])
    m.commit(s, r.seq_id, fence=1)
    # The worker dies before reporting fence 1: its K/V may be half written.
    m.close_session(s)
    s2 = m.open_session("acme")
    assert m.lookup(s2, SCOPE, [1, 2, 3, 4, 5]) == 0
    assert m.state_counts()["free"] == 4
    m.check_invariants()


def test_append_batch_matches_single_appends() -> None:
    """The batched decode path gives exactly what one append per sequence gives."""

    def run(batched: bool):  # type: ignore[no-untyped-def]
        m = manager(num_blocks=9)
        s = m.open_session("acme")
        a = m.admit(s, SCOPE, [1, 2, 3])  # room in its last block
        b = m.admit(s, SCOPE, [4, 5, 6, 7])  # full last block: needs a new one
        (c,) = m.fork(s, a.seq_id)  # shares a's partial block: copy-on-write
        ids = [a.seq_id, b.seq_id, c, "ghost"]
        tokens = [[10], [11, 12], [13], [14]]
        if batched:
            raw = b"".join(t.to_bytes(4, "little") for ts in tokens for t in ts)
            out = m.append_batch(s, ids, raw, [1, 2, 1, 1], fence=1)
            results = dict(out.deltas)
            errors = dict(out.errors)
            nums = out.num_tokens
        else:
            results, errors, nums = {}, {}, []
            for i, (sid, ts) in enumerate(zip(ids, tokens, strict=True)):
                try:
                    r = m.append(s, sid, ts, fence=1)
                except Exception as exc:  # noqa: BLE001 - compared below
                    errors[i] = exc
                    nums.append(0)
                    continue
                nums.append(r.num_tokens)
                if r.block_ids:
                    results[i] = r
        m.check_invariants()
        return ([m.block_table(s, x) for x in ids[:3]], nums,
                {i: (r.start_index, r.block_ids, r.copy) for i, r in results.items()},
                {i: type(e).__name__ for i, e in errors.items()}, m.counters.cow_copies)

    single, batched = run(False), run(True)
    assert batched == single
    tables, nums, deltas, errors, cows = batched
    assert nums == [4, 6, 4, 0]
    # a copies the block it shares with c; c, then its only holder, writes in place.
    assert set(deltas) == {0, 1} and deltas[0][2] is not None
    assert errors == {3: "NotFound"} and cows == 1
