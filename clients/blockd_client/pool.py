"""PoolView: the daemon's host KV pool mapped into this process, zero-copy, as torch tensors.

The descriptors arrive over the daemon's handle socket (``blockd_client.handles``): the pool's
memfd and this session's fence page. The pool is viewed in the ``blockd_gpu`` layout (see
``blockd_gpu.layout`` and ``blockd_client.views``): ``kv_pool[shard]`` is ``[num_layers, 2,
num_blocks, block_size, num_kv_heads, head_dim]``; the shards follow each other in the memfd.

NOTE: the mapping is never closed explicitly. Every tensor view holds a reference to the mmap
object (``torch.frombuffer``) but not a buffer export, so ``mmap.close()`` would succeed under a
live view and turn its next read into a SIGSEGV. ``close()`` therefore only drops this object's
references; the memory is unmapped when the last view is garbage-collected (``mapped`` tells).
"""

from __future__ import annotations

import mmap
import os
import weakref

from blockd import handle_wire, wire
from blockd_client.handles import fetch_handles
from blockd_client.views import MappedPool

__all__ = ["PoolView", "open_pool"]

#: Linux's MAP_POPULATE (0 elsewhere: pages are then mapped on first touch).
POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def open_pool(handle_socket: str, session_id: str, fetch_secret: str, tenant_id: str = ""
              ) -> MappedPool:
    """Fetch a session's descriptors (``fetch_secret``: its AttachResponse's) and map the pool
    with the view its backend needs: the pool partition of the session's tenant
    (``num_blocks`` and every block id the session receives are that partition's;
    ``blockd.wire``, "Block ids")."""
    header, fds = fetch_handles(handle_socket, session_id, fetch_secret, tenant_id=tenant_id)
    if header.backend == "cuda":
        from blockd_client.cuda_view import CudaPoolView  # cuda-python only when needed

        return CudaPoolView(header, fds)
    return PoolView(header, fds)


class PoolView(MappedPool):
    """A mapped host pool plus this session's fence page."""

    def __init__(self, header: handle_wire.HandleHeader, fds: list[int]) -> None:
        """Map a host pool from its handle header and ``[pool fd, fence page fd]`` (closes the
        fds: the mappings keep the memory)."""
        import torch

        try:
            if header.backend != "host":
                raise ConnectionError(f"pool backend {header.backend!r} needs the CUDA view "
                                      f"(blockd_client.cuda_view.CudaPoolView)")
            (pool_fd,), fence_fd = header.split_fds(fds)
            self._adopt(header, fence_fd)
            # MAP_POPULATE: this process's page tables are filled at once. Without it every
            # block's first copy in this process takes a page fault per 4 KiB (the pages exist,
            # posix_fallocate reserved them, but each process maps them on first touch), and
            # an engine writes new blocks for hours before it has touched a large pool once.
            self._map = mmap.mmap(pool_fd, header.pool_bytes, mmap.MAP_SHARED | POPULATE,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            for fd in fds:
                os.close(fd)
        shard_bytes = wire.pool_bytes(self.layout, self.num_blocks)
        flat = torch.frombuffer(self._map, dtype=self.layout.torch_dtype,
                                count=self.tp_size * shard_bytes // self.layout.itemsize)
        shape = (self.tp_size, *self.layout.pool_shape(self.num_blocks))
        self._pools = list(flat.view(shape).unbind(0))
        del flat
        self._map_refs = [weakref.ref(self._map)]

    def _drop_mappings(self) -> None:
        del self._map  # tensors still hold the mmap object; it unmaps when they are gone
