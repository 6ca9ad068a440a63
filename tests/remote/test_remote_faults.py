"""Faults of the shared cluster never change a byte and never fail a request: a flushed
cluster, a value corrupted by hand, a killed master, the whole cluster down, a slow cluster, a
full cluster: misses (counted), admits that go ahead, and when the cluster is back it is used
again. Refusals at start name their key; an unreachable cluster is a degraded start, retried.

Two real daemons (node A writes, node B reads) share one real 3-master Redis Cluster for the
module; each test uses prompts of its own and leaves the cluster whole.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from cli_support import clean_env, run_refused, write_config
from daemon_proc import Daemon, Worker, admit, start, wait_metric
from redis_support import RedisCluster, needs_redis
from test_remote_daemons import node, remote_cfg
from test_shared_pool import run_worker

pytestmark = needs_redis


def prompt(i: int) -> list[int]:
    return list(range(10_000 * i, 10_000 * i + 14))  # 3 full blocks of 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    with RedisCluster.start(tmp_path_factory.mktemp("redis"), password="pw-blockd") as c:
        yield c


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory, cluster: RedisCluster
          ):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("nodes")
    with node(tmp, "a", cluster) as a, node(tmp, "b", cluster) as b:
        yield a, b


def wait_down(d: Daemon, timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while d.metric("blockd_remote_up") != 0:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def publish(a: Daemon, tokens: list[int]) -> dict[str, Any]:
    before = a.metric("blockd_remote_written_values_total")
    wrote = run_worker(a, "write", "alice", "acme", tokens)
    assert wrote["committed"] == 3
    assert wait_metric(a, "blockd_remote_written_values_total", before + 3) >= before + 3
    return wrote


def read(b: Daemon, tokens: list[int]) -> dict[str, Any]:
    got = run_worker(b, "read", "alice", "acme", tokens, wait_for_remote=True)
    assert got["pattern_ok"]  # whatever was hit holds exactly this prompt's K/V
    return got


def test_a_flushed_cluster_is_a_miss(nodes: tuple[Daemon, Daemon], cluster: RedisCluster
                                     ) -> None:
    a, b = nodes
    publish(a, prompt(1))
    for p in cluster.ports:
        cluster.cli(p, "flushall")
    misses = b.metric("blockd_remote_miss_blocks_total")
    assert read(b, prompt(1))["cached"] == 0
    assert b.metric("blockd_remote_miss_blocks_total") >= misses + 3


def test_a_value_corrupted_by_hand_is_never_served_and_is_deleted(
        nodes: tuple[Daemon, Daemon], cluster: RedisCluster) -> None:
    a, b = nodes
    before = {k for _, k in cluster.stored_keys()}
    publish(a, prompt(2))
    mine = [(p, k) for p, k in cluster.stored_keys() if k not in before]
    assert len(mine) == 3
    # Which key is which block is not visible from outside (keys are MACs), so all three are
    # damaged, each another way: a byte of the K/V, a byte of the header, another length.
    (p0, k0), (p1, k1), (p2, k2) = mine
    cluster.cli(p0, "setrange", k0, "200", "X")      # a byte of the K/V
    cluster.cli(p1, "setrange", k1, "20", "Y")       # a byte of the header
    cluster.cli(p2, "set", k2, "short")              # a value of another length
    bad = b.metric("blockd_remote_bad_values_total")
    got = read(b, prompt(2))
    assert got["cached"] == 0
    assert b.metric("blockd_remote_bad_values_total") == bad + 1  # the first block's, deleted
    assert len([k for _, k in cluster.stored_keys() if k in {k0, k1, k2}]) == 2


def test_a_killed_master_is_a_miss_for_its_keys_and_is_used_again_when_back(
        nodes: tuple[Daemon, Daemon], cluster: RedisCluster) -> None:
    a, b = nodes
    before = set(cluster.stored_keys())
    publish(a, prompt(3))
    holders = {p for p, _ in set(cluster.stored_keys()) - before}
    victim = min(holders)  # a master holding one of the prompt's blocks
    cluster.kill(victim)
    try:
        errors = sum(b.metric(f'blockd_remote_errors_total{{kind="{k}"}}')
                     for k in ("connection", "cluster_down", "timeout"))
        got = read(b, prompt(3))  # the blocks on the dead master's slots are misses
        assert got["cached"] < 12
        run_worker(a, "write", "alice", "acme", prompt(4))  # writes to it fail, counted
        after = sum(b.metric(f'blockd_remote_errors_total{{kind="{k}"}}')
                    for k in ("connection", "cluster_down", "timeout"))
        after += sum(a.metric(f'blockd_remote_errors_total{{kind="{k}"}}')
                     for k in ("connection", "cluster_down", "timeout"))
        assert after > errors
        # The other masters still answer: the tier is not down, their keys still serve.
        assert b.metric("blockd_remote_up") == 1 and a.metric("blockd_remote_up") == 1
    finally:
        cluster.revive(victim)  # an empty master (no persistence) with its slots
    assert wait_metric(b, "blockd_remote_up", 1) == 1
    publish(a, prompt(5))
    assert read(b, prompt(5))["cached"] == 12


def test_the_whole_cluster_down_then_back(nodes: tuple[Daemon, Daemon],
                                          cluster: RedisCluster) -> None:
    a, b = nodes
    for p in list(cluster.ports):
        cluster.kill(p)
    try:
        wrote = run_worker(a, "write", "alice", "acme", prompt(6))  # never an error
        assert wrote["committed"] == 3
        got = read(b, prompt(6))
        assert got["cached"] == 0
        assert wait_down(b) and wait_down(a)  # noticed (exported), retried
    finally:
        cluster.revive(*cluster.ports)
    assert wait_metric(a, "blockd_remote_up", 1) == 1
    assert wait_metric(b, "blockd_remote_up", 1) == 1
    publish(a, prompt(7))
    assert read(b, prompt(7))["cached"] == 12


def test_a_slow_cluster_is_a_miss_within_the_deadline(nodes: tuple[Daemon, Daemon],
                                                       cluster: RedisCluster) -> None:
    a, b = nodes
    publish(a, prompt(8))
    timeouts = b.metric('blockd_remote_errors_total{kind="timeout"}')
    cluster.freeze(True)  # nothing answers: slower than the 200 ms deadline, however long
    try:
        got = read(b, prompt(8))
        assert got["cached"] == 0
        assert b.metric('blockd_remote_errors_total{kind="timeout"}') > timeouts
    finally:
        cluster.freeze(False)
    assert wait_metric(b, "blockd_remote_up", 1) == 1
    # Used again: the prompt that missed is asked of the cluster again once remote_retry_ms
    # has passed since the miss (whether the tier went down meanwhile depends on whether the
    # idle probe ran while frozen); a read before that is a miss, so read until it hits.
    deadline = time.monotonic() + 15
    while (got := read(b, prompt(8)))["cached"] != 12:
        assert got["cached"] == 0 and time.monotonic() < deadline, got


def test_a_full_cluster_refuses_writes_counted(nodes: tuple[Daemon, Daemon],
                                               cluster: RedisCluster) -> None:
    a, b = nodes
    for p in cluster.ports:
        cluster.cli(p, "config", "set", "maxmemory-policy", "noeviction")
        cluster.cli(p, "config", "set", "maxmemory", "1")
    try:
        full = a.metric('blockd_remote_errors_total{kind="full"}')
        run_worker(a, "write", "alice", "acme", prompt(9))
        assert wait_metric(a, 'blockd_remote_errors_total{kind="full"}', full + 1) > full
        assert read(b, prompt(9))["cached"] == 0
    finally:
        for p in cluster.ports:
            cluster.cli(p, "config", "set", "maxmemory", "0")


def test_one_tenants_flood_of_misses_never_refuses_anothers_fetch(tmp_path: Path,
                                                                   cluster: RedisCluster) -> None:
    """The cluster frozen (every fetch waits for its deadline, 3 s here): acme's one Step of 12
    admits that all miss locally gets fetches for its share (4 waiting, the one being read),
    the rest are plain misses counted ``fetch_budget``; globex's admit right after is fetched
    all the same (answered pending), not refused behind acme's."""
    dropped = 'blockd_remote_dropped_total{reason="fetch_budget"}'
    cfg = remote_cfg(tmp_path / "c", cluster, remote_timeout_ms=3000,
                     remote_fetches_per_tenant=4)
    with start(tmp_path / "c", num_blocks=64, extra=cfg) as c:
        assert wait_metric(c, "blockd_remote_up", 1) == 1
        acme, globex = Worker(c.stub(), "alice", "acme"), Worker(c.stub(), "bob", "globex")
        cluster.freeze(True)
        try:
            flood = acme.step(*[admit(prompt(100 + i), wait_for_remote=True)
                                for i in range(12)], fence=0)
            pending = [r.admit.pending_remote_blocks for r in flood.results]
            assert all(r.status.code == 0 for r in flood.results)
            assert set(pending) == {0, 3} and 4 <= pending.count(3) <= 5, pending
            assert c.metric(dropped) == pending.count(0)
            quiet = globex.step(admit(prompt(200), wait_for_remote=True), fence=0).results[0]
            assert quiet.status.code == 0 and quiet.admit.pending_remote_blocks == 3
        finally:
            cluster.freeze(False)
        assert c.metric(dropped) == pending.count(0)  # globex's was never refused


@pytest.mark.parametrize("secret,needle", [
    (None, "cannot read"), (b"short", "holds 5 bytes"),
])
def test_a_bad_cluster_secret_is_refused_in_one_line(tmp_path: Path, secret: bytes | None,
                                                     needle: str) -> None:
    tiers = remote_cfg(tmp_path, RedisCluster(tmp_path, [1]))["tiers"]
    if secret is None:
        (tmp_path / "secret").unlink()
    else:
        (tmp_path / "secret").write_bytes(secret)
    cfg = write_config(tmp_path / "d", tiers=tiers)
    out = run_refused("--config", str(cfg), cwd=tmp_path, env=clean_env())
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "tiers.cluster_secret_file" in lines[0] and needle in lines[0], lines[0]


def test_redis_nodes_without_a_secret_or_a_tier_is_refused_by_flag(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "d")
    out = run_refused("--config", str(cfg), "--tiers-redis-nodes", "127.0.0.1:1",
                      "--tiers-host-bytes", "1048576", cwd=tmp_path, env=clean_env())
    assert out.returncode == 2 and "tiers.cluster_secret_file" in out.stderr, out.stderr
    out = run_refused("--config", str(cfg), "--tiers-redis-nodes", "127.0.0.1:x",
                      cwd=tmp_path, env=clean_env())
    assert out.returncode == 2 and "tiers.redis_nodes" in out.stderr, out.stderr


def test_an_unreachable_cluster_is_a_degraded_start_retried(tmp_path: Path) -> None:
    """Started before its cluster: serving (misses), exported as down, then used once up."""
    from redis_support import free_port

    ports = [free_port() for _ in range(3)]
    late = RedisCluster(tmp_path / "redis", ports, password="pw-blockd")
    with node(tmp_path, "a", late) as a, node(tmp_path, "b", late) as b:
        assert a.metric("blockd_remote_up") == 0
        assert "Redis Cluster is not reachable" in a.log_text()
        assert run_worker(a, "write", "alice", "acme", prompt(10))["committed"] == 3
        late.create()  # the cluster the daemons were told of comes up
        try:
            assert wait_metric(a, "blockd_remote_up", 1) == 1
            assert wait_metric(b, "blockd_remote_up", 1) == 1
            publish(a, prompt(11))
            assert read(b, prompt(11))["cached"] == 12
        finally:
            late.stop()
