"""A simulated pool and lower-tier store for the core's tier tests: real bytes, no memory maps.

``SimIO`` is a ``blockd.core.tier_io.TierIO`` over a dict of pool blocks (what a worker wrote,
``write``) and a dict per tier of slots, each slot holding the entry's (serial, key), a
checksum and the bytes, as the runtime's stores do. A load checks all three, so a test can
corrupt a slot (``corrupt``) or make writes fail (``fail_writes``) and see the core's answer;
``pool[b]`` is what a worker reading block ``b`` would get.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field


@dataclass
class Slot:
    serial: int
    key: bytes
    checksum: int
    data: bytes


@dataclass
class SimIO:
    pool: dict[int, bytes] = field(default_factory=dict)
    slots: dict[str, dict[int, Slot]] = field(default_factory=lambda: {"host": {}, "disk": {}})
    fail_writes: set[str] = field(default_factory=set)
    calls: list[tuple[str, ...]] = field(default_factory=list)
    scrubbed: list[tuple[str, int]] = field(default_factory=list)

    def write(self, block: int, data: bytes) -> None:
        """A worker wrote K/V into ``block``."""
        self.pool[block] = data

    def corrupt(self, tier: str, slot: int) -> None:
        old = self.slots[tier][slot]
        self.slots[tier][slot] = Slot(old.serial, old.key, old.checksum,
                                      bytes(b ^ 0xFF for b in old.data))

    def spill(self, block: int, tier: str, slot: int, serial: int, key: bytes) -> bool:
        self.calls.append(("spill", str(block), tier, str(slot)))
        if tier in self.fail_writes:
            return False
        data = self.pool.get(block, b"")
        self.slots[tier][slot] = Slot(serial, key, zlib.crc32(data), data)
        return True

    def load(self, tier: str, slot: int, block: int, serial: int, key: bytes) -> bool:
        self.calls.append(("load", tier, str(slot), str(block)))
        got = self.slots[tier].get(slot)
        if got is None or got.serial != serial or got.key != key \
                or zlib.crc32(got.data) != got.checksum:
            return False
        self.pool[block] = got.data
        return True

    def move(self, src_tier: str, src_slot: int, dst_tier: str, dst_slot: int, serial: int,
             key: bytes) -> bool:
        self.calls.append(("move", src_tier, str(src_slot), dst_tier, str(dst_slot)))
        got = self.slots[src_tier].get(src_slot)
        if dst_tier in self.fail_writes or got is None or got.serial != serial:
            return False
        self.slots[dst_tier][dst_slot] = got
        return True

    def scrub(self, tier: str, slot: int) -> None:
        self.scrubbed.append((tier, slot))
        self.slots[tier].pop(slot, None)
