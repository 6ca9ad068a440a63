"""The pool's shape: how many blocks, how many tokens per block, and how many bytes a block is.

The same numbers are declared once in the daemon's config, returned to workers at Attach and
compared with the layout the worker's kernels were built for (design.md section 6).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from blockd import wire
from blockd.core.errors import InvalidArgument
from blockd.wire import MAX_NUM_BLOCKS

__all__ = ["MAX_NUM_BLOCKS", "PoolSpec"]


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """Shape of a KV pool.

    Per layer, K and V are each ``[num_blocks, block_size, num_kv_heads, head_dim]`` of ``dtype``
    (``kv_order`` names that order). With tensor parallelism there are ``tp_size`` such shards,
    one per device, each holding ``num_kv_heads`` heads; all shards share one block id space.
    The rules for every field are ``blockd.wire``'s, the same the workers' kernels apply.
    """

    #: Tokens per block: a power of two in 1..256 (``wire.check_block_size``).
    block_size: int
    #: Physical blocks in the pool, 1..2^31-1.
    num_blocks: int
    #: Transformer layers whose K/V the pool holds.
    num_layers: int = 1
    #: KV heads per layer held by one tensor-parallel shard.
    num_kv_heads: int = 1
    #: Elements per head.
    head_dim: int = 64
    #: Element type, a ``wire.DTYPES`` name (aliases such as "bf16" are normalised).
    dtype: str = "float16"
    #: Physical order of a layer's cache, a ``wire.KV_ORDERS`` name (aliases normalised).
    kv_order: str = wire.KV_ORDER
    #: Tensor-parallel shards.
    tp_size: int = 1

    def __post_init__(self) -> None:
        try:
            wire.check_block_size(self.block_size)
            for name in ("num_blocks", "num_layers", "num_kv_heads", "head_dim", "tp_size"):
                wire.check_count(getattr(self, name), name)
            if self.num_blocks > MAX_NUM_BLOCKS:
                raise wire.WireError("num_blocks", f"must be in 1..{MAX_NUM_BLOCKS}, "
                                     f"got {self.num_blocks}")
            # Frozen: normalise through object.__setattr__ so "bf16" and "bfloat16" compare equal.
            object.__setattr__(self, "dtype", wire.canonical_dtype(self.dtype))
            object.__setattr__(self, "kv_order", wire.canonical_kv_order(self.kv_order))
        except wire.WireError as exc:
            raise InvalidArgument(str(exc), field=exc.field) from None

    @property
    def token_bytes(self) -> int:
        """Bytes of K plus V of one token, all layers, one shard."""
        return wire.token_bytes(self)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: K and V of ``block_size`` tokens, all layers, one shard."""
        return wire.block_bytes(self)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one block in every shard: what a lower tier's slot holds of it."""
        return wire.block_bytes(self) * self.tp_size

    @property
    def pool_bytes(self) -> int:
        """Bytes of one shard's pool (every shard holds this much)."""
        return wire.pool_bytes(self, self.num_blocks)

    def layout_mismatches(self, other: PoolSpec) -> list[str]:
        """Names of the layout fields (everything but ``num_blocks``) that differ from ``other``.

        A worker's kernels are built for a layout; any difference is a FAILED_PRECONDITION at
        Attach, never wrong numbers later.
        """
        return [
            f.name
            for f in fields(self)
            if f.name != "num_blocks" and getattr(self, f.name) != getattr(other, f.name)
        ]
