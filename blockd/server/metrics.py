"""Prometheus metrics, served over HTTP from the daemon's event loop.

Names follow Prometheus conventions, so that ``promtool check metrics`` passes on a live scrape
(tests/deploy/test_live_metrics.py): base units, ``_total`` only on counters (the pool's size is
the gauge ``blockd_pool_blocks``, not ``blockd_blocks_total``), and bounded labels (a tenant label
only for configured tenants). The prefix-cache hit rate, the vLLM convention, is recorded by
deploy/prometheus/blockd-rules.yaml as ``blockd:prefix_cache_hit_rate:ratio_rate5m``::

    rate(blockd_prefix_cache_hit_tokens_total[5m])
      / rate(blockd_prefix_cache_queried_tokens_total[5m])

The registry is private (nothing a library registers globally leaks in), so the standard
``process_*``, ``python_info`` and ``python_gc_*`` collectors are added to it explicitly.

Most values are read at render time by a custom collector, through the public queries of the
runtime (``blockd.runtime.daemon.Daemon``) and the core (``BlockManager.state_counts``,
``tenant_usage``...); since the HTTP server runs on the same event loop as the gRPC handlers, a
rendering always sees a consistent state.

What a rendering costs the loop does not grow with the live sequences: every figure is a running
total the core or the runtime keeps, or an O(tenants) / O(sessions) / O(partitions) loop over
them, except the block-state counts, one C-speed scan of the pool's state bytes in the core
(about 1.6 ns per block of the configured pool, live or free: an uncached scrape cost the
daemon 0.78 ms of CPU with 8k blocks, 1.62 ms with 528k; bench/results/metrics_scrape*.json).
Nor with the scrapers: a rendering is reused for ``metrics.cache_ms`` (every scrape within it
gets the same bytes), so N scrapers, or one asking in a loop, cost the loop one rendering per
interval plus ~0.13 ms per answer.
Per-tenant families are labelled by tenant, or summed with ``metrics.tenant_labels`` off
(``blockd.server.tenant_series``). The listener (authentication, TLS, bounds) is
``blockd.server.metrics_http``.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

import blockd
from blockd.core.errors import StatusCode
from blockd.metrics_config import MetricsConfig
from blockd.server.remote_metrics import RemoteCollector
from blockd.server.tenant_series import tenant_family
from blockd.server.tier_metrics import TierCollector

if TYPE_CHECKING:
    from blockd.runtime.daemon import Daemon
    from blockd.runtime.kv_events import KvEventPublisher
    from blockd.runtime.recovery import Recovery

STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                0.5, 1.0)

#: ``KvEventPublisher.stats()`` key -> (metric family, type, help). Exported only with events on.
KV_EVENT_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("published_batches", "blockd_kv_event_batches_published", "counter",
     "KV-event batches sent on the ZMQ PUB socket (vLLM's KVEventBatch)."),
    ("published_events", "blockd_kv_events_published", "counter",
     "vLLM KV events (BlockStored, BlockRemoved, AllBlocksCleared) in the published batches."),
    ("dropped_batches", "blockd_kv_event_batches_dropped", "counter",
     "KV-event batches lost before a subscriber could see them (a full queue, a failed "
     "encoding, a send the PUB socket refused): subscribers' indexes are incomplete."),
    ("dropped_events", "blockd_kv_events_dropped", "counter",
     "blockd events dropped by a full queue or a failed encoding (no replay has them)."),
    ("replays_served", "blockd_kv_event_replays_served", "counter",
     "Replay requests answered on the replay (ROUTER) socket."),
    ("replays_limited", "blockd_kv_event_replays_limited", "counter",
     "Replay requests answered with the end marker only: the peer's request rate "
     "(events.replay_requests_per_second) or every peer's byte budget was spent."),
    ("replays_truncated", "blockd_kv_event_replays_truncated", "counter",
     "Replay answers that ended before the newest batch (events.replay_max_bytes or the byte "
     "budget): the subscriber asks again from the next sequence number."),
    ("replay_bytes", "blockd_kv_event_replay_bytes", "counter",
     "Bytes of the batches replay answers carried (topic, sequence number and payload)."),
    ("subscribers", "blockd_kv_event_subscribers", "gauge",
     "Peers connected to the KV-event PUB socket now."),
)


#: The ``code`` label values of ``blockd_operation_errors_total``: every status but OK, exported
#: from the first scrape on (a series that appears only at the first error leaves dashboards'
#: panels empty and ``rate()`` blind to that first error).
OPERATION_ERROR_CODES = tuple(c.name for c in StatusCode if c is not StatusCode.OK)


class Metrics:
    """The registry plus the few metrics the transport updates itself."""

    def __init__(self, settings: MetricsConfig | None = None) -> None:
        settings = settings or MetricsConfig()
        #: Seconds a rendering is reused (``metrics.cache_ms``).
        self.cache_s = settings.cache_ms / 1000
        #: Per-tenant series labelled by tenant (``metrics.tenant_labels``), else summed.
        self.tenant_labels = settings.tenant_labels
        #: Renderings of the exposition (a scrape within ``cache_s`` of the last reuses it).
        self.renders = 0
        self._body = b""
        self._rendered_at = -float("inf")
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)  # process_* (CPU, memory, fds, start time)
        PlatformCollector(registry=self.registry)  # python_info
        GCCollector(registry=self.registry)  # python_gc_*
        #: The daemon served, set by ``bind``; ``/healthz`` reads its drain state.
        self.daemon: Daemon | None = None
        self.step_seconds = Histogram("blockd_step_duration_seconds",
                                      "Time the daemon spent applying one Step.",
                                      buckets=STEP_BUCKETS, registry=self.registry)
        #: Periodic invariant checks (``server.invariant_check_interval_ms``) and failures.
        self.invariant_checks = 0
        self.invariant_violations = 0
        #: HTTP connections closed at accept: ``metrics.max_connections`` were open.
        self.http_refused = 0
        #: Requests answered 401: no or a wrong bearer token (``metrics.bearer_token_file``).
        self.http_unauthorized = 0
        #: The handle server (``blockd.pools.handles``), set by the app: ``/healthz`` is 503
        #: once its accept thread has stopped (workers could no longer map the pool).
        self.handles: Any = None

    def bind(self, daemon: Daemon, events: KvEventPublisher | None = None) -> None:
        """Export ``daemon``'s state and, when events are on, the KV-event publisher's counters."""
        self.daemon = daemon
        self.registry.register(_DaemonCollector(daemon, self))
        self.registry.register(TierCollector(daemon, tenant_labels=self.tenant_labels))
        self.registry.register(RemoteCollector(daemon))
        if events is not None:
            self.registry.register(_KvEventsCollector(events))

    def render(self) -> bytes:
        """The exposition: rendered at most once per ``cache_s`` (the scrapes between get the
        same bytes; a counter at most ``cache_s`` old is what Prometheus' own scrape interval
        makes of it anyway)."""
        now = time.monotonic()
        if now - self._rendered_at >= self.cache_s:
            self.renders += 1
            self._body = generate_latest(self.registry)
            self._rendered_at = now
        return self._body

    def health(self) -> tuple[str, bytes]:
        """``/healthz``: 503 once the daemon drains (SIGTERM), so that an HTTP load balancer or
        readiness check stops sending new work while attached workers finish, and 503 for good
        once a journal write failed (every change is refused until a restart replays the
        journal: a liveness probe then restarts the daemon); 200 otherwise."""
        if self.daemon is not None and self.daemon.recovery.failed is not None:
            return "503 Service Unavailable", b"journal unwritable: restart to recover\n"
        if self.daemon is not None and self.daemon.draining:
            return "503 Service Unavailable", b"draining\n"
        if self.handles is not None and not self.handles.alive:
            return "503 Service Unavailable", b"handle socket stopped\n"
        return "200 OK", b"ok\n"

    def status_page(self) -> bytes:
        """``GET /``: what this listener is and serves (no tenant's data: without
        ``metrics.bearer_token_file`` it is unauthenticated)."""
        status, body = self.health()
        d = self.daemon
        lines = [f"blockd {blockd.__version__}",
                 f"health: {status} ({body.decode().strip()})"]
        if d is not None:
            lines += [f"pool: {d.spec.num_blocks} blocks of {d.spec.block_size} tokens, "
                      f"backend {d.cfg.pool.backend}", f"epoch: {d.epoch}"]
        lines += ["", "/metrics  Prometheus metrics", "/healthz  200 when serving, 503 when "
                  "draining or broken", ""]
        return "\n".join(lines).encode()


class _KvEventsCollector(Collector):
    """The publisher's ``stats()``, read at scrape time (its counters live in its threads)."""

    def __init__(self, publisher: KvEventPublisher) -> None:
        self.publisher = publisher

    def collect(self) -> Iterator[Metric]:
        stats = self.publisher.stats()
        for key, name, kind, doc in KV_EVENT_METRICS:
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(name, doc, value=stats[key])


class _DaemonCollector(Collector):
    def __init__(self, daemon: Daemon, metrics: Metrics) -> None:
        self.d = daemon
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        d = self.d
        m = d.manager
        spec = d.spec
        counts = m.state_counts()
        g = GaugeMetricFamily("blockd_blocks", "KV blocks by lifecycle state.", labels=["state"])
        for state, n in counts.items():
            g.add_metric([state], n)
        yield g
        yield GaugeMetricFamily("blockd_pool_blocks",
                                "KV blocks in the pool (the sum of blockd_blocks over states).",
                                value=m.num_blocks)
        used = m.num_blocks - counts["free"] - counts["cached"]
        yield GaugeMetricFamily("blockd_block_usage_ratio",
                                "Fraction of blocks neither free nor cached (0..1).",
                                value=used / m.num_blocks)
        c = m.counters
        yield CounterMetricFamily("blockd_prefix_cache_queried_tokens",
                                  "Prompt tokens looked up in the prefix cache at admission.",
                                  value=c.queried_tokens)
        yield CounterMetricFamily("blockd_prefix_cache_hit_tokens",
                                  "Prompt tokens found in the prefix cache at admission.",
                                  value=c.hit_tokens)
        yield CounterMetricFamily("blockd_evictions", "Cached blocks evicted.", value=c.evictions)
        yield CounterMetricFamily("blockd_cow_copies", "Copy-on-write block copies issued.",
                                  value=c.cow_copies)
        yield CounterMetricFamily("blockd_scrubbed_blocks",
                                  "Blocks zeroed before reuse by another tenant.",
                                  value=c.scrubbed_blocks)
        yield CounterMetricFamily("blockd_allocated_blocks", "Blocks allocated.",
                                  value=c.allocated_blocks)
        fail = CounterMetricFamily("blockd_allocation_failures",
                                   "Allocations that did not fit, by reason.", labels=["reason"])
        for reason in ("pool", "quota", "guarantee", "preempting", "max_sequences",
                       "max_metadata_bytes"):
            fail.add_metric([reason], c.alloc_failures.get(reason, 0))
        yield fail
        usage = m.tenant_usage()
        labels = self.metrics.tenant_labels
        yield tenant_family(
            CounterMetricFamily, "blockd_preemptions",
            "Running sequences preempted for a higher-priority request, by the victim's tenant.",
            [((u.tenant_id,), u.preemptions) for u in usage], labels=labels)
        yield tenant_family(
            CounterMetricFamily, "blockd_rate_limited",
            "Calls refused because the tenant's work budget was spent (reason 'rate').",
            [((u.tenant_id,), d.budgets.refused.get(u.tenant_id, 0)) for u in usage],
            labels=labels)
        errs = CounterMetricFamily("blockd_operation_errors",
                                   "Step operations that failed, by status.", labels=["code"])
        for code in OPERATION_ERROR_CODES:  # every series from the start, zeros included
            errs.add_metric([code], d.op_errors.get(code, 0))
        yield errs
        yield CounterMetricFamily("blockd_invariant_checks",
                                  "Periodic checks of every block-manager invariant.",
                                  value=self.metrics.invariant_checks)
        yield CounterMetricFamily("blockd_metrics_connections_refused",
                                  "HTTP connections to /metrics closed at accept "
                                  "(metrics.max_connections were open).",
                                  value=self.metrics.http_refused)
        yield CounterMetricFamily("blockd_metrics_unauthorized_requests",
                                  "HTTP requests answered 401 (no or a wrong bearer token, "
                                  "metrics.bearer_token_file).",
                                  value=self.metrics.http_unauthorized)
        yield CounterMetricFamily("blockd_metrics_renders",
                                  "Renderings of /metrics (scrapes within metrics.cache_ms of "
                                  "one reuse it).", value=self.metrics.renders)
        yield CounterMetricFamily("blockd_invariant_violations",
                                  "Periodic invariant checks that failed (see the log).",
                                  value=self.metrics.invariant_violations)
        r = d.recovery
        if r.enabled:
            yield GaugeMetricFamily("blockd_journal_bytes",
                                    "Bytes journalled since the last snapshot.",
                                    value=r.journal_bytes)
            yield CounterMetricFamily("blockd_snapshots", "Snapshots written (compactions).",
                                      value=r.snapshots)
            yield CounterMetricFamily(
                "blockd_snapshot_uncached_sequences",
                "Live sequences a snapshot found no committed token ids for (their prefix was "
                "flushed): they keep their blocks but stop offering new blocks to the cache.",
                value=c.uncacheable_after_snapshot)
            yield GaugeMetricFamily("blockd_last_snapshot_seconds",
                                    "Time the last snapshot held the event loop.",
                                    value=r.last_snapshot_seconds)
            yield from _durability(r, labels)
        yield GaugeMetricFamily("blockd_pending_blocks",
                                "Blocks waiting for a fence before reuse.",
                                value=counts["pending"])
        yield GaugeMetricFamily("blockd_oldest_pending_fence_age_seconds",
                                "Age of the oldest fence that still holds blocks back.",
                                value=d.sessions.oldest_pending_fence_age())
        yield GaugeMetricFamily("blockd_tail_waste_tokens",
                                "Unused token slots in the last blocks of live sequences.",
                                value=m.tail_waste_tokens())
        yield GaugeMetricFamily("blockd_sessions", "Attached sessions.", value=len(d.sessions))
        yield GaugeMetricFamily("blockd_sequences", "Live sequences.", value=m.num_sequences)
        for name, doc, field in (
                ("blockd_tenant_used_blocks", "Blocks held by a tenant (live, pending and "
                 "cached).", "used_blocks"),
                ("blockd_tenant_cached_blocks", "Cached blocks owned by a tenant.",
                 "cached_blocks"),
                ("blockd_tenant_quota_blocks", "A tenant's quota in blocks.", "quota_blocks")):
            yield tenant_family(GaugeMetricFamily, name, doc,
                                [((u.tenant_id,), getattr(u, field)) for u in usage],
                                labels=labels)
        yield GaugeMetricFamily("blockd_epoch", "The pool's current epoch.", value=d.epoch)
        yield GaugeMetricFamily("blockd_start_time_seconds", "Unix time the daemon started.",
                                value=d.started)
        info = InfoMetricFamily("blockd_build", "Build and configuration.")
        info.add_metric([], {
            "version": blockd.__version__, "python": platform.python_version(),
            "pool_backend": d.cfg.pool.backend, "block_size": str(spec.block_size),
            "num_blocks": str(spec.num_blocks), "dtype": spec.dtype,
            "prefix_cache": str(d.cfg.cache.enable_prefix_cache).lower(),
        })
        yield info


def _durability(r: Recovery, labels: bool) -> Iterator[Metric]:
    """The state directory's room and the journal's health (``blockd.runtime.recovery``)."""
    free = r.free_bytes()
    if free is not None:
        yield GaugeMetricFamily("blockd_state_dir_free_bytes",
                                "Bytes still free in state.dir (its file system).", value=free)
    yield GaugeMetricFamily("blockd_state_dir_reserve_bytes",
                            "Free bytes in state.dir below which new work is refused "
                            "(state.reserve_bytes plus the last snapshot's size).",
                            value=r.reserve)
    yield CounterMetricFamily("blockd_state_dir_refusals",
                              "Steps and attaches refused with RESOURCE_EXHAUSTED \"state dir "
                              "full\".", value=r.space_refusals)
    yield tenant_family(CounterMetricFamily, "blockd_tenant_journal_bytes",
                        "Bytes of Step records a tenant's Steps journalled (charged to its work "
                        "budget).", [((tenant_id,), n) for tenant_id, n
                                     in sorted(r.tenant_journal_bytes.items())], labels=labels)
    yield GaugeMetricFamily("blockd_journal_failed",
                            "1 once a journal write failed: every call is refused until the "
                            "daemon is restarted.", value=int(r.failed is not None))
    damaged = CounterMetricFamily("blockd_journal_damaged",
                                  "Damaged journals found when starting, by kind: torn (a final "
                                  "record cut short, never acknowledged, dropped) or corrupt "
                                  "(a new epoch was started).", labels=["kind"])
    for kind in ("torn", "corrupt"):
        damaged.add_metric([kind], r.journal_damage[kind])
    yield damaged

