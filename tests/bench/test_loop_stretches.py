"""bench/loop_stretches.py runs end to end (a real in-process daemon, two repetitions) and
writes every figure docs/security.md quotes; no timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_short_run_writes_every_stretch(tmp_path: Path) -> None:
    out = tmp_path / "stretches.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "loop_stretches.py"),
                           "--reps", "2", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    for key in ("parse_step_ms", "copy_ids_list_ms", "copy_ids_numpy_ms", "apply_step_ms",
                "release_step_ms", "lookup_ms"):
        assert res[key] > 0, (key, res)
    # The fairness benchmark's huge Step: eight admits under the default per-call bound.
    assert res["ids_per_admit"] == (1 << 17) // 8 - 256 - 8
    assert res["step_bytes"] > 8 * res["ids_per_admit"]
