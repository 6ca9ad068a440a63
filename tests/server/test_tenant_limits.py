"""Per-tenant limits against a real daemon process (issue 15's finding: a tenant with an 8-block
quota forked 320,000 sequences in 3.4 s and the daemon was OOM-killed, and every restart was
OOM-killed again replaying the journal).

A fork flood stops at the tenant's ``max_sequences`` with RESOURCE_EXHAUSTED naming the limit,
another tenant is still served, the daemon's resident memory stays bounded, and a ``kill -9``
plus journal replay of the refused flood restores exactly the admitted sequences without
growing either (refusals are never applied, so never replayed).
"""

from __future__ import annotations

import copy
import os
import signal
from pathlib import Path

import psutil
from daemon_proc import TENANTS, Worker, fork, md, start

from blockd.api.v1 import blockd_pb2 as pb

LIMIT = 200
#: Fork operations per Step (64 children each, the most one fork may create; within
#: server.max_work_per_call).
FORKS_PER_STEP = 16
#: Steps of the flood after the limit was reached: 64 x 16 x 80 = 81,920 refused children.
FLOOD_STEPS = 80
#: Resident memory the daemon may gain over the whole flood. 81,920 sequences would cost far more
#: (a few hundred bytes each at the very least, plus journal records); a refused fork costs none.
RSS_SLACK = 48 << 20


#: The flood is refused by the sequence limit, not by the work budget (tests/server/
#: test_fairness.py covers that one): budgets off.
EXTRA = {"tenants": {"work_units_per_second": 0}}


def limited_tenants() -> dict[str, object]:
    tenants = copy.deepcopy(TENANTS)
    for t in tenants["tenants"]:  # type: ignore[index]
        if t["id"] == "acme":
            t["max_sequences"] = LIMIT
    return tenants


def rss(pid: int) -> int:
    return int(psutil.Process(pid).memory_info().rss)


def stats(d) -> pb.StatsResponse:  # type: ignore[no-untyped-def]
    return d.stub().Stats(pb.StatsRequest(), metadata=md("admin"))


def test_a_fork_flood_stops_at_the_limit_and_memory_stays_bounded(tmp_path: Path) -> None:
    state = tmp_path / "state"
    extra = {**EXTRA, "state": {"dir": str(state)}}
    d = start(tmp_path / "d", tenants=limited_tenants(), extra=extra)
    try:
        a = Worker(d.stub(), "alice", "acme")
        parent = a.admit([1, 2, 3, 4, 5])
        # Fill up to the limit: the parent plus LIMIT - 1 children, in forks of at most 64.
        made = 1
        while made < LIMIT:
            n = min(64, LIMIT - made)
            r = a.step(fork(parent.sequence_id, n), fence=0).results[0]
            assert r.status.code == 0, r.status
            made += n
        assert stats(d).num_sequences == LIMIT
        before = rss(d.proc.pid)
        refused = 0
        for _ in range(FLOOD_STEPS):
            resp = a.step(*[fork(parent.sequence_id, 64) for _ in range(FORKS_PER_STEP)],
                          fence=0)
            for r in resp.results:
                assert r.status.code == 8, r.status  # RESOURCE_EXHAUSTED
                assert r.status.field == "max_sequences", r.status
                refused += 1
        assert refused == FLOOD_STEPS * FORKS_PER_STEP
        assert stats(d).num_sequences == LIMIT  # nothing of the flood was applied
        grown = rss(d.proc.pid) - before
        assert grown < RSS_SLACK, f"the daemon grew {grown >> 20} MiB under a refused flood"
        # Another tenant is unaffected by acme's limit.
        b = Worker(d.stub(), "bob", "globex")
        child = b.step(fork(b.admit([9, 9, 9]).sequence_id, 64), fence=0).results[0]
        assert child.status.code == 0 and len(child.fork.child_sequence_ids) == 64
        # kill -9, restart on the same state: the replay restores the admitted sequences only.
        os.kill(d.proc.pid, signal.SIGKILL)
        d.proc.wait()
        d.stop()
        d = start(tmp_path / "d", tenants=limited_tenants(), extra=extra)
        after = stats(d)
        assert after.num_sequences == LIMIT + 1 + 64
        assert rss(d.proc.pid) < before + RSS_SLACK, "replaying a refused flood grew memory"
        # The limit still holds after the restart.
        a2 = Worker(d.stub(), "alice", "acme")
        r = a2.step(pb.Operation(admit=pb.AdmitOp(namespace=pb.CacheNamespace(model_id="m"),
                                                  token_ids=[7])), fence=0).results[0]
        assert r.status.code == 8 and r.status.field == "max_sequences", r.status
    finally:
        d.stop()
