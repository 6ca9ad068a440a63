"""blockctl against a real daemon: tables by default, JSON with --json."""

import json
import subprocess
import sys

from daemon_proc import TOKENS, Worker, append, commit


def ctl(daemon, *args: str, token: str = "admin", check: bool = True):  # type: ignore[no-untyped-def]
    cmd = [sys.executable, "-m", "blockd_apps.ctl", "--target", f"unix:{daemon.endpoints['unix']}",
           "--token", TOKENS[token], *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=check)


def test_stats_tenants_inspect_watch_flush(daemon) -> None:  # type: ignore[no-untyped-def]
    w = Worker(daemon.stub("unix"), "carol", "initech")
    a = w.admit([811, 812, 813, 814, 815, 816])
    w.step(commit(a.sequence_id), append(a.sequence_id, [817]))
    w.step(completed=w.fence)

    out = ctl(daemon, "stats").stdout
    assert "free" in out and "cached" in out and "prefix cache" in out
    stats = json.loads(ctl(daemon, "--json", "stats").stdout)
    assert stats["num_blocks"] == "64"  # uint64 as a JSON string, the proto3 JSON mapping

    tenants = json.loads(ctl(daemon, "--json", "tenants").stdout)
    assert {t["tenant_id"] for t in tenants} >= {"acme", "initech"}
    assert "initech" in ctl(daemon, "tenants").stdout

    # The seeds' debugging step 1: every position's block, offset, physical block and slot.
    out = ctl(daemon, "inspect", a.sequence_id).stdout
    lines = [line.split() for line in out.splitlines()[3:]]
    assert len(lines) == 7
    table = list(a.block_table)
    for pos, _lb, off, pb_, slot, *_ in lines:
        assert int(pb_) == table[int(pos) // 4] and int(slot) == int(pb_) * 4 + int(off)
    js = json.loads(ctl(daemon, "--json", "inspect", a.sequence_id).stdout)
    assert len(js["positions"]) == 7

    events = ctl(daemon, "--json", "watch", "--since", "1", "--limit", "1").stdout
    assert json.loads(events.splitlines()[0])["sequence_number"] == "1"

    out = ctl(daemon, "flush", "--tenant", "initech").stdout
    assert out.startswith("flushed ")

    # Errors: a clear message and a non-zero exit.
    bad = ctl(daemon, "flush", "--model-id", "tiny", token="bob", check=False)
    assert bad.returncode == 1 and "PERMISSION_DENIED" in bad.stderr
    bad = ctl(daemon, "inspect", "no-such-seq", check=False)
    assert bad.returncode == 1 and "NOT_FOUND" in bad.stderr
