"""Tiers on a real daemon: workers in other processes write K/V into the shared pool, the pool
evicts it down to host memory and disk, and a later worker's prefix hit reads back exactly
those bytes; across ``kill -9`` and a restart on the same state directory; a corrupted disk
slot is a counted miss, never bytes served; refusals at start name their field.

The workers are ``kvworker.py`` processes (``write``: compute and commit a deterministic K/V
pattern of the prompt; ``read``: admit it and check what its own mapping holds in the hit
blocks). The pool has 8 blocks of 4 tokens; each 14-token prompt holds 4 of them (3 full).
"""

from __future__ import annotations

import copy
import json
import os
import signal
import time
from pathlib import Path

import pytest
import yaml
from cli_support import clean_env, run_refused, write_config
from daemon_proc import kill9, restart, start
from test_blockctl import ctl
from test_shared_pool import run_worker, write_each

from blockd.tiers.base import round_up
from blockd.tiers.disk import FILE_HEADER, tier_file
from blockd.tiers.slot import HEADER_BYTES

#: One block of the daemon_proc pool layout, every shard: 4 tokens x K,V x 2 layers x 2 heads
#: x 8 dims x 2 bytes.
SLOT = 4 * 2 * 2 * 2 * 8 * 2
P = list(range(300, 314))
OTHERS = [list(range(1000 * i, 1000 * i + 14)) for i in range(1, 6)]
MORE = [list(range(1000 * i, 1000 * i + 14)) for i in range(6, 11)]


def evict(d, prompts: list[list[int]]) -> None:  # type: ignore[no-untyped-def]
    """Each prompt written and committed in turn (one worker process for them all)."""
    for report in write_each(d, "alice", "acme", prompts):
        assert report["committed"] == 3


def test_an_evicted_prefix_comes_back_from_host_memory_with_its_bytes(tmp_path: Path) -> None:
    with start(tmp_path, num_blocks=8, extra={"tiers": {"host_bytes": 32 * SLOT}}) as d:
        a = run_worker(d, "write", "alice", "acme", P)
        evict(d, OTHERS)  # 5 x 3 blocks through an 8-block pool: P is long gone from it
        assert d.metric('blockd_tier_stored_blocks_total{tier="host"}') >= 3
        b = run_worker(d, "read", "alice", "acme", P)
        assert b["cached"] == 12  # all 3 full blocks, loaded from the host tier
        assert b["pattern_ok"] and b["digests"] == a["digests"][:3]
        assert d.metric('blockd_tier_hit_tokens_total{tier="host"}') >= 12
        assert d.metric('blockd_tier_loaded_blocks_total{tier="host"}') >= 3
        # blockctl stats shows the tier: its slots, what it holds, what it served.
        out = ctl(d, "stats").stdout
        assert "tiers below the pool" in out
        (row,) = [line.split() for line in out.splitlines() if line.startswith("host ")]
        assert int(row[2]) == 32 and int(row[1]) >= 3 and int(row[5]) >= 12
        (tier,) = json.loads(ctl(d, "--json", "stats").stdout)["tiers"]
        assert tier["tier"] == "host" and tier["num_slots"] == "32"
        # Another tenant's worker, private sharing: none of it, whatever tier holds it.
        c = run_worker(d, "read", "bob", "globex", P)
        assert c["cached"] == 0


def test_the_disk_tier_survives_kill_9_and_a_corrupt_slot_is_a_counted_miss(
        tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    state = Path(f"/dev/shm/blockd-test-{os.getpid()}-{tmp_path.name}")
    tiers = {"host_bytes": 2 * SLOT, "disk_path": str(disk), "disk_bytes": 64 * SLOT}
    d = start(tmp_path, num_blocks=8, extra={"tiers": tiers, "state": {"dir": str(state)}})
    try:
        a = run_worker(d, "write", "alice", "acme", P)
        evict(d, OTHERS)  # P's blocks pass through the 2-slot host tier onto the disk
        assert d.metric('blockd_tier_stored_blocks_total{tier="disk"}') >= 3
        kill9(d)
        d = restart(d)  # the same state dir: the index of the disk's slots is recovered
        b = run_worker(d, "read", "alice", "acme", P)
        assert b["cached"] == 12 and b["pattern_ok"] and b["digests"] == a["digests"][:3]
        assert d.metric('blockd_tier_hit_tokens_total{tier="disk"}') >= 12 - 2 * 4
        # Damage every slot's bytes on disk (their headers intact), then push P out of the
        # pool again: its next hit must come from the disk, and fail the check.
        path = Path(tier_file(str(disk), "shared"))
        stride = round_up(HEADER_BYTES + SLOT, 4096)
        with path.open("r+b") as f:
            for i in range(64):
                f.seek(FILE_HEADER + i * stride + HEADER_BYTES)
                f.write(b"\xa5" * SLOT)
        evict(d, MORE)
        before = d.metric('blockd_tier_load_failures_total{tier="disk"}')
        c = run_worker(d, "read", "alice", "acme", P)
        assert c["pattern_ok"]  # whatever it was given is P's own K/V
        assert c["cached"] < 12
        assert d.metric('blockd_tier_load_failures_total{tier="disk"}') > before
        assert d.metric('blockd_tier_errors_total{kind="disk_check"}') >= 1
    finally:
        d.stop()
        for p in state.glob("*"):
            p.unlink()
        state.rmdir()


@pytest.mark.parametrize("tiers,field,needle", [
    ({"host_bytes": 100}, "tiers.host_bytes", "less than one block"),
    ({"host_bytes": 1 << 50}, "tiers.host_bytes", "more than this machine's memory"),
    ({"disk_path": "/nonexistent/blockd", "disk_bytes": 1 << 20}, "tiers.disk_path",
     "not a writable directory"),
    ({"disk_bytes": 1 << 20}, "tiers.disk_path", "needs both"),
    ({"disk_path": "{tmp}", "disk_bytes": 1 << 55}, "tiers.disk_bytes", "index of"),
    ({"disk_path": "{tmp}", "disk_bytes": "{free}"}, "tiers.disk_bytes", "do not fit"),
])
def test_a_tier_the_machine_cannot_hold_is_refused_in_one_line(
        tmp_path: Path, tiers: dict[str, object], field: str, needle: str) -> None:
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    tiers = {k: {"{tmp}": str(tmp_path), "{free}": free + (1 << 30)}.get(v, v)  # type: ignore[call-overload]
             for k, v in tiers.items()}
    # Big blocks (64 KiB), so that a disk tier of the disk's size has an index that fits.
    cfg = write_config(tmp_path / "d", tiers=tiers, pool={"num_layers": 8, "num_kv_heads": 8,
                                                          "head_dim": 64})
    out = run_refused("--config", str(cfg), cwd=tmp_path, env=clean_env())
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert field in lines[0] and needle in lines[0], lines[0]
    assert not list((tmp_path).glob("blockd-*.tier"))  # nothing left behind


def test_kill_9_in_the_middle_of_spills_and_demotions_never_serves_a_bad_slot(
        tmp_path: Path) -> None:
    """A client keeps pushing blocks down the tiers (every admit evicts, spills to a 2-slot host
    tier and demotes to disk) while the daemon is killed at four arbitrary moments and restarted
    on its state dir each time: whatever a copy cut short or an unjournalled copy left in a slot
    fails its check. The daemon checks every invariant after each call, and a worker's read of
    a prefix written before the storm gets only its own K/V, from whichever tier kept it."""
    import random
    import threading

    import grpc
    from daemon_proc import Worker, release

    disk = tmp_path / "disk"
    disk.mkdir()
    state = Path(f"/dev/shm/blockd-test-storm-{os.getpid()}-{tmp_path.name}")
    tiers = {"host_bytes": 2 * SLOT, "disk_path": str(disk), "disk_bytes": 64 * SLOT}
    d = start(tmp_path, num_blocks=8, extra={"tiers": tiers, "state": {"dir": str(state)}})
    rng = random.Random(5)
    try:
        a = run_worker(d, "write", "alice", "acme", P)
        for round_ in range(4):
            stop = threading.Event()

            def storm(d=d, round_=round_, stop=stop) -> None:  # type: ignore[no-untyped-def]
                try:
                    w = Worker(d.stub("unix"), "alice", "acme", lease_ms=300)
                    i = 0
                    while not stop.is_set():
                        i += 1
                        base = 100_000 * (round_ + 1) + 20 * i
                        seq = w.cache(list(range(base, base + 13)))
                        w.step(release(seq), fence=0)
                except grpc.RpcError:
                    pass  # the daemon was killed under it

            t = threading.Thread(target=storm)
            t.start()
            time.sleep(rng.uniform(0.3, 1.2))
            kill9(d)
            stop.set()
            t.join(30)
            d = restart(d)
        time.sleep(1.5)  # the killed storms' sessions (300 ms leases) are reaped
        b = run_worker(d, "read", "alice", "acme", P)
        assert b["pattern_ok"]  # every block it was given is P's own K/V
        assert b["digests"] == a["digests"][:len(b["digests"])]
        assert d.metric('blockd_tier_stored_blocks_total{tier="disk"}') > 0  # it did demote
    finally:
        d.stop()
        for p in state.glob("*"):
            p.unlink()
        state.rmdir()


@pytest.mark.parametrize("bad", [-1, "1G", True, 2.5])
def test_a_bad_tier_quota_is_refused_naming_it_and_a_reload_keeps_the_tenants(
        tmp_path: Path, bad: object) -> None:
    from daemon_proc import TENANTS

    from blockd.core.errors import InvalidArgument
    from blockd.runtime import tenants_file

    tenants = copy.deepcopy(TENANTS)
    tenants["tenants"][0]["host_quota_bytes"] = bad
    with pytest.raises(InvalidArgument) as err:
        tenants_file.parse(tenants)
    assert err.value.field == "tenants[0].host_quota_bytes"
    if bad != -1:
        return  # one daemon for the reload: the same refusal path for every value
    with start(tmp_path, num_blocks=8, extra={"tiers": {"host_bytes": 8 * SLOT}}) as d:
        before = json.loads(ctl(d, "--json", "tenants").stdout)
        d.tenants_path.write_text(yaml.safe_dump(tenants))
        d.signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "tenants reload failed" not in d.log_text():
            assert time.monotonic() < deadline, d.log_text()
            time.sleep(0.05)
        assert "host_quota_bytes" in d.log_text()
        assert json.loads(ctl(d, "--json", "tenants").stdout) == before
        assert run_worker(d, "write", "alice", "acme", P)["committed"] == 3  # still serving
