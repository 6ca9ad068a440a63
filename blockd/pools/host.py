"""The host pool: one shared-memory region per pool (an anonymous memfd, or a file in the
daemon's private state directory when crash recovery is on).

Layout of one shard (documented once in ``blockd_gpu.layout``): a stacked tensor
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` of ``dtype``; shards follow
each other in the one region. A block is therefore one run in each of the
``2 * num_layers * tp_size`` planes (``blockd.pools.base.Planes``).

The region is reserved with ``posix_fallocate``, so a full /dev/shm (or memory cgroup) fails
here, at creation, instead of with SIGBUS on first touch. The file descriptor is what a worker
receives (SCM_RIGHTS) to map the same memory; no name exists that another process could guess.

With ``path`` (``state.dir``), the region is a file in a private tmpfs directory instead: its
content outlives the daemon process, so a daemon restarted after a crash maps the very memory
its workers still map (``reuse=True``), and every live sequence keeps its K/V.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import numpy as np

from blockd import handle_wire
from blockd.core.spec import PoolSpec
from blockd.pools import region
from blockd.pools.base import Planes, header_for
from blockd.pools.region import open_region


class HostPool:
    """A memfd-backed KV pool (a ``blockd.pools.base.Pool``). Owned by the daemon; workers map
    its fd."""

    medium = "CPU"
    #: The backend's name in the config and the handle header. The daemon's comparisons with it
    #: are to become ``medium`` comparisons (then only ``handle`` reads it).
    backend = "host"

    def __init__(self, spec: PoolSpec, prefault: bool = False, path: str | None = None,
                 reuse: bool = False) -> None:
        self.spec = spec
        #: All shards in one region: 2 * num_layers * tp_size planes.
        self.planes = Planes.of(spec, shards=spec.tp_size)
        self.size = self.planes.region_bytes
        self.path = path
        self.fd, self.map = open_region(self.size, name="blockd-kv-pool", path=path,
                                        reuse=reuse, field="pool.num_blocks", what="pool")
        if prefault:
            region.prefault(self.map, self.size)
        self._zeros = b""
        #: The region as ``[planes, num_blocks, run_bytes]`` bytes (``copy_out``/``copy_in``);
        #: released in ``close`` before the mapping is (a view would keep it open).
        self._blocks: np.ndarray | None = None

    def zero_blocks(self, blocks: Iterable[int]) -> None:
        """Scrub: overwrite every byte of each block with zeros (synchronous memset)."""
        m = self.map
        for off, n in self.planes.zero_runs(blocks):
            if len(self._zeros) < n:
                self._zeros = bytes(n)  # grows to the longest span once, then is reused
            m[off:off + n] = memoryview(self._zeros)[:n]

    def read_block(self, block: int, shard: int = 0) -> bytes:
        """Every byte of a block in one shard, runs concatenated (for tests and diagnostics)."""
        if not 0 <= shard < self.spec.tp_size:
            raise IndexError(f"shard {shard} out of range 0..{self.spec.tp_size - 1}")
        per_shard = 2 * self.spec.num_layers
        runs = self.planes.block_runs(block)[shard * per_shard:(shard + 1) * per_shard]
        return b"".join(self.map[o:o + n] for o, n in runs)

    def _by_block(self) -> np.ndarray:
        if self._blocks is None:
            p = self.planes
            self._blocks = np.frombuffer(self.map, dtype=np.uint8).reshape(
                p.num_planes, p.num_blocks, p.run_bytes)
        return self._blocks

    def copy_out(self, block: int, out: memoryview) -> None:
        """Every byte of ``block`` in every shard (``spec.slot_bytes``, runs in plane order)
        into ``out``: a spill to a tier."""
        p = self.planes
        dst = np.frombuffer(out, dtype=np.uint8).reshape(p.num_planes, p.run_bytes)
        np.copyto(dst, self._by_block()[:, block, :])

    def copy_in(self, block: int, data: memoryview) -> None:
        """Overwrite every byte of ``block`` in every shard with ``data`` (``copy_out``'s
        layout): a load from a tier. The worker sees them once its answer says so."""
        p = self.planes
        src = np.frombuffer(data, dtype=np.uint8).reshape(p.num_planes, p.run_bytes)
        self._by_block()[:, block, :] = src

    def register_host(self, region: memoryview) -> bool:
        """Host memory needs no pinning for copies within it."""
        return False

    def unregister_host(self, region: memoryview) -> None:
        pass

    def block_runs(self, block: int) -> list[tuple[int, int]]:
        """(offset, length) of each contiguous run of ``block``'s bytes."""
        return self.planes.block_runs(block)

    def handle(self, epoch: int, fence_fd: int) -> tuple[handle_wire.HandleHeader, list[int]]:
        """The header and ``[pool fd, fence page fd]`` a session's worker receives."""
        header = header_for(self.spec, epoch=epoch, backend=self.backend, pool_bytes=self.size)
        return header, [self.fd, fence_fd]

    def close(self) -> None:
        self._blocks = None
        self.map.close()
        os.close(self.fd)
