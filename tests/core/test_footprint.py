"""Manager metadata stays compact: at most 64 bytes per block at 1,000,000 blocks.

Measured with tracemalloc (every array, list and object the manager allocates), for a fresh
manager and for one whose whole pool is held by live sequences. vLLM's block pool holds about
300 bytes per block, nano-vllm's about 460 (one Python object per block).
"""

import gc
import tracemalloc

from helpers import SCOPE

from blockd.core import BlockManager, PoolSpec, TenantPolicy
from blockd.core.blocks import BYTES_PER_BLOCK as ALLOC_BYTES
from blockd.core.prefix_index import BYTES_PER_BLOCK as INDEX_BYTES

N = 1_000_000
LIMIT = 64


def _measure(build):  # type: ignore[no-untyped-def]
    gc.collect()
    tracemalloc.start()
    try:
        obj = build()
        gc.collect()
        current, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return obj, current


def test_fresh_manager_is_under_64_bytes_per_block() -> None:
    assert ALLOC_BYTES + INDEX_BYTES <= LIMIT
    spec = PoolSpec(block_size=16, num_blocks=N)
    m, used = _measure(lambda: BlockManager(spec, [TenantPolicy("acme", quota_blocks=N)]))
    per_block = used / N
    assert per_block <= LIMIT, f"{per_block:.1f} bytes per block"
    assert m.num_blocks == N


def test_full_pool_is_under_64_bytes_per_block() -> None:
    """Every block held by one of 10,000 live sequences (100 blocks each, caching off)."""
    spec = PoolSpec(block_size=16, num_blocks=N)
    m = BlockManager(spec, [TenantPolicy("acme", quota_blocks=N)])
    s = m.open_session("acme")
    prompt = bytes(16 * 100 * 4)  # 1,600 tokens (all zero) as uint32 LE bytes

    def fill() -> int:
        for _ in range(N // 100):
            m.admit(s, SCOPE, prompt, cache=False)
        return len(m.sequences)

    gc.collect()
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        assert fill() == N // 100
        gc.collect()
        grown, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert m.blocks.num_free == 0
    fixed = ALLOC_BYTES + INDEX_BYTES
    per_block = fixed + (grown - base) / N
    assert per_block <= LIMIT, f"{per_block:.1f} bytes per block ({fixed} fixed)"
