"""The host pool: one shared-memory region per pool (an anonymous memfd, or a file in the
daemon's private state directory when crash recovery is on).

Layout of one shard (documented once in ``blockd_gpu.layout``): a stacked tensor
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` of ``dtype``; shards follow
each other. A block is therefore ``2 * num_layers * tp_size`` contiguous runs of
``block_size * num_kv_heads * head_dim`` elements.

The region is reserved with ``posix_fallocate``, so a full /dev/shm (or memory cgroup) fails
here, at creation, instead of with SIGBUS on first touch. The file descriptor is what a worker
receives (SCM_RIGHTS) to map the same memory; no name exists that another process could guess.

With ``path`` (``state.dir``), the region is a file in a private tmpfs directory instead: its
content outlives the daemon process, so a daemon restarted after a crash maps the very memory
its workers still map (``reuse=True``), and every live sequence keeps its K/V.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterable

from blockd.core.errors import ResourceExhausted
from blockd.core.spec import DTYPE_BYTES, PoolSpec


class HostPool:
    """A memfd-backed KV pool. Owned by the daemon; workers map its fd."""

    backend = "host"

    def __init__(self, spec: PoolSpec, prefault: bool = False, path: str | None = None,
                 reuse: bool = False) -> None:
        self.spec = spec
        #: Bytes of one block's run within one (layer, K/V, shard) plane.
        self.run_bytes = (spec.block_size * spec.num_kv_heads * spec.head_dim
                          * DTYPE_BYTES[spec.dtype])
        self.plane_bytes = self.run_bytes * spec.num_blocks
        self.num_planes = 2 * spec.num_layers * spec.tp_size
        self.size = self.plane_bytes * self.num_planes
        self.path = path
        if path is None:
            self.fd = os.memfd_create("blockd-kv-pool", os.MFD_CLOEXEC)
        elif reuse:
            self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        else:
            # A fresh pool: workers still mapping an old file keep their (old) memory.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            if reuse:
                have = os.fstat(self.fd).st_size
                if have != self.size:
                    raise ValueError(f"{path} holds {have} bytes, the pool needs {self.size}")
            else:
                os.ftruncate(self.fd, self.size)
                try:
                    os.posix_fallocate(self.fd, 0, self.size)
                except OSError as exc:
                    raise ResourceExhausted(
                        f"cannot reserve {self.size} bytes of shared memory for the pool: {exc}",
                        reason="shm", field="pool.num_blocks") from None
            self.map = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED,
                                 mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        if prefault:
            self.map.madvise(mmap.MADV_WILLNEED)
            for off in range(0, self.size, mmap.PAGESIZE):
                self.map[off] = 0
        self._zeros = bytes(self.run_bytes)

    def block_runs(self, block: int) -> list[tuple[int, int]]:
        """(offset, length) of each contiguous run of ``block``'s bytes."""
        return [(p * self.plane_bytes + block * self.run_bytes, self.run_bytes)
                for p in range(self.num_planes)]

    def zero_blocks(self, blocks: Iterable[int]) -> None:
        """Scrub: overwrite every byte of each block with zeros (synchronous memset)."""
        zeros = self._zeros
        run = self.run_bytes
        m = self.map
        for b in blocks:
            base = b * run
            for p in range(self.num_planes):
                off = p * self.plane_bytes + base
                m[off:off + run] = zeros

    def read_block(self, block: int) -> bytes:
        """Every byte of a block, runs concatenated (for tests and diagnostics)."""
        return b"".join(self.map[o:o + n] for o, n in self.block_runs(block))

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)
