"""reshape_and_cache and copy_blocks, both backends, against plain indexing."""

from __future__ import annotations

import pytest
import torch
from _kvtest import DTYPE_IDS, assert_close, build_paged, rand, sdpa_decode, sdpa_prefill

import blockd_gpu as bg
from blockd_gpu import reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["torch", "triton"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=DTYPE_IDS.get)
@pytest.mark.parametrize(("block_size", "heads", "head_dim"), [(8, 2, 64), (16, 3, 80),
                                                               (32, 1, 128)])
def test_reshape_and_cache_writes_exact_slots(backend, dtype, block_size, heads, head_dim):
    num_blocks = 6
    k_cache = torch.zeros((num_blocks, block_size, heads, head_dim), dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    # Scattered slots across blocks, a padding token in the middle, last slot of the pool.
    slots = [3 * block_size + 2, 0, bg.PAD_SLOT_ID, block_size - 1, num_blocks * block_size - 1]
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    key = rand((5, heads, head_dim), dtype, seed=1).to(DEVICE)
    value = rand((5, heads, head_dim), dtype, seed=2).to(DEVICE)
    bg.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, backend=backend)
    expect_k = torch.zeros_like(k_cache)
    expect_v = torch.zeros_like(v_cache)
    for i, s in enumerate(slots):
        if s >= 0:
            expect_k[s // block_size, s % block_size] = key[i]
            expect_v[s // block_size, s % block_size] = value[i]
    assert torch.equal(k_cache, expect_k)
    assert torch.equal(v_cache, expect_v)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reshape_and_cache_from_fused_qkv_views(backend):
    """key/value are strided slices of one QKV projection; the caches are layer views of a pool."""
    layout = bg.KvLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16,
                         dtype=torch.bfloat16)
    pool = layout.allocate_pool(4, device=DEVICE)
    qkv = rand((3, 8 + 2 + 2, 64), torch.bfloat16).to(DEVICE)
    key, value = qkv[:, 8:10], qkv[:, 10:12]
    assert not key.is_contiguous()
    k_cache, v_cache = layout.kv_caches(pool)[1]
    slots = torch.tensor([17, 18, 63], dtype=torch.int64, device=DEVICE)
    bg.reshape_and_cache(key, value, k_cache, v_cache, slots, backend=backend)
    assert torch.equal(pool[1, 0, 1, 1], key[0]) and torch.equal(pool[1, 1, 3, 15], value[2])
    assert not pool[0].any()  # the other layer is untouched


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_then_attend(backend):
    """The serving order: write this step's K/V into fresh blocks after a cached prefix, then
    prefill-attend; equals SDPA over prefix + new tokens."""
    kv = build_paged([21], 2, 64, 8, torch.float16, spare_blocks=2, table_pad=0, device=DEVICE)
    new_k = rand((6, 2, 64), torch.float16, seed=5).to(DEVICE)
    new_v = rand((6, 2, 64), torch.float16, seed=6).to(DEVICE)
    # Extend the table: tokens 21..26 go to the rest of the last block and one spare block.
    used = set(kv.block_tables[0, :3].tolist())
    spare = next(b for b in range(kv.k_cache.shape[0]) if b not in used)
    table = torch.cat([kv.block_tables, torch.tensor([[spare]], dtype=torch.int32,
                                                     device=DEVICE)], 1)
    positions = torch.arange(21, 27, device=DEVICE)
    slots = (table[0, positions // 8].to(torch.int64) * 8 + positions % 8)
    bg.reshape_and_cache(new_k, new_v, kv.k_cache, kv.v_cache, slots, backend=backend)
    kv.k_seqs[0] = torch.cat([kv.k_seqs[0], new_k.cpu()])
    kv.v_seqs[0] = torch.cat([kv.v_seqs[0], new_v.cpu()])
    seq_lens = torch.tensor([27], dtype=torch.int32, device=DEVICE)
    q = rand((6, 4, 64), torch.float16, seed=7).to(DEVICE)
    indptr = torch.tensor([0, 6], dtype=torch.int32, device=DEVICE)
    out = bg.paged_prefill_attention(q, kv.k_cache, kv.v_cache, table, seq_lens, indptr,
                                     backend=backend)
    assert_close(out, sdpa_prefill(q, indptr, kv))
    dec = bg.paged_decode_attention(q[5:], kv.k_cache, kv.v_cache, table, seq_lens,
                                    backend=backend)
    assert_close(dec, sdpa_decode(q[5:], kv))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_copy_blocks_all_layers_one_call(backend, dtype):
    layout = bg.KvLayout(num_layers=3, num_kv_heads=2, head_dim=64, block_size=8, dtype=dtype)
    pool = rand(layout.pool_shape(10), dtype).to(DEVICE)
    before = pool.clone()
    mapping = torch.tensor([[2, 7], [2, 9], [0, 3]], dtype=torch.int64, device=DEVICE)
    bg.copy_blocks(pool, mapping, backend=backend)
    expect = before.clone()
    for src, dst in mapping.tolist():
        expect[:, :, dst] = before[:, :, src]
    assert torch.equal(pool, expect)


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_blocks_empty_mapping_is_a_no_op(backend):
    pool = rand((1, 2, 3, 8, 1, 16), torch.float16).to(DEVICE)
    before = pool.clone()
    bg.copy_blocks(pool, torch.zeros((0, 2), dtype=torch.int64, device=DEVICE), backend=backend)
    assert torch.equal(pool, before)


def test_twins_chunking_does_not_change_results(monkeypatch):
    """With tiny budgets the twins process one block of one sequence (decode, merged by the
    online softmax) and one query row (prefill) at a time; results must not depend on it."""
    kv = build_paged([1, 9, 30, 0], 2, 64, 8, torch.float32, device=DEVICE)
    q = rand((4, 4, 64), torch.float32).to(DEVICE)
    qp = rand((12, 4, 64), torch.float32).to(DEVICE)
    indptr = torch.tensor([0, 1, 5, 12, 12], dtype=torch.int32, device=DEVICE)
    args = (kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens)
    full_dec = bg.paged_decode_attention(q, *args, backend="torch")
    full_pre = bg.paged_prefill_attention(qp, *args, indptr, backend="torch")
    monkeypatch.setattr(reference, "CHUNK_BYTES", 1)
    monkeypatch.setattr(reference, "DECODE_TILE_BYTES", 1)  # one block of one sequence per tile
    torch.testing.assert_close(bg.paged_decode_attention(q, *args, backend="torch"), full_dec,
                               atol=1e-6, rtol=1e-6)
    assert_close(full_dec, sdpa_decode(q, kv))
    torch.testing.assert_close(bg.paged_prefill_attention(qp, *args, indptr, backend="torch"),
                               full_pre, atol=1e-6, rtol=1e-6)
    assert_close(full_pre, sdpa_prefill(qp, indptr, kv))
