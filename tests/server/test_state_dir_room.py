"""One tenant's journal cannot stop every tenant (issue 28, finding 4), against a real daemon.

521 admit+release cycles within a 10-block quota grew the journal until every Step, any
tenant's, was refused "state dir full": a compaction ran only at ``state.snapshot_min_bytes``.
Now the journal is compacted when free space nears the reserve (``Recovery.due``), a state
directory that cannot hold the pool, the reserve, a snapshot and journal room is refused at
start in one line, and the bytes a tenant's Steps journal are charged to its work budget and
exported per tenant.

The file system is a real tmpfs, small enough that the journal of the cycles fills it; where
one cannot be mounted, ``reserve_bytes`` is set close to the free space of ``tmp_path``'s file
system instead (read with ``os.statvfs``), so the daemon sees it as nearly full.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from daemon_proc import Worker, admit, release, restart, start

from blockd_apps.launch import DAEMON_COMMAND

FS_BYTES = 4 * 1024 * 1024
#: Free bytes the journal may take before new work would be refused, without compaction.
ROOM = 160 * 1024
CYCLES = 600


@pytest.fixture
def state_fs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs when one can be mounted, else a directory of ``tmp_path``."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES},mode=0700", "tmpfs",
                           str(mnt)], capture_output=True, check=False)
    try:
        yield mnt
    finally:
        if done.returncode == 0:
            subprocess.run(["umount", "-l", str(mnt)], check=False)


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_a_tenants_admit_release_cycles_no_longer_stop_the_others(
        state_fs: Path, tmp_path: Path) -> None:
    """A first start measures what the state takes; the second leaves the journal ``ROOM``
    bytes above the reserve. acme then runs 600 admit+release cycles of 120-token prompts
    within its quota (~600 bytes of journal each, twice ``ROOM`` in all): every cycle and
    globex's Step after them are served, compactions kept the free space above the reserve,
    nothing was refused for space, and acme's journal bytes are exported and charged to it.
    Before, the cycles were refused "state dir full" about half way, and globex's Step too."""
    state = state_fs / "state"
    work = tmp_path / "work"
    d = start(work, num_blocks=64, lease_ms=60_000,
              extra={"state": {"dir": str(state), "reserve_bytes": 64 * 1024}})
    snapshot = d.metric("blockd_state_dir_reserve_bytes") - 64 * 1024
    d.stop()
    free = _free(state)
    reserve = int(free - snapshot - ROOM)
    assert reserve > 0
    cfg = yaml.safe_load((work / "blockd.yaml").read_text())
    cfg["state"]["reserve_bytes"] = reserve
    (work / "blockd.yaml").write_text(yaml.safe_dump(cfg))
    d = restart(d)
    try:
        a = Worker(d.stub(), "alice", "acme")
        g = Worker(d.stub(), "bob", "globex")
        low = d.metric("blockd_state_dir_free_bytes") - d.metric("blockd_state_dir_reserve_bytes")
        assert low < ROOM + 64 * 1024  # the journal's room above the reserve is small
        for i in range(CYCLES):
            prompt = [100_000 + i * 7 + t for t in range(120)]  # 3-byte token ids
            # Each admit completes the fence of the release before it: its blocks are free.
            got = a.step(admit(prompt), fence=0, completed=a.fence).results[0]
            assert got.status.code == 0, (i, got.status)
            out = a.step(release(got.admit.sequence_id))
            assert out.results[0].status.code == 0, (i, out.results[0].status)
        assert g.step(admit([1, 2, 3, 4, 5]), fence=0).results[0].status.code == 0
        assert d.metric("blockd_state_dir_refusals_total") == 0
        assert d.metric("blockd_snapshots_total") >= 2  # compactions near the reserve
        assert (d.metric("blockd_state_dir_free_bytes")
                >= d.metric("blockd_state_dir_reserve_bytes"))
        written = d.metric('blockd_tenant_journal_bytes_total{tenant="acme"}')
        assert written > 2 * ROOM, written
        assert d.metric('blockd_tenant_journal_bytes_total{tenant="globex"}') < written / 100
    finally:
        d.stop()


def test_a_state_dir_too_small_for_the_reserve_is_refused_at_start(
        state_fs: Path, tmp_path: Path) -> None:
    """``state.reserve_bytes`` larger than what the state directory's file system has free
    after the pool and a first snapshot: the daemon does not start (exit 2), in one line that
    names state.dir and state.reserve_bytes. Before, it started and refused every Step."""
    state = state_fs / "state"
    config = tmp_path / "blockd.yaml"
    config.write_text(yaml.safe_dump({
        "server": {"unix_socket": str(tmp_path / "b.sock"), "tcp_address": "",
                   "handle_socket": str(tmp_path / "p.sock")},
        "metrics": {"address": ""},
        "pool": {"block_size": 4, "num_blocks": 64, "num_layers": 2, "num_kv_heads": 2,
                 "head_dim": 8},
        "state": {"dir": str(state), "reserve_bytes": _free(state_fs) - 16 * 1024},
    }))
    out = subprocess.run([*DAEMON_COMMAND, "--config", str(config)], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path, check=False)
    assert out.returncode == 2, out.stdout + out.stderr
    errors = [line for line in out.stderr.splitlines() if "cannot start" in line]
    assert len(errors) == 1, out.stderr
    assert "state.dir" in errors[0] and "state.reserve_bytes" in errors[0], errors[0]
