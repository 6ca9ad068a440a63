"""`blockd load` against a real daemon that checks its invariants after every call."""

import json
import re
import subprocess
import sys
import time

from daemon_proc import TOKENS, md, start

from blockd.api.v1 import blockd_pb2 as pb

PROGRESS = re.compile(r"blockd load: \d+ s, (?P<running>starting \d+ workers|\d+/\d+ workers "
                      r"running), (?P<steps>\d+) steps, \d+ steps/s, (?P<errors>\d+) errors")


def test_load_generator_runs_clean_under_pool_pressure(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # Small: appends run out and preempt. The daemon checks every invariant after every call
    # and, besides, every 50 ms (what the 8x256 figure in docs/benchmarks.md runs with).
    d = start(tmp_path / "load", num_blocks=160,
              extra={"server": {"invariant_check_interval_ms": 50}})
    try:
        layout = {"block_size": 4, "num_layers": 2, "num_kv_heads": 2, "head_dim": 8,
                  "dtype": pb.KV_DTYPE_FLOAT16, "kv_order": pb.KV_ORDER_BLOCK_TOKEN_HEAD_DIM,
                  "tp_size": 1}
        out = subprocess.run(
            [sys.executable, "-m", "blockd_apps", "load", "--target", f"unix:{d.endpoints['unix']}",
             "--token", TOKENS["carol"], "--tenant", "initech", "--workers", "2", "--seqs",
             "16", "--duration", "3", "--layout", json.dumps(layout), "--json",
             "--metrics", d.metrics_url, "--progress", "0.5"],
            capture_output=True, text=True, timeout=180)
        res = json.loads(out.stdout)
        assert out.returncode == 0, out.stderr
        assert res["workers_finished"] == 2 and res["steps"] > 50
        # Progress while it ran: a line every 0.5 s on stderr (the run lasts >= 3 s).
        shown = [PROGRESS.fullmatch(line) for line in out.stderr.splitlines()]
        assert len(shown) >= 3 and all(shown), out.stderr
        steps = [int(m["steps"]) for m in shown if m]
        assert steps == sorted(steps) and 0 < steps[-1] <= res["steps"]
        assert {m["errors"] for m in shown if m} == {"0"}
        assert any(m["running"] == "2/2 workers running" for m in shown if m)
        assert res["errors_by_code"] == {}  # no INTERNAL: invariants held after every call
        assert res["invariant_checks"] >= 10 and res["invariant_violations"] == 0
        stats = d.stub("unix").Stats(pb.StatsRequest(), metadata=md("admin"))
        assert stats.num_sequences == 0 and stats.num_sessions == 0
        assert stats.blocks_free + stats.blocks_cached == 160
        assert stats.prefix_hit_tokens_total > 0

        # Text mode: progress lines, then the summary on stdout.
        out = subprocess.run(
            [sys.executable, "-m", "blockd_apps", "load", "--target", f"unix:{d.endpoints['unix']}",
             "--token", TOKENS["carol"], "--tenant", "initech", "--workers", "1", "--seqs", "4",
             "--duration", "1.5", "--layout", json.dumps(layout), "--progress", "0.5"],
            capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stderr
        assert out.stderr and all(PROGRESS.fullmatch(line) for line in out.stderr.splitlines())
        summary = out.stdout.strip()
        assert summary.startswith("1/1 workers x 4 sequences for 2 s: ") and "steps/s" in summary
        assert summary.endswith("errors none"), summary
    finally:
        d.stop()


def test_load_says_so_in_one_line_without_a_daemon(tmp_path) -> None:  # type: ignore[no-untyped-def]
    target = f"unix:{tmp_path / 'none.sock'}"
    out = subprocess.run([sys.executable, "-m", "blockd_apps", "load", "--target", target,
                          "--duration", "1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith(f"blockd load: no blockd is answering at {target} (")
    assert len(out.stderr.splitlines()) == 1


def test_load_reports_workers_that_died(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # #28 finding 10: a worker whose daemon went away was left out of the summary, which then
    # said "0 steps/s ... errors none" (and the exit status did not say it either).
    d = start(tmp_path / "dies", num_blocks=160)
    layout = {"block_size": 4, "num_layers": 2, "num_kv_heads": 2, "head_dim": 8,
              "dtype": pb.KV_DTYPE_FLOAT16, "kv_order": pb.KV_ORDER_BLOCK_TOKEN_HEAD_DIM,
              "tp_size": 1}
    base = [sys.executable, "-m", "blockd_apps", "load", "--target",
            f"unix:{d.endpoints['unix']}", "--token", TOKENS["carol"], "--layout",
            json.dumps(layout), "--progress", "0", "--seqs", "4"]
    try:
        # A tenant the token may not use: every worker's Attach is refused.
        out = subprocess.run(base + ["--tenant", "acme", "--workers", "2", "--duration", "2"],
                             capture_output=True, text=True, timeout=180)
        assert out.returncode == 1
        summary = out.stdout.strip()
        assert summary.startswith("0/2 workers"), summary
        assert "2 workers failed: PERMISSION_DENIED" in summary and "(x2)" in summary, summary
        # The daemon killed under a running load: its workers are reported failed.
        proc = subprocess.Popen(base + ["--tenant", "initech", "--workers", "2", "--duration",
                                        "30", "--json"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            stats = d.stub("unix").Stats(pb.StatsRequest(), metadata=md("admin"))
            if stats.num_sessions == 2 and stats.num_sequences > 0:
                break
            time.sleep(0.1)
        d.proc.kill()
        stdout, stderr = proc.communicate(timeout=120)
        res = json.loads(stdout)
        assert proc.returncode == 1, stderr
        assert res["workers_finished"] == 0 and len(res["workers_failed"]) == 2, res
        assert all(why.startswith("UNAVAILABLE") for why in res["workers_failed"].values()), res
    finally:
        d.stop()
