"""What a tier's store is: slots of one block each, written and read with their header.

Both stores (``blockd.tiers.host``, ``blockd.tiers.disk``) follow the write protocol of
``blockd.tiers.slot``: ``begin_write`` clears the slot's header and hands back the buffer to fill
with the block's bytes, ``end_write`` writes the bytes (the disk store) and then the header with
their checksum. ``checked_view`` returns the slot's bytes only if its header names the entry
and the checksum matches them. An ``OSError`` of a store is the caller's to count: the core
gets ``False`` from its ``TierIO`` (``blockd.runtime.tier_io``) and drops or computes instead.
"""

from __future__ import annotations

from typing import Protocol


class TierStore(Protocol):
    #: ``"host"`` or ``"disk"`` (``blockd.core.lower_tiers``).
    name: str
    num_slots: int
    #: Bytes of one block in every shard (``PoolSpec.slot_bytes``).
    slot_bytes: int

    def begin_write(self, slot: int) -> memoryview:
        """The writable ``slot_bytes`` to fill; the slot's header is cleared first."""
        ...

    def end_write(self, slot: int, serial: int, key: bytes) -> None:
        """The bytes of ``begin_write`` are the entry's: store them, then the header."""
        ...

    def checked_view(self, slot: int, serial: int, key: bytes) -> memoryview | None:
        """The slot's bytes if its header names (``serial``, ``key``) and their checksum
        matches, else None. Valid until the next call on this store."""
        ...

    def scrub(self, slot: int) -> None:
        """Erase the slot (header and bytes)."""
        ...

    def host_region(self) -> memoryview | None:
        """The store's whole host memory, to pin for a cuda pool's copies (None: nothing to
        pin, e.g. the disk store, whose one-slot buffer is copied through the driver)."""
        ...

    def close(self) -> None: ...


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to
