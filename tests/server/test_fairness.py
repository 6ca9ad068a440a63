"""Fairness (issue 15): no call holds the shared loop for long, each tenant spends its own work
budget, and leases are judged against the daemon's own progress. Real daemons, real sockets;
no timed asserts (the benchmark, bench/fairness.py, measures latency)."""

from __future__ import annotations

import copy
import dataclasses
import signal
import time

import grpc
import pytest
from daemon_proc import NS, TENANTS, Worker, admit, commit, md, start

from blockd.api.v1 import blockd_pb2 as pb
from blockd.config import Config, PoolConfig
from blockd.core.errors import ResourceExhausted
from blockd.runtime import startup as runtime
from blockd.runtime.budgets import OverBudget, WorkBudgets

S = grpc.StatusCode


def lookup(w: Worker, tokens: list[int]) -> pb.LookupResponse:
    return w.stub.Lookup(pb.LookupRequest(session_id=w.sid, epoch=w.epoch, namespace=NS,
                                          token_ids=tokens), metadata=md(w.who))


def usage(w: Worker, tenant: str) -> list[tuple[str, int]]:
    """What an admin sees of a tenant: its usage and its live sequences."""
    st = w.stub.Stats(pb.StatsRequest(), metadata=md("admin"))
    seqs = w.stub.ListSequences(pb.ListSequencesRequest(tenant_id=tenant), metadata=md("admin"))
    return [(str(u), 0) for u in st.tenants if u.tenant_id == tenant] + [
        (s.sequence_id, s.num_tokens) for s in seqs.sequences]


def refused(fn, code: grpc.StatusCode) -> grpc.RpcError:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as err:
        fn()
    assert err.value.code() == code, err.value.details()
    return err.value


@pytest.fixture(scope="module")
def budgeted(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    tenants = copy.deepcopy(TENANTS)
    for t in tenants["tenants"]:
        t["quota_blocks"] = 250
    d = start(tmp_path_factory.mktemp("fair"), num_blocks=256, tenants=tenants,
              extra={"server": {"max_work_per_call": 1100},
                     "tenants": {"work_units_per_second": 1000, "work_units_burst": 20_000}})
    yield d
    d.stop()


def test_step_over_the_work_bound_is_refused_and_changes_nothing(budgeted) -> None:  # type: ignore[no-untyped-def]
    a = Worker(budgeted.stub(), "alice", "acme")
    a.admit(list(range(1, 9)))
    before = usage(a, "acme")
    # Two admits of 450 tokens: 2 x (256 + 450) = 1412 units, over the bound of 1100.
    r = pb.StepRequest(session_id=a.sid, epoch=a.epoch, step_id=a.step_id + 1,
                       operations=[admit(list(range(450))), admit(list(range(450, 900)))])
    err = refused(lambda: a.stub.Step(r, metadata=md("alice")), S.RESOURCE_EXHAUSTED)
    assert err.details().startswith("operations: work:"), err.details()
    assert "1412 work units" in err.details() and "server.max_work_per_call (1100)" in \
        err.details()
    assert usage(a, "acme") == before
    # Nothing was applied, not even the step id: the same step_id with a smaller Step is new.
    del r.operations[1]
    resp = a.stub.Step(r, metadata=md("alice"))
    assert resp.results[0].status.code == 0 and resp.results[0].admit.num_tokens == 450
    assert len(usage(a, "acme")) == len(before) + 1


def test_a_huge_lookup_is_cut_at_the_longest_possible_hit(budgeted) -> None:  # type: ignore[no-untyped-def]
    a = Worker(budgeted.stub(), "alice", "acme")
    prompt = list(range(5000, 5017))  # 4 full blocks and one token
    seq = a.admit(prompt).sequence_id
    a.step(commit(seq), fence=1)
    a.stub.Heartbeat(pb.HeartbeatRequest(session_id=a.sid, epoch=a.epoch, completed_fence=1),
                     metadata=md("alice"))
    # 100,000 tokens would cost 100,000 units (over the bound of 1,100), but no hit can be longer
    # than the pool (256 blocks of 4): only 1,025 tokens are looked at, and the answer is exact.
    lk = lookup(a, prompt[:16] + list(range(100_000)))
    assert (lk.num_cached_tokens, lk.num_cached_blocks) == (16, 4)
    assert lookup(a, prompt[:16] + [1]).num_cached_tokens == 16


def test_tenant_over_its_budget_is_refused_while_another_is_served(budgeted) -> None:  # type: ignore[no-untyped-def]
    b = Worker(budgeted.stub(), "bob", "globex")
    a = Worker(budgeted.stub(), "alice", "acme")
    for _ in range(60):  # 1,025 units each (cut at the pool), from a bucket of 20,000
        try:
            lookup(b, list(range(5000)))
        except grpc.RpcError as err:
            assert err.code() == S.RESOURCE_EXHAUSTED, err.details()
            assert err.details().startswith("rate: tenant 'globex' is over its work budget")
            assert "tenants.work_units_per_second=1000" in err.details()
            hint = dict(err.trailing_metadata())["retry-after-ms"]
            assert int(hint) >= 1 and f"retry after {hint} ms" in err.details()
            break
    else:
        pytest.fail("globex was never refused for rate")
    before = usage(a, "globex")
    step = pb.StepRequest(session_id=b.sid, epoch=b.epoch, step_id=1,  # 4 x 266 = 1064 units
                          operations=[admit(list(range(i, i + 10))) for i in range(4)])
    err = refused(lambda: b.stub.Step(step, metadata=md("bob")), S.RESOURCE_EXHAUSTED)
    assert err.details().startswith("rate:")
    assert usage(a, "globex") == before
    # The other tenant is not affected: its own bucket pays for its calls.
    assert lookup(a, list(range(5000))).num_cached_tokens == 0
    assert a.admit(list(range(40))).num_tokens == 40
    # After the hint, the very same Step goes through (nothing of it was applied before).
    time.sleep(int(dict(err.trailing_metadata())["retry-after-ms"]) / 1000 + 0.05)
    resp = b.stub.Step(step, metadata=md("bob"))
    assert [r.status.code for r in resp.results] == [0] * 4
    assert len(usage(a, "globex")) == len(before) + 4
    assert budgeted.metric('blockd_rate_limited_total{tenant="globex"}') >= 2
    assert budgeted.metric('blockd_rate_limited_total{tenant="acme"}') == 0


def test_a_daemon_stall_reaps_no_worker_that_kept_heartbeating(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with start(tmp_path, lease_ms=1000) as d:
        a = Worker(d.stub(), "alice", "acme", lease_ms=1000)
        seq_a = a.admit(list(range(1, 10))).sequence_id
        b = Worker(d.stub(), "bob", "globex", lease_ms=1000)
        seq_b = b.admit(list(range(1, 10))).sequence_id  # bob stops calling here
        table = list(a.stub.GetBlockTable(pb.GetBlockTableRequest(
            session_id=a.sid, sequence_id=seq_a), metadata=md("alice")).block_ids)

        def beat() -> pb.HeartbeatResponse:
            return a.stub.Heartbeat(pb.HeartbeatRequest(session_id=a.sid, epoch=a.epoch),
                                    metadata=md("alice"), timeout=10)

        beat()
        d.signal(signal.SIGSTOP)  # the daemon stalls for 2.5 leases
        try:
            time.sleep(2.5)
        finally:
            d.signal(signal.SIGCONT)
        beat()  # alice heartbeated until the stall: her session survived it
        got = a.stub.GetBlockTable(pb.GetBlockTableRequest(session_id=a.sid, sequence_id=seq_a),
                                   metadata=md("alice"))
        assert list(got.block_ids) == table
        # bob, who stopped calling before the stall, is reaped one lease of daemon time later.
        deadline = time.monotonic() + 15
        while True:
            beat()
            live = d.stub().ListSequences(pb.ListSequencesRequest(), metadata=md("admin"))
            ids = {s.sequence_id for s in live.sequences}
            assert seq_a in ids
            if seq_b not in ids:
                break
            assert time.monotonic() < deadline, "bob was never reaped"
            time.sleep(0.2)
        err = refused(lambda: b.stub.Heartbeat(pb.HeartbeatRequest(session_id=b.sid,
                                                                  epoch=b.epoch),
                                               metadata=md("bob")), S.NOT_FOUND)
        assert "session_id" in err.details()
        assert "the daemon stalled" in d.log_text()


def test_a_lookup_over_the_bound_even_when_cut_is_refused(tmp_path) -> None:
    """A pool so large that its longest possible hit is over the bound (in process)."""
    base = Config()
    cfg = dataclasses.replace(
        base, pool=PoolConfig(num_blocks=4096, block_size=16),
        server=dataclasses.replace(base.server, unix_socket="", handle_socket="",
                                   tcp_address="", max_work_per_call=10_000))
    d = runtime.start(cfg)
    try:
        p = d.sessions.authenticate(())
        layout = pb.KvLayout(block_size=16, num_layers=4, num_kv_heads=4, head_dim=64,
                             dtype=pb.KV_DTYPE_FLOAT16,
                             kv_order=pb.KV_ORDER_BLOCK_TOKEN_HEAD_DIM, tp_size=1)
        att = d.attach(p, pb.AttachRequest(tenant_id="default", layout=layout))
        req = pb.LookupRequest(session_id=att.session_id, epoch=att.epoch, namespace=NS,
                               token_ids=range(20_000))
        with pytest.raises(ResourceExhausted) as err:
            d.lookup(p, req)
        assert (err.value.field, err.value.reason) == ("token_ids", "work")
        assert "20000 work units" in err.value.message
        del req.token_ids[10_000:]
        assert d.lookup(p, req).num_cached_tokens == 0
    finally:
        d.close()


def test_work_budget_bucket() -> None:
    now = [0.0]
    b = WorkBudgets(rate=100, burst=500, clock=lambda: now[0])
    b.charge("t", 400)
    with pytest.raises(OverBudget) as err:
        b.charge("t", 200)  # 100 left: 100 more units take 1 s
    assert err.value.reason == "rate" and 1000 <= err.value.retry_after_ms <= 1002
    b.charge("u", 500)  # another tenant's bucket is its own
    now[0] = 1.0
    b.charge("t", 200)  # refilled by 100: the refused call took nothing
    now[0] = 100.0
    b.charge("t", 10_000)  # above the burst: needs (and empties) a full bucket
    with pytest.raises(OverBudget):
        b.charge("t", 1)
    assert b.refused == {"t": 2}
    assert not WorkBudgets(rate=0, burst=1).enabled
    WorkBudgets(rate=0, burst=1).charge("t", 10**9)
