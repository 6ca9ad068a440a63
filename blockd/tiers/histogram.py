"""A latency histogram the tiers' copy paths and the remote tier's threads fill (plain counts:
the metrics collector turns them into Prometheus histograms, ``blockd.server.tier_metrics``)."""

from __future__ import annotations

from dataclasses import dataclass, field

#: Upper bounds of the copy-latency histograms, seconds (a 64 KiB block is ~10 us in memory).
LATENCY_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        i = 0
        while i < len(self.buckets) and seconds > self.buckets[i]:
            i += 1
        self.counts[i] += 1
        self.total += seconds
