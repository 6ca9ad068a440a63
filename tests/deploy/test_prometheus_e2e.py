"""A real Prometheus scrapes a real daemon every second while a workload runs through it; the
prefix-cache hit rate read back through Prometheus' HTTP API, computed from the raw counters and
as recorded by the recording rules, matches the daemon's own counters. The same Prometheus loads
the rules (recording and alerting) and evaluates every dashboard query, so both are shown to be
valid PromQL against real series, not only against promtool's synthetic ones."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from daemon_proc import Daemon, Worker, commit, md, release, start
from deploy_support import APT_HINT, RULES, dashboard_queries, http_get, require_tool
from promql_names import substitute_grafana

from blockd.api.v1 import blockd_pb2 as pb
from blockd_apps.launch import terminate

HIT = "blockd_prefix_cache_hit_tokens_total"
QUERIED = "blockd_prefix_cache_queried_tokens_total"
RECORDED_HIT_RATE = "blockd:prefix_cache_hit_rate:ratio_rate5m"
TOLERANCE = 0.02
T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 20.0) -> T:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            got = probe()
            if got is not None:
                return got
        except OSError as exc:  # not listening yet
            last = exc
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what} (last error: {last})")


class Prometheus:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.proc, self.url, self.log = proc, url, log

    def api(self, path: str, **params: str) -> Any:
        body = json.loads(http_get(f"{self.url}/api/v1/{path}", params or None))
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        result: list[dict[str, Any]] = data["result"]
        return result

    def scalar(self, expr: str) -> float | None:
        result = self.query(expr)
        assert len(result) <= 1, result
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> int:
        return terminate(self.proc)


@pytest.fixture
def blockd(tmp_path: Path) -> Iterator[Daemon]:
    d = start(tmp_path / "blockd", num_blocks=256)
    yield d
    d.stop()


@pytest.fixture
def prometheus(blockd: Daemon, tmp_path: Path) -> Iterator[Prometheus]:
    exe = require_tool("prometheus", APT_HINT)
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                   "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": "blockd",
                            "static_configs": [{"targets": [blockd.endpoints["metrics"]]}]}],
    }))
    port = free_port()
    log = tmp_path / "prometheus.log"
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [exe, f"--config.file={config}", f"--web.listen-address=127.0.0.1:{port}",
             f"--storage.tsdb.path={tmp_path / 'data'}", "--log.level=info"],
            stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, env=env)
    p = Prometheus(proc, f"http://127.0.0.1:{port}", log)
    try:
        wait_for("Prometheus to be ready", timeout=30, probe=
                 lambda: http_get(f"{p.url}/-/ready") if proc.poll() is None else _died(p))
        yield p
    finally:
        rc = p.stop()
        text = log.read_text(errors="replace")
    # A clean shutdown: SIGTERM, exit status 0.
    assert rc == 0, f"prometheus exited with {rc}:\n{text[-3000:]}"


def _died(p: Prometheus) -> None:
    raise AssertionError(f"prometheus exited early:\n{p.log.read_text(errors='replace')}")


def workload(d: Daemon) -> None:
    """Admit the same prompts repeatedly (hits) plus some one-off prompts (misses)."""
    w = Worker(d.stub("unix"), "alice", "acme")
    shared = [[1000 * p + i for i in range(13)] for p in range(1, 5)]  # 3 full blocks + 1
    for burst in range(3):
        for r in range(3):
            for n, prompt in enumerate(shared):
                tail = [50_000 + 100 * burst + 10 * r + n]
                one_off = [90_000 + 1000 * burst + 100 * r + 10 * n + i for i in range(9)]
                for tokens in (prompt + tail, one_off) if r == 0 else (prompt + tail,):
                    seq = w.admit(tokens).sequence_id
                    w.step(commit(seq), completed=w.fence)
                    w.step(release(seq), completed=w.fence)
        w.step(completed=w.fence)
        time.sleep(1.1)  # spread over several scrapes
    detach(w)


def detach(w: Worker) -> None:
    """Detach, so that stopping the daemon does not wait out its drain grace period."""
    w.stub.Detach(pb.DetachRequest(session_id=w.sid), metadata=md(w.who))


def test_hit_rate_through_prometheus_matches_the_daemon(blockd: Daemon,
                                                        prometheus: Prometheus) -> None:
    started = time.monotonic()
    # Prometheus has scraped the idle daemon: its first sample of both counters is 0.
    wait_for("the first scrape", lambda: prometheus.scalar(f"sum({QUERIED})"))
    assert prometheus.scalar(f"sum({HIT})") == 0.0
    up = prometheus.query('up{job="blockd"}')
    assert [float(s["value"][1]) for s in up] == [1.0]

    workload(blockd)
    # Pool-wide counters are an admin's (a tenant's Stats shows only its own figures).
    stats = blockd.stub("unix").Stats(pb.StatsRequest(), metadata=md("admin"))
    hits, queried = stats.prefix_hit_tokens_total, stats.prefix_queried_tokens_total
    assert queried > 0 and 0.2 < hits / queried < 0.9, (hits, queried)  # a meaningful ratio
    expected = hits / queried

    # Wait until Prometheus holds the final values, then ask it for the rate over the run.
    wait_for("the final scrape", lambda: True if (
        prometheus.scalar(f"sum({QUERIED})") == queried
        and prometheus.scalar(f"sum({HIT})") == hits) else None)
    by_rate = prometheus.scalar(f"sum(rate({HIT}[1m])) / sum(rate({QUERIED}[1m]))")
    by_increase = prometheus.scalar(f"sum(increase({HIT}[1m])) / sum(increase({QUERIED}[1m]))")
    assert by_rate is not None and by_increase is not None
    print(f"hit rate: daemon {expected:.4f} rate {by_rate:.4f} increase {by_increase:.4f}")
    assert abs(by_rate - expected) <= TOLERANCE, (by_rate, expected)
    assert abs(by_increase - expected) <= TOLERANCE, (by_increase, expected)

    # The recording rule, once evaluated after the final scrape, says the same. Its 5-minute
    # window holds the whole run from the first (zero) sample, so it is the run's exact ratio.
    final_scrape = prometheus.scalar(f"max(timestamp({QUERIED}))")
    assert final_scrape is not None
    wait_for("a rule evaluation after the final scrape", lambda: True if (
        (ts := prometheus.scalar(f"timestamp({RECORDED_HIT_RATE})")) is not None
        and ts > final_scrape) else None)
    recorded = prometheus.scalar(RECORDED_HIT_RATE)
    assert recorded is not None and abs(recorded - expected) <= TOLERANCE, (recorded, expected)
    # Any other value would be caught: the daemon's ratio is not 0.5 and not 1 (a rule that
    # divided the wrong counters, or one by itself).
    assert abs(expected - 1) > TOLERANCE and abs(expected - queried / hits) > TOLERANCE

    # Every dashboard query is valid PromQL and evaluates against the real series.
    for where, expr in dashboard_queries().items():
        if where.startswith("variable"):
            continue
        prometheus.query(substitute_grafana(expr, rate_interval="1m"))
    hit_panel = next(e for w, e in dashboard_queries().items() if "Prefix-cache hit rate" in w)
    got = prometheus.scalar(substitute_grafana(hit_panel, rate_interval="1m"))
    assert got is not None and abs(got - expected) <= TOLERANCE

    # The alert rules load and evaluate without errors against the real series.
    def rules_evaluated() -> list[dict[str, Any]] | None:
        rules = [r for g in prometheus.api("rules")["groups"] for r in g["rules"]]
        return rules if rules and all(r["health"] != "unknown" for r in rules) else None

    rules = wait_for("a rule evaluation", rules_evaluated)
    defined = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    assert len(rules) == len(defined)
    assert {r["name"] for r in rules} == {d.get("record") or d["alert"] for d in defined}
    assert {r["type"] for r in rules} == {"recording", "alerting"}
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError"))
                                                     for r in rules]
    assert time.monotonic() - started < 60
