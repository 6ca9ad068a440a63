"""Manager metadata stays compact at 1,000,000 blocks: at most 64 bytes per block fresh, 66 held
by live sequences, at most 150 per block with the whole pool in the prefix index (issue 17),
exact verification kept (every indexed block's key and token ids are stored).

The held figure was 64 until issue 28 (finding 6) added ``BlockArrays.payer``, the tenant
charged for each block (2 bytes per block, a flat array like every other field): the pool held
by 100-block sequences measured 63.5 bytes per block before and 65.5 after. Keeping 64 would
have meant a dict entry per block whose charge moved to another tenant (~100 bytes each under
sharing) or packing two fields into one.

Measured with tracemalloc (every array, list and object the manager allocates), and for the
fully indexed pool, whose filling takes ~20x longer under tracemalloc, by summing
``sys.getsizeof`` over every object the manager reaches; a smaller pool checks that both
methods agree. vLLM's block pool holds about 300 bytes per block, nano-vllm's about 460 (one
Python object per block).
"""

import gc
import sys
import tracemalloc
import types
from array import array

from helpers import SCOPE

from blockd.core import BlockManager, PoolSpec, TenantPolicy
from blockd.core.blocks import BYTES_PER_BLOCK as ALLOC_BYTES
from blockd.core.key_table import KEY_BYTES
from blockd.core.prefix_index import BYTES_PER_BLOCK as INDEX_BYTES

N = 1_000_000
LIMIT = 64
HELD_LIMIT = 66
INDEXED_LIMIT = 150
_NOT_STATE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
              types.MethodType)


def _reachable_bytes(root: object) -> int:
    """``sys.getsizeof`` summed over every object reachable from ``root`` (each once)."""
    seen: set[int] = set()
    stack = [root]
    total = 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _NOT_STATE):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
    return total


def _fill_index(m: BlockManager, n: int) -> None:
    """Every block indexed and cached: distinct 100-block prompts, committed and released."""
    s = m.open_session("acme")
    per = 100 * 16
    for i in range(n // 100):
        r = m.admit(s, SCOPE, array("I", range(i * per, i * per + per + 1)).tobytes())
        m.commit(s, r.seq_id)
        m.release(s, r.seq_id)
    m.close_session(s)


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


def test_full_pool_is_under_66_bytes_per_block() -> None:
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
    assert per_block <= HELD_LIMIT, f"{per_block:.1f} bytes per block ({fixed} fixed)"


def test_both_measures_agree_on_an_indexed_pool() -> None:
    n = 20_000
    spec = PoolSpec(block_size=16, num_blocks=n)

    def build() -> BlockManager:
        m = BlockManager(spec, [TenantPolicy("acme", quota_blocks=n)])
        _fill_index(m, n)
        return m

    m, traced = _measure(build)
    assert m.num_indexed >= n - 1
    reached = _reachable_bytes(m)
    assert abs(reached - traced) <= 0.05 * traced, (reached, traced)


def test_fully_indexed_pool_is_under_150_bytes_per_block() -> None:
    """1,000,000 blocks of 16 tokens, all in the prefix index (CACHED): per block, the
    allocator's and the index's arrays plus the stored key (16 bytes) and token ids (64)."""
    spec = PoolSpec(block_size=16, num_blocks=N)
    m = BlockManager(spec, [TenantPolicy("acme", quota_blocks=N)])
    _fill_index(m, N)
    assert m.num_indexed >= N - 1 and m.state_counts()["cached"] == m.num_indexed
    assert ALLOC_BYTES + INDEX_BYTES + KEY_BYTES + 4 * 16 <= INDEXED_LIMIT
    per_block = _reachable_bytes(m) / N
    assert per_block <= INDEXED_LIMIT, f"{per_block:.1f} bytes per indexed block"
