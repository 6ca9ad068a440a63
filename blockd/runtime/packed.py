"""A request's packed token ids read from its bytes, vectorised, instead of by protobuf.

A LookupRequest of a long prompt is almost all ``token_ids``: a 256k-token Lookup is 770 kB
of varints, which protobuf parses into a repeated field (2.4 ms on the loop) that the daemon
then copies into a list and into uint32 bytes (4 ms more), although no hit can cover more
than the pool's tokens. ``split_field`` instead cuts the packed field's payloads out of the
message bytes (a walk over the top-level fields only: a handful), protobuf parses the small
rest, and ``PackedIds`` turns only the varints needed into uint32 bytes with numpy and
counts the others without decoding them.

It follows protobuf's rules for what it accepts: a repeated scalar may come packed in several
chunks (concatenated in order) or unpacked (``split_field`` then answers None and the caller
parses the whole message as before), a uint32 keeps the low 32 bits of its varint, a varint
is at most 10 bytes, and bytes that do not frame (a truncated varint or length, a group) are
malformed (``Malformed``; the caller answers INVALID_ARGUMENT as for any unparseable request).
"""

from __future__ import annotations

import numpy as np

#: Top-level fields walked at most; a request with more (each a Python step) is parsed by
#: protobuf instead, at C speed.
MAX_FIELDS = 64

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


class Malformed(ValueError):
    """The bytes are not a protobuf message."""


def _varint(raw: bytes | memoryview, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(raw) or shift > 63:
            raise Malformed("a truncated or over-long varint")
        b = raw[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


def split_field(raw: bytes, field: int) -> tuple[bytes, list[memoryview]] | None:
    """(the message without field ``field``, that field's packed payloads in order), or None
    when it cannot be split cheaply: the field also comes unpacked, or the message has more
    than ``MAX_FIELDS`` top-level fields or a group (protobuf parses those as a whole)."""
    view = memoryview(raw)
    rest: list[memoryview] = []
    payloads: list[memoryview] = []
    i = kept = fields = 0
    while i < len(raw):
        fields += 1
        if fields > MAX_FIELDS:
            return None
        start = i
        tag, i = _varint(view, i)
        number, wire = tag >> 3, tag & 7
        if wire == _VARINT:
            _, i = _varint(view, i)
            if number == field:
                return None  # unpacked: protobuf's parse handles the mix
        elif wire == _I64:
            i += 8
        elif wire == _I32:
            i += 4
        elif wire == _LEN:
            n, i = _varint(view, i)
            if number == field:
                if i + n > len(raw):
                    raise Malformed("a length beyond the end")
                rest.append(view[kept:start])
                payloads.append(view[i:i + n])
                i += n
                kept = i
                continue
            i += n
        else:
            return None  # groups (3, 4) or invalid wire types: protobuf decides
        if i > len(raw):
            raise Malformed("a field beyond the end")
    rest.append(view[kept:])
    return b"".join(rest), payloads


def count_uint32(payloads: list[memoryview]) -> int:
    """How many varints the packed ``payloads`` hold (one terminating byte each), without
    decoding them: what a request's ids cost is known, and charged, before any is decoded
    (``check_uint32`` refuses what protobuf's parse would)."""
    for p in payloads:
        if len(p) and p[-1] >= 0x80:
            raise Malformed("a packed field ends inside a varint")
    return sum(int(np.count_nonzero(np.frombuffer(p, dtype=np.uint8) < 0x80)) for p in payloads)


def check_uint32(payloads: list[memoryview]) -> None:
    """Refuse a varint over 10 bytes anywhere in the payloads, as protobuf's parse does, so a
    decoder that stops early (``PackedIds``) accepts nothing protobuf would not."""
    for p in payloads:
        more = np.frombuffer(p, dtype=np.uint8) >= 0x80
        # A run of 10 continuation bytes: runs of 2, 4, 8, then 10.
        for step in (1, 2, 4, 2):
            more = more[:-step] & more[step:]
        if more.any():
            raise Malformed("a varint longer than 10 bytes")


class PackedIds:
    """A request's packed token ids, counted (``count_uint32``), checked and decoded on
    demand: a Lookup decodes only as many as its match reaches."""

    def __init__(self, payloads: list[memoryview]) -> None:
        #: Every id the request carries.
        self.count = count_uint32(payloads)
        check_uint32(payloads)
        self._payloads = payloads

    def first(self, k: int) -> bytes:
        """The first ``k`` ids (fewer if there are fewer) as uint32 little-endian bytes."""
        return _first(self._payloads, min(self.count, max(0, k)))


def _first(payloads: list[memoryview], k: int) -> bytes:
    """The first ``k`` varints of well-formed payloads (``count_uint32`` checked them; at
    least ``k`` of them) as uint32 bytes. Reads only the bytes they can lie in: 10 each at
    most, 3 for token ids under 2**21."""
    if k == 0:
        return b""
    head = np.frombuffer(_prefix(payloads, 3 * k), dtype=np.uint8)
    ends = np.flatnonzero(head < 0x80)[:k]
    if len(ends) < k:
        head = np.frombuffer(_prefix(payloads, 10 * k), dtype=np.uint8)
        ends = np.flatnonzero(head < 0x80)[:k]
    starts = np.empty(k, dtype=np.int64)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    padded = np.concatenate([head, np.zeros(5, dtype=np.uint8)])
    values = np.zeros(k, dtype=np.uint32)
    alive = np.ones(k, dtype=bool)  # whether byte j still belongs to each varint
    # Bytes 5.. of a varint only reach bits 35 and up: nothing a uint32 keeps (the shift by
    # 28 of byte 4 drops its high bits too).
    for j in range(5):
        byte = padded[starts + j]
        values |= np.where(alive, (byte & 0x7F).astype(np.uint32) << np.uint32(7 * j), 0
                           ).astype(np.uint32)
        alive &= byte >= 0x80
        if not alive.any():
            break
    return values.astype("<u4").tobytes()


def _prefix(payloads: list[memoryview], n: int) -> bytes:
    """The first ``n`` bytes of the payloads joined (fewer if they hold fewer)."""
    out, left = [], n
    for p in payloads:
        if left <= 0:
            break
        out.append(p[:left])
        left -= len(out[-1])
    return b"".join(out)
