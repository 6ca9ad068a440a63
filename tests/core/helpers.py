"""Small builders shared by the core tests."""

from blockd.core import BlockManager, PoolSpec, PrefixScope, TenantPolicy
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
        list(m.alloc.usage),
        {sid: (s.table.tolist(), s.num_tokens) for sid, s in m.sequences.items()},
        bytes(m.alloc.state),
        m.alloc.ref.tobytes(),
        m.alloc.pend.tobytes(),
        len(m.index),
        len(m.namespaces),
    )


def state_of(m: BlockManager) -> object:
    """Everything the manager holds (``snapshot.canonical``), for "changed nothing" checks.

    Left out: the counters, the memos (of namespaces, of a preemption that could not help),
    the per-Step preemption scan budget,
    and which namespace ids are free for reuse (a refused admit may intern a namespace and
    release it again): only the live namespaces count.
    """
    return tuple((name, canonical(value._by_id if name == "namespaces" else value))
                 for name, value in vars(m).items()
                 if name not in ("counters", "_ns_cache", "_no_victims", "preempt_scans_left"))

