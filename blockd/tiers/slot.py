"""A slot's header: which entry its bytes are, and a checksum of them (a durable format).

Every slot of every tier starts with ``HEADER_BYTES`` bytes naming the entry whose bytes follow
(its serial and 16-byte key), their length and an XXH3-64 checksum of them, and a CRC32 of the
header itself. A load trusts a slot only if its header is intact, names the entry the index
expects there, and the checksum matches the bytes: after a crash a slot may hold bytes of a
copy the journal never recorded, or half of one; a disk may return damaged bytes. Every such
case is a miss, never bytes served.

Writing a slot (``blockd.tiers.host``, ``blockd.tiers.disk``): the header is cleared, the bytes
written, then the header: whatever point a crash stops at, the header does not vouch for bytes
it does not describe.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import xxhash

#: Bytes of a slot header (the bytes follow; the host tier aligns slots to 64, the disk to 4096).
HEADER_BYTES = 64
MAGIC = b"BLKDSLT1"
VERSION = 1
#: magic(8) version(4) serial(4) key(16) length(8) checksum(8); CRC32 of those 48 at 48.
_FIELDS = struct.Struct("<8sII16sQQ")
_CRC = struct.Struct("<I")
EMPTY = bytes(HEADER_BYTES)


def checksum(data: bytes | bytearray | memoryview) -> int:
    """XXH3-64 of a slot's bytes (C speed, no copy)."""
    return int(xxhash.xxh3_64_intdigest(data))


@dataclass(frozen=True, slots=True)
class SlotHeader:
    serial: int
    key: bytes
    length: int
    checksum: int

    def pack(self) -> bytes:
        head = _FIELDS.pack(MAGIC, VERSION, self.serial, self.key, self.length, self.checksum)
        return head + _CRC.pack(zlib.crc32(head)) + bytes(HEADER_BYTES - _FIELDS.size - 4)

    @classmethod
    def unpack(cls, raw: bytes | bytearray | memoryview) -> SlotHeader | None:
        """The header in ``raw`` (``HEADER_BYTES`` bytes), or None if there is none intact."""
        raw = bytes(raw[:HEADER_BYTES])
        if len(raw) < HEADER_BYTES:
            return None
        head = raw[:_FIELDS.size]
        (crc,) = _CRC.unpack_from(raw, _FIELDS.size)
        if zlib.crc32(head) != crc:
            return None
        magic, version, serial, key, length, digest = _FIELDS.unpack(head)
        if magic != MAGIC or version != VERSION:
            return None
        return cls(serial, key, length, digest)

    def describes(self, serial: int, key: bytes, data: bytes | bytearray | memoryview) -> bool:
        """Whether this header vouches for ``data`` as entry (``serial``, ``key``)."""
        return (self.serial == serial and self.key == key and self.length == len(data)
                and self.checksum == checksum(data))
