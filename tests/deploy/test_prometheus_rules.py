"""The recording and alert rules: promtool accepts and unit-tests them, the alerts and the
dashboard read the recording rules, and the Kubernetes copy is identical."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_support import APT_HINT, DEPLOY, ROOT, dashboard_queries, one, require_tool
from promql_names import metric_names

RULES_DIR = DEPLOY / "prometheus"
RULES = RULES_DIR / "blockd-rules.yaml"
RULES_TEST = RULES_DIR / "blockd-rules.test.yaml"
#: alert -> metrics its expression must use, directly or through a recording rule (the issue's
#: list of alerts).
REQUIRED_ALERTS = {
    "BlockdFreeBlocksLow": ("blockd_blocks", "blockd_pool_blocks"),
    "BlockdPrefixHitRateDropped": ("blockd_prefix_cache_hit_tokens_total",
                                   "blockd_prefix_cache_queried_tokens_total"),
    "BlockdAllocationFailures": ("blockd_allocation_failures_total",),
    "BlockdPendingFenceStuck": ("blockd_oldest_pending_fence_age_seconds",),
    "BlockdTenantAtQuota": ("blockd_tenant_used_blocks", "blockd_tenant_quota_blocks"),
    "BlockdInvariantViolated": ("blockd_invariant_violations_total",),
    "BlockdStateDirLow": ("blockd_state_dir_free_bytes", "blockd_state_dir_reserve_bytes"),
    "BlockdJournalUnwritable": ("blockd_journal_failed",),
    # The remote tier (issue 26): down, failing commands, dropping what it cannot queue.
    "BlockdRemoteTierDown": ("blockd_remote_up",),
    "BlockdRemoteTierErrors": ("blockd_remote_errors_total", "blockd_remote_up"),
    "BlockdRemoteTierDropping": ("blockd_remote_dropped_total",),
}
#: recording rule -> metrics it is computed from (hit rate and usage, the issue's list).
REQUIRED_RECORDS = {
    "blockd:prefix_cache_hit_tokens:rate5m": ("blockd_prefix_cache_hit_tokens_total",),
    "blockd:prefix_cache_queried_tokens:rate5m": ("blockd_prefix_cache_queried_tokens_total",),
    "blockd:prefix_cache_hit_rate:ratio_rate5m": ("blockd_prefix_cache_hit_tokens_total",
                                                  "blockd_prefix_cache_queried_tokens_total"),
    "blockd:prefix_cache_hit_rate:ratio_rate15m": ("blockd_prefix_cache_hit_tokens_total",
                                                   "blockd_prefix_cache_queried_tokens_total"),
    "blockd:prefix_cache_hit_rate:ratio_rate6h": ("blockd_prefix_cache_hit_tokens_total",
                                                  "blockd_prefix_cache_queried_tokens_total"),
    "blockd:blocks_available:ratio": ("blockd_blocks", "blockd_pool_blocks"),
    "blockd:tenant_quota_usage:ratio": ("blockd_tenant_used_blocks",
                                        "blockd_tenant_cached_blocks",
                                        "blockd_tenant_quota_blocks"),
}


def promtool(*args: str, cwd: Path = RULES_DIR) -> subprocess.CompletedProcess[str]:
    exe = require_tool("promtool", APT_HINT)
    return subprocess.run([exe, *args], capture_output=True, text=True, cwd=cwd, timeout=120,
                          check=False)


def alerts(groups: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}


def records(groups: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["record"]: r for g in groups for r in g["rules"] if "record" in r}


def expanded_names(expr: str, recorded: dict[str, dict[str, Any]]) -> set[str]:
    """The metric names ``expr`` reads, with every recording rule it uses replaced by the names
    its own expression reads (transitively)."""
    out: set[str] = set()
    todo = list(metric_names(expr))
    while todo:
        name = todo.pop()
        if name in out:
            continue
        out.add(name)
        if name in recorded:
            todo.extend(metric_names(recorded[name]["expr"]))
    return out


def test_promtool_check_rules() -> None:
    proc = promtool("check", "rules", str(RULES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    n = len(REQUIRED_ALERTS) + len(REQUIRED_RECORDS)
    assert f"SUCCESS: {n} rules found" in proc.stdout


def test_promtool_unit_tests_pass() -> None:
    proc = promtool("test", "rules", RULES_TEST.name)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_every_alert_is_required_unit_tested_and_documented() -> None:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    rules, recorded = alerts(groups), records(groups)
    assert set(rules) == set(REQUIRED_ALERTS)
    for name, metrics in REQUIRED_ALERTS.items():
        assert set(metrics) <= expanded_names(rules[name]["expr"], recorded), name
    tested = {t["alertname"] for case in yaml.safe_load(RULES_TEST.read_text())["tests"]
              for t in case.get("alert_rule_test", []) if t.get("exp_alerts")}
    assert tested == set(rules), "every alert needs a unit test in which it fires"
    ops = (ROOT / "docs" / "operations.md").read_text()
    for name in rules:
        assert f"`{name}`" in ops, f"docs/operations.md does not explain {name}"


def test_every_recording_rule_is_required_unit_tested_used_and_documented() -> None:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    recorded = records(groups)
    assert set(recorded) == set(REQUIRED_RECORDS)
    for name, metrics in REQUIRED_RECORDS.items():
        assert set(metrics) <= expanded_names(recorded[name]["expr"], recorded), name
        assert name.count(":") == 2 and name.startswith("blockd:"), f"{name}: level:metric:ops"
    # Each is checked for its values (promql_expr_test selects it by name, in which it has
    # a sample) ...
    tested = {t["expr"].strip() for case in yaml.safe_load(RULES_TEST.read_text())["tests"]
              for t in case.get("promql_expr_test", []) if t.get("exp_samples")}
    assert set(recorded) <= tested, sorted(set(recorded) - tested)
    # ... and read by an alert, by the dashboard or by another recording rule.
    readers = [r["expr"] for g in groups for r in g["rules"]] + list(dashboard_queries().values())
    read = set().union(*(metric_names(e) for e in readers))
    assert set(recorded) <= read, sorted(set(recorded) - read)
    # Rules are evaluated in order within a group: a rule reads only rules recorded before it.
    seen: set[str] = set()
    for g in groups:
        for r in g["rules"]:
            early = (metric_names(r["expr"]) & set(recorded)) - seen
            assert not early, f"{r.get('alert') or r.get('record')} reads {early} before it"
            if "record" in r:
                seen.add(r["record"])
    ops = (ROOT / "docs" / "operations.md").read_text()
    for name in recorded:
        assert f"`{name}`" in ops, f"docs/operations.md does not explain {name}"


def test_prometheusrule_matches_the_rules_file(rendered: dict[str, list[dict[str, Any]]],
                                               tmp_path: Path) -> None:
    source = yaml.safe_load(RULES.read_text())
    for name, docs in rendered.items():
        pr = one(docs, "PrometheusRule")
        assert pr["spec"] == source, f"{name}: PrometheusRule differs from {RULES.name}"
    # ... and the Kubernetes copy is itself valid for Prometheus.
    copy = tmp_path / "from-prometheusrule.yaml"
    copy.write_text(yaml.safe_dump(one(rendered["base"], "PrometheusRule")["spec"]))
    proc = promtool("check", "rules", str(copy))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_generated_prometheusrule_is_up_to_date() -> None:
    proc = subprocess.run([sys.executable, str(RULES_DIR / "sync_rules.py"), "--check"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("broken", [
    "rate(blockd_evictions_total[5m] > 0",  # unbalanced
    "blockd_pool_blocks > on() bool",  # dangling operator
])
def test_promtool_really_rejects_bad_rules(broken: str, tmp_path: Path) -> None:
    """A control: a syntax error in an expression fails `promtool check rules`."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"groups": [{"name": "x", "rules": [
        {"alert": "Broken", "expr": broken}]}]}))
    assert promtool("check", "rules", str(bad)).returncode != 0
