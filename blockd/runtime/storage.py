"""Where a daemon's bytes live: per partition, its pool and the stores of its lower tiers.

``Storage`` builds them (``blockd.runtime.pool_set`` for the pools, ``blockd.tiers`` for the
host and disk stores), gives each partition's manager its ``TierIO`` (wrapped in the core's
``RecordingIO``, whose failures each Step's journal record keeps), and closes them. With
``state.dir`` the host pools and host tiers are files there (kept by a restart that recovers);
the disk tier's file is in ``tiers.disk_path`` (kept by a recovering restart, truncated on a new
epoch). The coordinator decides nothing here: it says which partitions and tiers exist.
"""

from __future__ import annotations

import os
from pathlib import Path

from blockd.config import Config
from blockd.core.coordinator import PartitionCoordinator
from blockd.core.errors import ResourceExhausted
from blockd.core.lower_tiers import DISK, HOST, bytes_per_slot
from blockd.core.tier_io import RecordingIO, ReplayIO
from blockd.pools.base import Pool
from blockd.runtime.pool_set import build_pools, close_pools
from blockd.runtime.tier_io import PoolTierIO, TierIOStats
from blockd.tiers.base import TierStore
from blockd.tiers.disk import DiskTierStore
from blockd.tiers.host import HostTierStore, memory_limit


def check_machine(cfg: Config) -> None:
    """Refuse, before anything is built, lower tiers this machine cannot hold: a host tier
    above its memory, an index (``lower_tiers.bytes_per_slot`` per slot) above half of it, a
    disk tier above the free space of its directory. Each a one-line refusal naming the key."""
    tiers = cfg.tiers
    if not tiers.enabled:
        return
    spec = cfg.pool.spec()
    limit = memory_limit()
    if tiers.host_bytes > limit:
        raise ResourceExhausted(
            f"tiers.host_bytes: a host tier of {tiers.host_bytes} bytes is more than this "
            f"machine's memory ({limit} bytes)", reason="memory", field="tiers.host_bytes")
    slots = (tiers.host_bytes + tiers.disk_bytes) // spec.slot_bytes
    index = slots * bytes_per_slot(spec.block_size)
    if index > limit // 2:
        name = "disk_bytes" if tiers.disk_bytes > tiers.host_bytes else "host_bytes"
        raise ResourceExhausted(
            f"tiers.{name}: the index of {slots} slots of {spec.slot_bytes} bytes would need "
            f"{index} bytes of memory, more than half of this machine's ({limit})",
            reason="memory", field=f"tiers.{name}")
    if tiers.disk_bytes and os.path.isdir(tiers.disk_path):
        st = os.statvfs(tiers.disk_path)
        have = sum(os.path.getsize(f) for f in Path(tiers.disk_path).glob("blockd-*.tier"))
        free = st.f_bavail * st.f_frsize + have
        if tiers.disk_bytes > free:
            raise ResourceExhausted(
                f"tiers.disk_bytes: {tiers.disk_bytes} bytes do not fit in "
                f"{tiers.disk_path} ({free} bytes free there)", reason="disk",
                field="tiers.disk_bytes")


class Storage:
    """Every partition's pool and tier stores. Owned by the daemon."""

    def __init__(self, cfg: Config, parts: PartitionCoordinator, *, state_dir: Path | None,
                 shared_path: str, reuse: bool) -> None:
        self.pools: dict[str, Pool] = build_pools(
            parts.specs, cfg.pool.backend, prefault=cfg.pool.prefault, state_dir=state_dir,
            shared_path=shared_path, reuse=reuse)
        self.stores: dict[str, dict[str, TierStore]] = {}
        self.recorders: dict[str, RecordingIO] = {}
        self.stats = TierIOStats()
        #: Host tier memory registered with a cuda pool (unregistered before it is closed).
        self._pinned: list[tuple[Pool, memoryview]] = []
        try:
            for name, limits in parts.tiers.items():
                if not limits.enabled:
                    continue
                slot_bytes = parts.specs[name].slot_bytes
                stores: dict[str, TierStore] = {}
                self.stores[name] = stores
                if limits.host_slots:
                    path = str(state_dir / f"tier.host.{name}") if state_dir else None
                    stores[HOST] = HostTierStore(limits.host_slots, slot_bytes, path, reuse,
                                                 prefault=cfg.pool.prefault)
                if limits.disk_slots:
                    stores[DISK] = DiskTierStore(cfg.tiers.disk_path, name, limits.disk_slots,
                                                 slot_bytes, reuse)
                pool = self.pools[name]
                for store in stores.values():
                    region = store.host_region()
                    if region is not None and pool.register_host(region):
                        self._pinned.append((pool, region))
                self.recorders[name] = RecordingIO(PoolTierIO(pool, stores, self.stats, name))
        except BaseException:
            self.close()
            raise
        self._parts = parts

    def connect(self) -> None:
        """From now on every partition's tier copies move bytes (and are recorded)."""
        for name, recorder in self.recorders.items():
            recorder.take_failures()
            self._parts.set_tier_io(name, recorder)

    def replaying(self) -> None:
        """During a journal replay: no byte moves (``ReplayIO``); each Step sets its own."""
        for name in self.recorders:
            self._parts.set_tier_io(name, ReplayIO())

    def replay_step(self, partition: str, failed: tuple[int, ...]) -> None:
        if partition in self.recorders:
            self._parts.set_tier_io(partition, ReplayIO(failed))

    def stage(self, partition: str, data: list[memoryview]) -> None:
        """Bytes from outside the node that the next ``Tiering.adopt`` of ``partition``
        writes into its slots (``TierIO.store``'s sources); [] when it is done."""
        recorder = self.recorders.get(partition)
        if recorder is not None and isinstance(recorder.inner, PoolTierIO):
            recorder.inner.staged = data

    def take_io_failures(self, partition: str) -> tuple[int, ...]:
        """The tier copies of the last Step (in ``partition``) that failed, by number."""
        recorder = self.recorders.get(partition)
        return tuple(recorder.take_failures()) if recorder is not None else ()

    def close(self) -> None:
        for pool, region in self._pinned:
            pool.unregister_host(region)
        self._pinned = []
        for stores in self.stores.values():
            for store in stores.values():
                store.close()
        self.stores = {}
        close_pools(self.pools)
