"""Every metric the Grafana dashboard and the rules query exists in a real daemon's scrape, or is
a recording rule of deploy/prometheus/blockd-rules.yaml."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest
from daemon_proc import Daemon, start
from deploy_support import DASHBOARD, RULES, dashboard_queries, http_get, rule_queries
from promql_names import exposed_series, metric_names, substitute_grafana


def scrape(d: Daemon) -> str:
    return http_get(d.metrics_url).decode()


# -- the extractor and the exposition parser themselves ----------------------------------------

@pytest.mark.parametrize(("expr", "names"), [
    ('sum without (state) (blockd_blocks{state=~"free|cached"}) / blockd_pool_blocks < 0.05',
     {"blockd_blocks", "blockd_pool_blocks"}),
    ("blockd:prefix_cache_hit_rate:ratio_rate15m < 0.5 * (blockd:x:ratio_rate6h offset 15m)",
     {"blockd:prefix_cache_hit_rate:ratio_rate15m", "blockd:x:ratio_rate6h"}),
    ('max by (pod) (blockd:blocks_available:ratio{pod=~"$pod"})',
     {"blockd:blocks_available:ratio"}),
    ("sum by (pod) (rate(process_cpu_seconds_total[1m]) and on (instance) blockd_build_info)",
     {"process_cpu_seconds_total", "blockd_build_info"}),
    ("histogram_quantile(0.99, sum by (le) (rate(blockd_step_duration_seconds_bucket"
     '{pod=~"$pod"}[$__rate_interval])))', {"blockd_step_duration_seconds_bucket"}),
    ("rate(a_total[6h] offset 15m) / rate(b_total[15m]) > 1 and on (pod) c > bool 1e3",
     {"a_total", "b_total", "c"}),
    ('label_values(blockd_build_info{namespace=~"$namespace", x="a,b"}, pod)',
     {"blockd_build_info"}),
    ("(x - y) / (z > 0)", {"x", "y", "z"}),
])
def test_metric_names_extracts_only_metric_names(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


EXPOSITION = """\
# TYPE c_total counter
c_total{reason="a"} 1.0
# TYPE quiet_total counter
# TYPE g_total gauge
g_total 3.0
# TYPE h histogram
h_bucket{le="+Inf"} 0.0
h_count 0.0
h_sum 0.0
# TYPE b_info gauge
b_info{version="1"} 1.0
"""


def test_exposed_series_derives_suffixes_from_the_type() -> None:
    got = exposed_series(EXPOSITION)
    assert got["c_total"] == ("c", "counter")
    assert got["quiet_total"] == ("quiet", "counter")  # declared, no samples yet
    assert got["g_total"] == ("g_total", "gauge")  # a gauge named *_total is not a counter
    for suffix in ("_bucket", "_sum", "_count"):
        assert got["h" + suffix] == ("h", "histogram")
    assert got["b_info"] == ("b_info", "gauge")
    for absent in ("c", "quiet", "g", "h", "h_total", "b"):
        assert absent not in got


def test_grafana_substitution_gives_plain_promql() -> None:
    expr = 'rate(x{pod=~"$pod", ns=~"${namespace}"}[$__rate_interval])'
    assert substitute_grafana(expr) == 'rate(x{pod=~".*", ns=~".*"}[1m])'


# -- against the real daemon -------------------------------------------------------------------

@pytest.fixture(scope="module")
def with_events(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon with KV events on (the dashboard's KV-event panels query its publisher metrics)
    and a remote tier (the remote alerts query blockd_remote_*): its cluster is a closed port,
    so it starts degraded, exporting the remote family with blockd_remote_up 0."""
    work = tmp_path_factory.mktemp("blockd-events")
    (work / "cluster-secret").write_bytes(b"s" * 32)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    d = start(work, extra={"events": {"zmq_endpoint": "tcp://127.0.0.1:*",
                                      "topic": "kv@metrics-test@tiny"},
                           "state": {"dir": str(work / "state")},  # the durability gauges
                           "tiers": {"host_bytes": 1 << 20,
                                     "redis_nodes": f"127.0.0.1:{closed}",
                                     "cluster_secret_file": str(work / "cluster-secret")}})
    yield d
    d.stop()


def recorded_names() -> set[str]:
    return {w.split(" ", 1)[1] for w in rule_queries(RULES) if w.startswith("rule blockd:")}


def test_every_queried_metric_is_exported_by_the_daemon(with_events: Daemon) -> None:
    series = exposed_series(scrape(with_events))
    recorded = recorded_names()
    assert recorded, "the rules file records nothing"
    queries = {**dashboard_queries(), **rule_queries()}
    assert any(w.startswith("rule ") for w in queries)
    assert any(w.startswith("panel ") for w in queries)
    problems = []
    used: set[str] = set()
    for where, expr in queries.items():
        names = metric_names(expr)
        if not names:
            problems.append(f"{where}: no metric name found in {expr!r}")
        for name in sorted(names):
            used.add(name)
            if ":" in name:  # a recorded series: it must be one of ours
                if name not in recorded:
                    problems.append(f"{where}: {name} is not recorded by {RULES.name}")
            elif name not in series:
                problems.append(f"{where}: {name} is not exported by blockd")
    assert not problems, "\n".join(problems)
    # The dashboard and the rules cover what the issue asks for.
    for must in ("blockd_blocks", "blockd_prefix_cache_hit_tokens_total",
                 "blockd_prefix_cache_queried_tokens_total", "blockd_evictions_total",
                 "blockd_cow_copies_total", "blockd_step_duration_seconds_bucket",
                 "blockd_tenant_used_blocks", "blockd_oldest_pending_fence_age_seconds",
                 "blockd_tenant_quota_blocks", "blockd_allocation_failures_total",
                 "blockd:prefix_cache_hit_rate:ratio_rate5m", "blockd:tenant_quota_usage:ratio",
                 "blockd_kv_event_batches_published_total",
                 "blockd_kv_event_batches_dropped_total", "blockd_kv_event_subscribers",
                 "process_cpu_seconds_total", "process_resident_memory_bytes",
                 "blockd_remote_up", "blockd_remote_errors_total",
                 "blockd_remote_dropped_total"):
        assert must in used, must


def test_an_unknown_recorded_name_is_reported() -> None:
    """A control: the check above really tells a recording rule from a typo of one."""
    assert "blockd:prefix_cache_hit_rate:ratio_rate5m" in recorded_names()
    assert "blockd:prefix_cache_hit_rate:ratio_rate1m" not in recorded_names()


def test_dashboard_is_well_formed() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    ids = []
    stack = list(dash["panels"])
    while stack:
        p = stack.pop()
        ids.append(p["id"])
        stack.extend(p.get("panels", []))
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]), p["title"]
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert p["targets"], p["title"]
            ref_ids = [t["refId"] for t in p["targets"]]
            assert len(set(ref_ids)) == len(ref_ids), p["title"]
    assert len(set(ids)) == len(ids), "panel ids must be unique"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    # Every panel query is valid once Grafana's variables are substituted (checked against a real
    # Prometheus in test_prometheus_e2e.py); here: variables used are all defined.
    for expr in dashboard_queries().values():
        for var in {v.strip("{}") for v in _vars(expr)}:
            assert var.startswith("__") or var in variables, f"undefined variable ${var}"


def _vars(expr: str) -> list[str]:
    import re

    return re.findall(r"\$(\{?[A-Za-z_]\w*\}?)", expr)
