"""bench/tracing_overhead.py runs end to end on a tiny workload: its JSON has the figures
docs/operations.md quotes, and the sampled daemon exported one span per call it served (the
bench exits 1 otherwise). No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tracing_overhead_bench(tmp_path: Path) -> None:
    out = tmp_path / "tracing.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "tracing_overhead.py"),
                          "--reps", "3", "--chunk", "20", "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    got = json.loads(out.read_text())
    assert got["spans_accounted"] and got["sampled_spans"]["exported"] == got["sampled_calls"]
    assert set(got["ratio_vs_off"]) == {"sampled", "unsampled"}
    assert all(len(v) == 3 for v in got["ratio_vs_off_per_rep"].values())
    assert out.with_suffix(".png").stat().st_size > 0
