"""``RedisRemote``'s rounds against a real 3-master Redis Cluster (no daemon): a dead master
fails its own keys and never takes the tier down, however many of one round's keys it holds,
or however many rounds ask it alone;
a slot map that lacks slots (what a client that connected while the cluster formed holds) is
reloaded in the round that finds out, and that round's values are still written; so is one
that sends keys to the wrong master (MOVED); a round no master answers counts each of its
commands once and takes the tier down at once."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from redis_support import RedisCluster, needs_redis

from blockd.tiers.redis_cluster import DOWN_AFTER, RedisRemote
from blockd.tiers.remote_jobs import RedisSettings

pytestmark = needs_redis

#: Keys per round: with three masters, about a third on each (many more than ``DOWN_AFTER``).
N = 60


def _remote(cluster: RedisCluster) -> tuple[RedisRemote, list[object], threading.Event]:
    remote = RedisRemote(RedisSettings(nodes=tuple(("127.0.0.1", p) for p in cluster.ports),
                                       timeout_s=0.5, retry_s=30.0))
    written: list[object] = []
    got = threading.Event()

    def on_written(tags: list[object]) -> None:
        written.extend(tags)
        got.set()

    remote.on_written = on_written
    assert remote.start()
    return remote, written, got


def _publish(remote: RedisRemote, written: list[object], got: threading.Event,
             keys: list[bytes]) -> None:
    """Queue ``keys`` at once (one round: at most PUBLISH_BATCH = 64 per pipeline), wait for
    the round's answer."""
    got.clear()
    for k in keys:
        assert remote.publish(k, b"v:" + k, tag=k)
    assert got.wait(30)
    deadline = time.monotonic() + 10  # every key of the round is answered (written or failed)
    while remote.counters.values_written + sum(remote.counters.errors.values()) < len(keys):
        assert time.monotonic() < deadline, remote.counters
        time.sleep(0.02)


@pytest.fixture
def cluster(tmp_path: Path):  # type: ignore[no-untyped-def]
    with RedisCluster.start(tmp_path / "redis") as c:
        yield c


def test_a_round_with_many_keys_on_a_dead_master_keeps_the_tier_up(cluster: RedisCluster
                                                                    ) -> None:
    remote, written, got = _remote(cluster)
    try:
        keys = [f"blockd:round:{i}".encode() for i in range(N)]
        victim = cluster.ports[0]
        slots = _slots_of(cluster, victim)
        assert remote._client is not None
        on_victim = {k for k in keys if remote._client.keyslot(k) in slots}
        assert len(on_victim) > DOWN_AFTER  # enough to trip a per-value count in one round
        cluster.kill(victim)
        _publish(remote, written, got, keys)
        assert set(written) == set(keys) - on_victim  # the live masters' keys are written
        assert remote.up and sum(remote.counters.errors.values()) == len(on_victim)
        values, unread = remote._read(keys)  # the fetcher's read: the dead master's keys miss
        assert {k for k, v in zip(keys, values, strict=True) if v is not None} == \
            set(keys) - on_victim
        # ... as unanswered, not as "no such key": the keys are not taken for gone.
        assert {keys[i] for i in unread} == on_victim
        assert all(v == b"v:" + k for k, v in zip(keys, values, strict=True) if v is not None)
        assert remote.up and remote.counters.connects == 1  # never dropped and rebuilt
    finally:
        remote.close()


def test_rounds_that_ask_only_a_dead_master_keep_the_tier_up(cluster: RedisCluster) -> None:
    """Fetches whose keys all live on the dead master (a prompt's blocks on its slots) reach
    no master, round after round, while the other masters answer: its keys are unanswered
    (misses), the tier stays up and the live masters' keys are still read. (A daemon's read
    of a prompt whose master was killed used to take its whole tier down: the round reached
    no master, so it counted as the cluster down, at once.)"""
    remote, written, got = _remote(cluster)
    try:
        keys = [f"blockd:alone:{i}".encode() for i in range(N)]
        _publish(remote, written, got, keys)
        assert set(written) == set(keys)
        client = remote._client
        assert client is not None
        slots = _slots_of(cluster, cluster.ports[0])
        on_victim = [k for k in keys if client.keyslot(k) in slots]
        elsewhere = [k for k in keys if k not in on_victim]
        assert on_victim and elsewhere
        cluster.kill(cluster.ports[0])
        for _ in range(DOWN_AFTER + 1):  # more rounds than a run of failures may have
            values, unread = remote._read(on_victim)
            assert values == [None] * len(on_victim)
            assert unread == frozenset(range(len(on_victim)))  # unanswered, not "gone"
            assert remote.up, remote.counters.errors
        values, unread = remote._read(elsewhere)
        assert values == [b"v:" + k for k in elsewhere] and unread == frozenset()
        assert remote.up and remote.counters.connects == 1  # never dropped and rebuilt
    finally:
        remote.close()


def test_a_slot_map_missing_slots_is_reloaded_and_the_round_is_written(
        cluster: RedisCluster) -> None:
    remote, written, got = _remote(cluster)
    try:
        client = remote._client
        assert client is not None
        cache = client.nodes_manager.slots_cache
        gone = [slot for slot in list(cache) if slot < 8000]
        for slot in gone:  # the map a client that connected mid-`cluster create` holds
            del cache[slot]
        keys = [f"blockd:map:{i}".encode() for i in range(N)]
        assert any(client.keyslot(k) in gone for k in keys)
        _publish(remote, written, got, keys)
        assert set(written) == set(keys)  # reloaded in this round, nothing dropped
        assert all(slot in client.nodes_manager.slots_cache for slot in gone)
        assert sum(remote.counters.errors.values()) == 0 and remote.up
    finally:
        remote.close()


def test_a_slot_map_pointing_at_the_wrong_master_is_reloaded_on_moved(
        cluster: RedisCluster) -> None:
    """The map a client holds after a reshard or a failover: slots assigned to another master.
    The MOVED replies reload it in that round, and those values are written where they go."""
    remote, written, got = _remote(cluster)
    try:
        client = remote._client
        assert client is not None
        cache = client.nodes_manager.slots_cache
        wrong = {slot: cache[(slot + 8192) % 16384] for slot in range(0, 16384, 2)}
        assert any(wrong[s][0].name != cache[s][0].name for s in wrong)
        cache.update(wrong)
        keys = [f"blockd:moved:{i}".encode() for i in range(N)]
        _publish(remote, written, got, keys)
        assert set(written) == set(keys)  # reloaded in this round, nothing dropped
        assert sum(remote.counters.errors.values()) == 0 and remote.up
        values, unread = remote._read(keys)
        assert values == [b"v:" + k for k in keys] and unread == frozenset()
    finally:
        remote.close()


def test_a_round_no_master_answers_counts_each_command_once_and_takes_the_tier_down(
        cluster: RedisCluster) -> None:
    """Every master dead: the round's commands fail by connection, each counted once (not once
    more for the round), and the tier is down at once (no DOWN_AFTER rounds of timeouts)."""
    remote, _, _ = _remote(cluster)
    try:
        keys = [f"blockd:gone:{i}".encode() for i in range(N)]
        for port in cluster.ports:
            cluster.kill(port)
        values, unread = remote._read(keys)
        assert values == [None] * N and unread == frozenset(range(N))
        assert sum(remote.counters.errors.values()) == N, remote.counters.errors
        assert not remote.up
    finally:
        remote.close()


def _slots_of(cluster: RedisCluster, port: int) -> set[int]:
    """The slots master ``port`` serves, from its own CLUSTER NODES line."""
    out: set[int] = set()
    for row in cluster.cli(port, "cluster", "nodes").splitlines():
        parts = row.split()
        if "myself" in parts[2]:
            for r in parts[8:]:
                lo, _, hi = r.partition("-")
                out.update(range(int(lo), int(hi or lo) + 1))
    return out
