"""The remote tier between two real daemons ("node A" and "node B", each its own pool and host
tier) through a real 3-master Redis Cluster on loopback: what a worker on node A computed is
read on node B as exactly its bytes; another tenant gets none of it; every fault of the cluster
is a miss and never wrong bytes; refusals at start name their key.

Workers are ``tests/pools/kvworker.py`` processes (``write`` computes and commits a deterministic
K/V pattern of a prompt; ``read`` admits it and checks what its own mapping holds in the hit
blocks). The pools have 8 blocks of 4 tokens; a 14-token prompt has 3 full blocks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from daemon_proc import Daemon, start, wait_metric
from redis_support import RedisCluster, needs_redis
from test_shared_pool import run_worker, write_each

pytestmark = needs_redis

SLOT = 4 * 2 * 2 * 2 * 8 * 2  # one block of daemon_proc's layout, every shard
P = list(range(300, 314))
SECRET = b"s" * 40


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    with RedisCluster.start(tmp_path_factory.mktemp("redis"), password="pw-blockd") as c:
        yield c


def remote_cfg(workdir: Path, cluster: RedisCluster, **over: Any) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "secret").write_bytes(SECRET)
    (workdir / "redis-password").write_text("pw-blockd\n")
    tiers = {"host_bytes": 32 * SLOT, "redis_nodes": cluster.nodes,
             "redis_password_file": str(workdir / "redis-password"),
             "cluster_secret_file": str(workdir / "secret"), "remote_retry_ms": 300}
    tiers.update(over)
    return {"tiers": tiers}


def node(tmp: Path, name: str, cluster: RedisCluster, **over: Any) -> Daemon:
    return start(tmp / name, num_blocks=8, extra=remote_cfg(tmp / name, cluster, **over))


def test_a_prefix_computed_on_node_a_is_read_on_node_b_as_its_bytes(
        tmp_path: Path, cluster: RedisCluster) -> None:
    with node(tmp_path, "a", cluster) as a, node(tmp_path, "b", cluster) as b:
        wrote = run_worker(a, "write", "alice", "acme", P)
        assert wrote["committed"] == 3
        assert wait_metric(a, "blockd_remote_written_values_total", 3) >= 3
        keys = cluster.stored_keys()
        assert len(keys) >= 3
        # A key says nothing about the tenant or the tokens.
        assert all("acme" not in k and "300" not in k for _, k in keys)
        # Node B: the admit waits for the fetch (answered "pending" meanwhile), then hits
        # all 3 full blocks, loaded from the host tier they were fetched into.
        got = run_worker(b, "read", "alice", "acme", P, wait_for_remote=True)
        assert got["cached"] == 12 and got["pattern_ok"]
        assert got["digests"] == wrote["digests"][:3]
        assert got["pending_answers"] >= 1
        assert b.metric("blockd_remote_hit_blocks_total") >= 3
        assert b.metric("blockd_remote_adopted_blocks_total") >= 3
        assert b.metric('blockd_tier_hit_tokens_total{tier="host"}') >= 12
        # Another (private) tenant on node B: the same tokens, no hit, nothing fetched.
        other = run_worker(b, "read", "bob", "globex", P, wait_for_remote=True)
        assert other["cached"] == 0
        assert b.metric("blockd_remote_bad_values_total") == 0


def test_a_dedicated_tenant_keeps_its_remote_entries_apart_on_both_nodes(
        tmp_path: Path, cluster: RedisCluster) -> None:
    """``g1`` and ``g2`` share a group ``lab`` in a dedicated partition on each node; ``pub``
    is public in the shared region. What ``g1`` computes on node A is hit by ``g2`` on node B
    (the group's own bytes, from its own partition's tier), never by ``pub``."""
    from daemon_proc import TENANTS, TOKENS
    from daemon_proc import start as start_daemon

    from blockd.runtime.tenants_file import token_hash

    tenants = {"tenants": [
        {"id": "g1", "quota_blocks": 8, "sharing": "group", "group": "lab",
         "isolation": "dedicated", "host_quota_bytes": 8 * SLOT},
        {"id": "g2", "quota_blocks": 8, "sharing": "group", "group": "lab",
         "isolation": "dedicated", "host_quota_bytes": 8 * SLOT},
        {"id": "pub", "quota_blocks": 8, "sharing": "public"}],
        "workers": [
            {"name": "carol", "token_sha256": token_hash(TOKENS["carol"]), "tenants": ["g1"]},
            {"name": "dave", "token_sha256": token_hash(TOKENS["dave"]), "tenants": ["pub"]},
            {"name": "bob", "token_sha256": token_hash(TOKENS["bob"]), "tenants": ["g2"]},
            *[w for w in TENANTS["workers"] if w["name"] == "admin"]]}

    def dnode(name: str) -> Daemon:
        return start_daemon(tmp_path / name, num_blocks=8, tenants=tenants,
                            extra=remote_cfg(tmp_path / name, cluster))

    tokens = list(range(7000, 7014))
    with dnode("a") as a, dnode("b") as b:
        wrote = run_worker(a, "write", "carol", "g1", tokens)
        assert wait_metric(a, "blockd_remote_written_values_total", 3) >= 3
        other = run_worker(b, "read", "dave", "pub", tokens, wait_for_remote=True)
        assert other["cached"] == 0
        mine = run_worker(b, "read", "bob", "g2", tokens, wait_for_remote=True)
        assert mine["cached"] == 12 and mine["pattern_ok"]
        assert mine["digests"] == wrote["digests"][:3]


def test_fetched_blocks_survive_kill_9_of_node_b_on_its_state_dir(
        tmp_path: Path, cluster: RedisCluster) -> None:
    """The blocks a fetch put in node B's host tier are journalled (``AdoptRecord``): after a
    ``kill -9`` and a restart on the state dir, with the cluster flushed meanwhile, node B
    still hits them, from its own host tier, as exactly their bytes."""
    from daemon_proc import kill9, restart

    tokens = list(range(8000, 8014))
    extra_b = remote_cfg(tmp_path / "b", cluster)
    extra_b["state"] = {"dir": str(tmp_path / "b" / "state")}
    with node(tmp_path, "a", cluster) as a:
        wrote = run_worker(a, "write", "alice", "acme", tokens)
        assert wait_metric(a, "blockd_remote_written_values_total", 3) >= 3
    b = start(tmp_path / "b", num_blocks=8, extra=extra_b)
    try:
        got = run_worker(b, "read", "alice", "acme", tokens, wait_for_remote=True)
        assert got["cached"] == 12
        kill9(b)
        for p in cluster.ports:
            cluster.cli(p, "flushall")
        b = restart(b)
        # The host tier's index came back from the journal (nothing was fetched since).
        assert b.metric('blockd_tier_used_slots{tier="host"}') >= 3
        misses = b.metric("blockd_remote_miss_blocks_total")
        again = run_worker(b, "read", "alice", "acme", tokens, wait_for_remote=True)
        assert again["cached"] == 12 and again["pattern_ok"]
        assert again["digests"] == wrote["digests"][:3]
        assert b.metric("blockd_remote_miss_blocks_total") == misses  # not fetched again
    finally:
        b.stop()


def test_blocks_the_cluster_holds_are_announced_with_the_remote_medium(
        tmp_path: Path, cluster: RedisCluster) -> None:
    """Node A's KV events: the committed blocks on the pool's medium (``CPU`` here), then, once
    the cluster accepted them, the same keys and token ids on ``REMOTE``."""
    from daemon_proc import pb

    tokens = list(range(9000, 9014))
    with node(tmp_path, "a", cluster) as a:
        run_worker(a, "write", "carol", "initech", tokens)  # a group tenant: token ids shown
        assert wait_metric(a, "blockd_remote_written_values_total", 3) >= 3
        admin = a.stub("unix")
        calls = admin.WatchEvents(pb.WatchEventsRequest(since_sequence=1),
                                  metadata=(("authorization", "Bearer tok-admin"),), timeout=10)
        stored = []
        for ev in calls:
            if ev.WhichOneof("event") == "block_stored":
                stored.append((ev.block_stored.medium, bytes(ev.block_stored.block_hashes[0]),
                               list(ev.block_stored.token_ids)))
            if sum(m == "REMOTE" for m, _, _ in stored) >= 3:
                break
        calls.cancel()
        pool = [(k, t) for m, k, t in stored if m == "CPU"]
        remote = [(k, t) for m, k, t in stored if m == "REMOTE"]
        assert sorted(remote) == sorted(pool[:3])  # the same keys and tokens, on REMOTE
        assert remote[0][1] == tokens[:4]


def remote_events(d: Daemon, kind: str, want: int) -> list[tuple[bytes, ...]]:
    """The block hashes of the first ``want`` ``kind`` events on ``REMOTE`` (from the first)."""
    from daemon_proc import pb

    calls = d.stub("unix").WatchEvents(pb.WatchEventsRequest(since_sequence=1),
                                       metadata=(("authorization", "Bearer tok-admin"),),
                                       timeout=10)
    got: list[tuple[bytes, ...]] = []
    for ev in calls:
        if ev.WhichOneof("event") == kind and getattr(ev, kind).medium == "REMOTE":
            got.append(tuple(bytes(h) for h in getattr(ev, kind).block_hashes))
            if sum(len(g) for g in got) >= want:
                break
    calls.cancel()
    return got


def test_an_announced_entry_a_fetch_finds_gone_is_announced_removed_and_published_again(
        tmp_path: Path, cluster: RedisCluster) -> None:
    """The cluster drops values silently (a flush here; eviction or a TTL alike): node A,
    which announced the prompt's blocks on ``REMOTE``, announces their removal when its own
    fetch of them finds no such key, and publishes them again when they are computed again.
    Its pool (8 blocks) and host tier (4 slots) are filled by other prompts first, so that the
    prompt is asked of the cluster."""
    tokens = list(range(9100, 9114))
    with node(tmp_path, "a", cluster, host_bytes=4 * SLOT) as a:
        run_worker(a, "write", "carol", "initech", tokens)
        assert wait_metric(a, "blockd_remote_written_values_total", 3) >= 3
        stored = remote_events(a, "block_stored", 3)
        # 12 blocks of other prompts push it out of the pool and host (one worker process).
        write_each(a, "carol", "initech", [[t + 100 * i for t in tokens] for i in range(1, 5)])
        assert wait_metric(a, "blockd_remote_written_values_total", 15) >= 15
        for p in cluster.ports:
            cluster.cli(p, "flushall")
        got = run_worker(a, "read", "carol", "initech", tokens, wait_for_remote=True)
        assert got["cached"] == 0 and got["pattern_ok"]
        removed = remote_events(a, "block_removed", 3)
        assert sorted(h for g in removed for h in g) == sorted(h for g in stored for h in g)
        written = a.metric("blockd_remote_written_values_total")
        run_worker(a, "write", "carol", "initech", tokens)  # computed again: published again
        assert wait_metric(a, "blockd_remote_written_values_total", written + 3) >= written + 3
