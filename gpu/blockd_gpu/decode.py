"""Paged decode attention: one new query token per sequence against its paged K/V.

Tensor layouts follow the contract in ``blockd_gpu.layout``. ``plan_decode`` does the host-side
work (split-K partitioning) once per step; the resulting ``DecodePlan`` is reused by every layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import reference
from ._backend import Backend, use_triton
from .validate import (
    check_tensor,
    validate_block_tables,
    validate_kv_cache,
    validate_out,
    validate_query,
)

__all__ = ["DecodePlan", "DecodeWorkspace", "plan_decode", "paged_decode_attention"]

DEFAULT_NUM_SMS = 132  # H100/H200 SXM; used when planning without a CUDA device.
MIN_PARTITION = 256  # tokens; below this a split's fixed cost outweighs the parallelism it adds.
MAX_SPLITS = 64


class DecodeWorkspace(NamedTuple):
    """Split-K scratch, reusable across layers: fp32 ``[num_seqs, num_qo_heads, num_splits,
    head_dim]`` partial outputs and fp32 ``[num_seqs, num_qo_heads, num_splits]`` log-sum-exps."""

    part_out: torch.Tensor
    part_lse: torch.Tensor


@dataclass(frozen=True)
class DecodePlan:
    """How a decode step is cut into programs; host-only, computed once per step.

    ``num_splits`` partitions of ``partition_size`` tokens per sequence (1 = no split-K, one
    pass per (sequence, KV head)); ``tile`` tokens are gathered per loop iteration. Sequences
    longer than ``num_splits * partition_size`` are still correct: the last split runs to the end.
    """

    num_seqs: int
    num_qo_heads: int
    head_dim: int
    num_splits: int
    partition_size: int
    tile: int

    def workspace(self, device: torch.device | str) -> DecodeWorkspace | None:
        """Allocate the split-K scratch once and pass it to every layer (None when unsplit)."""
        if self.num_splits == 1:
            return None
        shape = (self.num_seqs, self.num_qo_heads, self.num_splits)
        return DecodeWorkspace(
            torch.empty((*shape, self.head_dim), dtype=torch.float32, device=device),
            torch.empty(shape, dtype=torch.float32, device=device),
        )


def plan_decode(
    num_seqs: int,
    max_seq_len: int,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    num_sms: int | None = None,
    num_splits: int | None = None,
    tile: int | None = None,
) -> DecodePlan:
    """Choose split-K for a step. ``max_seq_len`` is an upper bound (``max_blocks * block_size``
    is one that needs no device sync). Splits are added only while (sequences x KV heads) would
    leave SMs idle: about two programs per SM, partitions no shorter than ``MIN_PARTITION``.
    ``dtype`` is the KV dtype (it sizes the tile); ``num_splits``/``tile`` override the
    heuristic (tests, tuning)."""
    for name, value in (("num_seqs", num_seqs), ("max_seq_len", max_seq_len),
                        ("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}: expected a non-negative int, got {value!r}")
    if tile is None:
        # Tokens per loop iteration: the largest tile that ptxas (sm_90) fits without spills.
        tile = 64 if dtype.itemsize <= 2 and head_dim <= 128 else 32
    if tile < 16 or tile & (tile - 1):
        raise ValueError(f"tile: must be a power of two >= 16 (tl.dot minimum), got {tile}")
    if num_sms is None:
        num_sms = (torch.cuda.get_device_properties(0).multi_processor_count
                   if torch.cuda.is_available() else DEFAULT_NUM_SMS)
    if num_splits is None:
        programs = max(1, num_seqs * max(1, num_kv_heads))
        wanted = math.ceil(2 * num_sms / programs)
        by_length = max_seq_len // MIN_PARTITION
        num_splits = max(1, min(wanted, by_length, MAX_SPLITS))
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits: expected a positive int, got {num_splits!r}")
    # Partitions are whole tiles so no tile straddles two splits.
    partition = max(tile, math.ceil(max(1, max_seq_len) / num_splits / tile) * tile)
    return DecodePlan(num_seqs, num_qo_heads, head_dim, num_splits, partition, tile)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    plan: DecodePlan | None = None,
    workspace: DecodeWorkspace | None = None,
    backend: Backend = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged K/V (MHA, GQA, MQA).

    Args (layouts: ``blockd_gpu.layout``):
        q: ``[num_seqs, num_qo_heads, head_dim]``, the caches' dtype; head_dim contiguous.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, fp32/fp16/bf16;
            ``num_qo_heads % num_kv_heads == 0``.
        block_tables: int32 ``[num_seqs, max_blocks]``.
        seq_lens: int32 ``[num_seqs]``, K/V tokens per sequence including the current one; a
            zero-length sequence yields a zero row.
        scale: softmax scale, default ``head_dim ** -0.5``.
        out: optional ``[num_seqs, num_qo_heads, head_dim]`` buffer in q's dtype (any strides
            with head_dim contiguous); written and returned.
        plan: from ``plan_decode``; default plans from ``max_blocks * block_size`` (no sync).
        workspace: split-K scratch from ``plan.workspace``; allocated per call when omitted.
        backend: ``"auto"`` (Triton on CUDA, torch twin on CPU), ``"triton"`` or ``"torch"``.
        validate: also check values (block ids in the pool, lengths within the table); this
            reads the metadata tensors, a device sync on CUDA.

    Returns ``out`` (or a new tensor): ``[num_seqs, num_qo_heads, head_dim]``, q's dtype.
    """
    # q: [S, Hq, D]  k_cache/v_cache: [N, B, Hkv, D]  block_tables: [S, M]  seq_lens: [S]
    dims = validate_kv_cache(k_cache, v_cache)
    q = validate_query(q, dims, dtype=k_cache.dtype, device=k_cache.device)
    num_seqs, num_qo_heads, head_dim = q.shape
    block_tables, seq_lens = validate_block_tables(
        block_tables, seq_lens, num_blocks=dims.num_blocks, block_size=dims.block_size,
        device=k_cache.device, num_seqs=num_seqs, check_values=validate)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        out = validate_out(out, shape=q.shape, dtype=q.dtype, device=q.device)
    if scale is None:
        scale = head_dim ** -0.5
    if num_seqs == 0:
        return out
    if not use_triton(backend, q.device):
        return reference.decode_reference(q, k_cache, v_cache, block_tables, seq_lens,
                                          scale=scale, out=out)

    from ._triton.decode_kernels import decode_launches

    if plan is None:
        plan = plan_decode(num_seqs, block_tables.shape[1] * dims.block_size, num_qo_heads,
                           dims.num_kv_heads, head_dim, dtype=q.dtype)
    elif (plan.num_seqs, plan.num_qo_heads, plan.head_dim) != (num_seqs, num_qo_heads, head_dim):
        raise ValueError(f"plan: made for (num_seqs, num_qo_heads, head_dim) = "
                         f"{(plan.num_seqs, plan.num_qo_heads, plan.head_dim)}, got "
                         f"{(num_seqs, num_qo_heads, head_dim)}")
    if plan.num_splits > 1 and workspace is None:
        workspace = plan.workspace(q.device)
    elif plan.num_splits > 1:
        want = (num_seqs, num_qo_heads, plan.num_splits)
        for name, t, shape in (("workspace.part_out", workspace.part_out, (*want, head_dim)),
                               ("workspace.part_lse", workspace.part_lse, want)):
            check_tensor(name, t, dtypes=(torch.float32,), device=q.device, shape=shape)
            if not t.is_contiguous():
                raise ValueError(f"{name}: must be contiguous")
    for launch in decode_launches(
        q, k_cache, v_cache, block_tables, seq_lens.contiguous(), out, scale,
        num_splits=plan.num_splits, partition_size=plan.partition_size, tile=plan.tile,
        part_out=workspace.part_out if workspace is not None else None,
        part_lse=workspace.part_lse if workspace is not None else None,
    ):
        launch()
    return out
