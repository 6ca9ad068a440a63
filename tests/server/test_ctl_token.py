"""The operator's token never has to be on a command line (docs/operations.md): blockctl reads
it from a file, from a pipe (``--token-file /dev/stdin``) or the environment, and warns when it
is given with ``--token``, which every user sees in the process list (/proc/PID/cmdline)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from daemon_proc import TOKENS

ROOT = Path(__file__).resolve().parents[2]
#: ``--token`` followed by a value (``--token-file`` is fine).
TOKEN_ON_A_COMMAND_LINE = re.compile(r"--token(?:=|\s+)(?!-)\S")


def blockctl(daemon, *args: str, **kw):  # type: ignore[no-untyped-def]
    return subprocess.run([sys.executable, "-m", "blockd_apps.ctl", "--target",
                           f"unix:{daemon.endpoints['unix']}", *args], capture_output=True,
                          text=True, timeout=30, check=False, **kw)


def test_no_document_or_manifest_shows_a_token_on_a_command_line() -> None:
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "deploy").rglob("*.yaml"),
             *(ROOT / "clients").rglob("*.md")]
    shown = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in files
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if TOKEN_ON_A_COMMAND_LINE.search(line)]
    assert not shown, "\n".join(shown)


def test_the_token_piped_in_as_the_docs_show(daemon) -> None:  # type: ignore[no-untyped-def]
    """``--token-file /dev/stdin < ops.token``: the admin's stats; nothing on the command line,
    no warning. A wrong token piped in is refused as any wrong token is."""
    out = blockctl(daemon, "--token-file", "/dev/stdin", "--json", "stats",
                   input=TOKENS["admin"] + "\n")
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert "num_blocks" in json.loads(out.stdout)
    bad = blockctl(daemon, "--token-file", "/dev/stdin", "stats", input="not-a-token")
    assert bad.returncode == 1 and bad.stderr.startswith("blockctl: UNAUTHENTICATED"), bad.stderr


def test_a_token_on_the_command_line_is_warned_about(daemon) -> None:  # type: ignore[no-untyped-def]
    out = blockctl(daemon, "--token", TOKENS["admin"], "stats")
    assert out.returncode == 0
    assert "--token is visible to every user" in out.stderr and "--token-file" in out.stderr
