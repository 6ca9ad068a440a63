"""The host tier's store: slots in host memory the daemon alone maps.

One region of ``num_slots`` slots, each a ``blockd.tiers.slot`` header and one block's bytes,
64-byte aligned. Without crash recovery it is an anonymous memfd; with ``state.dir`` a file in
that private tmpfs directory, so that a daemon restarted after ``kill -9`` finds the slots its
recovered index names (each is checked on every load anyway). Reserved with
``posix_fallocate``: a tier the machine cannot hold is refused at start, not a SIGBUS later.
No worker ever maps it: the daemon copies between it and the pool.
"""

from __future__ import annotations

import contextlib
import mmap
import os

from blockd.core.errors import ResourceExhausted
from blockd.tiers.base import round_up
from blockd.tiers.slot import EMPTY, HEADER_BYTES, SlotHeader, checksum


def memory_limit() -> int:
    """Bytes of memory this process may use at most: the machine's, or its cgroup's if lower."""
    limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with contextlib.suppress(OSError, ValueError):
        with open("/sys/fs/cgroup/memory.max") as f:
            text = f.read().strip()
        if text != "max":
            limit = min(limit, int(text))
    return limit


class HostTierStore:
    name = "host"

    def __init__(self, num_slots: int, slot_bytes: int, path: str | None = None,
                 reuse: bool = False, prefault: bool = False) -> None:
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.stride = round_up(HEADER_BYTES + slot_bytes, 64)
        self.size = num_slots * self.stride
        limit = memory_limit()
        if self.size > limit:
            raise ResourceExhausted(
                f"tiers.host_bytes: a host tier of {self.size} bytes is more than this "
                f"machine's memory ({limit} bytes)", reason="memory", field="tiers.host_bytes")
        self.path = path
        if path is None:
            self.fd = os.memfd_create("blockd-host-tier", os.MFD_CLOEXEC)
        elif reuse and os.path.exists(path):
            self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            if os.fstat(self.fd).st_size != self.size:
                os.ftruncate(self.fd, 0)  # another geometry: its slots mean nothing now
                os.ftruncate(self.fd, self.size)
            try:
                os.posix_fallocate(self.fd, 0, self.size)
            except OSError as exc:
                raise ResourceExhausted(
                    f"tiers.host_bytes: cannot reserve {self.size} bytes of memory for the "
                    f"host tier: {exc.strerror or exc}", reason="memory",
                    field="tiers.host_bytes") from None
            self.map = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED,
                                 mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self._view = memoryview(self.map)
        if prefault:  # the first spill into a page would pay its fault (``pool.prefault``)
            self.map.madvise(mmap.MADV_WILLNEED)
            for off in range(0, self.size, mmap.PAGESIZE):
                self._view[off] = self._view[off]

    def _body(self, slot: int) -> memoryview:
        off = slot * self.stride + HEADER_BYTES
        return self._view[off:off + self.slot_bytes]

    def begin_write(self, slot: int) -> memoryview:
        off = slot * self.stride
        self._view[off:off + HEADER_BYTES] = EMPTY
        return self._body(slot)

    def end_write(self, slot: int, serial: int, key: bytes) -> None:
        body = self._body(slot)
        off = slot * self.stride
        self._view[off:off + HEADER_BYTES] = SlotHeader(serial, key, len(body),
                                                        checksum(body)).pack()

    def checked_view(self, slot: int, serial: int, key: bytes) -> memoryview | None:
        off = slot * self.stride
        header = SlotHeader.unpack(self._view[off:off + HEADER_BYTES])
        body = self._body(slot)
        if header is None or not header.describes(serial, key, body):
            return None
        return body

    def scrub(self, slot: int) -> None:
        off = slot * self.stride
        self._view[off:off + self.stride] = bytes(self.stride)

    def close(self) -> None:
        try:
            self._view.release()
            self.map.close()
        except BufferError:  # a caller still holds a slot's view: the mapping goes with it
            pass
        os.close(self.fd)
