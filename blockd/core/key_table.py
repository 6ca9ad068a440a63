"""A map from 16-byte prefix keys to small integer ids, with no Python object per entry.

Open addressing over an ``array`` of ids (linear probing, backward-shift deletion) whose home
slot is the key's own first bytes: the keys are already keyed hashes (Python's ``hash`` is salted
per process, which would break snapshots). The keys themselves live in one arena indexed by id
(``KEY_BYTES`` per id, grown to the highest id stored so far), so the table costs 4 bytes per
slot plus 16 per id ever stored. A dict of bytes keys to int ids cost ~150 bytes per entry on its
own (key object, int object, dict entry): issue 17's budget is 150 bytes per indexed block.

Used by the pool's prefix index (ids: block ids) and by the lower tiers' index (ids: slot ids).
An id holds at most one key; a key maps to at most one id.
"""

from __future__ import annotations

from array import array

#: Bytes of one key (XXH3-128 digest).
KEY_BYTES = 16
_EMPTY = -1


def table_size(capacity: int) -> int:
    """Slots of the table for ``capacity`` ids: a power of two, at least 2 per id. An insert
    probes ~(1 + 1/(1-load)^2)/2 slots: 1.5 per block ran a full 20,000-block pool at load 0.61
    (~3.8 probes), 2 runs it at 0.31 (~1.5); see bench/results/core_perf.md. Same at 1M."""
    size = 8
    while size < 2 * capacity:
        size *= 2
    return size


class KeyTable:
    """Key -> id for ids ``0..capacity-1``. Not thread-safe (the core's one event loop)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        #: slot -> id (``_EMPTY``); an id's home slot is its key's first bytes & ``_mask``.
        self._slots = array("i", [_EMPTY]) * table_size(capacity)
        self._mask = len(self._slots) - 1
        #: id -> its key (valid only while the id is stored); grown by ``_reserve``.
        self._keys = bytearray()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def find(self, key: bytes) -> int | None:
        """The id stored under ``key``, or None."""
        slots = self._slots
        keys = self._keys
        mask = self._mask
        i = int.from_bytes(key, "little") & mask
        while True:
            b = slots[i]
            if b == _EMPTY:
                return None
            if keys[b * KEY_BYTES:(b + 1) * KEY_BYTES] == key:
                return b
            i = (i + 1) & mask

    def key_of(self, ident: int) -> bytes:
        """The key ``ident`` is stored under (the caller knows it is stored)."""
        return bytes(self._keys[ident * KEY_BYTES:(ident + 1) * KEY_BYTES])

    def insert(self, ident: int, key: bytes) -> bool:
        """Store ``ident`` under ``key``; False (nothing changed) if the key is taken."""
        slots = self._slots
        keys = self._keys
        mask = self._mask
        i = int.from_bytes(key, "little") & mask
        while True:
            b = slots[i]
            if b == _EMPTY:
                break
            if keys[b * KEY_BYTES:(b + 1) * KEY_BYTES] == key:
                return False
            i = (i + 1) & mask
        self._reserve(ident)
        slots[i] = ident
        keys[ident * KEY_BYTES:(ident + 1) * KEY_BYTES] = key
        self._count += 1
        return True

    def remove(self, ident: int) -> bool:
        """Drop ``ident``'s key; False if ``ident`` is not where its key says (not stored)."""
        slots = self._slots
        keys = self._keys
        mask = self._mask
        if ident >= len(keys) // KEY_BYTES:
            return False
        i = int.from_bytes(keys[ident * KEY_BYTES:(ident + 1) * KEY_BYTES], "little") & mask
        while slots[i] != ident:
            if slots[i] == _EMPTY:
                return False
            i = (i + 1) & mask
        # Backward-shift deletion: move later entries of the probe run into the hole unless
        # their home slot lies cyclically in (hole, their slot].
        j = i
        while True:
            j = (j + 1) & mask
            c = slots[j]
            if c == _EMPTY:
                break
            home = int.from_bytes(keys[c * KEY_BYTES:(c + 1) * KEY_BYTES], "little") & mask
            if (j - home) & mask >= (j - i) & mask:
                slots[i] = c
                i = j
        slots[i] = _EMPTY
        self._count -= 1
        return True

    def _reserve(self, ident: int) -> None:
        """Grow the key arena to hold ``ident`` (doubling, capped at ``capacity``)."""
        have = len(self._keys) // KEY_BYTES
        if ident < have:
            return
        grow = min(self.capacity, max(ident + 1, 2 * have, 1024)) - have
        self._keys.extend(bytes(grow * KEY_BYTES))
