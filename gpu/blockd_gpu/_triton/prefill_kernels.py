"""Paged prefill / extend attention: new tokens attend causally to themselves and to the cached
prefix of their sequence, all read through the block table.

The new tokens' K/V are written by ``reshape_and_cache`` first, so prefix and new tokens are the
same paged cache here; a prefix hit simply means a sequence starts with a long cached prefix and a
short ``q_len``. Row i of sequence s sits at position ``seq_len - q_len + i`` and sees keys
``0 .. seq_len - q_len + i``.

One program owns ``BLOCK_M`` query rows of one sequence for one query head and walks KV tiles of
``BLOCK_N`` tokens only up to the causal limit of its last row (FlashAttention-2 online softmax).
Dot operand dtypes (``dot_dtype``) and int64 block offsets as in ``decode_kernels``, for the
reasons given there.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .decode_kernels import dot_dtype, dot_precision, is_interpreted
from .launch import Launch, cdiv, next_pow2


@triton.jit
def paged_prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, indptr_ptr, out_ptr,
    scale_log2,
    stride_q_tok, stride_q_head,
    stride_k_block, stride_k_tok, stride_k_head,
    stride_v_block, stride_v_tok, stride_v_head,
    stride_bt_seq,
    stride_o_tok, stride_o_head,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    # q/out: [num_tokens, num_qo_heads, HEAD_DIM] packed by indptr: [num_seqs + 1]
    # k/v: [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]; bt: [num_seqs, max_blocks]
    m_tile = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    kv_head = (head // GROUP).to(tl.int64)
    q_start = tl.load(indptr_ptr + seq).to(tl.int64)
    q_len = tl.load(indptr_ptr + seq + 1) - q_start
    seq_len = tl.load(lens_ptr + seq)
    prefix = seq_len - q_len

    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_m = offs_m < q_len
    mask_d = offs_d < HEAD_DIM
    rows = q_start + offs_m.to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_q_tok + head * stride_q_head + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0).to(DOT_DTYPE)
    q_pos = prefix + offs_m  # absolute position of each row

    # Keys past the last row's position are causally masked for the whole tile: stop there. A
    # tile past this sequence's new tokens (grid sized for the longest) does no work at all.
    kv_end = tl.minimum(seq_len, prefix + (m_tile + 1) * BLOCK_M)
    kv_end = tl.where(m_tile * BLOCK_M < q_len, kv_end, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    bt_row = bt_ptr + seq * stride_bt_seq
    k_head = k_ptr + kv_head * stride_k_head
    v_head = v_ptr + kv_head * stride_v_head
    for t0 in range(0, kv_end, BLOCK_N):
        offs_n = t0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        block = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
        in_block = (offs_n % BLOCK_SIZE).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_head + (block * stride_k_block + in_block * stride_k_tok)[:, None]
                    + offs_d[None, :], mask=kv_mask, other=0.0).to(DOT_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        allowed = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(allowed, s, float("-inf"))
        # Key 0 is in the first tile and visible to every row, so m_new is finite from then on;
        # later tiles that a row cannot see give p = exp2(-inf) = 0.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + (block * stride_v_block + in_block * stride_v_tok)[:, None]
                    + offs_d[None, :], mask=kv_mask, other=0.0).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
        m_i = m_new

    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_o_tok + head * stride_o_head + offs_d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def prefill_config(dtype: torch.dtype, head_dim_pad: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). Chosen with ptxas for sm_90 (cuobjdump
    -res-usage): the largest tiles that compile without register spills; the gathered K/V
    tiles need one pointer per vector, which costs more registers than a contiguous layout."""
    if dtype != torch.float32:
        return (64, 64, 8, 3) if head_dim_pad <= 128 else (32, 32, 8, 3)
    return (32, 32, 8, 3) if head_dim_pad <= 128 else (32, 16, 8, 2)


def prefill_launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    *,
    max_q_len: int,
) -> Launch:
    """The launch of one prefill step; shapes as in
    ``blockd_gpu.prefill.paged_prefill_attention``."""
    _, num_qo_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    head_dim_pad = max(16, next_pow2(head_dim))
    block_m, block_n, num_warps, num_stages = prefill_config(q.dtype, head_dim_pad)
    return Launch(
        kernel=paged_prefill_kernel,
        grid=(cdiv(max_q_len, block_m), seq_lens.shape[0], num_qo_heads),
        args=dict(
            q_ptr=q, k_ptr=k_cache, v_ptr=v_cache, bt_ptr=block_tables, lens_ptr=seq_lens,
            indptr_ptr=qo_indptr, out_ptr=out,
            scale_log2=float(scale) * math.log2(math.e),
            stride_q_tok=q.stride(0), stride_q_head=q.stride(1),
            stride_k_block=k_cache.stride(0), stride_k_tok=k_cache.stride(1),
            stride_k_head=k_cache.stride(2),
            stride_v_block=v_cache.stride(0), stride_v_tok=v_cache.stride(1),
            stride_v_head=v_cache.stride(2),
            stride_bt_seq=block_tables.stride(0),
            stride_o_tok=out.stride(0), stride_o_head=out.stride(1),
        ),
        constexprs=dict(
            GROUP=num_qo_heads // num_kv_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
            DOT_DTYPE=dot_dtype(q.dtype, is_interpreted(paged_prefill_kernel)),
            PRECISION=dot_precision(q.dtype),
        ),
        num_warps=num_warps,
        num_stages=num_stages,
        name="paged_prefill",
    )


__all__ = ["paged_prefill_kernel", "prefill_launch"]
