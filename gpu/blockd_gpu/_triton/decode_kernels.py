"""Paged decode attention: one query token per sequence, optional split-K with a reduction.

One program owns (sequence, KV head, split) and all ``GROUP`` query heads that share that KV
head, so each K/V byte is read once per step however many query heads use it (GQA/MQA are the
same kernel with ``GROUP`` > 1). The query group is padded to 16 rows so the score and value
products are ``tl.dot`` tiles. KV tokens are walked ``TILE`` at a time; a tile's tokens are
gathered through the block table (``block id = table[t // BLOCK_SIZE]``), so one kernel serves
every block size, smaller or larger than the tile.

Split-K (flash-decoding): with ``SPLIT`` the token range is cut into partitions of
``partition_size`` tokens; each split writes its normalised partial output and its log-sum-exp
(base 2) to a workspace and ``paged_decode_reduce_kernel`` merges them. The last split runs to
``seq_len`` whatever the plan assumed, so a plan made for shorter sequences is slow, never wrong.

Dot operands are ``DOT_DTYPE`` (see ``dot_dtype``): the cache dtype on a GPU (bf16/fp16 tensor
cores, fp32 accumulation, probabilities rounded to the cache dtype for ``p @ v`` as in
FlashAttention), fp32 for fp32 caches, and fp32 for bf16 under ``TRITON_INTERPRET``, whose bf16
``tl.dot`` is wrong. Block ids are widened to int64 before they multiply a stride:
``block_id * stride`` passes 2**31 elements in pools past 4 GiB of bf16 and int32 would wrap.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .launch import Launch, cdiv, next_pow2


@triton.jit
def paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    scale_log2,
    stride_q_seq, stride_q_head,
    stride_k_block, stride_k_tok, stride_k_head,
    stride_v_block, stride_v_tok, stride_v_head,
    stride_bt_seq,
    stride_o_seq, stride_o_head,
    num_splits, partition_size,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    SPLIT: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    # q: [num_seqs, num_qo_heads, HEAD_DIM]; k/v: [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    # out: [num_seqs, num_qo_heads, HEAD_DIM]
    # part_out: fp32 [num_seqs, num_qo_heads, num_splits, HEAD_DIM]; part_lse: fp32 [.., num_splits]
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + seq)

    if SPLIT:
        start = split * partition_size
        end = tl.minimum(seq_len, start + partition_size)
        end = tl.where(split == num_splits - 1, seq_len, end)
    else:
        start = 0
        end = seq_len

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(DOT_DTYPE)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    bt_row = bt_ptr + seq * stride_bt_seq
    k_head = k_ptr + kv_head.to(tl.int64) * stride_k_head
    v_head = v_ptr + kv_head.to(tl.int64) * stride_v_head

    for t0 in range(start, end, TILE):
        offs_t = t0 + tl.arange(0, TILE)
        mask_t = offs_t < end
        # int64 before the multiply: block_id * stride overflows int32 in large pools.
        block = tl.load(bt_row + offs_t // BLOCK_SIZE, mask=mask_t, other=0).to(tl.int64)
        in_block = (offs_t % BLOCK_SIZE).to(tl.int64)
        kv_mask = mask_t[:, None] & mask_d[None, :]
        # Issue the V load with the K load: decode is bound by memory latency, not math.
        k = tl.load(k_head + (block * stride_k_block + in_block * stride_k_tok)[:, None]
                    + offs_d[None, :], mask=kv_mask, other=0.0).to(DOT_DTYPE)
        v = tl.load(v_head + (block * stride_v_block + in_block * stride_v_tok)[:, None]
                    + offs_d[None, :], mask=kv_mask, other=0.0).to(DOT_DTYPE)
        # Scores in the log2 domain (scale_log2 = scale * log2(e)) so exp2 replaces exp.
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        s = tl.where(mask_t[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)  # m_new is finite: every tile holds a valid token.
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
        m_i = m_new

    # Empty range (zero-length sequence, or a split past its end): l_i == 0, output 0, lse -inf.
    has_keys = l_i > 0.0
    acc = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if SPLIT:
        row = (seq * (num_splits * GROUP * tl.num_programs(1)) + heads.to(tl.int64) * num_splits
               + split)
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=mask_g[:, None] & mask_d[None, :])
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=mask_g)
    else:
        tl.store(out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + offs_d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])


@triton.jit
def paged_decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_o_seq, stride_o_head,
    num_qo_heads, num_splits,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    # part_out: fp32 [num_seqs, num_qo_heads, num_splits, HEAD_DIM]; part_lse: fp32 [.., num_splits]
    # out: [num_seqs, num_qo_heads, HEAD_DIM]
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row0 = (seq * num_qo_heads + head) * num_splits
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_s = offs_s < num_splits
    lse = tl.load(part_lse_ptr + row0 + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    # All splits empty (zero-length sequence): weights 0, output 0, never NaN.
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0)
    parts = tl.load(part_out_ptr + (row0 + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=mask_s[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    o = tl.sum(parts * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + seq * stride_o_seq + head * stride_o_head + offs_d,
             o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def dot_dtype(dtype: torch.dtype, interpreted: bool) -> tl.dtype:
    """Operand dtype of the kernels' ``tl.dot`` for a cache of ``dtype``."""
    if dtype == torch.float32 or (dtype == torch.bfloat16 and interpreted):
        return tl.float32  # the interpreter's bf16 dot is wrong: upcast (exact for bf16 inputs)
    return tl.float16 if dtype == torch.float16 else tl.bfloat16


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 caches get true fp32 products rather than tf32's 10-bit mantissa; for 16-bit operands
    # (and bf16 upcast to fp32, exact in tf32) the setting changes nothing.
    return "ieee" if dtype == torch.float32 else "tf32"


def decode_num_warps(dtype: torch.dtype, head_dim: int) -> int:
    # Chosen with ptxas -v for sm_90 (cuobjdump -res-usage): no register spills at the default
    # tiles of ``plan_decode``; fp32 tiles (and the split-K epilogue) need 8 warps to spread.
    return 8 if dtype == torch.float32 else 4


def is_interpreted(kernel: object) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def decode_launches(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    *,
    num_splits: int,
    partition_size: int,
    tile: int,
    part_out: torch.Tensor | None = None,
    part_lse: torch.Tensor | None = None,
) -> list[Launch]:
    """The one (no split) or two (split + reduce) launches of a decode step; shapes as in
    ``blockd_gpu.decode.paged_decode_attention``. Split workspaces: ``part_out`` fp32
    ``[num_seqs, num_qo_heads, num_splits, head_dim]``, ``part_lse`` fp32 ``[.., num_splits]``."""
    num_seqs, num_qo_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_qo_heads // num_kv_heads
    split = num_splits > 1
    if split:
        assert part_out is not None and part_lse is not None
    main = Launch(
        kernel=paged_decode_kernel,
        grid=(num_seqs, num_kv_heads, num_splits),
        args=dict(
            q_ptr=q, k_ptr=k_cache, v_ptr=v_cache, bt_ptr=block_tables, lens_ptr=seq_lens,
            out_ptr=out,
            # Unused pointers still need a tensor: point them at `out` (never dereferenced).
            part_out_ptr=part_out if split else out, part_lse_ptr=part_lse if split else out,
            scale_log2=float(scale) * math.log2(math.e),
            stride_q_seq=q.stride(0), stride_q_head=q.stride(1),
            stride_k_block=k_cache.stride(0), stride_k_tok=k_cache.stride(1),
            stride_k_head=k_cache.stride(2),
            stride_v_block=v_cache.stride(0), stride_v_tok=v_cache.stride(1),
            stride_v_head=v_cache.stride(2),
            stride_bt_seq=block_tables.stride(0),
            stride_o_seq=out.stride(0), stride_o_head=out.stride(1),
            num_splits=num_splits, partition_size=partition_size,
        ),
        constexprs=dict(
            GROUP=group, GROUP_PAD=max(16, next_pow2(group)),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, next_pow2(head_dim)),
            BLOCK_SIZE=block_size, TILE=tile, SPLIT=split,
            DOT_DTYPE=dot_dtype(q.dtype, is_interpreted(paged_decode_kernel)),
            PRECISION=dot_precision(q.dtype),
        ),
        num_warps=decode_num_warps(q.dtype, head_dim),
        # 3 stages: K/V tiles for the next iterations are in flight (cp.async) while this one
        # is reduced; decode is bound by memory latency x bytes in flight.
        num_stages=3,
        name="paged_decode",
    )
    if not split:
        return [main]
    reduce = Launch(
        kernel=paged_decode_reduce_kernel,
        grid=(num_seqs, num_qo_heads),
        args=dict(
            part_out_ptr=part_out, part_lse_ptr=part_lse, out_ptr=out,
            stride_o_seq=out.stride(0), stride_o_head=out.stride(1),
            num_qo_heads=num_qo_heads, num_splits=num_splits,
        ),
        constexprs=dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, next_pow2(head_dim)),
                        SPLITS_PAD=max(2, next_pow2(num_splits))),
        num_warps=4,
        num_stages=1,
        name="paged_decode_reduce",
    )
    return [main, reduce]


__all__ = ["decode_launches", "paged_decode_kernel", "paged_decode_reduce_kernel", "cdiv"]
