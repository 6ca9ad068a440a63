"""Fence pages: one small shared-memory page per session, where the worker publishes progress.

The worker writes the highest fence whose GPU work is done into its page (the format is
``blockd.wire``'s: ``FENCE_PAGE_BYTES``, a little-endian uint64 per tensor-parallel shard of
the pool, at offset ``8 * rank``; the fence is their minimum); the daemon polls it (no RPC per
step needed) and retires PENDING blocks. Each session gets its own memfd, so a worker can only
ever advance its own fences: a shared page for all sessions would let one worker release
another's blocks early. With crash recovery on, the page is a file in the daemon's private
state directory instead, so a restarted daemon reads the page its workers still write.
"""

from __future__ import annotations

import contextlib
import mmap
import os

from blockd.wire import FENCE_PAGE_BYTES, read_fences


class FencePage:
    """The daemon's side of one session's fence page."""

    __slots__ = ("fd", "map", "path")

    def __init__(self, path: str | None = None) -> None:
        """An anonymous page, or the file ``path`` (created, or reopened as it is)."""
        self.path = path
        if path is None:
            self.fd = os.memfd_create("blockd-fence", os.MFD_CLOEXEC)
        else:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            if os.fstat(self.fd).st_size != FENCE_PAGE_BYTES:
                os.ftruncate(self.fd, FENCE_PAGE_BYTES)
            self.map = mmap.mmap(self.fd, FENCE_PAGE_BYTES, mmap.MAP_SHARED,
                                 mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise

    def read(self, slots: int = 1) -> int:
        """The fence the session's workers last published (0 before they published anything):
        the lowest of the first ``slots`` slots, one per tensor-parallel shard."""
        return read_fences(self.map, slots)

    def close(self, unlink: bool = False) -> None:
        """Unmap; ``unlink`` also removes a file-backed page (its session has ended)."""
        self.map.close()
        os.close(self.fd)
        if unlink and self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

