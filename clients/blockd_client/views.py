"""What every mapped pool view shares: the header, the layout, per-shard tensors, the fence page.

``blockd_client.pool.PoolView`` (host memfd) and ``blockd_client.cuda_view.CudaPoolView`` (CUDA
VMM) differ only in how they map the shards; both then expose ``kv_pool(shard)`` as
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` (the ``blockd_gpu.layout``
contract), ``kv_caches(shard)`` as per-layer ``(k_cache, v_cache)`` views of it, and
``publish_fence`` / ``publish_fence_on_stream`` into this session's fence page
(``blockd.wire``'s format; ``blockd_client.fences``).

NOTE: a view never unmaps memory a tensor still uses. ``close()`` only drops the view's own
references; a shard is unmapped when the last tensor viewing it is garbage-collected
(``mapped`` tells). Each subclass says how its mapping is kept alive by its tensors.
"""

from __future__ import annotations

import mmap
import weakref
from typing import Any

from blockd import handle_wire, wire
from blockd_client.fences import FencePublisher

__all__ = ["MappedPool"]


class MappedPool:
    """Base of the pool views; a subclass maps the shards and fills ``_pools``/``_map_refs``."""

    header: handle_wire.HandleHeader
    epoch: int
    #: The ``blockd_gpu.KvLayout`` the pool has (from the header).
    layout: Any
    num_blocks: int
    tp_size: int
    _fence: mmap.mmap
    #: Writes the fence page, now or in a CUDA stream's order (``blockd_client.fences``).
    fences: FencePublisher
    _pools: list[Any] | None = None
    #: Weak references to whatever keeps each shard mapped (see the module NOTE).
    _map_refs: list[weakref.ref[Any]]

    def _adopt(self, header: handle_wire.HandleHeader, fence_fd: int) -> None:
        """Take the header's layout and map the fence page (the fd stays the caller's)."""
        from blockd_gpu.layout import KvLayout

        self.header = header
        self.epoch = header.epoch
        self.layout = KvLayout(num_layers=header.num_layers, num_kv_heads=header.num_kv_heads,
                               head_dim=header.head_dim, block_size=header.block_size,
                               dtype=header.dtype)
        self.num_blocks = header.num_blocks
        self.tp_size = header.tp_size
        self._map_refs = []
        self._fence = mmap.mmap(fence_fd, header.fence_page_bytes, mmap.MAP_SHARED,
                                mmap.PROT_READ | mmap.PROT_WRITE)
        #: A worker owning every shard publishes every slot (``for_rank`` narrows it).
        self.fences = FencePublisher(self._fence, slots=range(header.tp_size))

    def for_rank(self, rank: int) -> MappedPool:
        """This process is tensor-parallel rank ``rank``'s worker: it copies shard ``rank``
        only and publishes its fences into that rank's slot of the page, so the daemon counts
        a fence done once every rank published it. Call right after mapping, before any publish."""
        if not 0 <= rank < self.tp_size:
            raise ValueError(f"rank: {rank} is outside 0..{self.tp_size - 1} (the pool has "
                             f"tp_size={self.tp_size} shards)")
        self.fences.close()  # (a publisher of every slot, unused so far)
        self.fences = FencePublisher(self._fence, slots=(rank,))
        return self

    def kv_pool(self, shard: int = 0) -> Any:
        """The stacked pool of one shard: ``[num_layers, 2, num_blocks, B, H, D]``."""
        if self._pools is None:
            raise ValueError(f"{type(self).__name__} is closed")
        return self._pools[shard]

    def kv_caches(self, shard: int = 0) -> list[tuple[Any, Any]]:
        """Per-layer ``(k_cache, v_cache)`` views, each ``[num_blocks, B, H, D]``."""
        return self.layout.kv_caches(self.kv_pool(shard))

    def session_fence(self) -> int:
        """The session's fence as the daemon reads it: the lowest slot of every rank."""
        return wire.read_fences(self._fence, self.tp_size)

    def publish_fence(self, fence: int) -> str:
        """Tell the daemon that all GPU work up to ``fence`` is done (an 8-byte store). Call it
        only once that work has completed on your stream (e.g. after ``event.synchronize()``).
        A fence not above the highest handed over is ignored (``fences.IGNORED``)."""
        return self.fences.publish(fence)

    def publish_fence_on_stream(self, fence: int, stream: Any = None) -> str:
        """Publish ``fence`` when ``stream`` reaches this point, without waiting for it.

        ``stream`` None: the current torch stream of shard 0's device when the pool is on CUDA;
        with a host pool (CPU tensors, whose work already ran) the fence is written at once
        (``fences.HOST``). A worker whose kernels run on CUDA while the pool is on the host
        passes the stream explicitly. Returns what was done (``blockd_client.fences``)."""
        if stream is None:
            device = self.kv_pool(0).device
            if device.type != "cuda":
                return self.fences.publish(fence)
            import torch

            stream = torch.cuda.current_stream(device)
        return self.fences.publish_on_stream(fence, stream)

    @property
    def mapped(self) -> bool:
        """Whether any shard is still mapped (by this view or a tensor that outlived it)."""
        return any(ref() is not None for ref in self._map_refs)

    def _drop_mappings(self) -> None:
        """Drop the view's own strong references to its mappings (subclasses that hold any)."""

    def close(self) -> None:
        """Drop this view's references; see the module NOTE for when memory is unmapped."""
        if self._pools is None:
            return
        self._pools = None
        self._drop_mappings()
        self.fences.close()  # waits for queued writes, unregisters: before the unmap
        self._fence.close()
