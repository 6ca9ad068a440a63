"""Small builders shared by the core tests."""

import itertools

from blockd.core import BlockManager, PoolSpec, PrefixScope, SequenceIds, TenantPolicy
from blockd.core.snapshot import canonical

SCOPE = PrefixScope("llama-tiny", model_revision="r1")


def manager(block_size: int = 4, num_blocks: int = 8, quota: int | None = None,
            tenants: list[TenantPolicy] | None = None, **kw: object) -> BlockManager:
    if tenants is None:
        tenants = [TenantPolicy("acme", quota_blocks=quota or num_blocks)]
    return BlockManager(PoolSpec(block_size=block_size, num_blocks=num_blocks), tenants,
                        seed=1234, **kw)


def snapshot(m: BlockManager) -> tuple:
    """Everything an operation could change, for 'changed nothing' assertions."""
    return (
        m.state_counts(),
        list(m.blocks.usage),
        {sid: (s.table.tolist(), s.num_tokens) for sid, s in m.sequences.items()},
        bytes(m.blocks.state),
        m.blocks.ref.tobytes(),
        m.blocks.pend.tobytes(),
        len(m.index),
        len(m.namespaces),
    )


def state_of(m: BlockManager) -> object:
    """Everything the manager holds (``snapshot.canonical``), for "changed nothing" checks.

    Left out: the counters, the memos (of namespaces per request, of a preemption that could
    not help), the per-Step preemption scan budget, and which namespace ids are free for reuse
    (a refused admit may intern a namespace and release it again): only the live namespaces
    count.
    """
    return tuple((name, canonical(value)) for name, value in (
        ("blocks", m.blocks), ("index", m.index), ("namespaces", m.namespaces._by_id),
        ("sessions", m.sessions), ("sequences", m.sequences), ("dup", m.cache.dup),
        ("scrub", m.admission._scrub), ("tenants", m.tenants), ("lower", m.tiers.lower),
        ("settings", (m.enable_prefix_cache, m.preempt, m.admission.scrub_always, m.seed)),
    ))


class CountingIds(SequenceIds):
    """Deterministic sequence ids (q0, q1, ...): the manager iterates sets of them
    (close_session), so random ids would make a failing run impossible to replay and shrink."""

    __slots__ = ("_count",)

    def __init__(self) -> None:
        super().__init__()
        self._count = itertools.count()

    def new(self) -> str:
        return f"q{next(self._count)}"
