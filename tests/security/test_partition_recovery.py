"""Crash recovery inside a dedicated partition: ``kill -9`` the daemon, restart it, hit.

A dedicated tenant's worker writes a K/V pattern into its partition and commits; the daemon is
killed; the restarted daemon (same ``state.dir``) serves the same epoch, maps the partition's
own pool file again, and a new worker of that tenant gets the prefix hit and reads exactly the
pattern from its mapping, while a shared tenant's worker gets no hit. A tenants file whose
partitions changed while the daemon was down starts a new epoch instead.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from daemon_proc import TOKENS, Daemon, kill9, restart, start, token_hash
from test_shared_pool import LAYOUT_ARGS, run_worker

LAYOUT = {"block_size": 4, "num_layers": 2, "num_kv_heads": 2, "head_dim": 8,
          "dtype": "float16"}
TENANTS = {
    "tenants": [{"id": "acme", "quota_blocks": 12, "isolation": "dedicated"},
                {"id": "globex", "quota_blocks": 32}],
    "workers": [{"name": "alice", "token_sha256": token_hash(TOKENS["alice"]),
                 "tenants": ["acme"]},
                {"name": "bob", "token_sha256": token_hash(TOKENS["bob"]),
                 "tenants": ["globex"]}],
}
PROMPT = list(range(300, 313))


def _worker(d: Daemon, mode: str, who: str, tenant: str) -> dict:
    """A ``kvworker.py`` process (forked from its fork server, test_shared_pool.run_worker)."""
    assert LAYOUT == LAYOUT_ARGS
    return run_worker(d, mode, who, tenant, PROMPT)


def _restart(d: Daemon) -> Daemon:
    kill9(d)
    return restart(d)


def test_kill9_keeps_a_dedicated_partitions_cache_and_bytes(tmp_path: Path) -> None:
    state = tmp_path / "state"
    d = start(tmp_path / "d", num_blocks=32, tenants=TENANTS,
              extra={"state": {"dir": str(state)}})
    try:
        wrote = _worker(d, "write", "alice", "acme")
        assert wrote["committed"] == 3
        assert (state / "pool.tenant-acme").exists()
        d = _restart(d)
        read = _worker(d, "read", "alice", "acme")
        assert read["epoch"] == wrote["epoch"]  # the same epoch: recovered, not restarted
        assert read["cached"] == 12 and read["pattern_ok"]
        assert read["digests"] == wrote["digests"][:3]
        other = _worker(d, "read", "bob", "globex")
        assert other["cached"] == 0
        # The partitions change while the daemon is down: a new epoch, no stale partition.
        grown = {**TENANTS, "tenants": [{**TENANTS["tenants"][0], "quota_blocks": 16},
                                        TENANTS["tenants"][1]]}
        d.tenants_path.write_text(yaml.safe_dump(grown))
        d = _restart(d)
        again = _worker(d, "read", "alice", "acme")
        assert again["epoch"] != wrote["epoch"] and again["cached"] == 0
        assert "partitions were" in d.log_text()
    finally:
        d.stop()
