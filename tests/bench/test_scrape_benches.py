"""bench/metrics_scrape.py and bench/replay_flood.py run end to end on a tiny workload (this tree
as both sources): their JSON has every figure the docs quote. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(script: str, *args: str) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr


def test_metrics_scrape_bench(tmp_path: Path) -> None:
    out = tmp_path / "scrape.json"
    run("metrics_scrape.py", "--source", f"old={ROOT}", "--source", f"new={ROOT}",
        "--sequences", "256", "--scrapes", "10", "--admits", "20", "--scrapers", "2",
        "--scrape-seconds", "1", "--out", str(out))
    got = json.loads(out.read_text())
    assert set(got["summary"]) == {"old", "new", "old_over_new"}
    for row in got["rows"]:
        assert row["daemon_cpu_ms_per_scrape"] > 0 and row["admit_p50_ratio"] > 0


def test_replay_flood_bench(tmp_path: Path) -> None:
    out = tmp_path / "flood.json"
    run("replay_flood.py", "--source", f"new={ROOT}", "--batches", "40", "--requests", "20",
        "--out", str(out))
    (row,) = json.loads(out.read_text())["rows"]
    assert row["served"] + row["limited"] == 20 and row["replay_bytes"] > 0
