"""bench/fairness.py runs end to end in a short run (both placements, one flood kind each).

No timings are asserted (the figures are the script's output): this checks that the script
starts a real daemon, floods it from separate processes (and runs them without it, the
control), measures A in every phase and
writes the JSON and plot docs/security.md is built from.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("placement, kinds", [("isolated", "lookup,steps"),
                                              ("shared", "sessions")])
def test_a_short_fairness_run_writes_its_figures(tmp_path: Path, placement: str,
                                                 kinds: str) -> None:
    if placement == "isolated" and len(os.sched_getaffinity(0)) < 2:
        pytest.skip("--placement isolated needs 2 CPUs")
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "fairness.py"), "--runs", "1", "--seconds", "1",
         "--placement", placement, "--kinds", kinds, "--out", str(tmp_path), "--tag", "t"],
        cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "fairness-t.json").read_text())
    assert (tmp_path / "fairness-t.png").stat().st_size > 0
    assert (res["placement"], res["flood_kinds"], res["keep_awake"]) == (
        placement, kinds.split(","), True)
    run = res["runs"][0]
    assert run["a_alone"]["steps"] > 0 and run["a_flooded"]["steps"] > 0
    assert set(run["b_flood"]) == set(kinds.split(","))
    # The control phase: the same flooder processes, building B's requests, sending none.
    assert run["a_control"]["steps"] > 0
    assert {k: set(v) for k, v in run["b_control"].items()} == {
        k: {"built"} for k in kinds.split(",")}
    assert res["flood_sched"] == ("idle" if placement == "isolated" else "nice")
    # Every outcome of B's calls is a success or a refusal the daemon documents.
    for outcomes in run["b_flood"].values():
        for what in outcomes:
            assert what == "ok" or what.startswith("RESOURCE_EXHAUSTED:"), outcomes
