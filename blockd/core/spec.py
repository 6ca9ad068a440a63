"""The pool's shape: how many blocks, how many tokens per block, and how many bytes a block is.

The same numbers are declared once in the daemon's config, returned to workers at Attach and
compared with the layout the worker's kernels were built for (design.md section 6).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from blockd.core.errors import InvalidArgument

#: Bytes per element of each KV dtype the kernels support.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3": 1,
}

#: Physical order of one layer's K (and V) cache. The only one today; see gpu/ docs.
KV_ORDERS = ("block_token_head_dim",)

MAX_BLOCK_SIZE = 256
#: Block ids travel as uint32 and are stored in int32 arrays.
MAX_NUM_BLOCKS = 2**31 - 1


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """Shape of a KV pool.

    Per layer, K and V are each ``[num_blocks, block_size, num_kv_heads, head_dim]`` of ``dtype``
    (``kv_order`` names that order). With tensor parallelism there are ``tp_size`` such shards,
    one per device, each holding ``num_kv_heads`` heads; all shards share one block id space.
    """

    #: Tokens per block, 1..256.
    block_size: int
    #: Physical blocks in the pool, 1..2^31-1.
    num_blocks: int
    #: Transformer layers whose K/V the pool holds.
    num_layers: int = 1
    #: KV heads per layer held by one tensor-parallel shard.
    num_kv_heads: int = 1
    #: Elements per head.
    head_dim: int = 64
    #: Element type, one of ``DTYPE_BYTES``.
    dtype: str = "float16"
    #: Physical order of a layer's cache, one of ``KV_ORDERS``.
    kv_order: str = "block_token_head_dim"
    #: Tensor-parallel shards.
    tp_size: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            raise InvalidArgument(
                f"block_size must be in 1..{MAX_BLOCK_SIZE}, got {self.block_size}",
                field="block_size",
            )
        if not 1 <= self.num_blocks <= MAX_NUM_BLOCKS:
            raise InvalidArgument(
                f"num_blocks must be in 1..{MAX_NUM_BLOCKS}, got {self.num_blocks}",
                field="num_blocks",
            )
        for name in ("num_layers", "num_kv_heads", "head_dim", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"{name} must be a positive integer, got {value!r}",
                                      field=name)
        if self.dtype not in DTYPE_BYTES:
            raise InvalidArgument(
                f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}", field="dtype"
            )
        if self.kv_order not in KV_ORDERS:
            raise InvalidArgument(f"kv_order must be one of {KV_ORDERS}, got {self.kv_order!r}",
                                  field="kv_order")

    @property
    def token_bytes(self) -> int:
        """Bytes of K plus V of one token, all layers, one shard."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: K and V of ``block_size`` tokens, all layers, one shard."""
        return self.block_size * self.token_bytes

    @property
    def pool_bytes(self) -> int:
        """Bytes of one shard's pool (every shard holds this much)."""
        return self.num_blocks * self.block_bytes

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
