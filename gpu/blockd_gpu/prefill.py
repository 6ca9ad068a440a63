"""Paged prefill / extend (chunked prefill) attention over cached prefixes.

Tensor layouts follow the contract in ``blockd_gpu.layout``.
"""

from __future__ import annotations

import torch

from . import reference
from ._backend import Backend, use_triton
from .validate import (
    validate_block_tables,
    validate_kv_cache,
    validate_out,
    validate_qo_indptr,
    validate_query,
)

__all__ = ["paged_prefill_attention"]


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    *,
    max_q_len: int | None = None,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    backend: Backend = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole paged K/V (cached prefix
    blocks plus the new tokens, which ``reshape_and_cache`` has already written).

    Args (layouts: ``blockd_gpu.layout``):
        q: ``[num_tokens, num_qo_heads, head_dim]``, the new tokens of all sequences packed in
            sequence order; the caches' dtype; head_dim contiguous.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, fp32/fp16/bf16.
        block_tables: int32 ``[num_seqs, max_blocks]``.
        seq_lens: int32 ``[num_seqs]``, total K/V tokens per sequence *including* the new ones.
        qo_indptr: int32 ``[num_seqs + 1]``; sequence s owns q rows ``qo_indptr[s]:qo_indptr[s+1]``
            (``q_len``), at positions ``seq_lens[s] - q_len ..``; ``q_len`` may be 0.
        max_q_len: largest ``q_len`` (sizes the Triton grid); computed from ``qo_indptr`` when
            omitted, which on CUDA is a device sync.
        scale: softmax scale, default ``head_dim ** -0.5``.
        out: optional ``[num_tokens, num_qo_heads, head_dim]`` buffer in q's dtype (any strides
            with head_dim contiguous); written and returned.
        backend: ``"auto"`` (Triton on CUDA, torch twin on CPU), ``"triton"`` or ``"torch"``.
        validate: also check values (block ids, lengths, ``qo_indptr``); a device sync on CUDA.

    Returns ``out`` (or a new tensor): ``[num_tokens, num_qo_heads, head_dim]``, q's dtype.
    """
    # q: [T, Hq, D]  k_cache/v_cache: [N, B, Hkv, D]  block_tables: [S, M]  seq_lens: [S]
    dims = validate_kv_cache(k_cache, v_cache)
    q = validate_query(q, dims, dtype=k_cache.dtype, device=k_cache.device)
    block_tables, seq_lens = validate_block_tables(
        block_tables, seq_lens, num_blocks=dims.num_blocks, block_size=dims.block_size,
        device=k_cache.device, check_values=validate)
    qo_indptr = validate_qo_indptr(qo_indptr, seq_lens, num_tokens=q.shape[0],
                                   device=k_cache.device, check_values=validate)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        out = validate_out(out, shape=q.shape, dtype=q.dtype, device=q.device)
    if scale is None:
        scale = q.shape[2] ** -0.5
    if q.shape[0] == 0:
        return out
    if not use_triton(backend, q.device):
        return reference.prefill_reference(q, k_cache, v_cache, block_tables, seq_lens,
                                           qo_indptr, scale=scale, out=out)

    from ._triton.prefill_kernels import prefill_launch

    if max_q_len is None:
        max_q_len = int((qo_indptr[1:] - qo_indptr[:-1]).max())
    elif validate and max_q_len < int((qo_indptr[1:] - qo_indptr[:-1]).max()):
        raise ValueError(f"max_q_len: {max_q_len} is smaller than the longest q_len")
    prefill_launch(q, k_cache, v_cache, block_tables, seq_lens.contiguous(),
                   qo_indptr.contiguous(), out, scale, max_q_len=max_q_len)()
    return out
