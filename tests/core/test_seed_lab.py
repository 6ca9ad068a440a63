"""The seeds' compact lab, reproduced through the core API.

Seed 000: "A physical cache has 3 blocks. Requests receive non-adjacent blocks."
``tables = {"A": [2, 0], "B": [1]}`` with BLOCK = 4 gives
``A physical slots: [8, 9, 10, 11, 0, 1]`` and ``B physical slots: [4, 5, 6]``.
"""

from helpers import SCOPE, manager

from blockd.core import DoesNotFit


def test_two_sequences_on_three_blocks_give_the_seeds_slots() -> None:
    m = manager(block_size=4, num_blocks=3)
    s = m.open_session("acme")
    # Make the free stack hand out 2, then 0, then 1: occupy all three blocks and release them
    # in the order 1, 0, 2 (the stack is LIFO; caching is off so nothing stays cached).
    warm = [m.admit(s, SCOPE, [900 + i], cache=False) for i in range(3)]
    assert [w.block_table for w in warm] == [[0], [1], [2]]
    for i in (1, 0, 2):
        m.release(s, warm[i].seq_id)

    a = m.admit(s, SCOPE, [100 + t for t in range(6)], cache=False)
    b = m.admit(s, SCOPE, [200 + t for t in range(3)], cache=False)
    assert a.block_table == [2, 0]
    assert b.block_table == [1]
    assert [p.slot for p in m.inspect(s, a.seq_id)] == [8, 9, 10, 11, 0, 1]
    assert [p.slot for p in m.inspect(s, b.seq_id)] == [4, 5, 6]

    # The lab's paged-vs-contiguous count: 5 blocks for lengths 6, 3, 5 (pool of 3 holds 2).
    assert [(p.logical_block, p.offset, p.physical_block) for p in m.inspect(s, a.seq_id)] == [
        (0, 0, 2), (0, 1, 2), (0, 2, 2), (0, 3, 2), (1, 0, 0), (1, 1, 0)]
    m.check_invariants()


def test_revealing_variation_is_impossible_through_the_api() -> None:
    """Seed 000's revealing variation hands B's live block 1 to A as a second writer.

    Through the API, A growing past its blocks on a full pool is refused (does not fit) instead
    of being given block 1, and the tables stay disjoint.
    """
    m = manager(block_size=4, num_blocks=3)
    s = m.open_session("acme")
    warm = [m.admit(s, SCOPE, [900 + i], cache=False) for i in range(3)]
    for i in (1, 0, 2):
        m.release(s, warm[i].seq_id)
    a = m.admit(s, SCOPE, list(range(6)), cache=False)
    b = m.admit(s, SCOPE, list(range(3)), cache=False)

    # A grows to 9 tokens: it needs a third block; the only other block is B's live block 1.
    out = m.append(s, a.seq_id, [6, 7, 8])
    assert isinstance(out, DoesNotFit) and out.reason in ("pool", "quota")
    assert m.block_table(s, a.seq_id) == ([2, 0], 6)
    assert m.block_table(s, b.seq_id) == ([1], 3)

    # Once B is released the table can grow without moving A's first two blocks.
    m.release(s, b.seq_id)
    grown = m.append(s, a.seq_id, [6, 7, 8])
    assert not isinstance(grown, DoesNotFit)
    assert m.block_table(s, a.seq_id) == ([2, 0, 1], 9)
    # Positions 6, 7 finish logical block 1 (physical 0); position 8 starts block 2 (physical 1).
    assert [p.slot for p in m.inspect(s, a.seq_id)] == [8, 9, 10, 11, 0, 1, 2, 3, 4]
    m.check_invariants()


def test_fork_never_gives_a_shared_block_to_a_writer() -> None:
    """A fork shares blocks; the first write into the shared partial block is copied."""
    m = manager(block_size=4, num_blocks=4)
    s = m.open_session("acme")
    a = m.admit(s, SCOPE, list(range(6)), cache=False)
    (child,) = m.fork(s, a.seq_id)
    assert m.block_table(s, child)[0] == a.block_table
    out = m.append(s, child, [99])
    assert out.copy is not None and out.copy.src == a.block_table[1]
    assert m.block_table(s, child)[0] == [a.block_table[0], out.copy.dst]
    assert m.block_table(s, a.seq_id)[0] == a.block_table
    m.check_invariants()
