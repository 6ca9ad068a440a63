"""Cache writes: ``reshape_and_cache`` (new tokens into their slots) and ``copy_blocks``
(copy-on-write copies, every layer's K and V in one launch). Offsets are int64 throughout: slots
and block ids times strides pass 2**31 elements in large pools."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Launch, cdiv, next_pow2


@triton.jit
def reshape_and_cache_kernel(
    key_ptr, value_ptr, k_ptr, v_ptr, slot_ptr,
    stride_key_tok, stride_key_head,
    stride_value_tok, stride_value_head,
    stride_k_block, stride_k_tok, stride_k_head,
    stride_v_block, stride_v_tok, stride_v_head,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # key/value: [num_tokens, NUM_HEADS, HEAD_DIM]
    # k/v: [num_blocks, BLOCK_SIZE, NUM_HEADS, HEAD_DIM]
    # slot: int64 [num_tokens]; -1 = padding, not written.
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok)
    keep = slot >= 0
    block = slot // BLOCK_SIZE
    in_block = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = keep & (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
    src = offs_h[:, None] * stride_key_head + offs_d[None, :]
    key = tl.load(key_ptr + tok * stride_key_tok + src, mask=mask)
    k_dst = block * stride_k_block + in_block * stride_k_tok
    tl.store(k_ptr + k_dst + offs_h[:, None] * stride_k_head + offs_d[None, :], key, mask=mask)
    value = tl.load(value_ptr + tok * stride_value_tok + offs_h[:, None] * stride_value_head
                    + offs_d[None, :], mask=mask)
    v_dst = block * stride_v_block + in_block * stride_v_tok
    tl.store(v_ptr + v_dst + offs_h[:, None] * stride_v_head + offs_d[None, :], value, mask=mask)


@triton.jit
def copy_blocks_kernel(
    pool_ptr, map_ptr,
    stride_layer, stride_kv, stride_block,
    block_numel,
    CHUNK: tl.constexpr,
):
    # pool: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], each block one flat
    # run of block_numel elements; map: int64 [num_pairs, 2] (src, dst).
    # grid: (num_pairs, num_layers * 2, cdiv(block_numel, CHUNK))
    pair = tl.program_id(0).to(tl.int64)
    layer_kv = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    src = tl.load(map_ptr + pair * 2)
    dst = tl.load(map_ptr + pair * 2 + 1)
    base = (layer_kv // 2) * stride_layer + (layer_kv % 2) * stride_kv
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_numel
    x = tl.load(pool_ptr + base + src * stride_block + offs, mask=mask)
    tl.store(pool_ptr + base + dst * stride_block + offs, x, mask=mask)


def reshape_and_cache_launch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> Launch:
    """One program per token; shapes as in ``blockd_gpu.cache_ops.reshape_and_cache``."""
    num_tokens, num_heads, head_dim = key.shape
    return Launch(
        kernel=reshape_and_cache_kernel,
        grid=(num_tokens,),
        args=dict(
            key_ptr=key, value_ptr=value, k_ptr=k_cache, v_ptr=v_cache, slot_ptr=slot_mapping,
            stride_key_tok=key.stride(0), stride_key_head=key.stride(1),
            stride_value_tok=value.stride(0), stride_value_head=value.stride(1),
            stride_k_block=k_cache.stride(0), stride_k_tok=k_cache.stride(1),
            stride_k_head=k_cache.stride(2),
            stride_v_block=v_cache.stride(0), stride_v_tok=v_cache.stride(1),
            stride_v_head=v_cache.stride(2),
        ),
        constexprs=dict(
            NUM_HEADS=num_heads, HEADS_PAD=next_pow2(num_heads),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=next_pow2(head_dim),
            BLOCK_SIZE=k_cache.shape[1],
        ),
        num_warps=4,
        num_stages=1,
        name="reshape_and_cache",
    )


def copy_blocks_launch(kv_pool: torch.Tensor, block_mapping: torch.Tensor) -> Launch:
    """One launch for all layers, K and V; shapes as in ``blockd_gpu.cache_ops.copy_blocks``."""
    num_layers = kv_pool.shape[0]
    block_numel = kv_pool.shape[3] * kv_pool.shape[4] * kv_pool.shape[5]
    chunk = min(4096, next_pow2(block_numel))
    return Launch(
        kernel=copy_blocks_kernel,
        grid=(block_mapping.shape[0], num_layers * 2, cdiv(block_numel, chunk)),
        args=dict(
            pool_ptr=kv_pool, map_ptr=block_mapping,
            stride_layer=kv_pool.stride(0), stride_kv=kv_pool.stride(1),
            stride_block=kv_pool.stride(2), block_numel=block_numel,
        ),
        constexprs=dict(CHUNK=chunk),
        num_warps=4,
        num_stages=1,
        name="copy_blocks",
    )


__all__ = [
    "copy_blocks_kernel",
    "copy_blocks_launch",
    "reshape_and_cache_kernel",
    "reshape_and_cache_launch",
]
