"""The fuzz suite: shared imports, and the count of inputs tried (printed and saved).

Every input sent to a daemon or to the conversion harness is counted in
``fuzz_support.COUNTS``; at the end of the run the totals are printed in pytest's terminal
summary and written to ``tests/fuzz/.last_run.json`` (with the hypothesis profile and the wall
time; any run that includes tests/fuzz overwrites it).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The daemon launcher is shared with the server tests; the fuzz helpers live next to this file.
sys.path.insert(0, str(HERE.parent / "server"))
sys.path.insert(0, str(HERE))

import fuzz_support  # noqa: E402

_START = time.monotonic()


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # type: ignore[no-untyped-def]
    counts = fuzz_support.COUNTS
    if not counts:
        return
    profile = os.environ.get("HYPOTHESIS_PROFILE", "dev")
    wall = time.monotonic() - _START
    tr = terminalreporter
    tr.write_sep("-", "blockd fuzz: inputs tried")
    total = counts["requests"] + counts["convert"]
    tr.write_line(f"profile={profile} wall_s={wall:.1f} total_inputs={total} "
                  f"(requests={counts['requests']} step_ops={counts['step_ops']} "
                  f"raw={counts['raw']} convert={counts['convert']})")
    for key in sorted(counts):
        tr.write_line(f"  {key}: {counts[key]}")
    record = {"profile": profile, "wall_s": round(wall, 1), "exitstatus": int(exitstatus),
              "total_inputs": total,
              "counts": dict(sorted(counts.items())), "time": time.strftime("%FT%TZ",
                                                                            time.gmtime())}
    with contextlib.suppress(OSError):
        (HERE / ".last_run.json").write_text(json.dumps(record, indent=1) + "\n")
