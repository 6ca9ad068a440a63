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
import os

from blockd.core.errors import ResourceExhausted
from blockd.pools import region
from blockd.pools.region import open_region
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
        self.fd, self.map = open_region(self.size, name="blockd-host-tier", path=path,
                                        reuse=reuse, field="tiers.host_bytes",
                                        what="host tier", missing_ok=True)
        if prefault:  # the first spill into a page would pay its fault (``pool.prefault``)
            region.prefault(self.map, self.size)
        self._view = memoryview(self.map)

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

    def host_region(self) -> memoryview | None:
        return self._view

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
