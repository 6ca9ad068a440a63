"""bench/tier_copies.py and bench/tier_admit.py run end to end on a small configuration and
report what docs/benchmarks.md quotes: every kind's rate, per-repetition ratios to the same
run's baselines, the tiers' hits through a real daemon."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run(script: str, *args: str, tmp: Path) -> dict:
    out = tmp / f"{script}.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / f"{script}.py"), *args,
                           "--dir", str(tmp), "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert out.with_suffix(".png").stat().st_size > 0
    return json.loads(out.read_text())


def test_tier_copies_reports_every_rate_and_same_run_ratios(tmp_path: Path) -> None:
    r = run("tier_copies", "--repeats", "2", "--megabytes", "8", tmp=tmp_path)
    assert len(r["runs"]) == 4  # 2 layouts x 2 repetitions, interleaved
    for lay in r["layouts"].values():
        assert all(v > 0 for v in lay["median_bytes_per_s"].values())
        for ratio in lay["ratios"].values():
            assert len(ratio["samples"]) == 2 and ratio["min"] <= ratio["median"] <= ratio["max"]


def test_tier_admit_measures_the_tiers_through_a_real_daemon(tmp_path: Path) -> None:
    r = run("tier_admit", "--repeats", "1", "--requests", "100", "--warmup", "40", "--prompts",
            "48", "--prompt-tokens", "128", tmp=tmp_path)  # 384 blocks through 256
    c = r["configs"]
    assert set(c) == {"no tiers", "host tier", "host + disk"}
    # The working set outgrows the pool: only the tiers keep the revisited prompts.
    assert c["host tier"]["hit_rate_tokens"] > c["no tiers"]["hit_rate_tokens"]
    assert {t["tier"] for t in c["host + disk"]["tiers"]} == {"host", "disk"}
    assert sum(t["loaded_blocks"] for t in c["host tier"]["tiers"]) > 0
    assert c["host tier"]["p99 ratio"]["samples"]
