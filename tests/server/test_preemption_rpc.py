"""Daemon-side preemption against a real daemon (invariants checked after every call).

A low-priority tenant fills the pool; a high-priority tenant's admission preempts its latest
sequence: RESOURCE_EXHAUSTED "preempting" while the victim's fence is pending, a notice in the
victim's next StepResponse, ABORTED for operations naming it, success once the fence completes.
Then two workers step concurrently under pool pressure, writing a K/V pattern into the shared
pool for every token: the high one must finish its work (no deadlock, bounded by a timeout) and
no worker may ever read K/V it did not write (a preempted block reused too early would show).
"""

from __future__ import annotations

import copy
import random
import threading
import time
import zlib
from typing import Any

import grpc
import pytest
import torch
from daemon_proc import TENANTS, TOKENS, Daemon, Worker, admit, append, commit, md, release, start

import blockd_client.requests as rq
from blockd.api.v1 import blockd_pb2 as pb
from blockd_client import Client
from blockd_gpu import KvLayout

ABORTED = grpc.StatusCode.ABORTED.value[0]
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
NUM_BLOCKS = 16


def tenants() -> dict[str, Any]:
    t = copy.deepcopy(TENANTS)
    for policy in t["tenants"]:
        policy["quota_blocks"] = NUM_BLOCKS
        policy["priority"] = {"acme": 0, "globex": 1}.get(policy["id"], 0)
    return t


@pytest.fixture
def pdaemon(tmp_path: Any) -> Daemon:
    d = start(tmp_path / "blockd", num_blocks=NUM_BLOCKS, tenants=tenants())
    yield d
    d.stop()


def prompt(k: int, blocks: int) -> list[int]:
    return [k * 1000 + i for i in range(blocks * 4)]


def test_preempting_then_notice_then_aborted_then_success(pdaemon: Daemon) -> None:
    low = Worker(pdaemon.stub(), "alice", "acme")
    high = Worker(pdaemon.stub(), "bob", "globex")
    # Fence 1: the low worker's kernels may read its blocks until it reports fence 1.
    resp = low.step(*[admit(prompt(k, 4), priority=k % 2) for k in range(4)], fence=1)
    seqs = [r.admit.sequence_id for r in resp.results]
    assert all(r.status.code == 0 for r in resp.results)
    # 2 blocks for a tenant of higher priority: the latest of the lowest priority (seq 2,
    # priority 0) gives way; its blocks wait for the low worker's fence 1.
    r = high.step(admit(prompt(9, 2)), fence=0).results[0]
    assert (r.status.code, r.status.field) == (EXHAUSTED, "preempting"), r.status
    assert pdaemon.metric('blockd_preemptions_total{tenant="acme"}') == 1
    assert pdaemon.metric('blockd_allocation_failures_total{reason="preempting"}') == 1
    # A retry before the fence completes preempts nobody else.
    r = high.step(admit(prompt(9, 2)), fence=0).results[0]
    assert (r.status.code, r.status.field) == (EXHAUSTED, "pool"), r.status
    assert pdaemon.metric('blockd_preemptions_total{tenant="acme"}') == 1
    # The victim's worker learns it in its next Step; an operation on it is ABORTED.
    resp = low.step(append(seqs[2], [1]), commit(seqs[0]), fence=2)
    assert [(p.sequence_id, p.reason) for p in resp.preempted] == [(seqs[2], "priority")]
    st = resp.results[0].status
    assert (st.code, st.field) == (ABORTED, "operations[0].append.sequence_id"), st
    assert "preempted by a higher-priority request" in st.message
    assert resp.results[1].status.code == 0
    assert not low.step(fence=0).preempted  # told once
    with pytest.raises(grpc.RpcError) as err:
        low.stub.GetBlockTable(pb.GetBlockTableRequest(session_id=low.sid,
                                                       sequence_id=seqs[2]),
                               metadata=md("alice"))
    assert err.value.code() == grpc.StatusCode.ABORTED
    # The low worker reports its fences: the victim's blocks are reusable, the retry fits.
    low.step(fence=0, completed=2)
    r = high.step(admit(prompt(9, 2)), fence=0).results[0]
    assert r.status.code == 0, r.status
    assert len(r.admit.block_table) == 2
    for s in (seqs[0], seqs[1], seqs[3]):
        low.step(release(s), fence=0)
    high.step(release(r.admit.sequence_id), fence=0)


def test_policy_off_only_answers_pool(tmp_path: Any) -> None:
    d = start(tmp_path / "off", num_blocks=NUM_BLOCKS, tenants=tenants(),
              extra={"cache": {"preemption": "off"}})
    try:
        low = Worker(d.stub(), "alice", "acme")
        high = Worker(d.stub(), "bob", "globex")
        low.admit(prompt(1, NUM_BLOCKS))
        r = high.step(admit(prompt(2, 1), priority=100), fence=0).results[0]
        assert (r.status.code, r.status.field) == (EXHAUSTED, "pool")
        assert not low.step(fence=0).preempted
        assert d.metric('blockd_preemptions_total{tenant="acme"}') == 0
    finally:
        d.stop()


# -- two workers stepping concurrently ---------------------------------------------------------

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")
B = LAYOUT.block_size
NS = rq.namespace("tiny", model_revision="r1")


def value(tag: str, prefix: list[int]) -> float:
    return float(zlib.crc32(bytes(f"{tag}{prefix}", "ascii")) % 2000)


def write(kv: torch.Tensor, table: list[int], tag: str, tokens: list[int], start: int) -> None:
    for p in range(start, len(tokens)):
        kv[:, :, table[p // B], p % B] = value(tag, tokens[: p + 1])


def check(kv: torch.Tensor, table: list[int], tag: str, tokens: list[int], what: str) -> None:
    for p in range(len(tokens)):
        got = kv[:, :, table[p // B], p % B]
        if not torch.all(got == value(tag, tokens[: p + 1])):
            raise AssertionError(f"{what}: position {p} (block {table[p // B]}) was overwritten")


class PressureWorker(threading.Thread):
    """Admits (prefix cache off: every block is private), appends and releases sequences,
    writing each token's K/V pattern, completing each step's fence right after it; drops the
    sequences the daemon preempts and checks all its live K/V after every step."""

    def __init__(self, target: str, who: str, tenant: str, seed: int, goal: int,
                 max_live: int) -> None:
        super().__init__(name=f"pressure-{who}", daemon=True)
        self.target, self.who, self.tenant = target, who, tenant
        self.rng = random.Random(seed)
        self.goal = goal  # sequences to finish (0: run until stopped)
        self.max_live = max_live
        self.stop_flag = threading.Event()
        self.error: BaseException | None = None
        self.finished = 0
        self.preempted = 0
        self.aborted = 0
        self.refused: dict[str, int] = {}
        self.live: dict[str, list[int]] = {}

    def run(self) -> None:
        try:
            with Client(f"unix:{self.target}", token=TOKENS[self.who]) as client:
                self.session = client.attach(self.tenant, LAYOUT, worker_name=self.who,
                                             max_seqs=64, max_blocks=64)
                try:
                    self._run()
                finally:
                    self.session.detach()
        except BaseException as exc:  # reported by the test
            self.error = exc

    def _run(self) -> None:
        kv = self.session.pool.kv_pool()
        rng = self.rng
        tag = self.who
        n = 0
        while not self.stop_flag.is_set() and (not self.goal or self.finished < self.goal):
            ops: list[pb.Operation] = []
            grow = {s: [rng.randrange(100) for _ in range(rng.randrange(1, 6))]
                    for s in sorted(self.live)}
            done = [s for s in grow if len(self.live[s]) > 24]
            for s in done:
                del grow[s]
                ops.append(rq.release(s))
            ops.extend(rq.append(s, t) for s, t in grow.items())
            new = None
            if len(self.live) - len(done) < self.max_live:
                n += 1
                new = [n % 100] + [rng.randrange(100) for _ in range(rng.randrange(3, 16))]
                ops.append(rq.admit(new, NS, cache=False))
            out = self.session.step(ops)
            # The preempted sequences are gone from the local tables already.
            for q in out.preempted:
                assert not self.session.tables.has(q)
                if self.live.pop(q, None) is not None:
                    self.preempted += 1
            for op, res in zip(ops, out.results, strict=True):
                kind = op.WhichOneof("op")
                code = res.status.code
                if kind == "release":
                    assert code in (0, ABORTED), res.status
                    if self.live.pop(op.release.sequence_id, None) is not None or code == 0:
                        self.finished += 1
                elif kind == "append":
                    s = op.append.sequence_id
                    if code == 0 and s in self.live:
                        tokens = self.live[s] + list(op.append.token_ids)
                        self.live[s] = tokens
                        write(kv, self.session.tables.blocks(s), tag, tokens,
                              len(tokens) - len(op.append.token_ids))
                    elif code == ABORTED:
                        self.aborted += 1
                        self.live.pop(s, None)
                    else:
                        assert code == EXHAUSTED, res.status
                        self.refused[res.status.field] = self.refused.get(res.status.field, 0) + 1
                elif kind == "admit":
                    if code == 0:
                        s = res.admit.sequence_id
                        if self.session.tables.has(s):  # not preempted later in the Step
                            self.live[s] = list(new or [])
                            write(kv, list(res.admit.block_table), tag, self.live[s], 0)
                    else:
                        assert code == EXHAUSTED, res.status
                        self.refused[res.status.field] = self.refused.get(res.status.field, 0) + 1
            # Reading K/V is GPU work of this step too: before its fence is reported (after it,
            # a preempted sequence's blocks may already belong to someone else).
            for s, tokens in self.live.items():
                check(kv, self.session.tables.blocks(s), tag, tokens, f"{self.who} {s}")
            self.session.complete(out.fence)  # the step's "GPU work" is done


def test_two_workers_under_pool_pressure_neither_deadlock_nor_corrupt(pdaemon: Daemon) -> None:
    target = pdaemon.endpoints["unix"]
    low = PressureWorker(target, "alice", "acme", seed=1, goal=0, max_live=6)
    # At most 2 sequences of at most 29 tokens (8 blocks): the high worker alone always fits.
    high = PressureWorker(target, "bob", "globex", seed=2, goal=12, max_live=2)
    low.start()
    time.sleep(0.3)  # the low worker fills the pool first
    high.start()
    high.join(timeout=120)
    low.stop_flag.set()
    low.join(timeout=30)
    assert not high.is_alive(), "the high-priority worker did not finish: deadlock?"
    assert not low.is_alive()
    for w in (high, low):
        if w.error is not None:
            raise w.error
    assert high.finished >= 12
    assert high.preempted == 0 and high.aborted == 0  # nobody outranks it
    assert low.preempted > 0  # the pressure was real: the daemon preempted the low worker
    assert pdaemon.metric('blockd_preemptions_total{tenant="acme"}') == low.preempted
    assert pdaemon.metric('blockd_preemptions_total{tenant="globex"}') == 0
