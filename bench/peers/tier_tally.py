"""The counting rule of tally.py, with the prefix hits split by the tier that served them.

Everything ``Tally`` counts keeps its meaning: a block a sequence acquires through a prefix hit
is a hit block, whichever tier it came from, so ``released == allocated + hit_blocks`` still
holds for every sequence. A hit served from the host tier is a hit that first needed a copy
back into the device pool: the copy is counted apart (``loaded_blocks``) and is not an
allocation of the sequence, since the block belongs to the cache once loaded.

* ``hit_tokens_device``: prompt tokens found resident in the device (GPU) pool;
* ``hit_tokens_host``: prompt tokens found only in the host tier and loaded back;
* ``loaded_blocks``: blocks copied host -> device for those hits;
* ``stored_blocks``: blocks copied device -> host (backups / offloads), as the manager itself
  reports them.

``hit_tokens == hit_tokens_device + hit_tokens_host``; ``hit_rate_tokens`` is over all tiers
and ``hit_rate_device`` over the device pool alone (both over prompt tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

from .tally import Tally


@dataclass(slots=True)
class TierTally(Tally):
    hit_tokens_device: int = 0
    hit_tokens_host: int = 0
    loaded_blocks: int = 0
    stored_blocks: int = 0

    def hit(self, device_tokens: int, host_tokens: int, block_size: int) -> None:
        """Count one sequence's prefix hit: ``device_tokens`` resident, ``host_tokens`` loaded."""
        self.hit_tokens_device += device_tokens
        self.hit_tokens_host += host_tokens
        self.hit_tokens += device_tokens + host_tokens
        self.hit_blocks += (device_tokens + host_tokens) // block_size
        self.loaded_blocks += host_tokens // block_size

    def as_dict(self) -> dict[str, int | float]:
        d = Tally.as_dict(self)
        q = self.queried_tokens
        d["hit_rate_device"] = self.hit_tokens_device / q if q else 0.0
        d["hit_rate_host"] = self.hit_tokens_host / q if q else 0.0
        return d
