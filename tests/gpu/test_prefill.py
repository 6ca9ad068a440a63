"""paged_prefill_attention vs SDPA with a bottom-right causal mask on contiguous K/V.

Each sequence is (cached prefix, new tokens): the new tokens' K/V are already in the cache
(``reshape_and_cache`` ran first), so a prefix hit is a long prefix and a short q_len.
Tolerances: ``_kvtest.TOLERANCES``.
"""

from __future__ import annotations

import pytest
import torch
from _kvtest import DTYPE_IDS, assert_close, build_paged, rand, sdpa_prefill

import blockd_gpu as bg

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEADS = [(4, 4), (8, 2), (4, 1)]
HEAD_IDS = ["mha", "gqa4", "mqa"]


def cases_for(block_size: int) -> list[tuple[int, int]]:
    """(prefix_len, q_len): fresh prefill of 1 token and of exactly a block, decode-like 1 new
    token after a block, an extend after a block plus one, a chunk crossing block boundaries
    after a prefix hit, and a sequence with nothing new this step."""
    b = block_size
    return [(0, 1), (0, b), (b, 1), (b + 1, 3), (2 * b - 1, b + 2), (5, 0)]


def run_case(block_size, heads, head_dim, dtype, backend, *, cases=None, seed=0):
    hq, hkv = heads
    cases = cases if cases is not None else cases_for(block_size)
    lens = [p + n for p, n in cases]
    kv = build_paged(lens, hkv, head_dim, block_size, dtype, seed=seed, device=DEVICE)
    q_lens = torch.tensor([n for _, n in cases])
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).to(torch.int32)
    q = rand((int(q_lens.sum()), hq, head_dim), dtype, seed=seed + 1).to(DEVICE)
    indptr = indptr.to(DEVICE)
    out = bg.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens,
                                     indptr, backend=backend)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, sdpa_prefill(q, indptr, kv))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("block_size", [8, 16, 32, 128])
def test_torch_twin_matches_sdpa(block_size, heads, head_dim, dtype):
    run_case(block_size, heads, head_dim, dtype, "torch")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_triton_matches_sdpa(block_size, heads, dtype):
    run_case(block_size, heads, 64, dtype, "triton")


@pytest.mark.parametrize("head_dim", [80, 128, 256])
def test_triton_other_head_dims(head_dim):
    run_case(16, (4, 2), head_dim, torch.float16, "triton", cases=[(0, 3), (17, 5)])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_triton_many_query_tiles(dtype):
    # 70 new tokens after a 10-token prefix: 3 query tiles at BLOCK_M=32 (fp32), 2 at 64, and
    # KV tiles that are partly causal-masked on the diagonal.
    run_case(16, (2, 1), 64, dtype, "triton", cases=[(10, 70), (0, 33)])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_non_contiguous_q_and_out(backend):
    hq, hkv, d = 4, 2, 64
    # (prefix, q_len) = (3, 5) and (16, 2)
    kv = build_paged([8, 18], hkv, d, 8, torch.float32, device=DEVICE)
    qkv = rand((7, hq + 2 * hkv, d), torch.float32).to(DEVICE)
    q = qkv[:, :hq]
    indptr = torch.tensor([0, 5, 7], dtype=torch.int32, device=DEVICE)
    out = torch.full((hq, 7, d), float("nan"), device=DEVICE).transpose(0, 1)
    ret = bg.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens,
                                     indptr, out=out, backend=backend)
    assert ret is out
    assert_close(out, sdpa_prefill(q.contiguous(), indptr, kv))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prefill_then_decode_consistency(backend):
    """The last new token of a prefill sees exactly what a decode of that token sees."""
    kv = build_paged([37], 2, 64, 16, torch.float16, device=DEVICE)
    q = rand((5, 4, 64), torch.float16).to(DEVICE)
    indptr = torch.tensor([0, 5], dtype=torch.int32, device=DEVICE)
    pre = bg.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens,
                                     indptr, backend=backend)
    dec = bg.paged_decode_attention(q[4:], kv.k_cache, kv.v_cache, kv.block_tables,
                                    kv.seq_lens, backend=backend)
    assert_close(pre[4:], dec)


def test_max_q_len_too_small_is_named():
    kv = build_paged([4], 1, 64, 16, torch.float32, device=DEVICE)
    q = rand((4, 1, 64), torch.float32).to(DEVICE)
    indptr = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="^max_q_len"):
        bg.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens,
                                   indptr, max_q_len=2, backend="triton")
