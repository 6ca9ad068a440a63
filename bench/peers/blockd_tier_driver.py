"""blockd's core with its host tier, as bench/tiers_replay.py drives it: the driver of
bench/peers/blockd_driver.py (``append_batch``) over a ``BlockManager`` with ``TierLimits``,
whose tier copies are real: a host pool (``HostPool``) and a host tier store
(``HostTierStore``) through the daemon's own ``PoolTierIO``, every slot checksummed on the way
down and checked on the way back, exactly as in the daemon.

The KV layout is tiny (one layer, one KV head of 8 dims, fp16: 512 bytes a block of 16), like
SGLang's host pool in bench/peers/sglang_hicache_driver.py: the replay measures the managers,
not memcpy (bench/tier_copies.py measures the copies). Per-Step copy bounds are the daemon's
defaults (``tiers.max_spill_bytes_per_step``, ``max_load_bytes_per_step``) in this layout's
blocks. Hits are split by tier from the core's own counters (``tier_hit_tokens``).
"""

from __future__ import annotations

from blockd.core import BlockManager, PoolSpec, TenantPolicy
from blockd.core.tiering import TierLimits
from blockd.pools.host import HostPool
from blockd.runtime.tier_io import PoolTierIO, TierIOStats
from blockd.tiers.host import HostTierStore
from blockd.tiers_config import TiersConfig

from .blockd_driver import SCOPE, BlockdDriver
from .tier_tally import TierTally


class BlockdTierDriver(BlockdDriver):
    def __init__(self, trace: list, block_size: int, num_blocks: int, host_blocks: int
                 ) -> None:
        super().__init__(trace, block_size, num_blocks, batch=True)
        import blockd

        self.name, self.version = "blockd tiered", blockd.__version__
        spec = PoolSpec(block_size=block_size, num_blocks=num_blocks, num_layers=1,
                        num_kv_heads=1, head_dim=8)
        defaults = TiersConfig(host_bytes=host_blocks * spec.slot_bytes)
        host, _, spills, loads = defaults.limits(spec.slot_bytes)
        self.m = BlockManager(spec, [TenantPolicy("bench", quota_blocks=num_blocks)], seed=7,
                              tiers=TierLimits(host_slots=host, max_spill_blocks=spills,
                                               max_load_blocks=loads))
        self.pool = HostPool(spec)
        self.store = HostTierStore(host, spec.slot_bytes) if host else None
        self.io_stats = TierIOStats()
        if self.store is not None:
            self.m.set_tier_io(PoolTierIO(self.pool, {"host": self.store}, self.io_stats,
                                          "bench"))
        self.s = self.m.open_session("bench")
        self.t = TierTally()

    def begin_step(self, step: int) -> None:
        self.m.begin_step(self.s, 0)  # the Step's copy budgets start again
        super().begin_step(step)

    def admit(self, i: int) -> bool:
        c = self.m.counters
        host_before = c.tier_hit_tokens["host"]
        res = self.m.admit(self.s, SCOPE, self.prompts[i])
        if not hasattr(res, "block_table"):
            return False
        t = self.t
        host = c.tier_hit_tokens["host"] - host_before
        t.hit(res.num_cached_tokens - host, host, self.B)
        n = len(res.block_table)
        t.allocated += n - res.num_cached_tokens // self.B
        t.queried_tokens += self.plen[i]
        t.tokens += self.plen[i]
        t.requests += 1
        t.stored_blocks = c.tier_stored_blocks["host"]
        self.held[i] = n
        self.seq[i] = res.seq_id
        self.m.commit(self.s, res.seq_id, self.fence)
        return True

    def tier_counts(self) -> dict[str, int]:
        c = self.m.counters
        return {"stored_blocks": c.tier_stored_blocks["host"],
                "loaded_blocks": c.tier_loaded_blocks["host"],
                "spills_skipped": sum(c.tier_spill_skipped.values()),
                "loads_skipped": sum(c.tier_loads_skipped.values()),
                "written_bytes": self.io_stats.bytes_written["host"],
                "read_bytes": self.io_stats.bytes_read["host"]}

    def __del__(self) -> None:
        if getattr(self, "store", None) is not None:
            self.store.close()
