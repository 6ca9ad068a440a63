"""The alert rules: promtool accepts and unit-tests them, and the Kubernetes copy is identical."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_support import APT_HINT, DEPLOY, ROOT, one, require_tool

RULES_DIR = DEPLOY / "prometheus"
RULES = RULES_DIR / "blockd-rules.yaml"
RULES_TEST = RULES_DIR / "blockd-rules.test.yaml"
#: alert -> metrics its expression must use (the issue's list of alerts).
REQUIRED_ALERTS = {
    "BlockdFreeBlocksLow": ("blockd_blocks", "blockd_blocks_total"),
    "BlockdPrefixHitRateDropped": ("blockd_prefix_cache_hit_tokens_total",
                                   "blockd_prefix_cache_queried_tokens_total"),
    "BlockdAllocationFailures": ("blockd_allocation_failures_total",),
    "BlockdPendingFenceStuck": ("blockd_oldest_pending_fence_age_seconds",),
    "BlockdTenantAtQuota": ("blockd_tenant_used_blocks", "blockd_tenant_quota_blocks"),
    "BlockdInvariantViolated": ("blockd_invariant_violations_total",),
}


def promtool(*args: str, cwd: Path = RULES_DIR) -> subprocess.CompletedProcess[str]:
    exe = require_tool("promtool", APT_HINT)
    return subprocess.run([exe, *args], capture_output=True, text=True, cwd=cwd, timeout=120,
                          check=False)


def alerts(groups: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}


def test_promtool_check_rules() -> None:
    proc = promtool("check", "rules", str(RULES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(REQUIRED_ALERTS)} rules found" in proc.stdout


def test_promtool_unit_tests_pass() -> None:
    proc = promtool("test", "rules", RULES_TEST.name)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_every_alert_is_required_unit_tested_and_documented() -> None:
    from promql_names import metric_names

    rules = alerts(yaml.safe_load(RULES.read_text())["groups"])
    assert set(rules) == set(REQUIRED_ALERTS)
    for name, metrics in REQUIRED_ALERTS.items():
        assert set(metrics) <= metric_names(rules[name]["expr"]), name
    tested = {t["alertname"] for case in yaml.safe_load(RULES_TEST.read_text())["tests"]
              for t in case.get("alert_rule_test", []) if t.get("exp_alerts")}
    assert tested == set(rules), "every alert needs a unit test in which it fires"
    ops = (ROOT / "docs" / "operations.md").read_text()
    for name in rules:
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
    "blockd_blocks_total > on() bool",  # dangling operator
])
def test_promtool_really_rejects_bad_rules(broken: str, tmp_path: Path) -> None:
    """A control: a syntax error in an expression fails `promtool check rules`."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"groups": [{"name": "x", "rules": [
        {"alert": "Broken", "expr": broken}]}]}))
    assert promtool("check", "rules", str(bad)).returncode != 0
