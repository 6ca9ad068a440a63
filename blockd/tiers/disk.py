"""The disk tier's store: fixed-size slots in one preallocated file on local disk.

``<tiers.disk_path>/blockd-<partition>.tier``: a 4096-byte file header (magic, version, slot
size, slot count, stride), then ``num_slots`` slots of ``stride`` bytes (4096-aligned), each a
``blockd.tiers.slot`` header and one block's bytes. Written behind: ``pwrite`` returns once the
bytes are in the page cache, and the kernel writes them to the disk later (no ``fsync``: the
tier is a cache, and every read is checked). A slot is written header cleared, bytes, header
(``blockd.tiers.slot``), so a write cut short by the daemon's death leaves a slot that fails
its check. The file is created with mode 0600 in a directory that must exist and be writable,
and preallocated with ``posix_fallocate``: a disk without room is refused at start.

Kept across a restart that recovers the daemon's state (its index names the slots); otherwise
(a new epoch) truncated and preallocated again, so no earlier tenant's bytes linger.
"""

from __future__ import annotations

import errno
import os
import struct

from blockd.core.errors import FailedPrecondition, ResourceExhausted
from blockd.tiers.base import round_up
from blockd.tiers.slot import EMPTY, HEADER_BYTES, SlotHeader, checksum

FILE_HEADER = 4096
_FILE = struct.Struct("<8sIQQQ")
_MAGIC = b"BLKDTIER"
_VERSION = 1


def tier_file(disk_path: str, partition: str) -> str:
    return os.path.join(disk_path, f"blockd-{partition}.tier")


class DiskTierStore:
    name = "disk"

    def __init__(self, disk_path: str, partition: str, num_slots: int, slot_bytes: int,
                 reuse: bool = False) -> None:
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.stride = round_up(HEADER_BYTES + slot_bytes, 4096)
        self.size = FILE_HEADER + num_slots * self.stride
        self.path = tier_file(disk_path, partition)
        if not os.path.isdir(disk_path) or not os.access(disk_path, os.W_OK | os.X_OK):
            raise FailedPrecondition(f"tiers.disk_path: {disk_path!r} is not a writable "
                                     "directory", field="tiers.disk_path")
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                              0o600)
        except OSError as exc:
            raise FailedPrecondition(f"tiers.disk_path: cannot open {self.path}: "
                                     f"{exc.strerror or exc}", field="tiers.disk_path") from None
        try:
            if not (reuse and self._geometry_matches()):
                self._create()
        except BaseException:
            os.close(self.fd)
            raise
        self._buf = bytearray(self.stride)
        self._view = memoryview(self._buf)

    def _header(self) -> bytes:
        head = _FILE.pack(_MAGIC, _VERSION, self.slot_bytes, self.num_slots, self.stride)
        return head + bytes(FILE_HEADER - len(head))

    def _geometry_matches(self) -> bool:
        try:
            return (os.fstat(self.fd).st_size == self.size
                    and os.pread(self.fd, FILE_HEADER, 0) == self._header())
        except OSError:
            return False

    def _create(self) -> None:
        os.ftruncate(self.fd, 0)  # no earlier tenant's bytes are kept
        try:
            os.posix_fallocate(self.fd, 0, self.size)
        except OSError as exc:
            os.ftruncate(self.fd, 0)
            st = os.statvfs(os.path.dirname(self.path))
            raise ResourceExhausted(
                f"tiers.disk_bytes: cannot preallocate {self.size} bytes in {self.path} "
                f"({exc.strerror or exc}; {st.f_bavail * st.f_frsize} bytes free there)",
                reason="disk", field="tiers.disk_bytes") from None
        os.pwrite(self.fd, self._header(), 0)

    def _offset(self, slot: int) -> int:
        return FILE_HEADER + slot * self.stride

    def begin_write(self, slot: int) -> memoryview:
        os.pwrite(self.fd, EMPTY, self._offset(slot))
        return self._view[HEADER_BYTES:HEADER_BYTES + self.slot_bytes]

    def end_write(self, slot: int, serial: int, key: bytes) -> None:
        body = self._view[HEADER_BYTES:HEADER_BYTES + self.slot_bytes]
        off = self._offset(slot)
        _write_all(self.fd, body, off + HEADER_BYTES)
        os.pwrite(self.fd, SlotHeader(serial, key, len(body), checksum(body)).pack(), off)

    def checked_view(self, slot: int, serial: int, key: bytes) -> memoryview | None:
        n = os.preadv(self.fd, [self._view[:HEADER_BYTES + self.slot_bytes]], self._offset(slot))
        if n != HEADER_BYTES + self.slot_bytes:
            return None
        header = SlotHeader.unpack(self._view[:HEADER_BYTES])
        body = self._view[HEADER_BYTES:HEADER_BYTES + self.slot_bytes]
        if header is None or not header.describes(serial, key, body):
            return None
        return body

    def host_region(self) -> memoryview | None:
        return None

    def scrub(self, slot: int) -> None:
        """Zeros over the whole slot (written, not deallocated: the slot stays reserved, so
        a later write cannot find the disk full)."""
        _write_all(self.fd, bytes(self.stride), self._offset(slot))

    def close(self) -> None:
        os.close(self.fd)


def _write_all(fd: int, data: memoryview | bytes, off: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, off)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        view = view[n:]
        off += n
