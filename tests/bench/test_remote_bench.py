"""bench/remote_tier.py runs end to end on a small configuration (a real cluster and two real
daemons; the vLLM baseline left to ``make bench``) and reports what docs/tiers.md quotes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
def test_remote_bench_reports_fetches_and_the_trace_shares(tmp_path: Path) -> None:
    out = tmp_path / "remote_tier.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "remote_tier.py"), "--repeats",
                           "1", "--prompts", "3", "--blocks", "4", "--requests", "16",
                           "--systems", "4", "--skip-vllm", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert out.with_suffix(".png").stat().st_size > 0
    r = json.loads(out.read_text())
    for layout in r["fetch"].values():
        assert layout["prompt_ms"]["median"] > 0 and layout["mb_per_s"]["median"] > 0
    for label in ("trace", "master killed half-way"):
        b = r["trace"][label]["b"]
        assert 0 <= b["from_cluster_share"]["median"] <= b["ceiling_share"]["median"] + 1e-9
    # Without faults node B gets every system-prompt block the other node had computed. With
    # 4 system prompts over 16 requests (seed 0), B asks for 2 that A computed first (with the
    # default 32, B never sees one of A's and this held with nothing fetched).
    b = r["trace"]["trace"]["b"]
    assert b["ceiling_share"]["median"] > 0
    assert b["from_cluster_share"]["median"] == pytest.approx(b["ceiling_share"]["median"])
