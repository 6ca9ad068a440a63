"""Fence pages: one small shared-memory page per session, where the worker publishes progress.

The worker writes the highest fence whose GPU work is done as a little-endian uint64 at offset
0 of its page; the daemon polls it (no RPC per step needed) and retires PENDING blocks. Each
session gets its own memfd, so a worker can only ever advance its own fences: a shared page for
all sessions would let one worker release another's blocks early.
"""

from __future__ import annotations

import mmap
import os
import struct

PAGE_BYTES = 4096
_U64 = struct.Struct("<Q")


class FencePage:
    """The daemon's side of one session's fence page."""

    __slots__ = ("fd", "map")

    def __init__(self) -> None:
        self.fd = os.memfd_create("blockd-fence", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, PAGE_BYTES)
            self.map = mmap.mmap(self.fd, PAGE_BYTES, mmap.MAP_SHARED,
                                 mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise

    def read(self) -> int:
        """The fence the worker last published (0 before it published anything)."""
        return int(_U64.unpack_from(self.map, 0)[0])

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


def publish(page: mmap.mmap | memoryview, fence: int) -> None:
    """The worker's side: an aligned 8-byte store, which x86-64 and arm64 make atomic."""
    _U64.pack_into(page, 0, fence)
