"""The KV-cache layout contract, documented once; every kernel docstring points here.

Pool (what the daemon allocates, one contiguous region per pool)::

    kv_pool: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]   dtype = layout.dtype
              layer      K=0/V=1

Per-layer caches are views of it, never copies::

    k_cache = kv_pool[layer, 0]   # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache = kv_pool[layer, 1]   # same shape

The per-layer order is "NHD" (token N, head H, head dim D), FlashInfer's name for it; its
canonical name (``KvLayout.kv_order``) is the proto's, ``"block_token_head_dim"``, and "NHD" is
accepted for it. The names of dtypes and orders, the block-size rule (a power of two in
1..256) and the byte arithmetic are ``blockd.wire``'s, the contract the daemon applies to its
pool too (this package imports nothing else of blockd, and never the client). Kernels accept
any strides for the block, token and head dimensions but need ``head_dim`` innermost (stride
1); ``copy_blocks`` also needs each block's ``block_size * num_kv_heads * head_dim`` elements
to be contiguous, which the pool above guarantees.

Per-step metadata (all on the caches' device):

- ``block_tables``: int32 ``[num_seqs, max_blocks]``. Row s lists the physical blocks of sequence s
  in logical order; token t of s lives in block ``block_tables[s, t // block_size]`` at offset
  ``t % block_size``. Entries past ``ceil(seq_lens[s] / block_size)`` are ignored (any value).
- ``seq_lens``: int32 ``[num_seqs]``. Tokens of K/V each sequence has in the cache, including the
  ones written this step; 0 is allowed (output rows are zeros).
- ``slot_mapping``: int64 ``[num_tokens]``. Flat slot ``block_id * block_size + offset`` of each new
  token; ``PAD_SLOT_ID`` (-1) marks a padding token that is not written (CUDA-graph padding).
- ``qo_indptr``: int32 ``[num_seqs + 1]``. Prefill only: the new tokens of sequence s are rows
  ``qo_indptr[s]:qo_indptr[s + 1]`` of the packed query, and they are the *last* tokens of the
  sequence (positions ``seq_lens[s] - q_len .. seq_lens[s] - 1``).
- ``block_mapping``: int64 ``[num_pairs, 2]``. ``copy_blocks`` copies block ``[i, 0]`` to
  ``[i, 1]`` in every layer, K and V.

NOTE: why NHD and a stacked pool rather than HND or one tensor per layer. NHD makes one token's K
(all heads) a contiguous ``[num_kv_heads, head_dim]`` row, so ``reshape_and_cache`` writes whole
rows and a slot is one address; decode still reads ``head_dim``-long contiguous runs (256 bytes in
bf16 at head_dim 128), enough for full memory transactions. One stacked region per pool is what
the daemon maps and shares (one fd, one base address), and it lets ``copy_blocks`` do every
layer's copy-on-write in one launch from one base pointer and three strides, without a device
array of per-layer pointers that would have to be rebuilt whenever a pool is re-attached.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from blockd import wire

__all__ = ["KvLayout", "PAD_SLOT_ID", "SUPPORTED_DTYPES", "KV_ORDERS", "canonical_dtype"]

PAD_SLOT_ID = -1
"""A ``slot_mapping`` entry that ``reshape_and_cache`` skips (padding tokens)."""

#: The torch dtype of each of ``blockd.wire.DTYPES`` (the names are torch's).
SUPPORTED_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in wire.DTYPES}
KV_ORDERS = tuple(wire.KV_ORDERS)


def canonical_dtype(dtype: str | torch.dtype, *, arg: str = "dtype") -> str:
    """Name of a supported KV dtype (``"float32"``, ``"float16"``, ``"bfloat16"``)."""
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    elif not isinstance(dtype, str):
        raise TypeError(f"{arg}: expected a torch.dtype or a dtype name, "
                        f"got {type(dtype).__name__}")
    return wire.canonical_dtype(dtype, field=arg)


@dataclass(frozen=True)
class KvLayout:
    """What a worker's kernels were built for; compared with the pool's layout at Attach.

    Invariants (checked in ``__post_init__``, by ``blockd.wire``'s rules): every count is a
    positive int, ``block_size`` is a power of two in 1..256 (``wire.check_block_size``),
    ``dtype`` is a canonical name from ``SUPPORTED_DTYPES`` and ``kv_order`` one of
    ``KV_ORDERS`` (aliases are normalised). ``num_kv_heads`` is the count in this worker's shard
    (after tensor parallelism). ``num_blocks`` is a property of a pool, not of a layout: the
    same kernels serve any pool size. Pure data: the tensor checks are ``blockd_gpu.validate``'s.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    kv_order: str = wire.KV_ORDER

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            wire.check_count(getattr(self, name), name)
        wire.check_block_size(self.block_size)
        # Frozen: normalise through object.__setattr__ so torch.bfloat16 and "bf16" compare equal.
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        object.__setattr__(self, "kv_order", wire.canonical_kv_order(self.kv_order))

    @property
    def torch_dtype(self) -> torch.dtype:
        return SUPPORTED_DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return wire.DTYPE_BYTES[self.dtype]

    @property
    def block_numel(self) -> int:
        """Elements of one block in one layer's K (or V) cache."""
        return self.block_size * self.num_kv_heads * self.head_dim

    @property
    def block_bytes(self) -> int:
        """Bytes one block id occupies in the pool: all layers, K and V."""
        return wire.block_bytes(self)

    def cache_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        """One layer's K (or V) cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
        return (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The stacked pool: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``."""
        return (self.num_layers, 2, *self.cache_shape(num_blocks))

    def pool_bytes(self, num_blocks: int) -> int:
        """Bytes of the stacked pool of ``num_blocks`` blocks."""
        return wire.pool_bytes(self, num_blocks)

    def allocate_pool(self, num_blocks: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """A zeroed pool with this layout (tests, reference worker); the daemon owns real ones."""
        return torch.zeros(self.pool_shape(num_blocks), dtype=self.torch_dtype, device=device)

    def kv_caches(self, kv_pool: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer ``(k_cache, v_cache)`` views of ``kv_pool``, which must have this layout
        (shape and dtype; ``blockd_gpu.validate.validate_pool`` also checks strides)."""
        diff = self.mismatch(KvLayout.from_pool(kv_pool, self.kv_order))
        if diff:
            raise ValueError("kv_pool: does not match layout: " + "; ".join(diff))
        return [(kv_pool[layer, 0], kv_pool[layer, 1]) for layer in range(self.num_layers)]

    @classmethod
    def from_pool(cls, kv_pool: torch.Tensor, kv_order: str = wire.KV_ORDER) -> KvLayout:
        """The layout a stacked ``kv_pool`` tensor has (its shape and dtype)."""
        if not isinstance(kv_pool, torch.Tensor) or kv_pool.dim() != 6 or kv_pool.shape[1] != 2:
            raise ValueError("kv_pool: expected a 6-d tensor [num_layers, 2, num_blocks, "
                             "block_size, num_kv_heads, head_dim]")
        num_layers, _, _, block_size, num_kv_heads, head_dim = kv_pool.shape
        return cls(num_layers, num_kv_heads, head_dim, block_size, canonical_dtype(kv_pool.dtype),
                   kv_order)

    def mismatch(self, other: KvLayout) -> list[str]:
        """Fields that differ, as ``"name: mine != theirs"``; empty when the layouts agree."""
        return [f"{f.name}: {getattr(self, f.name)!r} != {getattr(other, f.name)!r}"
                for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
