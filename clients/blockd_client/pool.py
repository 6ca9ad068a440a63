"""PoolView: the daemon's KV pool mapped into this process, zero-copy, as torch tensors.

The descriptors arrive over the daemon's handle socket (SCM_RIGHTS): the pool's memfd and this
session's fence page. The pool is viewed in the ``blockd_gpu`` layout (see
``blockd_gpu.layout``): ``kv_pool[shard]`` is ``[num_layers, 2, num_blocks, block_size,
num_kv_heads, head_dim]``; ``kv_caches(shard)`` gives per-layer ``(k_cache, v_cache)`` views.

NOTE: the mapping is never closed explicitly. Every tensor view holds a reference to the mmap
object (``torch.frombuffer``) but not a buffer export, so ``mmap.close()`` would succeed under a
live view and turn its next read into a SIGSEGV. ``close()`` therefore only drops this object's
references; the memory is unmapped when the last view is garbage-collected (``mapped`` tells).
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import struct
import weakref
from typing import Any

_U64 = struct.Struct("<Q")
MAX_FDS = 65


def open_pool(handle_socket: str, session_id: str) -> Any:
    """Fetch a session's descriptors and map the pool with the view its backend needs."""
    header, fds = fetch_handles(handle_socket, session_id)
    if header.get("backend") == "cuda":
        from blockd_client.cuda_view import CudaPoolView

        return CudaPoolView(header, fds)
    return PoolView(header, fds)


def fetch_handles(path: str, session_id: str, timeout: float = 10.0
                  ) -> tuple[dict[str, Any], list[int]]:
    """Ask the daemon's handle socket for a session's descriptors (pool fd, fence page fd)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(json.dumps({"session_id": session_id}).encode() + b"\n")
        # One fd per tensor-parallel shard (CUDA) plus the fence page.
        buf, fds, _flags, _addr = socket.recv_fds(s, 65536, MAX_FDS)
        while not buf.endswith(b"\n"):
            more = s.recv(65536)
            if not more:
                break
            buf += more
    header = json.loads(buf)
    if not header.get("ok"):
        for fd in fds:
            os.close(fd)
        raise ConnectionError(f"{header.get('code')}: {header.get('message')}")
    return header, fds


class PoolView:
    """A mapped host pool plus this session's fence page."""

    def __init__(self, header: dict[str, Any], fds: list[int]) -> None:
        """Map a host pool from the handle server's header and descriptors (closes the fds)."""
        import torch

        from blockd_gpu.layout import KvLayout

        try:
            if len(fds) != 2:
                raise ConnectionError(f"expected 2 descriptors (pool, fence page), got {len(fds)}")
            pool_fd, fence_fd = fds[0], fds[1]
            if header["backend"] != "host":
                raise ConnectionError(f"pool backend {header['backend']!r} needs the CUDA view")
            self.header = header
            self.epoch = int(header["epoch"])
            self.layout = KvLayout(num_layers=header["num_layers"],
                                   num_kv_heads=header["num_kv_heads"],
                                   head_dim=header["head_dim"], block_size=header["block_size"],
                                   dtype=header["dtype"])
            self.num_blocks = int(header["num_blocks"])
            self.tp_size = int(header["tp_size"])
            size = int(header["pool_bytes"])
            self._map = mmap.mmap(pool_fd, size, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
            self._fence = mmap.mmap(fence_fd, int(header["fence_page_bytes"]), mmap.MAP_SHARED,
                                    mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            for fd in fds:
                os.close(fd)  # the mappings keep the memory; the descriptors are not needed
        flat = torch.frombuffer(self._map, dtype=self.layout.torch_dtype)
        shape = (self.tp_size, *self.layout.pool_shape(self.num_blocks))
        self._pools: list[Any] | None = list(flat.view(shape).unbind(0))
        del flat
        self._map_ref = weakref.ref(self._map)

    def kv_pool(self, shard: int = 0) -> Any:
        """The stacked pool of one shard: ``[num_layers, 2, num_blocks, B, H, D]``."""
        assert self._pools is not None, "PoolView is closed"
        return self._pools[shard]

    def kv_caches(self, shard: int = 0) -> list[tuple[Any, Any]]:
        """Per-layer ``(k_cache, v_cache)`` views, each ``[num_blocks, B, H, D]``."""
        return self.layout.kv_caches(self.kv_pool(shard))

    def publish_fence(self, fence: int) -> None:
        """Tell the daemon that all GPU work up to ``fence`` is done (an 8-byte store)."""
        _U64.pack_into(self._fence, 0, fence)

    @property
    def mapped(self) -> bool:
        """Whether the pool is still mapped (by this view or a tensor that outlived it)."""
        return self._map_ref() is not None

    def close(self) -> None:
        """Drop this view's references; see the module NOTE for when memory is unmapped."""
        if self._pools is None:
            return
        self._map_ref = weakref.ref(self._map)
        self._pools = None
        del self._map
        self._fence.close()
