"""bench/daemon_call_cost.py runs end to end against a real daemon on a small pool that the
warm-up fills: every phase of every counted round costs the daemon CPU time, the admits evict
(the steady state the tool is about), the summary and the plot are written. No timing is
asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PHASES = ("admit", "commit", "release", "step")


def test_daemon_call_cost_bench(tmp_path: Path) -> None:
    out = tmp_path / "call_cost.json"
    # 4 prompts of 2 blocks a call on a 32-block pool: full after 4 warm-up rounds.
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "daemon_call_cost.py"),
                          "--rounds", "3", "--warmup", "6", "--requests", "4", "--length", "64",
                          "--num-blocks", "32", "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    got = json.loads(out.read_text())
    assert got["blocks_per_call"] == 8 and got["pool"]["num_blocks"] == 32
    assert len(got["rounds"]) == 3
    for r in got["rounds"]:
        assert all(r[p] > 0 for p in PHASES), r
        assert r["evictions"] == 8, r  # every block an admit takes is an evicted one
    s = got["summary"]
    for p in PHASES:
        assert 0 < s[p]["min_ms"] <= s[p]["median_ms"] <= s[p]["max_ms"]
    assert s["call_ms"] == sum(s[p]["median_ms"] for p in ("admit", "commit", "release"))
    assert out.with_suffix(".png").stat().st_size > 0
    assert "daemon CPU per call of 8 blocks" in run.stdout
