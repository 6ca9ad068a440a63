"""Crash recovery: ``kill -9`` the daemon under a multi-worker workload, restart it, go on.

The daemon runs with ``state.dir`` (pool, fence pages, snapshot and journal in a private
directory) and checks its invariants after every call. Workers are real ``blockd_client``
sessions that write a K/V pattern into the shared pool for every token they compute; the pattern
of a position is a function of the prefix up to it, so a cache hit must read exactly what the
writer wrote. After every restart the workers carry on with the same session, epoch and mapped
pool (their in-flight Step is retried with its step_id), and check that every live sequence's
K/V bytes are unchanged and that the daemon's block tables equal theirs.
"""

from __future__ import annotations

import os
import pickle
import random
import signal
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from daemon_proc import TOKENS, Daemon, kill9, md, restart, start

import blockd_client.requests as rq
from blockd.api.v1 import blockd_pb2 as pb
from blockd.runtime import journal
from blockd.runtime.recovery import SNAPSHOT_VERSION
from blockd.runtime.state_store import MAGIC
from blockd_client import Client
from blockd_client.errors import BlockdError
from blockd_gpu import KvLayout

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")
B = LAYOUT.block_size
NS = rq.namespace("tiny", model_revision="r1")
SYSTEM = list(range(1, 13))  # three full blocks every prompt starts with
KILLS = int(os.environ.get("CRASH_KILLS", "5"))


def value(prefix: list[int]) -> float:
    """What every element of a position's K/V holds (before the per-plane offset)."""
    return float(zlib.crc32(bytes(str(prefix), "ascii")) % 251)


def plane_offsets() -> torch.Tensor:
    # Layer l, K (0) or V (1): + 0.25 * (2l + kv); exact in float16 next to values < 256.
    return torch.tensor([[0.25 * (2 * layer + kv) for kv in range(2)]
                         for layer in range(LAYOUT.num_layers)], dtype=torch.float16)


def write(kv: torch.Tensor, table: list[int], tokens: list[int], start: int) -> None:
    """The worker 'computes' K/V of positions start.. of a sequence into the pool."""
    offsets = plane_offsets()
    for p in range(start, len(tokens)):
        b, o = table[p // B], p % B
        kv[:, :, b, o] = (value(tokens[: p + 1]) + offsets)[:, :, None, None]


def check(kv: torch.Tensor, table: list[int], tokens: list[int], what: str) -> None:
    """Every position of a sequence holds its pattern."""
    if not tokens:
        return
    blocks = torch.tensor([table[p // B] for p in range(len(tokens))])
    offs = torch.tensor([p % B for p in range(len(tokens))])
    got = kv[:, :, blocks, offs]  # [L, 2, P, H, D]
    want = torch.tensor([value(tokens[: p + 1]) for p in range(len(tokens))],
                        dtype=torch.float16)[None, None, :, None, None] + plane_offsets()[
                            :, :, None, None, None]
    if not torch.equal(got, want.expand_as(got)):
        bad = [p for p in range(len(tokens)) if not torch.equal(got[:, :, p], want.expand_as(
            got)[:, :, p])]
        raise AssertionError(f"{what}: K/V changed at positions {bad[:8]} (blocks "
                             f"{[table[p // B] for p in bad[:8]]})")


class CrashWorker(threading.Thread):
    """Admits, prefills, commits, decodes and releases sequences until told to stop."""

    def __init__(self, target: str, who: str, tenant: str, seed: int, stream: bool = False
                 ) -> None:
        super().__init__(name=f"worker-{who}", daemon=True)
        self.stream = stream
        self.target = target
        self.who = who
        self.tenant = tenant
        self.rng = random.Random(seed)
        self.stop_flag = threading.Event()
        self.error: BaseException | None = None
        self.steps = 0
        self.hits_after_restart = 0
        self.restarts_seen = 0
        self.epoch = 0
        self.live: dict[str, list[int]] = {}
        self.committed: dict[str, int] = {}

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # reported by the test
            self.error = exc

    def _step(self, ops: list[pb.Operation]) -> Any:
        out = self.session.step(ops)
        self.session.complete(out.fence)  # no GPU: the step's work is done at once
        self.steps += 1
        return out

    def _run(self) -> None:
        client = Client(f"unix:{self.target}", token=TOKENS[self.who], reconnect_s=60)
        self.client = client
        self.session = client.attach(self.tenant, LAYOUT, worker_name=self.who, max_seqs=64,
                                     max_blocks=64, stream=self.stream)
        self.epoch = self.session.epoch
        kv = self.session.pool.kv_pool()
        rng = self.rng
        while not self.stop_flag.is_set():
            action = rng.choice(["admit", "admit", "append", "append", "append", "commit",
                                 "release"])
            if action == "admit" and len(self.live) < 5:
                prompt = SYSTEM + [rng.randrange(100) for _ in range(rng.randrange(1, 9))]
                res = self._step([rq.admit(prompt, NS)]).results[0]
                if res.status.code:
                    assert res.status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], res
                    self._release_one()
                    continue
                seq = res.admit.sequence_id
                table = list(res.admit.block_table)
                cached = res.admit.num_cached_tokens
                # A hit reads exactly what its writer computed for this very prefix.
                check(kv, table, prompt[:cached], f"{self.who}: hit of {seq}")
                if cached and self.restarts_seen:
                    self.hits_after_restart += cached
                write(kv, table, prompt, cached)
                self.live[seq] = prompt
                self.committed[seq] = cached // B
            elif action == "append" and self.live:
                seq = rng.choice(sorted(self.live))
                toks = [rng.randrange(100) for _ in range(rng.randrange(1, 4))]
                res = self._step([rq.append(seq, toks)]).results[0]
                if res.status.code:
                    assert res.status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], res
                    self._release_one()
                    continue
                tokens = self.live[seq] + toks
                self.live[seq] = tokens
                write(kv, self.session.tables.blocks(seq), tokens, len(tokens) - len(toks))
            elif action == "commit" and self.live:
                seq = rng.choice(sorted(self.live))
                self._step([rq.commit(seq)])
            elif action == "release" and self.live:
                self._release_one()
            else:
                continue
            self.verify(kv)

    def _release_one(self) -> None:
        if self.live:
            seq = self.rng.choice(sorted(self.live))
            res = self._step([rq.release(seq)]).results[0]
            assert res.status.code == 0, res
            del self.live[seq]

    def verify(self, kv: torch.Tensor) -> None:
        for seq, tokens in self.live.items():
            check(kv, self.session.tables.blocks(seq), tokens, f"{self.who}: {seq}")

    def verify_with_daemon(self) -> None:
        """The daemon's tables equal the worker's, and the content is unchanged."""
        kv = self.session.pool.kv_pool()
        for seq, tokens in self.live.items():
            t = self.session.block_table(seq)
            assert list(t.block_ids) == self.session.tables.blocks(seq), seq
            assert t.num_tokens == len(tokens)
            check(kv, list(t.block_ids), tokens, f"{self.who}: {seq} after the run")


def stats(d: Daemon) -> pb.StatsResponse:
    return d.stub().Stats(pb.StatsRequest(), metadata=md("admin"))


@pytest.fixture
def state_daemon(tmp_path: Path) -> Any:
    holder: dict[str, Daemon] = {}
    holder["d"] = start(tmp_path, num_blocks=256, lease_ms=30_000, extra={
        "state": {"dir": str(tmp_path / "state"), "snapshot_min_bytes": 16 * 1024}})
    yield holder
    holder["d"].stop()


def test_kill9_keeps_sequences_content_cache_and_sessions(state_daemon: dict[str, Daemon]
                                                          ) -> None:
    d = state_daemon["d"]
    epoch = stats(d).epoch
    # Two workers step with unary calls, one on a StepStream that must reconnect by itself.
    workers = [CrashWorker(d.endpoints["unix"], who, tenant, seed, stream)
               for seed, (who, tenant, stream) in enumerate([
                   ("alice", "acme", False), ("multi", "acme", False), ("bob", "globex", True)])]
    for w in workers:
        w.start()
    rng = random.Random(7)
    try:
        for kill in range(KILLS):
            # Let every worker make progress, then kill at a random point of its work.
            floor = [w.steps for w in workers]
            deadline = time.monotonic() + 60
            while any(w.steps < f + 5 for w, f in zip(workers, floor, strict=True)):
                assert all(w.error is None and w.is_alive() for w in workers), [
                    w.error for w in workers]
                assert time.monotonic() < deadline, "workers made no progress"
                time.sleep(0.02)
            time.sleep(rng.uniform(0, 0.3))
            kill9(d)
            for w in workers:
                w.restarts_seen += 1
            time.sleep(rng.uniform(0, 0.2))
            d = state_daemon["d"] = restart(d)
            assert any("recovered epoch" in line for line in d.lines), d.log_text()
            assert stats(d).epoch == epoch, f"kill {kill}: the epoch changed"
        floor = [w.steps for w in workers]
        deadline = time.monotonic() + 60
        while any(w.steps < f + 20 for w, f in zip(workers, floor, strict=True)):
            assert all(w.error is None for w in workers), [w.error for w in workers]
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        for w in workers:
            w.stop_flag.set()
        for w in workers:
            w.join(60)
    errors = [(w.who, w.error) for w in workers if w.error is not None]
    assert not errors, errors
    for w in workers:
        assert w.session.epoch == epoch
        w.verify_with_daemon()
    # The streaming worker's stream broke with every kill and was reopened each time.
    assert workers[2].session.streamer.opened >= KILLS + 1
    # Cached prefixes survived the crashes: admissions after a restart hit them.
    assert sum(w.hits_after_restart for w in workers) > 0
    # No block leaked or double-owned: the daemon checked its invariants after every call;
    # once every worker has detached, every block is free or cached.
    for w in workers:
        w.session.detach()
    s = stats(d)
    assert s.num_sessions == 0 and s.num_sequences == 0
    assert s.blocks_writing == s.blocks_committed == s.blocks_pending == 0
    assert s.blocks_free + s.blocks_cached == s.num_blocks
    assert "Traceback" not in d.log_text()


def test_step_retried_across_a_crash_is_applied_once(state_daemon: dict[str, Daemon]) -> None:
    """A Step whose answer was lost in the crash is answered from the journal, not redone."""
    d = state_daemon["d"]
    client = Client(f"unix:{d.endpoints['unix']}", token=TOKENS["alice"], reconnect_s=30)
    session = client.attach("acme", LAYOUT, worker_name="alice")
    out = session.step([rq.admit(list(range(50, 61)), NS)])
    seq = out.results[0].admit.sequence_id
    session.complete(out.fence)
    req = session.state.request([rq.append(seq, [7, 8])])
    first = client.stub.Step(req, metadata=client.metadata)
    kill9(d)
    d = state_daemon["d"] = restart(d)
    again = client.call(client.stub.Step, req)  # the worker never saw ``first``: it retries
    assert again == first
    table = session.block_table(seq)
    assert table.num_tokens == 13  # applied once, not twice
    # The session, its sequences and fences carry on.
    nxt = session.step([rq.append(seq, [9])])
    assert nxt.results[0].append.num_tokens == 14
    session.detach()
    client.close()


def test_mismatched_pool_starts_a_new_epoch_that_workers_detect(tmp_path: Path) -> None:
    """State for another pool geometry is not loaded: a clean epoch, seen by the worker."""
    d = start(tmp_path, num_blocks=64, extra={"state": {"dir": str(tmp_path / "state")}})
    try:
        client = Client(f"unix:{d.endpoints['unix']}", token=TOKENS["alice"], reconnect_s=30)
        session = client.attach("acme", LAYOUT, worker_name="alice")
        out = session.step([rq.admit(list(range(20)), NS)])
        session.complete(out.fence)
        old = session.epoch
        kill9(d)
        cfg = (tmp_path / "blockd.yaml").read_text().replace("num_blocks: 64",
                                                               "num_blocks: 96")
        (tmp_path / "blockd.yaml").write_text(cfg)
        d = restart(d)
        assert any("not recovering" in line for line in d.lines), d.log_text()
        with pytest.raises(BlockdError) as err:
            session.step([rq.admit(list(range(20)), NS)])
        assert type(err.value).__name__ == "EpochChanged"
        assert session.epoch != old
        s = stats(d)
        assert s.num_blocks == 96 and s.num_sequences == 0 and s.blocks_cached == 0
        client.close()
    finally:
        d.stop()


#: A pickle of the previous layout: a class of ``blockd.core.allocator``, which the renovation
#: of issue 12 removed (its blocks are ``blockd.core.blocks`` now).
OLD_LAYOUT_PICKLE = b"cblockd.core.allocator\nBlockAllocator\n."


@pytest.mark.parametrize("snapshot", ["version-1", "unpicklable"])
def test_a_snapshot_of_the_previous_layout_starts_a_new_epoch(tmp_path: Path, snapshot: str
                                                              ) -> None:
    """A snapshot the previous layout wrote is never loaded: neither one of format version 1
    (the state dict of the previous layout, naming its module paths), nor one that cannot be
    unpickled at all. The daemon starts a new epoch, which the worker detects, and serves."""
    state = tmp_path / "state"
    d = start(tmp_path, num_blocks=64, extra={"state": {"dir": str(state)}})
    try:
        client = Client(f"unix:{d.endpoints['unix']}", token=TOKENS["alice"], reconnect_s=30)
        session = client.attach("acme", LAYOUT, worker_name="alice")
        session.complete(session.step([rq.admit(list(range(20)), NS)]).fence)
        old = session.epoch
        kill9(d)
        if snapshot == "version-1":
            saved = pickle.loads((state / "snapshot").read_bytes()[len(MAGIC):])  # noqa: S301
            saved.pop("manager_format", None)
            saved.update(version=1, manager=OLD_LAYOUT_PICKLE)
            payload = pickle.dumps(saved)
        else:
            payload = OLD_LAYOUT_PICKLE
        (state / "snapshot").write_bytes(MAGIC + payload)
        d = restart(d)
        why = "snapshot version 1" if snapshot == "version-1" else "ModuleNotFoundError"
        assert any("not recovering" in line and why in line for line in d.lines), d.log_text()
        assert not any("recovered epoch" in line for line in d.lines)
        with pytest.raises(BlockdError) as err:
            session.step([rq.admit(list(range(20)), NS)])
        assert type(err.value).__name__ == "EpochChanged" and session.epoch != old
        out = session.step([rq.admit(list(range(20)), NS)])  # the new epoch serves
        assert out.results[0].status.code == 0
        s = stats(d)
        assert s.epoch == session.epoch and s.num_sequences == 1 and s.num_sessions == 1
        # The new epoch's own snapshot is of the current format.
        fresh = pickle.loads((state / "snapshot").read_bytes()[len(MAGIC):])  # noqa: S301
        assert fresh["version"] == SNAPSHOT_VERSION and fresh["epoch"] == session.epoch
        session.detach()
        client.close()
    finally:
        d.stop()


def test_state_dir_must_be_private(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    state.chmod(0o755)
    with pytest.raises(RuntimeError, match="private"):
        start(tmp_path, extra={"state": {"dir": str(state)}})


def test_event_subscribers_resync_after_a_restart(state_daemon: dict[str, Daemon]) -> None:
    """The new process's event stream starts with AllBlocksCleared, then lists every block the
    recovered index holds, with the same hashes as before the crash."""
    d = state_daemon["d"]
    client = Client(f"unix:{d.endpoints['unix']}", token=TOKENS["alice"], reconnect_s=30)
    session = client.attach("acme", LAYOUT, worker_name="alice")
    out = session.step([rq.admit(list(range(30, 47)), NS)])  # 4 full blocks + 1 token
    seq = out.results[0].admit.sequence_id
    session.complete(out.fence)
    session.complete(session.step([rq.commit(seq)]).fence)
    before = d.stub().WatchEvents(pb.WatchEventsRequest(since_sequence=1), metadata=md("admin"),
                                  timeout=10)
    stored = [next(before) for _ in range(4)]
    before.cancel()
    kill9(d)
    d = state_daemon["d"] = restart(d)
    after = d.stub().WatchEvents(pb.WatchEventsRequest(since_sequence=1), metadata=md("admin"),
                                 timeout=10)
    events = [next(after) for _ in range(5)]
    after.cancel()
    assert events[0].WhichOneof("event") == "all_blocks_cleared"
    assert [e.block_stored.block_hashes for e in events[1:]] == [
        e.block_stored.block_hashes for e in stored]
    assert [e.block_stored.parent_block_hash for e in events[1:]] == [
        e.block_stored.parent_block_hash for e in stored]
    assert all(e.epoch == stored[0].epoch for e in events)
    assert d.metric("blockd_snapshot_uncached_sequences_total") == 0  # nothing was flushed
    session.detach()
    client.close()


def test_state_that_cannot_be_replayed_is_kept_aside_and_a_new_epoch_starts(
        state_daemon: dict[str, Daemon], tmp_path: Path) -> None:
    """A journal record the daemon cannot apply (a bug, or damage its checksum cannot see)
    must not crash-loop the daemon: the state is moved aside and workers see a new epoch."""
    d = state_daemon["d"]
    client = Client(f"unix:{d.endpoints['unix']}", token=TOKENS["alice"], reconnect_s=30)
    session = client.attach("acme", LAYOUT, worker_name="alice")
    session.complete(session.step([rq.admit(list(range(9)), NS)]).fence)
    old = session.epoch
    kill9(d)
    state = tmp_path / "state"
    (current,) = state.glob("journal.*")
    j = journal.Journal(str(tmp_path / "bogus"))
    j.append(["no-such-record", 1])
    j.close()
    with open(current, "ab") as f:
        f.write((tmp_path / "bogus").read_bytes())
    d = state_daemon["d"] = restart(d)
    assert any("failed: starting a new epoch" in line for line in d.lines), d.log_text()
    (kept,) = state.glob("failed-*")
    assert (kept / "snapshot").exists() and (kept / current.name).exists()
    with pytest.raises(BlockdError) as err:
        session.step([rq.admit(list(range(9)), NS)])
    assert type(err.value).__name__ == "EpochChanged" and session.epoch != old
    out = session.step([rq.admit(list(range(9)), NS)])  # the new epoch serves
    assert out.results[0].status.code == 0
    session.detach()
    client.close()


def test_a_stream_step_to_a_hung_daemon_times_out_and_the_stream_recovers(
        state_daemon: dict[str, Daemon]) -> None:
    """The StepStream has no deadline of its own: each round trip gets the client's timeout
    (one watchdog thread per session), and the next Step opens a fresh stream."""
    d = state_daemon["d"]
    client = Client(f"unix:{d.endpoints['unix']}", token=TOKENS["alice"], timeout=1.0)
    session = client.attach("acme", LAYOUT, worker_name="alice", stream=True)
    out = session.step([rq.admit(list(range(9)), NS)])
    seq = out.results[0].admit.sequence_id
    session.complete(out.fence)
    d.proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(BlockdError) as err:
            session.step([rq.append(seq, [1])])
        assert err.value.status == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - t0 < 5
    finally:
        d.proc.send_signal(signal.SIGCONT)
    # The timed-out Step may or may not have been applied: the worker retries its step_id.
    session.state.counter.step_id -= 1
    again = session.step([rq.append(seq, [1])])
    assert again.results[0].status.code == 0 and again.results[0].append.num_tokens == 10
    assert session.streamer.opened == 2
    session.detach()
    client.close()
