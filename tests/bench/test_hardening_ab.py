"""bench/hardening_ab.py end to end on a tiny workload, the after side only (this tree): a
before commit that is not in the clone (as in a shallow CI clone) is skipped with a note, and
each attack's row has the figures the docs quote. The after side's outcomes are the fixes'
(what tests/security and tests/server test in depth); no timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ABSENT = "0" * 40


def test_hardening_ab_after_side(tmp_path: Path) -> None:
    out = tmp_path / "ab.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "hardening_ab.py"), "--before", ABSENT,
         "--reps", "1", "--nofile", "256", "--flooders", "1", "--step-mb", "5",
         "--flood-seconds", "1", "--admits", "20", "--cycles", "40", "--recheck-s", "0.1",
         "--sequences", "256", "--scrapes", "5", "--scrape-seconds", "1", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    got = json.loads(out.read_text())
    assert got["sides_run"] == ["after"]
    assert any(ABSENT in note for note in got["notes"])
    rows = {r["attack"]: r for r in got["rows"]}
    assert set(rows) == {"fds", "oversized", "state_dir", "metrics"}
    assert all(r["side"] == "after" for r in got["rows"])
    fds = rows["fds"]
    assert fds["audit_config_started"] is False and "RLIMIT_NOFILE" in fds["audit_config_refusal"]
    assert fds["a_refusal"].startswith("RESOURCE_EXHAUSTED") and "fds" in fds["a_refusal"]
    assert fds["b_attached"] == fds["b_entitled"] and fds["internal_refusals"] == 0
    ov = rows["oversized"]
    assert ov["flood_calls"] > 0 and ov["daemon_bytes_received"] > 0
    assert all(k.startswith("RESOURCE_EXHAUSTED") for c in ov["flood_outcomes"].values()
               for k in c)
    sd = rows["state_dir"]
    assert sd["cycles_served"] == 40 and sd["other_tenant_step"] == "OK", sd
    m = rows["metrics"]
    assert m["daemon_cpu_ms_per_scrape"] > 0 and m["admit_p50_ratio"] > 0
    assert (tmp_path / "ab.png").stat().st_size > 0
