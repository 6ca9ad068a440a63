"""bench/step_off_thread.py runs end to end on a tiny workload against a real daemon: every
Step answered with success (the bench exits 1 otherwise), the four cells (tables or none, main
thread idle or busy) in every repetition with their quantiles and the per-repetition ratios,
and a plot. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CELLS = {"tables_idle", "tables_busy", "no_tables_idle", "no_tables_busy"}


def test_step_off_thread_bench(tmp_path: Path) -> None:
    out = tmp_path / "off_thread.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "step_off_thread.py"),
                          "--repeats", "2", "--calls", "8", "--admits", "4", "--length", "64",
                          "--gap-ms", "1", "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    got = json.loads(out.read_text())
    assert len(got["repetitions"]) == 2
    for rep in got["repetitions"]:
        assert set(rep["order"]) == CELLS
        for cell in CELLS:
            q = rep[cell]
            assert 0 < q["p50"] <= q["p90"] <= q["p99"] <= q["max"]
        assert set(rep["ratio_tables_over_none_busy"]) == {"p50", "p99"}
    assert set(got["summary"]) >= CELLS
    assert out.with_suffix(".png").stat().st_size > 0
    assert "Step of 4 admits off a thread" in run.stdout
