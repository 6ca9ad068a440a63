"""Usage errors are short and say what was meant (#28, the operator path): a mistyped flag or
command prints the error, "did you mean ...?" and where the help is, not the whole usage (a page
for ``blockd serve``, one flag per config field). And ``blockd demo`` writes its plot where it
runs (``./blockd-demo``), never into a checkout's tracked bench/results."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(*argv: str, cwd: Path | None = None, timeout: float = 60
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, check=False)


@pytest.mark.parametrize("argv,meant", [
    (("blockd_apps", "serve", "--pool-num-blokcs", "64"), "--pool-num-blocks"),
    (("blockd.server", "--server-max-sesions=8"), "--server-max-sessions"),
    (("blockd_apps.ctl", "stats", "--jsn"), "--json"),
    (("blockd_apps", "serv"), "serve"),
    (("blockd_apps", "load", "--wrokers", "2"), "--workers"),
])
def test_a_mistyped_flag_or_command_is_two_lines_with_a_suggestion(argv: tuple[str, ...],
                                                                   meant: str) -> None:
    out = run(*argv)
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 2, out.stderr
    assert f"(did you mean {meant}?)" in lines[0]
    assert "usage:" not in out.stderr and "--help" in lines[1]


def test_no_suggestion_for_a_flag_like_nothing() -> None:
    out = run("blockd_apps", "serve", "--zzzzzz")
    assert out.returncode == 2 and "did you mean" not in out.stderr
    assert out.stderr.splitlines()[0].endswith("unrecognized arguments: --zzzzzz")


def digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


def test_the_demo_writes_where_it_runs_not_into_bench_results(tmp_path: Path) -> None:
    tracked = ROOT / "bench" / "results" / "demo.png"
    before = (digest(tracked), digest(tracked.with_suffix(".json")))
    out = run("blockd_apps", "demo", "--requests", "2", "--new-tokens", "1", "2",
              "--no-progress", "--no-check", cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "blockd-demo" / "demo.png").stat().st_size > 0
    assert (tmp_path / "blockd-demo" / "demo.json").exists()
    assert "plot: blockd-demo/demo.png" in out.stdout
    assert (digest(tracked), digest(tracked.with_suffix(".json"))) == before
