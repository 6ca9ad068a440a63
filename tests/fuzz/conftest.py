"""The fuzz suite: shared imports, and the count of inputs tried (printed and saved).

Every input sent to a daemon or to the conversion harness is counted in
``fuzz_support.COUNTS``; at the end of the run ``fuzz_report`` prints the totals in pytest's
terminal summary and writes them to ``tests/fuzz/.last_run.json`` (under pytest-xdist, the sum
of every worker's counts, written by the controller: see fuzz_report.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# The daemon launcher is shared with the server tests; the fuzz helpers live next to this file.
sys.path.insert(0, str(HERE.parent / "server"))
sys.path.insert(0, str(HERE))

import fuzz_report  # noqa: E402
import fuzz_support  # noqa: E402


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # type: ignore[no-untyped-def]
    fuzz_report.write(terminalreporter, fuzz_support.COUNTS, exitstatus)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """An xdist worker hands its counts to the controller (which has not loaded this file: it
    collects nothing), where tests/conftest.py sums them and writes the report."""
    out = getattr(session.config, "workeroutput", None)
    if out is not None:
        out[fuzz_report.WORKER_KEY] = dict(fuzz_support.COUNTS)
