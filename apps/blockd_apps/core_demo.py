"""A narrated walk through the block manager, in process (``blockd demo-core``).

It shows the block lifecycle of docs/architecture.md on a tiny pool: two requests sharing a
system prompt, a prefix hit, a fork with copy-on-write, a release held back by a fence, and the
seeds' per-position table (debugging step 1).
"""

from __future__ import annotations

from collections.abc import Callable

from blockd.core import BlockManager, PoolSpec, PrefixScope, TenantPolicy


def run(say: Callable[[str], None] = print) -> BlockManager:
    spec = PoolSpec(block_size=4, num_blocks=12)
    m = BlockManager(spec, [TenantPolicy("demo", quota_blocks=12)])
    scope = PrefixScope("tiny-llama", model_revision="r1")
    s = m.open_session("demo")
    system = [101, 102, 103, 104, 105, 106, 107, 108]

    say(f"pool: {spec.num_blocks} blocks of {spec.block_size} tokens; states {m.state_counts()}")
    a = m.admit(s, scope, system + [1, 2, 3])
    say(f"admit A (11 tokens): table {a.block_table}, cached tokens {a.num_cached_tokens}")
    m.commit(s, a.seq_id, fence=1)
    say(f"commit A's 2 full blocks under fence 1 -> states {m.state_counts()}")
    say(f"lookup of the system prompt before fence 1 completes: "
        f"{m.lookup(s, scope, system + [9])} cached tokens")
    m.complete_fence(s, 1)
    say(f"fence 1 complete: lookup finds {m.lookup(s, scope, system + [9])} cached tokens")
    b = m.admit(s, scope, system + [4, 5])
    say(f"admit B (same system prompt): table {b.block_table}, cached tokens "
        f"{b.num_cached_tokens} (blocks {b.block_table[:2]} now have refcount "
        f"{m.sequence_blocks(s, b.seq_id)[0].ref_count})")
    (c,) = m.fork(s, b.seq_id)
    out = m.append(s, c, [6], fence=2)
    say(f"fork B -> C, append to C: copy-on-write {out.copy}, C's table "
        f"{m.block_table(s, c)[0]}")
    m.release(s, a.seq_id, fence=2)
    say(f"release A under fence 2: states {m.state_counts()}")
    m.complete_fence(s, 2)
    say(f"fence 2 complete: states {m.state_counts()}")
    say("C, position by position (logical block, offset, physical block, slot):")
    for p in m.inspect(s, c):
        say(f"  pos {p.position:2d}: lb {p.logical_block} off {p.offset} -> "
            f"block {p.physical_block:2d} slot {p.slot:3d}")
    c_ = m.counters
    say(f"prefix hit rate: {c_.hit_tokens}/{c_.queried_tokens} tokens; "
        f"copy-on-write copies {c_.cow_copies}")
    m.check_invariants()
    say("invariants hold")
    return m
