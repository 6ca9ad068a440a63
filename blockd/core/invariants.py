"""Every invariant of the block lifecycle (design.md section 2), checked in one place.

``check_invariants(m)`` raises :class:`blockd.core.errors.Internal` naming the first violation.
It never uses ``assert``: the daemon's periodic check (``server.invariant_check_interval_ms``)
must work under ``python -O`` too. O(num_blocks + live sequences): for tests after every
operation, and for the daemon's periodic check between calls.
"""

from __future__ import annotations

from array import array
from collections import Counter
from typing import TYPE_CHECKING

from blockd.core.blocks import CACHED, COMMITTED, FREE, PENDING, WRITING
from blockd.core.errors import Internal
from blockd.core.fences import RELEASE

if TYPE_CHECKING:
    from blockd.core.manager import BlockManager


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise Internal(f"invariant violated: {what}")


def check_invariants(m: BlockManager) -> None:
    """Raise ``Internal`` if any invariant of the manager's state does not hold."""
    refs, pends = _check_tables_and_fences(m)
    _check_blocks(m, refs, pends)
    _check_writes_and_quotas(m)
    m.tiers.check()


def _check_tables_and_fences(m: BlockManager) -> tuple[Counter[int], Counter[int]]:
    refs: Counter[int] = Counter()
    B = m.block_size
    for seq in m.sequences.values():
        _require(len(seq.table) == -(-seq.num_tokens // B),
                 f"sequence {seq.id}: {len(seq.table)} blocks for {seq.num_tokens} tokens")
        _require(len(set(seq.table)) == len(seq.table), "a table names a block twice")
        refs.update(seq.table)
    walk = sum(len(seq.table) * B - seq.num_tokens for seq in m.sequences.values())
    _require(m.tail.tokens == walk, f"tail waste total {m.tail.tokens}, the walk says {walk}")
    per_session = Counter(seq.session for seq in m.sequences.values())
    pends: Counter[int] = Counter()
    for session in m.sessions.values():
        _require(session.num_sequences == per_session[session.id],
                 f"session {session.id}: sequence count")
        last = 0
        for f, kind, payload in session.waiting:
            _require(f >= last, "fence queue out of order")
            _require(f > session.completed, "a completed fence is still waiting")
            last = f
            if kind == RELEASE:
                _require(isinstance(payload, array), "a release without block ids")
                pends.update(payload)  # type: ignore[arg-type]
    return refs, pends


def _check_blocks(m: BlockManager, refs: Counter[int], pends: Counter[int]) -> None:
    a = m.blocks
    index = m.index
    state = a.state
    free_list = a.free_list()
    free_set = set(free_list)
    _require(len(free_set) == len(free_list) == a.num_free, "free stack is broken")
    cached_sets = [a.lru_order(t) for t in range(len(a.usage))]
    cached_all = [b for lst in cached_sets for b in lst]
    _require(len(cached_all) == len(set(cached_all)) == a.num_cached, "LRU lists are broken")
    cached_set = set(cached_all)
    usage = [0] * len(a.usage)
    for b in range(m.num_blocks):
        s = state[b]
        r = a.ref[b]
        p = a.pend[b]
        _require(r == refs[b], f"block {b}: ref {r} but {refs[b]} tables name it")
        _require(p == pends[b], f"block {b}: pend {p} but {pends[b]} waiting releases")
        _require((b in free_set) == (s == FREE), f"block {b}: free stack vs state {s}")
        _require((b in cached_set) == (s == CACHED), f"block {b}: LRU vs state {s}")
        indexed = index.key[b] is not None
        if s in (FREE, CACHED):
            _require(r == 0 and p == 0, f"block {b} reusable with ref {r} / pend {p}")
        if s == PENDING:
            _require(r == 0 and p > 0, f"block {b} pending with ref {r} / pend {p}")
        if s in (WRITING, COMMITTED):
            _require(r >= 1, f"block {b} in use with ref 0")
        if s == CACHED:
            _require(indexed, f"cached block {b} is not indexed")
        if indexed:
            _require(s in (COMMITTED, PENDING, CACHED), f"indexed block {b} in state {s}")
            _require(index.map.get(index.key[b]) == b,  # type: ignore[arg-type]
                     f"block {b}: key maps elsewhere")
            _require(index.ns[b] != 0, f"indexed block {b} has no namespace")
        if s != FREE:
            usage[a.payer[b]] += 1
    _require(len(index.map) == sum(1 for k in index.key if k is not None),
             "index map and keys disagree")
    for b in m.cache.dup:
        _require(state[b] != FREE and index.key[b] is None, f"stale duplicate {b}")
    _require(sum(usage) == m.num_blocks - a.num_free, "payers do not sum to the blocks in use")
    _check_charges(m, usage)
    _require(usage == a.usage, f"usage {a.usage} but blocks say {usage}")
    _require([len(x) for x in cached_sets] == a.cached, "cached counts disagree with the LRUs")
    _require(sum(a.count_states()) == m.num_blocks, "a block is in no state")


def _check_charges(m: BlockManager, usage: list[int]) -> None:
    """The charging rule (``blockd.core.blocks``): a held block's payer is one of its holders
    (tenants whose tables name it or whose releases of it wait for a fence), ``co_holders``
    are exactly the others with their holds; each of them is charged once more (added to
    ``usage``, which counts payers so far)."""
    a = m.blocks
    holds: dict[int, Counter[int]] = {}
    for seq in m.sequences.values():
        for b in seq.table:
            holds.setdefault(b, Counter())[seq.tenant] += 1
    for session in m.sessions.values():
        for _, _, payload in session.waiting:
            if isinstance(payload, array):
                for b in payload:
                    holds.setdefault(b, Counter())[session.tenant] += 1
    for b, by in holds.items():
        p = a.payer[b]
        _require(p in by, f"block {b}: payer {p} holds it not ({dict(by)})")
        others = {t: n for t, n in by.items() if t != p}
        _require(a.co_holders.get(b, {}) == others,
                 f"block {b}: co-holders {a.co_holders.get(b)} but tables and fences say "
                 f"{others}")
        for t in others:
            usage[t] += 1
    for b, others in a.co_holders.items():
        _require(b in holds and bool(others), f"block {b}: stale co-holders {others}")


def _check_writes_and_quotas(m: BlockManager) -> None:
    state = m.blocks.state
    B = m.block_size
    # Writes happen only at a sequence's last, partly filled block; a shared one must be
    # copied first (append does), and no indexed block is ever a write target.
    for seq in m.sequences.values():
        if seq.num_tokens % B:
            last = seq.table[-1]
            _require(state[last] == WRITING, f"partial block {last} is {state[last]}")
            _require(m.index.key[last] is None, f"partial block {last} is indexed")
        for b in seq.table[seq.num_committed:seq.num_tokens // B]:
            _require(state[b] in (WRITING, COMMITTED), f"full block {b} is {state[b]}")
    usage = m.blocks.usage
    for slot, policy in enumerate(m.tenants.policies):
        if m.tenants.active[slot]:
            _require(usage[slot] <= policy.quota_blocks, f"tenant {policy.tenant_id} over quota")
