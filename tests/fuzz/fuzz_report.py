"""The fuzz suite's report: the count of inputs tried, printed and saved (no grpc, no daemon).

``write`` prints the totals in pytest's terminal summary and writes ``tests/fuzz/.last_run.json``
(with the hypothesis profile and the wall time; any run that includes tests/fuzz overwrites it).
A serial run calls it from ``tests/fuzz/conftest.py`` with ``fuzz_support.COUNTS``; under
pytest-xdist each worker hands its counts to the controller (``WORKER_KEY`` of its
``workeroutput``), and ``tests/conftest.py`` sums them and calls it there.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
#: The key of an xdist worker's ``workeroutput`` that carries its counts.
WORKER_KEY = "blockd_fuzz_counts"
_START = time.monotonic()


def write(tr: Any, counts: Mapping[str, int], exitstatus: int) -> None:
    if not counts:
        return
    profile = os.environ.get("HYPOTHESIS_PROFILE", "dev")
    wall = time.monotonic() - _START
    tr.write_sep("-", "blockd fuzz: inputs tried")
    total = counts.get("requests", 0) + counts.get("convert", 0)
    tr.write_line(f"profile={profile} wall_s={wall:.1f} total_inputs={total} "
                  f"(requests={counts.get('requests', 0)} step_ops={counts.get('step_ops', 0)} "
                  f"raw={counts.get('raw', 0)} convert={counts.get('convert', 0)})")
    for key in sorted(counts):
        tr.write_line(f"  {key}: {counts[key]}")
    record = {"profile": profile, "wall_s": round(wall, 1), "exitstatus": int(exitstatus),
              "total_inputs": total, "counts": dict(sorted(counts.items())),
              "time": time.strftime("%FT%TZ", time.gmtime())}
    with contextlib.suppress(OSError):
        (HERE / ".last_run.json").write_text(json.dumps(record, indent=1) + "\n")
