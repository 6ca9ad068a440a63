"""Native GPU runs (skipped without CUDA): the compiled kernels, not the interpreter, at sizes
the interpreter cannot reach; compared with SDPA and with the torch twin on the same device."""

from __future__ import annotations

import pytest
import torch
from _kvtest import DTYPE_IDS, assert_close, build_paged, rand, sdpa_decode, sdpa_prefill

import blockd_gpu as bg

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=DTYPE_IDS.get)
@pytest.mark.parametrize("num_splits", [None, 1, 7])
@pytest.mark.parametrize(("block_size", "head_dim"), [(16, 128), (8, 64), (32, 96), (256, 256)])
def test_decode_long_ragged(dtype, num_splits, block_size, head_dim):
    lens = [1, block_size, block_size + 1, 4000, 0, 1500]
    kv = build_paged(lens, 8, head_dim, block_size, dtype, device="cuda")
    q = rand((len(lens), 32, head_dim), dtype).cuda()
    plan = None
    if num_splits is not None:
        plan = bg.plan_decode(len(lens), 4000, 32, 8, head_dim, dtype=dtype,
                              num_splits=num_splits)
    out = bg.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens,
                                    plan=plan)
    assert_close(out, sdpa_decode(q, kv))
    twin = bg.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens,
                                     backend="torch")
    assert_close(out, twin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=DTYPE_IDS.get)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_prefill_long(dtype, head_dim):
    cases = [(0, 300), (1000, 17), (37, 129), (5, 0)]
    kv = build_paged([p + n for p, n in cases], 4, head_dim, 16, dtype, device="cuda")
    q_lens = torch.tensor([n for _, n in cases])
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).int().cuda()
    q = rand((int(q_lens.sum()), 16, head_dim), dtype).cuda()
    out = bg.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens,
                                     indptr)
    assert_close(out, sdpa_prefill(q, indptr, kv))


def test_cache_ops_match_twin():
    layout = bg.KvLayout(4, 8, 128, 16, "bfloat16")
    pool = rand(layout.pool_shape(64), torch.bfloat16).cuda()
    twin = pool.clone()
    mapping = torch.tensor([[1, 40], [2, 41], [63, 0]], device="cuda")
    bg.copy_blocks(pool, mapping)
    bg.copy_blocks(twin, mapping, backend="torch")
    assert torch.equal(pool, twin)
    key = rand((50, 8, 128), torch.bfloat16, seed=2).cuda()
    slots = torch.randperm(64 * 16, device="cuda")[:50]
    slots[7] = bg.PAD_SLOT_ID
    for p in (pool, twin):
        k_cache, v_cache = layout.kv_caches(p)[3]
        bg.reshape_and_cache(key, key, k_cache, v_cache, slots,
                             backend="triton" if p is pool else "torch")
    assert torch.equal(pool, twin)
