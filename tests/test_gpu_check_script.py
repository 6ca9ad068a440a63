"""``scripts/gpu_check.sh`` on this machine, where there is no GPU.

The script's worth is to run unattended on a GPU machine within its budget, so it is run here for
real (the checkout's .venv, the real pytest and benchmark) to show what it does without a device:
the preflight fails loudly instead of letting every gpu test skip into a green run, each gpu test
file gets a summary line, the benchmark exits cleanly, a step that outruns its limit is reported
as timed out, and no more files are written than a device run can bring back (8).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def gpu_test_files() -> list[str]:
    return sorted(p.stem for p in (ROOT / "tests").rglob("test_*.py")
                  if re.search(r"pytest\.mark\.gpu", p.read_text()))


def test_without_a_gpu_the_preflight_fails_and_every_step_still_reports(tmp_path: Path) -> None:
    # PY: this interpreter; without it a checkout with no .venv would be installed first.
    env = {**os.environ, "OUT": str(tmp_path), "STEP_TIMEOUT_ISOLATION": "1",
           "PY": sys.executable}
    env.pop("PYTHONPATH", None)
    out = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=240, check=False)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    summary = (tmp_path / "gpu_check_summary.txt").read_text()
    assert "FAILED  preflight (exit 1)" in summary
    assert re.search(r"^ok      pytest \(\d+s\)$", summary, re.M), summary
    for name in gpu_test_files():
        # Every gpu test file was collected, and each of its gpu tests skipped here.
        assert re.search(rf"^skipped {name} \(0 passed, 0 failed, [1-9]\d* skipped\)$",
                         summary, re.M), (name, summary)
    assert re.search(r"^ok      gpu_decode \(\d+s\)$", summary, re.M), summary
    assert re.search(r"^ok      gpu_tiers \(\d+s\)$", summary, re.M), summary
    assert "gpu_tier_copies: no usable CUDA device" in (tmp_path / "gpu_decode.log").read_text()
    assert "FAILED  isolation (exit 124, timed out after 1s)" in summary
    assert "gpu_check: FAILED: preflight isolation" in out.stdout
    assert "no usable CUDA device" in (tmp_path / "env.log").read_text()
    written = sorted(p.name for p in tmp_path.iterdir())
    assert len(written) <= 8, written
    assert {"env.log", "pytest.log", "gpu_tests.xml", "gpu_decode.log",
            "isolation.log", "gpu_check_summary.txt"} <= set(written)
