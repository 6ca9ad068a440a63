"""A session's own pending commits are hits for its own later admissions, never for others'.

Blocks committed in a Step whose fence has not completed hold K/V that the worker's kernels of
that step are still writing. The same worker launches its later kernels after them (one stream
orders them), so its own next admissions may share those blocks; another worker's kernels are
not ordered after them, so every other session (of any tenant) misses until the fence
completes. Block size 4 throughout, exact block ids.
"""

from colliding_hashers import LenHasher
from helpers import SCOPE, manager, state_of

from blockd.core import PrefixScope, snapshot

SYSTEM = [11, 12, 13, 14, 15, 16, 17, 18]  # two full blocks


def test_own_pending_commit_is_hit_by_the_same_session() -> None:
    m = manager(num_blocks=12)
    s = m.open_session("acme")
    r1 = m.admit(s, SCOPE, SYSTEM + [1])
    assert r1.block_table == [0, 1, 2]
    assert m.commit(s, r1.seq_id, fence=1) == 2  # fence 1 not complete: blocks 0, 1 pending
    assert m.lookup(s, SCOPE, SYSTEM + [2]) == 8
    r2 = m.admit(s, SCOPE, SYSTEM + [2])
    assert (r2.block_table, r2.num_cached_tokens) == ([0, 1, 3], 8)
    assert (m.blocks.ref[0], m.blocks.ref[1]) == (2, 2)
    assert m.num_indexed == 0  # still nobody else's: not in the index
    m.check_invariants()
    m.complete_fence(s, 1)
    assert m.num_indexed == 2
    assert m.session_view(s).oldest_waiting_fence is None
    m.check_invariants()


def test_another_session_misses_until_the_fence_completes() -> None:
    m = manager(num_blocks=12)
    s = m.open_session("acme")
    other = m.open_session("acme")  # same tenant, another worker
    r1 = m.admit(s, SCOPE, SYSTEM + [1])
    m.commit(s, r1.seq_id, fence=1)
    assert m.lookup(other, SCOPE, SYSTEM + [2]) == 0
    r2 = m.admit(other, SCOPE, SYSTEM + [2])
    assert (r2.block_table, r2.num_cached_tokens) == ([3, 4, 5], 0)
    m.check_invariants()
    m.complete_fence(s, 1)
    r3 = m.admit(other, SCOPE, SYSTEM + [3])
    assert (r3.block_table, r3.num_cached_tokens) == ([0, 1, 6], 8)
    m.check_invariants()


def test_pending_hit_across_steps_and_after_the_committer_is_released() -> None:
    """Blocks of two waiting commits chain (the second's parent is the first's block); the
    committing sequence's release leaves them PENDING, and a hit makes them committed."""
    m = manager(num_blocks=12)
    s = m.open_session("acme")
    r1 = m.admit(s, SCOPE, SYSTEM + [19, 20])  # blocks 0, 1 full, block 2 half
    assert m.commit(s, r1.seq_id, fence=1) == 2
    m.append(s, r1.seq_id, [21, 22], fence=2)  # block 2 full now
    assert m.commit(s, r1.seq_id, fence=2) == 1
    assert m.release(s, r1.seq_id, fence=2) == 3
    assert [m.block_state(b) for b in (0, 1, 2)] == ["pending"] * 3
    r2 = m.admit(s, SCOPE, SYSTEM + [19, 20, 21, 22, 9])
    assert (r2.block_table, r2.num_cached_tokens) == ([0, 1, 2, 3], 12)
    assert [m.block_state(b) for b in (0, 1, 2)] == ["committed"] * 3
    m.check_invariants()
    m.complete_fence(s, 2)
    assert [m.block_state(b) for b in (0, 1, 2)] == ["committed"] * 3
    assert m.num_indexed == 3
    m.check_invariants()


def test_a_dropped_commit_is_no_longer_a_pending_hit() -> None:
    """A revoked session's unconfirmed commits are dropped (half-written K/V): neither its
    own later admissions nor anyone else may hit them."""
    m = manager(num_blocks=12)
    s = m.open_session("acme")
    r1 = m.admit(s, SCOPE, SYSTEM + [1])
    m.commit(s, r1.seq_id, fence=1)
    assert m.revoke_session(s) == 1
    assert m.lookup(s, SCOPE, SYSTEM + [2]) == 0
    r2 = m.admit(s, SCOPE, SYSTEM + [2])
    assert r2.num_cached_tokens == 0 and not set(r2.block_table) & {0, 1, 2}
    m.check_invariants()
    m.close_session(s)
    assert m.num_indexed == 0
    m.check_invariants()


def test_pending_hits_are_verified_like_indexed_ones() -> None:
    """With a hash under which block i of every prompt has the same key, a pending entry is
    found for any prompt: only its token ids, parent and namespace decide."""
    m = manager(num_blocks=16, hasher_factory=LenHasher)
    s = m.open_session("acme")
    r1 = m.admit(s, SCOPE, SYSTEM + [1])
    m.commit(s, r1.seq_id, fence=1)
    # Block 0 differs: a miss, though the key of block 0 is found.
    r2 = m.admit(s, SCOPE, [99] + SYSTEM[1:] + [1])
    assert r2.num_cached_tokens == 0
    # Block 0 matches, block 1 differs: only block 0 is a hit.
    r3 = m.admit(s, SCOPE, SYSTEM[:4] + [0, 0, 0, 0, 1])
    assert (r3.block_table[:1], r3.num_cached_tokens) == ([0], 4)
    # Another namespace never hits, whatever the tokens.
    r4 = m.admit(s, PrefixScope("llama-tiny", model_revision="r2"), SYSTEM + [1])
    assert r4.num_cached_tokens == 0
    m.check_invariants()


def test_a_pending_hit_survives_a_snapshot() -> None:
    """Pending entries are part of the session: a restored manager hits them exactly as the
    live one does."""
    m = manager(num_blocks=12)
    s = m.open_session("acme")
    r1 = m.admit(s, SCOPE, SYSTEM + [1])
    m.commit(s, r1.seq_id, fence=1)
    restored = snapshot.load(snapshot.dump(m))
    assert state_of(restored) == state_of(m)
    live = m.admit(s, SCOPE, SYSTEM + [2])
    again = restored.admit(s, SCOPE, SYSTEM + [2])
    assert (again.block_table, again.num_cached_tokens) == (live.block_table, 8)
    for x in (m, restored):
        x.complete_fence(s, 1)
        x.check_invariants()
    # Sequence ids are minted afresh by each manager; everything else is the same.
    assert bytes(restored.blocks.state) == bytes(m.blocks.state)
    assert restored.blocks.ref.tobytes() == m.blocks.ref.tobytes()
    assert restored.num_indexed == m.num_indexed == 2
