"""The ``tiers`` section of the configuration: the storage below the pool (docs/tiers.md).

Its own module because ``blockd.config`` is at the size limit; ``blockd.config.Config`` holds it
as ``tiers``. The sizes are checked here against each other; against the pool (a tier smaller
than one block) by ``Config``, and against the machine (its memory, the disk's free space) by the
daemon at start, each a one-line refusal naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

from blockd.core.errors import InvalidArgument
from blockd.options import option

MIB = 1024 * 1024


@dataclass(frozen=True)
class TiersConfig:
    """Where evicted prefixes go below the pool: host memory, then a file on local disk."""

    host_bytes: int = option(
        0, "Bytes of host memory below the pool for the prefixes it evicts (0: no host tier). "
           "Reserved at start (a memfd; a file in state.dir with crash recovery); refused "
           "above the machine's memory. Off by default: it is memory taken from the node.")
    disk_path: str = option(
        "", "Directory on local disk for the disk tier's file (\"\": no disk tier). Entries "
            "the host tier evicts go there (written through the page cache, behind the "
            "Steps); every slot has a checksum, checked on each read.")
    disk_bytes: int = option(0, "Bytes of the disk tier's file, preallocated at start (a full "
                                "disk is refused then, not at run time).")
    max_spill_bytes_per_step: int = option(
        16 * MIB, "Most bytes one Step copies down the tiers (spills and demotions); beyond, "
                  "an evicted prefix is dropped (counted): a Step's copies stay bounded.")
    max_load_bytes_per_step: int = option(
        64 * MIB, "Most bytes one Step loads from the tiers into the pool; a lower hit beyond "
                  "is computed instead (counted).")

    def __post_init__(self) -> None:
        for name in ("host_bytes", "disk_bytes", "max_spill_bytes_per_step",
                     "max_load_bytes_per_step"):
            value = getattr(self, name)
            if not value >= 0:
                raise InvalidArgument(f"tiers.{name}: must not be negative, got {value}",
                                      field=f"tiers.{name}")
        if bool(self.disk_path) != bool(self.disk_bytes):
            missing = "disk_bytes" if self.disk_path else "disk_path"
            raise InvalidArgument(f"tiers.{missing}: a disk tier needs both disk_path and "
                                  "disk_bytes", field=f"tiers.{missing}")

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0 or self.disk_bytes > 0

    def check_pool(self, slot_bytes: int) -> None:
        """Refuse tiers the pool cannot use: smaller than one of its blocks, or copy bounds
        below one block."""
        if not self.enabled:
            return
        for name in ("host_bytes", "disk_bytes", "max_spill_bytes_per_step",
                     "max_load_bytes_per_step"):
            value = getattr(self, name)
            if value < slot_bytes and (value or name.startswith("max_")):
                raise InvalidArgument(
                    f"tiers.{name}: {value} bytes is less than one block of the pool "
                    f"({slot_bytes} bytes)", field=f"tiers.{name}")

    def limits(self, slot_bytes: int) -> tuple[int, int, int, int]:
        """(host slots, disk slots, spills per Step, loads per Step), in blocks."""
        return (self.host_bytes // slot_bytes, self.disk_bytes // slot_bytes,
                self.max_spill_bytes_per_step // slot_bytes,
                self.max_load_bytes_per_step // slot_bytes)
