"""``tail_waste_tokens`` is a running total (issue 17: a metrics scrape must not walk every
sequence). Property: after any mix of operations it equals the walk over live sequences,
``len(table) * block_size - num_tokens`` summed; also across a snapshot round trip, and
unchanged by refused operations. (``check_invariants`` compares the two as well, so every core
test that checks invariants checks this too.)"""

import random

import pytest
from helpers import SCOPE, manager

from blockd.core import snapshot
from blockd.core.errors import BlockdError
from blockd.core.sequence import TailWaste


def walk(m) -> int:  # type: ignore[no-untyped-def]
    return TailWaste.walk(m.sequences.values(), m.block_size)


@pytest.mark.parametrize("seed", range(25))
def test_running_total_equals_the_walk_after_random_operations(seed: int) -> None:
    rng = random.Random(seed)
    m = manager(block_size=4, num_blocks=40, preemption="priority")
    sessions = [m.open_session("acme") for _ in range(2)]
    fence = {s: 0 for s in sessions}
    live: dict[str, str] = {}  # seq id -> session
    for _ in range(150):
        op = rng.choice(["admit", "append", "append", "batch", "batch", "fork", "release",
                         "commit", "fence", "close"])
        s = rng.choice(sessions)
        mine = [q for q, owner in live.items() if owner == s and q in m.sequences]
        try:
            if op == "admit":
                prompt = [rng.randrange(6) for _ in range(rng.randint(1, 13))]
                r = m.admit(s, SCOPE, prompt, priority=rng.randint(0, 2))
                if hasattr(r, "seq_id"):
                    live[r.seq_id] = s
            elif op == "append" and mine:
                m.append(s, rng.choice(mine), [rng.randrange(6)] * rng.randint(0, 6),
                         fence[s] + 1)
                fence[s] += 1
            elif op == "batch" and mine:
                ids = rng.sample(mine, rng.randint(1, len(mine)))
                if rng.random() < 0.5:
                    m.append_batch(s, ids, bytes(4 * len(ids)), fence=fence[s] + 1)
                else:
                    counts = [rng.randint(0, 5) for _ in ids]
                    m.append_batch(s, ids, bytes(4 * sum(counts)), counts, fence[s] + 1)
                fence[s] += 1
            elif op == "fork" and mine:
                for c in m.fork(s, rng.choice(mine), rng.randint(1, 3)):
                    live[c] = s
            elif op == "release" and mine:
                q = rng.choice(mine)
                m.release(s, q, fence[s])
                del live[q]
            elif op == "commit" and mine:
                m.commit(s, rng.choice(mine), fence[s])
            elif op == "fence" and fence[s]:
                m.complete_fence(s, fence[s])
            elif op == "close" and rng.random() < 0.1:
                m.close_session(s)
                sessions.remove(s)
                sessions.append(m.open_session("acme"))
                fence[sessions[-1]] = 0
        except BlockdError:
            pass  # a refusal changes nothing; the totals must still agree
        # Preemption may have ended sequences of either session.
        live = {q: o for q, o in live.items() if q in m.sequences}
        assert m.tail_waste_tokens() == walk(m), op
    m.check_invariants()
    restored = snapshot.load(snapshot.dump(m))
    assert restored.tail_waste_tokens() == walk(restored) == walk(m)


def test_each_operation_moves_the_total_by_its_own_waste() -> None:
    m = manager(block_size=4, num_blocks=16)
    s = m.open_session("acme")
    a = m.admit(s, SCOPE, list(range(5)))  # 2 blocks, 5 tokens: 3 wasted
    assert m.tail_waste_tokens() == 3
    m.append(s, a.seq_id, [9])  # in place
    assert m.tail_waste_tokens() == 2
    m.append(s, a.seq_id, [9, 9, 9])  # fills the block and opens one: 9 tokens in 3 blocks
    assert m.tail_waste_tokens() == 3
    kids = m.fork(s, a.seq_id, 2)
    assert m.tail_waste_tokens() == 9
    m.append_batch(s, kids, bytes(8), fence=1)  # copy-on-write for both children
    assert m.tail_waste_tokens() == 3 + 2 + 2
    m.release(s, a.seq_id, 1)
    assert m.tail_waste_tokens() == 4 == walk(m)
    m.close_session(s)
    assert m.tail_waste_tokens() == 0
