"""The journal: an append-only log of what the daemon applied since its last snapshot.

One record per applied change, written before the change is acknowledged (a Step's answer is
sent only after its record is written). A record is ``[u32 length][u32 crc32][msgpack]``; the
payload is a list whose first item names the record kind (see ``blockd.runtime.recovery``).

Durability model: the journal lives on the same tmpfs as the pool (``state.dir``). ``write``
returning means the bytes are in the kernel's page cache, which survives the daemon's death
(``kill -9``, an OOM kill, a segfault) but not the machine's; the pool's memory has the same
lifetime, so an fsync would buy nothing. A record torn by a kill in the middle of ``write``
fails its checksum and ends the replay there: its change was never acknowledged, and a worker
retrying it (same step_id) gets it applied once by the restarted daemon.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterator
from typing import Any

import msgpack

_HEADER = struct.Struct("<II")
#: Largest record accepted on replay (a Step is bounded by max_message_bytes, far below).
MAX_RECORD = 1 << 30


class Journal:
    """The writing end. Not thread-safe: the daemon writes from its event loop."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_TRUNC
                          | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        self.size = 0
        self.records = 0

    def append(self, record: list[Any]) -> None:
        payload = msgpack.packb(record, use_bin_type=True)
        data = _HEADER.pack(len(payload), zlib.crc32(payload)) + payload
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]
        self.size += len(data)
        self.records += 1

    def close(self) -> None:
        os.close(self.fd)


def read(path: str) -> Iterator[list[Any]]:
    """Every intact record of a journal, in order; stops at the first torn or corrupt one."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return
    off = 0
    end = len(data)
    while off + _HEADER.size <= end:
        length, crc = _HEADER.unpack_from(data, off)
        start = off + _HEADER.size
        if length > MAX_RECORD or start + length > end:
            return
        payload = data[start:start + length]
        if zlib.crc32(payload) != crc:
            return
        yield msgpack.unpackb(payload, raw=False)
        off = start + length
