"""Prometheus metrics of the remote tier (exported only when ``tiers.redis_nodes`` is set).

Whether the cluster is reachable (``blockd_remote_up``) and how often the client connected;
blocks fetched that passed their check, missed, or failed it (deleted); blocks that joined the
host tier; fetches started and admits answered "pending"; blocks published and not published
by why; the cluster client's commands (values and bytes written and read, errors by kind,
values dropped by why) and a latency histogram per operation (a pipeline of ``get`` or
``set``, on the client's threads: never the event loop). No label names a tenant or a key.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from blockd.server.tier_metrics import histogram_buckets

if TYPE_CHECKING:
    from blockd.runtime.daemon import Daemon

#: Every label value of the by-kind counters, exported from the start (zeros included).
ERROR_KINDS = ("timeout", "connection", "cluster_down", "full", "auth", "other")
DROP_REASONS = ("publish_queue", "fetch_budget", "down")
NOT_PUBLISHED = ("unchained", "present", "down", "copy", "queue")


class RemoteCollector(Collector):
    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon

    def collect(self) -> Iterator[Metric]:
        remote = self.d.remote
        if remote is None:
            return
        s, c = remote.stats, remote.client.counters
        yield GaugeMetricFamily("blockd_remote_up", "1 while the remote tier's Redis Cluster "
                                "answers, 0 while it is retried.", value=int(c.up))
        for name, doc, value in (
                ("blockd_remote_connects", "Times the cluster client was (re)built.",
                 c.connects),
                ("blockd_remote_hit_blocks", "Blocks fetched from the remote tier that passed "
                 "their check.", s.hit_blocks),
                ("blockd_remote_miss_blocks", "Blocks asked of the remote tier that it did not "
                 "have (or that came after a miss).", s.miss_blocks),
                ("blockd_remote_bad_values", "Fetched values that failed their check: a miss, "
                 "deleted from the cluster, never served.", s.bad_values),
                ("blockd_remote_adopted_blocks", "Fetched blocks that joined a lower tier.",
                 s.adopted_blocks),
                ("blockd_remote_fetches", "Fetches started (one per prompt's first missing "
                 "block).", s.fetches),
                ("blockd_remote_pending_admits", "Admits answered pending while a fetch was "
                 "under way (wait_for_remote).", s.pending_admits),
                ("blockd_remote_published_blocks", "Committed pool blocks queued to publish.",
                 s.published_blocks),
                ("blockd_remote_written_values", "Values the cluster accepted.",
                 c.values_written),
                ("blockd_remote_written_bytes", "Bytes of the values the cluster accepted.",
                 c.bytes_written),
                ("blockd_remote_read_values", "Values read from the cluster.", c.values_read),
                ("blockd_remote_read_bytes", "Bytes of the values read from the cluster.",
                 c.bytes_read)):
            yield CounterMetricFamily(name, doc, value=value)
        for name, doc, label, values, keys in (
                ("blockd_remote_errors", "Cluster commands that failed, by kind.", "kind",
                 c.errors, ERROR_KINDS),
                ("blockd_remote_dropped", "Values not written and fetches not made, by why.",
                 "reason", c.dropped, DROP_REASONS),
                ("blockd_remote_not_published", "Committed pool blocks not published, by why.",
                 "reason", s.not_published, NOT_PUBLISHED)):
            family = CounterMetricFamily(name, doc, labels=[label])
            for key in keys:
                family.add_metric([key], values.get(key, 0))
            yield family
        hist = HistogramMetricFamily("blockd_remote_command_seconds", "Time of one pipeline "
                                     "of cluster commands, by operation.", labels=["op"])
        for op, h in sorted(c.seconds.items()):
            hist.add_metric([op], histogram_buckets(h), sum_value=h.total)
        yield hist
