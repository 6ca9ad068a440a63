"""The journal: an append-only log of what the daemon applied since its last snapshot.

One record per applied change, written before the change is acknowledged (a Step's answer is
sent only after its record is written). A record is ``[u32 length][u32 ~length][u32 crc32]
[msgpack]``: the length twice (the second inverted) so that a damaged length is told from a
torn write, and a CRC32 of the payload. The payload is a list whose first item names the
record kind (``blockd.runtime.journal_records``: one typed record per kind).

Durability model: the journal lives on the same tmpfs as the pool (``state.dir``). ``write``
returning means the bytes are in the kernel's page cache, which survives the daemon's death
(``kill -9``, an OOM kill, a segfault) but not the machine's; the pool's memory has the same
lifetime, so an fsync would buy nothing.

Damage (``scan``) comes in two kinds, told apart by the header check:

* **torn**: the file ends inside a record whose header is intact (or inside the header). Only a
  write cut short by the daemon's death does that: ``write`` extends a file by a prefix of the
  bytes it was given, and a record is acknowledged only once all of them were written, so the
  torn record was never acknowledged and dropping it is safe (the worker's retry of that
  step_id is applied once by the restarted daemon).
* **corrupt**: a complete record whose CRC does not match, or a header whose two lengths
  disagree: bytes changed after they were written. The record, and everything after it, may
  have been acknowledged: the state it leads to is unknown, so recovery starts a new epoch
  (``blockd.runtime.recovery``) rather than carry on with a hole.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack

_HEADER = struct.Struct("<III")
#: Largest record accepted on replay (a Step record is bounded by max_message_bytes, far below).
MAX_RECORD = 1 << 30
#: Bytes a record takes beyond its payload.
OVERHEAD = _HEADER.size


class Journal:
    """The writing end. Not thread-safe: the daemon writes from its event loop."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_TRUNC
                          | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        self.size = 0
        self.records = 0

    def append(self, record: list[Any]) -> None:
        """Write one record; an ``OSError`` (ENOSPC, EFBIG, EIO) leaves the file as it was
        before the call (a partly written record is cut off again), so a later record never
        follows a torn one."""
        payload = msgpack.packb(record, use_bin_type=True)
        n = len(payload)
        data = _HEADER.pack(n, n ^ 0xFFFFFFFF, zlib.crc32(payload)) + payload
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self.fd, view):]
        except OSError:
            if len(view) < len(data):
                os.ftruncate(self.fd, self.size)
            raise
        self.size += len(data)
        self.records += 1

    def close(self) -> None:
        os.close(self.fd)


@dataclass(slots=True)
class Damage:
    """Where a journal stops being readable, and what is lost from there on."""

    kind: str  # "torn" or "corrupt"
    offset: int
    bytes_lost: int
    #: Records after the damaged one that could still be framed (corrupt payloads only; a
    #: corrupt header leaves the rest unframeable), by kind: what the lost part held.
    lost_kinds: Counter[str] = field(default_factory=Counter)

    def describe(self) -> str:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.lost_kinds.items())) or "unknown"
        return (f"{self.kind} record at byte {self.offset}: {self.bytes_lost} bytes lost "
                f"(records after it: {kinds})")


@dataclass(slots=True)
class Scan:
    records: list[list[Any]]
    damage: Damage | None


def scan(path: str) -> Scan:
    """Every intact record of a journal, in order, and the damage that ends it, if any."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return Scan([], None)
    records: list[list[Any]] = []
    off = 0
    end = len(data)
    while off < end:
        if off + _HEADER.size > end:
            return Scan(records, Damage("torn", off, end - off))
        length, check, crc = _HEADER.unpack_from(data, off)
        if length ^ 0xFFFFFFFF != check or length > MAX_RECORD:
            return Scan(records, Damage("corrupt", off, end - off))
        start = off + _HEADER.size
        if start + length > end:
            return Scan(records, Damage("torn", off, end - off))
        payload = data[start:start + length]
        if zlib.crc32(payload) != crc:
            return Scan(records, Damage("corrupt", off, end - off,
                                        _kinds_after(data, start + length)))
        records.append(msgpack.unpackb(payload, raw=False))
        off = start + length
    return Scan(records, None)


def read(path: str) -> Iterator[list[Any]]:
    """The intact records of a journal, stopping at any damage (see ``scan``)."""
    yield from scan(path).records


def _kinds_after(data: bytes, off: int) -> Counter[str]:
    """The kinds of the intact records from ``off`` on (what a corrupt record took along)."""
    kinds: Counter[str] = Counter()
    end = len(data)
    while off + _HEADER.size <= end:
        length, check, crc = _HEADER.unpack_from(data, off)
        start = off + _HEADER.size
        if length ^ 0xFFFFFFFF != check or start + length > end:
            break
        payload = data[start:start + length]
        if zlib.crc32(payload) == crc:
            try:
                kinds[str(msgpack.unpackb(payload, raw=False)[0])] += 1
            except Exception:  # noqa: BLE001 (a best-effort census of lost records)
                kinds["unreadable"] += 1
        off = start + length
    return kinds
