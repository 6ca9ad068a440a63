"""Argument checks run before every launch; each error names the argument that is wrong.

Two tiers. Metadata checks (shape, dtype, device, strides) read no tensor data and always run.
Value checks (block ids inside the pool, sequences no longer than their block-table row, slots in
range) read the metadata tensors, which on CUDA costs a device sync, so the public functions run
them when ``validate=True`` (the default; the design's debug mode). Triton kernels do no bounds
checks of their own: an out-of-range block id is a wild read on a GPU and a segfault in the
interpreter, so a bad id must be caught here, before launch.

Shapes and dtypes follow the layout contract in ``blockd_gpu.layout``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from .layout import SUPPORTED_DTYPES, KvLayout

__all__ = [
    "CacheDims",
    "check_tensor",
    "validate_kv_cache",
    "validate_pool",
    "validate_block_tables",
    "validate_slot_mapping",
    "validate_block_mapping",
    "validate_qo_indptr",
    "validate_query",
    "validate_out",
]


class CacheDims(NamedTuple):
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
    shape: Sequence[int | None] | None = None,
) -> torch.Tensor:
    """Type, rank, dtype, device and (``None`` = any) per-dimension size of ``t``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name}: expected dtype {want}, got {str(t.dtype).removeprefix('torch.')}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if shape is not None and (t.dim() != len(shape) or any(
            w is not None and w != s for w, s in zip(shape, t.shape, strict=False))):
        want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
        raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")
    return t


def validate_kv_cache(
    k_cache: object, v_cache: object, *, layout: KvLayout | None = None
) -> CacheDims:
    """One layer's caches: ``[num_blocks, block_size, num_kv_heads, head_dim]`` each, same dtype,
    shape and device, ``head_dim`` innermost; against ``layout`` when given."""
    k = check_tensor("k_cache", k_cache, ndim=4, dtypes=tuple(SUPPORTED_DTYPES.values()))
    v = check_tensor("v_cache", v_cache, ndim=4, dtypes=(k.dtype,), device=k.device,
                     shape=tuple(k.shape))
    dims = CacheDims(*k.shape)
    for name, t in (("k_cache", k), ("v_cache", v)):
        if t.stride(-1) != 1 and dims.head_dim > 1:
            raise ValueError(f"{name}: head_dim must be the innermost dimension (stride 1), got "
                             f"strides {t.stride()}")
    if layout is not None:
        want = (layout.block_size, layout.num_kv_heads, layout.head_dim)
        if tuple(dims[1:]) != want or k.dtype != layout.torch_dtype:
            raise ValueError(f"k_cache: shape {list(k.shape)} / dtype {k.dtype} does not match "
                             f"layout [*, {want[0]}, {want[1]}, {want[2]}] / {layout.dtype}")
    return dims


def validate_pool(kv_pool: object, *, layout: KvLayout | None = None) -> int:
    """A stacked pool ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``; each
    block's elements contiguous. Returns ``num_blocks``."""
    pool = check_tensor("kv_pool", kv_pool, ndim=6, dtypes=tuple(SUPPORTED_DTYPES.values()))
    if pool.shape[1] != 2:
        raise ValueError(f"kv_pool: dimension 1 must be 2 (K, V), got shape {list(pool.shape)}")
    _, _, _, block_size, heads, head_dim = pool.shape
    # copy_blocks moves a block as one flat run of block_size * heads * head_dim elements.
    want_inner = (heads * head_dim, head_dim, 1)
    got_inner = pool.stride()[3:]
    if any(n > 1 and g != w for n, g, w in zip(pool.shape[3:], got_inner, want_inner, strict=True)):
        raise ValueError(f"kv_pool: each block must be contiguous (strides {want_inner} for the "
                         f"last three dims), got {got_inner}")
    if layout is not None:
        got = KvLayout.from_pool(pool, layout.kv_order)
        diff = layout.mismatch(got)
        if diff:
            raise ValueError("kv_pool: does not match layout: " + "; ".join(diff))
    return int(pool.shape[2])


def validate_block_tables(
    block_tables: object,
    seq_lens: object,
    *,
    num_blocks: int,
    block_size: int,
    device: torch.device,
    num_seqs: int | None = None,
    check_values: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``block_tables`` int32 ``[num_seqs, max_blocks]`` and ``seq_lens`` int32 ``[num_seqs]``.

    Value checks: ``0 <= seq_lens[s] <= max_blocks * block_size`` and every block id a sequence
    uses (the first ``ceil(seq_lens[s] / block_size)`` of its row) is in ``[0, num_blocks)``.
    """
    bt = check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,), device=device)
    if num_seqs is not None and bt.shape[0] != num_seqs:
        raise ValueError(f"block_tables: expected {num_seqs} rows (one per sequence), got "
                         f"shape {list(bt.shape)}")
    lens = check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), device=device,
                        shape=(bt.shape[0],))
    if bt.numel() and bt.stride(1) != 1:
        raise ValueError(f"block_tables: rows must be contiguous (stride 1 along blocks), got "
                         f"strides {bt.stride()}")
    if not check_values or lens.numel() == 0:
        return bt, lens
    lens64 = lens.to(torch.int64)
    capacity = bt.shape[1] * block_size
    bad = (lens64 < 0) | (lens64 > capacity)
    if bool(bad.any()):
        s = int(bad.nonzero()[0, 0])
        raise ValueError(f"seq_lens: sequence {s} has length {int(lens64[s])}, outside "
                         f"[0, {capacity}] (max_blocks {bt.shape[1]} x block_size {block_size})")
    used_blocks = (lens64 + block_size - 1) // block_size
    in_use = torch.arange(bt.shape[1], device=device)[None, :] < used_blocks[:, None]
    out_of_pool = in_use & ((bt < 0) | (bt >= num_blocks))
    if bool(out_of_pool.any()):
        s, j = (int(x) for x in out_of_pool.nonzero()[0])
        raise ValueError(f"block_tables: block id {int(bt[s, j])} at [{s}, {j}] is outside the "
                         f"pool [0, {num_blocks})")
    return bt, lens


def validate_qo_indptr(
    qo_indptr: object,
    seq_lens: torch.Tensor,
    *,
    num_tokens: int,
    device: torch.device,
    check_values: bool = True,
) -> torch.Tensor:
    """int32 ``[num_seqs + 1]``: starts at 0, non-decreasing, ends at ``num_tokens``, and each
    sequence's new-token count is at most its ``seq_lens`` entry."""
    indptr = check_tensor("qo_indptr", qo_indptr, ndim=1, dtypes=(torch.int32,), device=device,
                          shape=(seq_lens.shape[0] + 1,))
    if not check_values:
        return indptr
    ip = indptr.to(torch.int64)
    q_lens = ip[1:] - ip[:-1]
    if int(ip[0]) != 0 or int(ip[-1]) != num_tokens or bool((q_lens < 0).any()):
        raise ValueError(f"qo_indptr: must start at 0, be non-decreasing and end at num_tokens="
                         f"{num_tokens}, got {ip.tolist() if ip.numel() <= 16 else 'a bad array'}")
    too_long = q_lens > seq_lens.to(torch.int64)
    if bool(too_long.any()):
        s = int(too_long.nonzero()[0, 0])
        raise ValueError(f"qo_indptr: sequence {s} has {int(q_lens[s])} new tokens but seq_lens "
                         f"is {int(seq_lens[s])} (seq_lens must include the new tokens)")
    return indptr


def validate_slot_mapping(
    slot_mapping: object,
    *,
    num_tokens: int,
    num_slots: int,
    device: torch.device,
    check_values: bool = True,
) -> torch.Tensor:
    """int64 ``[num_tokens]``; each entry in ``[0, num_slots)`` or ``PAD_SLOT_ID`` (-1), and no
    slot written twice (the write order of duplicates would be undefined)."""
    slots = check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64,),
                         device=device, shape=(num_tokens,))
    if not check_values or slots.numel() == 0:
        return slots
    bad = (slots < -1) | (slots >= num_slots)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"slot_mapping: slot {int(slots[i])} of token {i} is outside the pool "
                         f"[0, {num_slots}) (and is not the padding id -1)")
    real = slots[slots >= 0]
    if real.numel() != torch.unique(real).numel():
        raise ValueError("slot_mapping: a slot appears twice")
    return slots


def validate_block_mapping(
    block_mapping: object, *, num_blocks: int, device: torch.device, check_values: bool = True
) -> torch.Tensor:
    """int64 ``[num_pairs, 2]`` of (src, dst) block ids in ``[0, num_blocks)``; destinations are
    distinct and never a source, so the copies of one launch may run in any order."""
    mapping = check_tensor("block_mapping", block_mapping, ndim=2, dtypes=(torch.int64,),
                           device=device, shape=(None, 2))
    if not check_values or mapping.numel() == 0:
        return mapping
    bad = (mapping < 0) | (mapping >= num_blocks)
    if bool(bad.any()):
        i, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"block_mapping: block id {int(mapping[i, j])} at [{i}, {j}] is outside "
                         f"the pool [0, {num_blocks})")
    dst = mapping[:, 1]
    if dst.numel() != torch.unique(dst).numel():
        raise ValueError("block_mapping: a destination block appears twice")
    if bool(torch.isin(dst, mapping[:, 0]).any()):
        raise ValueError("block_mapping: a destination block is also a source")
    return mapping


def validate_query(
    q: object, dims: CacheDims, *, dtype: torch.dtype, device: torch.device, rows: int | None = None
) -> torch.Tensor:
    """``[rows, num_qo_heads, head_dim]`` in the caches' dtype and device, ``head_dim`` innermost,
    ``num_qo_heads`` a multiple of ``num_kv_heads`` (MHA, GQA, MQA)."""
    t = check_tensor("q", q, ndim=3, dtypes=(dtype,), device=device,
                     shape=(rows, None, dims.head_dim))
    if t.shape[1] == 0 or t.shape[1] % dims.num_kv_heads:
        raise ValueError(f"q: num_qo_heads ({t.shape[1]}) must be a positive multiple of "
                         f"num_kv_heads ({dims.num_kv_heads})")
    if t.numel() and t.stride(-1) != 1 and dims.head_dim > 1:
        raise ValueError(f"q: head_dim must be the innermost dimension (stride 1), got strides "
                         f"{t.stride()}")
    return t


def validate_out(
    out: object, *, shape: Sequence[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A caller-supplied output buffer: exact shape, dtype and device; any strides with the last
    dimension contiguous."""
    o = check_tensor("out", out, dtypes=(dtype,), device=device, shape=tuple(shape))
    if o.numel() and o.stride(-1) != 1 and o.shape[-1] > 1:
        raise ValueError(f"out: the last dimension must be contiguous, got strides {o.stride()}")
    return o
