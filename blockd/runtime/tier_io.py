"""The daemon's ``TierIO`` (``blockd.core.tier_io``): copies between a pool and its tiers.

Synchronous, on the daemon's loop, bounded per Step by the core (``TierLimits``): a spill copies
the block's runs out of the pool straight into the slot (host) or a buffer (disk), a load checks
the slot (``blockd.tiers.slot``) and copies it into the pool block. On the host pool these are
numpy copies through its mapping; on the cuda pool, copies on the daemon's own stream of each
device between pinned host memory and the VMM allocation, waited for on those streams. Nothing
a worker maps is written except a load's target block, which no kernel reads before the admit's
answer names it. An ``OSError`` of a store is a failed copy (False, counted by kind); it never
escapes into the Step.

``TierIOStats`` counts what moved, per tier, and times every load and spill (Prometheus
histograms in ``blockd.server.metrics``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from blockd import logs
from blockd.core.errors import BlockdError
from blockd.pools.base import Pool
from blockd.tiers.base import TierStore
from blockd.tiers.histogram import LATENCY_BUCKETS, Histogram  # noqa: F401  (re-exported)

log = logging.getLogger("blockd.tiers")

#: What a copy may raise that only fails it: a store's I/O error, a pool's copy error (a CUDA
#: call that failed is a ``BlockdError``; a bad size a ``ValueError``).
COPY_ERRORS = (OSError, BlockdError, ValueError)

@dataclass
class TierIOStats:
    """What the tiers' copies did (every partition's stores add to one of these)."""

    #: Bytes written into / read out of each tier's slots (a demotion counts as both).
    bytes_written: Counter[str] = field(default_factory=Counter)
    bytes_read: Counter[str] = field(default_factory=Counter)
    #: Failures by kind: ``<tier>_check`` (a slot that failed its check), ``<tier>_read`` and
    #: ``<tier>_write`` (an OSError).
    errors: Counter[str] = field(default_factory=Counter)
    load_seconds: dict[str, Histogram] = field(default_factory=dict)
    spill_seconds: dict[str, Histogram] = field(default_factory=dict)

    def timed(self, table: dict[str, Histogram], tier: str, t0: float) -> None:
        table.setdefault(tier, Histogram()).observe(time.perf_counter() - t0)


class PoolTierIO:
    """Moves one partition's blocks between its host pool and its tier stores."""

    def __init__(self, pool: Pool, stores: dict[str, TierStore], stats: TierIOStats,
                 partition: str) -> None:
        self.pool = pool
        self.stores = stores
        self.stats = stats
        self.partition = partition
        #: Bytes from outside the node for ``store`` (``Storage.stage``), by source number.
        self.staged: list[memoryview] = []

    def _failed(self, kind: str, exc: Exception | None = None) -> bool:
        self.stats.errors[kind] += 1
        if exc is not None:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            log.warning("tier copy failed", extra=logs.fields(
                partition=self.partition, kind=kind, error=why))
        return False

    def spill(self, block: int, tier: str, slot: int, serial: int, key: bytes) -> bool:
        store = self.stores[tier]
        t0 = time.perf_counter()
        try:
            self.pool.copy_out(block, store.begin_write(slot))
            store.end_write(slot, serial, key)
        except COPY_ERRORS as exc:
            return self._failed(f"{tier}_write", exc)
        self.stats.bytes_written[tier] += store.slot_bytes
        self.stats.timed(self.stats.spill_seconds, tier, t0)
        return True

    def _checked(self, tier: str, slot: int, serial: int, key: bytes) -> memoryview | None:
        """The slot's bytes if they pass their check; else None, the failure counted."""
        try:
            data = self.stores[tier].checked_view(slot, serial, key)
        except OSError as exc:
            self._failed(f"{tier}_read", exc)
            return None
        if data is None:
            self._failed(f"{tier}_check")
        return data

    def load(self, tier: str, slot: int, block: int, serial: int, key: bytes) -> bool:
        store = self.stores[tier]
        t0 = time.perf_counter()
        data = self._checked(tier, slot, serial, key)
        if data is None:
            return False
        try:
            self.pool.copy_in(block, data)  # cut short: the block is computed, never served
        except COPY_ERRORS as exc:
            return self._failed(f"{tier}_read", exc)
        self.stats.bytes_read[tier] += store.slot_bytes
        self.stats.timed(self.stats.load_seconds, tier, t0)
        return True

    def move(self, src_tier: str, src_slot: int, dst_tier: str, dst_slot: int, serial: int,
             key: bytes) -> bool:
        src, dst = self.stores[src_tier], self.stores[dst_tier]
        t0 = time.perf_counter()
        data = self._checked(src_tier, src_slot, serial, key)
        if data is None:
            return False
        try:
            dst.begin_write(dst_slot)[:] = data
            dst.end_write(dst_slot, serial, key)
        except OSError as exc:
            return self._failed(f"{dst_tier}_write", exc)
        self.stats.bytes_read[src_tier] += src.slot_bytes
        self.stats.bytes_written[dst_tier] += dst.slot_bytes
        self.stats.timed(self.stats.spill_seconds, dst_tier, t0)
        return True

    def store(self, tier: str, slot: int, source: int, serial: int, key: bytes) -> bool:
        dst = self.stores[tier]
        t0 = time.perf_counter()
        try:
            dst.begin_write(slot)[:] = self.staged[source]
            dst.end_write(slot, serial, key)
        except (OSError, IndexError, ValueError) as exc:
            return self._failed(f"{tier}_write", exc)
        self.stats.bytes_written[tier] += dst.slot_bytes
        self.stats.timed(self.stats.spill_seconds, tier, t0)
        return True

    def scrub(self, tier: str, slot: int) -> None:
        try:
            self.stores[tier].scrub(slot)
        except OSError as exc:
            self._failed(f"{tier}_write", exc)
