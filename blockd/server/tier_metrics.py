"""Prometheus metrics of the tiers below the pool (exported only when some tier is configured).

Per tier (``tier`` label: ``host``, ``disk``), summed over partitions: slots and bytes, used and
in all; prompt tokens admits loaded from it; blocks copied into it and loaded out of it, and the
bytes; entries it evicted; loads that failed their check; per reason, evicted pool prefixes not
kept below and lower hits computed instead; copy errors by kind; and histograms of how long one
block's load or store held the event loop. Per tenant, the slots it holds in each tier (bounded
labels: configured tenants only; summed over tenants with ``metrics.tenant_labels`` off).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from blockd.core.lower_tiers import TIER_ORDER
from blockd.server.tenant_series import tenant_family

if TYPE_CHECKING:
    from blockd.runtime.daemon import Daemon
    from blockd.tiers.histogram import Histogram


class TierCollector(Collector):
    def __init__(self, daemon: Daemon, *, tenant_labels: bool = True) -> None:
        self.d = daemon
        self.tenant_labels = tenant_labels

    def collect(self) -> Iterator[Metric]:
        d = self.d
        usage = d.manager.tier_usage()
        if not usage:
            return
        tiers = [t for t in TIER_ORDER if any(u.tier == t for u in usage)]
        slots = GaugeMetricFamily("blockd_tier_slots", "Block slots of a lower tier.",
                                  labels=["tier"])
        used = GaugeMetricFamily("blockd_tier_used_slots", "Slots of a lower tier holding a "
                                 "prefix.", labels=["tier"])
        size = GaugeMetricFamily("blockd_tier_bytes", "Bytes of a lower tier's slots.",
                                 labels=["tier"])
        used_b = GaugeMetricFamily("blockd_tier_used_bytes", "Bytes of a lower tier's slots "
                                   "holding a prefix.", labels=["tier"])
        by_tenant: list[tuple[tuple[str, str], float]] = []
        for t in tiers:
            mine = [u for u in usage if u.tier == t]
            n, k = sum(u.num_slots for u in mine), sum(u.used_slots for u in mine)
            slots.add_metric([t], n)
            used.add_metric([t], k)
            size.add_metric([t], sum(u.num_slots * u.slot_bytes for u in mine))
            used_b.add_metric([t], sum(u.used_slots * u.slot_bytes for u in mine))
            by: dict[str, int] = {}
            for u in mine:
                for tid, held in u.by_tenant.items():
                    by[tid] = by.get(tid, 0) + held
            by_tenant += [((tid, t), by[tid]) for tid in sorted(by)]
        yield from (slots, used, size, used_b)
        yield tenant_family(GaugeMetricFamily, "blockd_tenant_tier_used_slots", "Slots of a lower "
                            "tier holding a tenant's prefixes.", by_tenant,
                            labels=self.tenant_labels, other=("tier",))
        c = d.manager.counters
        for name, doc, values in (
                ("blockd_tier_hit_tokens", "Prompt tokens admits loaded from a lower tier.",
                 c.tier_hit_tokens),
                ("blockd_tier_stored_blocks", "Blocks copied into a lower tier (spills from the "
                 "pool, demotions from the tier above).", c.tier_stored_blocks),
                ("blockd_tier_loaded_blocks", "Blocks loaded from a lower tier into the pool.",
                 c.tier_loaded_blocks),
                ("blockd_tier_load_failures", "Loads whose slot failed its check or could not "
                 "be read (a miss, the entry dropped).", c.tier_load_failures),
                ("blockd_tier_evictions", "Entries a lower tier evicted (demoted or dropped).",
                 c.tier_evictions),
                ("blockd_tier_written_bytes", "Bytes written into a lower tier's slots.",
                 d.storage.stats.bytes_written),
                ("blockd_tier_read_bytes", "Bytes read out of a lower tier's slots.",
                 d.storage.stats.bytes_read)):
            family = CounterMetricFamily(name, doc, labels=["tier"])
            for t in tiers:
                family.add_metric([t], values.get(t, 0))
            yield family
        for name, doc, label, values, keys in (
                ("blockd_tier_spills_skipped", "Evicted pool prefixes not kept below, by why.",
                 "reason", c.tier_spill_skipped, ("budget", "no_room", "duplicate")),
                ("blockd_tier_loads_skipped", "Lower hits computed instead of loaded, by why.",
                 "reason", c.tier_loads_skipped, ("budget", "after_failure")),
                ("blockd_tier_errors", "Tier copies that failed, by kind (<tier>_check, "
                 "<tier>_read, <tier>_write).", "kind", d.storage.stats.errors,
                 tuple(f"{t}_{k}" for t in tiers for k in ("check", "read", "write")))):
            family = CounterMetricFamily(name, doc, labels=[label])
            for key in keys:
                family.add_metric([key], values.get(key, 0))
            yield family
        for hname, hdoc, table in (
                ("blockd_tier_load_seconds", "Time one block's load from a lower tier (its "
                 "check included) held the event loop.", d.storage.stats.load_seconds),
                ("blockd_tier_store_seconds", "Time one block's copy into a lower tier held "
                 "the event loop.", d.storage.stats.spill_seconds)):
            hist = HistogramMetricFamily(hname, hdoc, labels=["tier"])
            for t in tiers:
                h = table.get(t)
                if h is not None:
                    hist.add_metric([t], histogram_buckets(h), sum_value=h.total)
            yield hist


def _go_float(x: float) -> str:
    """A bucket bound as Prometheus' Go client writes it (what ``promtool`` expects)."""
    text = repr(float(x))
    return text[:-2] if text.endswith(".0") else text


def histogram_buckets(h: Histogram) -> list[tuple[str, float]]:
    out: list[tuple[str, float]] = []
    running = 0
    for bound, n in zip(h.buckets, h.counts, strict=False):
        running += n
        out.append((_go_float(bound), running))
    out.append(("+Inf", running + h.counts[-1]))
    return out
