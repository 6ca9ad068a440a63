"""Writes into the paged cache: new tokens into their slots, copy-on-write block copies.

Tensor layouts follow the contract in ``blockd_gpu.layout``.
"""

from __future__ import annotations

import torch

from . import reference
from ._backend import Backend, use_triton
from .validate import (
    check_tensor,
    validate_block_mapping,
    validate_kv_cache,
    validate_pool,
    validate_slot_mapping,
)

__all__ = ["reshape_and_cache", "copy_blocks"]


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: Backend = "auto",
    validate: bool = True,
) -> None:
    """Write each new token's K and V into its slot (in place).

    Args (layouts: ``blockd_gpu.layout``):
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, the caches' dtype; head_dim
            contiguous, other strides free (e.g. slices of a fused QKV projection).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, fp32/fp16/bf16.
        slot_mapping: int64 ``[num_tokens]``; ``block_id * block_size + offset``, or
            ``PAD_SLOT_ID`` (-1) for a token that is not written.
        backend: ``"auto"`` (Triton on CUDA, torch twin on CPU), ``"triton"`` or ``"torch"``.
        validate: also check slot values (in the pool, no slot twice); a device sync on CUDA.
    """
    # key/value: [T, Hkv, D]  k_cache/v_cache: [N, B, Hkv, D]  slot_mapping: [T]
    dims = validate_kv_cache(k_cache, v_cache)
    for name, t in (("key", key), ("value", value)):
        check_tensor(name, t, ndim=3, dtypes=(k_cache.dtype,), device=k_cache.device,
                     shape=(None, dims.num_kv_heads, dims.head_dim))
        if t.numel() and t.stride(-1) != 1 and dims.head_dim > 1:
            raise ValueError(f"{name}: head_dim must be contiguous, got strides {t.stride()}")
    if value.shape[0] != key.shape[0]:
        raise ValueError(f"value: expected {key.shape[0]} tokens like key, got {value.shape[0]}")
    slots = validate_slot_mapping(slot_mapping, num_tokens=key.shape[0],
                                  num_slots=dims.num_blocks * dims.block_size,
                                  device=k_cache.device, check_values=validate)
    if key.shape[0] == 0:
        return
    if not use_triton(backend, key.device):
        reference.reshape_and_cache_reference(key, value, k_cache, v_cache, slots)
        return

    from ._triton.cache_kernels import reshape_and_cache_launch

    reshape_and_cache_launch(key, value, k_cache, v_cache, slots.contiguous())()


def copy_blocks(
    kv_pool: torch.Tensor,
    block_mapping: torch.Tensor,
    *,
    backend: Backend = "auto",
    validate: bool = True,
) -> None:
    """Copy-on-write: copy block ``src`` to ``dst`` in every layer, K and V, in one launch.

    Args (layouts: ``blockd_gpu.layout``):
        kv_pool: the stacked pool ``[num_layers, 2, num_blocks, block_size, num_kv_heads,
            head_dim]`` (fp32/fp16/bf16), each block contiguous; per-layer caches are its views.
        block_mapping: int64 ``[num_pairs, 2]`` of (src, dst); destinations distinct and never
            a source (so the copies may run in any order).
        backend: ``"auto"`` (Triton on CUDA, torch twin on CPU), ``"triton"`` or ``"torch"``.
        validate: also check the ids; a device sync on CUDA.
    """
    # kv_pool: [L, 2, N, B, Hkv, D]  block_mapping: [P, 2]
    num_blocks = validate_pool(kv_pool)
    mapping = validate_block_mapping(block_mapping, num_blocks=num_blocks, device=kv_pool.device,
                                     check_values=validate)
    if mapping.shape[0] == 0:
        return
    if not use_triton(backend, kv_pool.device):
        reference.copy_blocks_reference(kv_pool, mapping)
        return

    from ._triton.cache_kernels import copy_blocks_launch

    copy_blocks_launch(kv_pool, mapping.contiguous())()
