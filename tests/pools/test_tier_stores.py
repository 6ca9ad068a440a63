"""The tier stores on their own: a slot's bytes come back only with the header that names them,
and every way a slot can go wrong (another entry's header, changed bytes, a write cut short, a
file of another geometry, an error of the disk) reads as "no such bytes", never as bytes."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from blockd.core.spec import PoolSpec
from blockd.pools.host import HostPool
from blockd.runtime.tier_io import PoolTierIO, TierIOStats
from blockd.tiers.base import TierStore, round_up
from blockd.tiers.disk import FILE_HEADER, DiskTierStore, tier_file
from blockd.tiers.host import HostTierStore
from blockd.tiers.slot import EMPTY, HEADER_BYTES, SlotHeader, checksum

SLOT = 512
KEY = bytes(range(16))


def stores(tmp_path: Path) -> list[TierStore]:
    return [HostTierStore(4, SLOT), DiskTierStore(str(tmp_path), "shared", 4, SLOT)]


def write(store: TierStore, slot: int, data: bytes, serial: int = 7, key: bytes = KEY) -> None:
    store.begin_write(slot)[:] = data
    store.end_write(slot, serial, key)


def test_a_header_round_trips_and_a_damaged_one_is_none() -> None:
    h = SlotHeader(2**32 - 1, KEY, SLOT, checksum(b"x" * SLOT))
    raw = h.pack()
    assert len(raw) == HEADER_BYTES and SlotHeader.unpack(raw) == h
    assert SlotHeader.unpack(EMPTY) is None
    for i in (0, 9, 20, 47, 48):  # the magic, serial, key, checksum, the CRC itself
        bad = bytearray(raw)
        bad[i] ^= 1
        assert SlotHeader.unpack(bytes(bad)) is None


@pytest.mark.parametrize("which", [0, 1], ids=["host", "disk"])
def test_a_slot_is_read_only_as_the_entry_its_header_names(tmp_path: Path, which: int) -> None:
    store = stores(tmp_path)[which]
    data = os.urandom(SLOT)
    write(store, 2, data)
    assert bytes(store.checked_view(2, 7, KEY) or b"") == data
    assert store.checked_view(2, 8, KEY) is None  # another serial
    assert store.checked_view(2, 7, bytes(16)) is None  # another key
    assert store.checked_view(1, 7, KEY) is None  # never written
    store.begin_write(2)  # a write cut short after clearing the header
    assert store.checked_view(2, 7, KEY) is None
    write(store, 2, data)
    store.scrub(2)
    assert store.checked_view(2, 7, KEY) is None
    store.close()


def test_changed_bytes_on_disk_fail_the_check_and_the_file_is_kept_across_a_reopen(
        tmp_path: Path) -> None:
    store = DiskTierStore(str(tmp_path), "shared", 4, SLOT)
    data = os.urandom(SLOT)
    write(store, 3, data)
    store.close()
    again = DiskTierStore(str(tmp_path), "shared", 4, SLOT, reuse=True)
    assert bytes(again.checked_view(3, 7, KEY) or b"") == data  # a recovering restart keeps it
    stride = round_up(HEADER_BYTES + SLOT, 4096)
    with open(tier_file(str(tmp_path), "shared"), "r+b") as f:
        f.seek(FILE_HEADER + 3 * stride + HEADER_BYTES + 100)
        f.write(b"\x00\x01")
    assert again.checked_view(3, 7, KEY) is None
    again.close()
    fresh = DiskTierStore(str(tmp_path), "shared", 4, SLOT, reuse=False)  # a new epoch
    assert fresh.checked_view(3, 7, KEY) is None
    assert Path(tier_file(str(tmp_path), "shared")).stat().st_size == FILE_HEADER + 4 * stride
    fresh.close()
    other = DiskTierStore(str(tmp_path), "shared", 8, SLOT, reuse=True)  # another geometry
    assert other.checked_view(3, 7, KEY) is None
    other.close()


class FullDisk:
    """A store whose writes fail as a full disk's do."""

    name = "disk"
    num_slots = 4
    slot_bytes = 0

    def begin_write(self, slot: int) -> memoryview:
        raise OSError(errno.ENOSPC, "No space left on device")

    def end_write(self, slot: int, serial: int, key: bytes) -> None: ...

    def checked_view(self, slot: int, serial: int, key: bytes) -> memoryview | None:
        raise OSError(errno.EIO, "Input/output error")

    def scrub(self, slot: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    def close(self) -> None: ...


def test_copies_between_the_pool_and_the_stores_and_errors_that_are_only_counted(
        tmp_path: Path) -> None:
    spec = PoolSpec(block_size=4, num_blocks=4, num_layers=2, num_kv_heads=2, head_dim=8)
    pool = HostPool(spec)
    host = HostTierStore(2, spec.slot_bytes)
    disk = DiskTierStore(str(tmp_path), "shared", 2, spec.slot_bytes)
    stats = TierIOStats()
    io = PoolTierIO(pool, {"host": host, "disk": disk}, stats, "shared")
    data = os.urandom(spec.slot_bytes)
    pool.copy_in(1, memoryview(data))
    assert io.spill(1, "host", 0, 5, KEY)
    assert io.move("host", 0, "disk", 1, 5, KEY)
    assert io.load("disk", 1, 3, 5, KEY) and pool.read_block(3) == data
    assert not io.load("disk", 1, 2, 6, KEY)  # the wrong entry: a miss, the block untouched
    assert pool.read_block(2) == bytes(spec.slot_bytes)
    assert stats.errors == {"disk_check": 1}
    assert stats.bytes_written == {"host": spec.slot_bytes, "disk": spec.slot_bytes}
    broken = PoolTierIO(pool, {"disk": FullDisk()}, stats, "shared")  # type: ignore[dict-item]
    assert not broken.spill(1, "disk", 0, 5, KEY)
    assert not broken.load("disk", 0, 2, 5, KEY)
    broken.scrub("disk", 0)
    assert stats.errors["disk_write"] == 2 and stats.errors["disk_read"] == 1
    for closing in (host, disk, pool):
        closing.close()
