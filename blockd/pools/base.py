"""What every pool is (the ``Pool`` protocol) and where a block's bytes are in one.

Both backends hold the stacked layout of ``blockd_gpu.layout``: per shard a tensor
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` of ``dtype``. Flattened, that
is ``num_planes`` planes (one per (layer, K/V), and per shard too when the shards share one
region, as in the host pool) of ``num_blocks`` runs of ``wire.run_bytes(spec)`` bytes each. A
block is therefore one run in every plane; ``Planes`` computes those runs, once for both.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from blockd import handle_wire, wire
from blockd.core.spec import PoolSpec

__all__ = ["Planes", "Pool", "header_for"]


class Pool(Protocol):
    """A KV pool as the daemon holds it. Pools own memory, never policy: which block to zero
    or hand out is decided above them."""

    spec: PoolSpec

    @property
    def medium(self) -> str:
        """Where the blocks live, in vLLM's names: ``"CPU"`` (host) or ``"GPU"`` (cuda)."""
        ...

    @property
    def size(self) -> int:
        """Bytes of each mapping a worker makes (host: the whole region; cuda: one shard)."""
        ...

    def zero_blocks(self, blocks: Iterable[int]) -> None:
        """Scrub: zero every byte of each block in every shard; the zeros are visible to
        workers when this returns. IndexError for an id outside the pool."""
        ...

    def read_block(self, block: int, shard: int = 0) -> bytes:
        """Every byte of one block in one shard (``spec.block_bytes``), runs in (layer, K/V)
        order: for tests and inspection."""
        ...

    def copy_out(self, block: int, out: memoryview) -> None:
        """Every byte of ``block`` in every shard (``spec.slot_bytes``: shard by shard, runs in
        plane order) into host ``out``, there when this returns: a spill to a tier."""
        ...

    def copy_in(self, block: int, data: memoryview) -> None:
        """Overwrite every byte of ``block`` in every shard with host ``data`` (``copy_out``'s
        layout), on the pool when this returns: a load from a tier."""
        ...

    def register_host(self, region: memoryview) -> bool:
        """Pin a tier's host memory for this pool's copies (True if it was pinned; the host
        pool needs none)."""
        ...

    def unregister_host(self, region: memoryview) -> None: ...

    def handle(self, epoch: int, fence_fd: int) -> tuple[handle_wire.HandleHeader, list[int]]:
        """What the handle socket sends a session: its header and descriptors, in the order
        ``handle_wire.HandleHeader.split_fds`` documents (the fds stay owned by the pool and the
        fence page)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Planes:
    """Block -> byte runs in a region of ``num_planes`` planes of ``num_blocks`` runs each."""

    #: Bytes of one block in one plane (``wire.run_bytes``).
    run_bytes: int
    num_blocks: int
    num_planes: int

    @classmethod
    def of(cls, spec: PoolSpec, shards: int = 1) -> Planes:
        """The planes of ``shards`` consecutive shards of ``spec`` (2 per layer per shard)."""
        return cls(wire.run_bytes(spec), spec.num_blocks, 2 * spec.num_layers * shards)

    @property
    def plane_bytes(self) -> int:
        return self.run_bytes * self.num_blocks

    @property
    def region_bytes(self) -> int:
        return self.plane_bytes * self.num_planes

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all planes (what ``read_block`` returns)."""
        return self.run_bytes * self.num_planes

    def block_runs(self, block: int) -> list[tuple[int, int]]:
        """(offset, length) of each contiguous run of ``block``'s bytes, in plane order."""
        self.spans([block])
        return [(p * self.plane_bytes + block * self.run_bytes, self.run_bytes)
                for p in range(self.num_planes)]

    def spans(self, blocks: Iterable[int]) -> list[tuple[int, int]]:
        """``blocks`` as sorted (first, count) spans of consecutive ids, so adjacent blocks are
        one run per plane instead of one each. IndexError for an id outside the pool."""
        ids = sorted(set(blocks))
        n = self.num_blocks
        if ids and (ids[0] < 0 or ids[-1] >= n):
            bad = [b for b in ids if not 0 <= b < n]
            raise IndexError(f"block ids {bad[:8]} out of range 0..{n - 1}")
        spans: list[tuple[int, int]] = []
        for b in ids:
            if spans and spans[-1][0] + spans[-1][1] == b:
                spans[-1] = (spans[-1][0], spans[-1][1] + 1)
            else:
                spans.append((b, 1))
        return spans

    def zero_runs(self, blocks: Iterable[int]) -> Iterator[tuple[int, int]]:
        """(offset, length) of every run to zero for ``blocks``: one per span per plane."""
        for first, count in self.spans(blocks):
            base, length = first * self.run_bytes, count * self.run_bytes
            for p in range(self.num_planes):
                yield p * self.plane_bytes + base, length


def header_for(spec: PoolSpec, *, epoch: int, backend: str, pool_bytes: int,
               devices: tuple[int, ...] = (), shard_bytes: int = 0, granularity: int = 0,
               device_uuids: tuple[str, ...] = ()) -> handle_wire.HandleHeader:
    """The handle header of a pool of ``spec`` (the cuda fields only for the cuda backend)."""
    return handle_wire.HandleHeader(
        epoch=epoch, backend=backend, pool_bytes=pool_bytes, num_blocks=spec.num_blocks,
        block_size=spec.block_size, num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim, dtype=spec.dtype, tp_size=spec.tp_size,
        fence_page_bytes=wire.FENCE_PAGE_BYTES, devices=devices, shard_bytes=shard_bytes,
        granularity=granularity, device_uuids=device_uuids)
