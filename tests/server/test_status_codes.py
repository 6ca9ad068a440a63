"""Every status code the daemon returns, each checked for its status, the field it names, that
Stats are unchanged afterwards (the daemon checks its invariants after every call), and that the
daemon keeps serving."""

from collections.abc import Callable

import grpc
import pytest
from daemon_proc import LAYOUT, Worker, admit, append, attach, fork, md, release

from blockd.api.v1 import blockd_pb2 as pb


@pytest.fixture(scope="module")
def world(daemon):  # type: ignore[no-untyped-def]
    """Two workers with live, committed and cached blocks."""
    a = Worker(daemon.stub("unix"), "alice", "acme")
    b = Worker(daemon.stub("tcp"), "bob", "globex")
    seq_a = a.admit([1, 2, 3, 4, 5, 6]).sequence_id
    a.step(pb.Operation(commit=pb.CommitOp(sequence_id=seq_a)))
    a.step(append(seq_a, [7]), completed=1)
    seq_b = b.admit([9, 9, 9, 9, 9]).sequence_id
    return {"a": a, "b": b, "seq_a": seq_a, "seq_b": seq_b}


def stats_of(w: Worker) -> pb.StatsResponse:
    s = w.stub.Stats(pb.StatsRequest(), metadata=md("admin"))
    return s


def expect(code: grpc.StatusCode, field: str, call: Callable[[], object], w: Worker) -> None:
    before = stats_of(w)
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, info.value.details()
    assert info.value.details().startswith(field), info.value.details()
    assert stats_of(w) == before
    # Still serving, and still consistent: the daemon checks its invariants after every call.
    assert w.stub.Stats(pb.StatsRequest(), metadata=md(w.who)).num_blocks == 64


def req(w: Worker, *ops: pb.Operation, **kw: object) -> pb.StepRequest:
    fields = {"session_id": w.sid, "epoch": w.epoch, "step_id": 10_000 + w.step_id, "fence": 0}
    fields.update(kw)
    return pb.StepRequest(operations=list(ops), **fields)


S = grpc.StatusCode


def test_unauthenticated(world) -> None:  # type: ignore[no-untyped-def]
    a = world["a"]
    for metadata in ((), (("authorization", "Bearer nope"),), (("authorization", "Basic x"),)):
        expect(S.UNAUTHENTICATED, "authorization",
               lambda m=metadata: a.stub.Step(req(a), metadata=m), a)
        expect(S.UNAUTHENTICATED, "authorization",
               lambda m=metadata: a.stub.Attach(pb.AttachRequest(tenant_id="acme",
                                                                 layout=LAYOUT), metadata=m), a)
        expect(S.UNAUTHENTICATED, "authorization",
               lambda m=metadata: a.stub.Stats(pb.StatsRequest(), metadata=m), a)


def test_permission_denied(world) -> None:  # type: ignore[no-untyped-def]
    a, b = world["a"], world["b"]
    # bob may not act for acme
    expect(S.PERMISSION_DENIED, "tenant_id", lambda: attach(b.stub, "bob", "acme"), a)
    # bob may not use alice's session
    expect(S.PERMISSION_DENIED, "session_id",
           lambda: b.stub.Step(req(a), metadata=md("bob")), a)
    expect(S.PERMISSION_DENIED, "session_id",
           lambda: b.stub.Inspect(pb.InspectRequest(session_id=a.sid,
                                                    sequence_id=world["seq_a"]),
                                  metadata=md("bob")), a)
    # bob's own session, alice's sequence: another tenant's object
    expect(S.PERMISSION_DENIED, "sequence_id",
           lambda: b.stub.GetBlockTable(pb.GetBlockTableRequest(
               session_id=b.sid, sequence_id=world["seq_a"]), metadata=md("bob")), a)
    expect(S.PERMISSION_DENIED, "sequence_id",
           lambda: b.stub.Inspect(pb.InspectRequest(session_id=b.sid,
                                                    sequence_id=world["seq_a"]),
                                  metadata=md("bob")), a)
    # flushes need rights
    expect(S.PERMISSION_DENIED, "tenant_id",
           lambda: b.stub.FlushNamespace(pb.FlushNamespaceRequest(model_id="tiny"),
                                         metadata=md("bob")), a)
    expect(S.PERMISSION_DENIED, "tenant_id",
           lambda: b.stub.FlushNamespace(pb.FlushNamespaceRequest(tenant_id="acme"),
                                         metadata=md("bob")), a)
    # WatchEvents: bob may watch his own tenants' events; a credential acting for no tenant is
    # refused (tests/server/test_kv_events.py).


def test_not_found(world) -> None:  # type: ignore[no-untyped-def]
    a = world["a"]
    expect(S.NOT_FOUND, "session_id",
           lambda: a.stub.Step(req(a, session_id="no-such-session"), metadata=md("alice")), a)
    expect(S.NOT_FOUND, "session_id",
           lambda: a.stub.Detach(pb.DetachRequest(session_id="gone"), metadata=md("alice")), a)
    expect(S.NOT_FOUND, "sequence_id",
           lambda: a.stub.GetBlockTable(pb.GetBlockTableRequest(session_id=a.sid,
                                                                sequence_id="nope"),
                                        metadata=md("alice")), a)


def test_invalid_argument(world) -> None:  # type: ignore[no-untyped-def]
    a = world["a"]
    bad_layout = pb.KvLayout(block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)
    expect(S.INVALID_ARGUMENT, "layout.dtype",
           lambda: a.stub.Attach(pb.AttachRequest(tenant_id="acme", layout=bad_layout),
                                 metadata=md("alice")), a)
    expect(S.INVALID_ARGUMENT, "layout",
           lambda: a.stub.Attach(pb.AttachRequest(tenant_id="acme"), metadata=md("alice")), a)
    expect(S.INVALID_ARGUMENT, "tenant_id",
           lambda: a.stub.Attach(pb.AttachRequest(tenant_id="x" * 200, layout=LAYOUT),
                                 metadata=md("alice")), a)
    expect(S.INVALID_ARGUMENT, "step_id",
           lambda: a.stub.Step(req(a, step_id=0), metadata=md("alice")), a)
    expect(S.INVALID_ARGUMENT, "fence",
           lambda: a.stub.Step(req(a, fence=1), metadata=md("alice")), a)  # already complete
    expect(S.INVALID_ARGUMENT, "completed_fence",
           lambda: a.stub.Step(req(a, completed_fence=999), metadata=md("alice")), a)
    expect(S.INVALID_ARGUMENT, "operations",
           lambda: a.stub.Step(req(a, *[release("x")] * 4097), metadata=md("alice")), a)
    expect(S.INVALID_ARGUMENT, "max_positions",
           lambda: a.stub.Inspect(pb.InspectRequest(session_id=a.sid, sequence_id=world["seq_a"],
                                                    max_positions=70000),
                                  metadata=md("alice")), a)
    expect(S.INVALID_ARGUMENT, "namespace.model_id",
           lambda: a.stub.Lookup(pb.LookupRequest(session_id=a.sid, epoch=a.epoch,
                                                  namespace=pb.CacheNamespace(),
                                                  token_ids=[1]), metadata=md("alice")), a)
    expect(S.INVALID_ARGUMENT, "filter",
           lambda: a.stub.FlushNamespace(pb.FlushNamespaceRequest(), metadata=md("admin")), a)


def test_failed_precondition(world) -> None:  # type: ignore[no-untyped-def]
    a = world["a"]
    wrong = pb.KvLayout()
    wrong.CopyFrom(LAYOUT)
    wrong.head_dim = 16
    expect(S.FAILED_PRECONDITION, "layout.head_dim",
           lambda: a.stub.Attach(pb.AttachRequest(tenant_id="acme", layout=wrong),
                                 metadata=md("alice")), a)
    wrong.CopyFrom(LAYOUT)
    wrong.dtype = pb.KV_DTYPE_BFLOAT16
    expect(S.FAILED_PRECONDITION, "layout.dtype",
           lambda: a.stub.Attach(pb.AttachRequest(tenant_id="acme", layout=wrong),
                                 metadata=md("alice")), a)
    expect(S.FAILED_PRECONDITION, "epoch",
           lambda: a.stub.Step(req(a, epoch=a.epoch + 1), metadata=md("alice")), a)
    expect(S.FAILED_PRECONDITION, "epoch",
           lambda: a.stub.Heartbeat(pb.HeartbeatRequest(session_id=a.sid, epoch=1),
                                    metadata=md("alice")), a)
    expect(S.FAILED_PRECONDITION, "step_id",
           lambda: a.stub.Step(req(a, step_id=1), metadata=md("alice")), a)


def test_per_operation_errors_leave_the_others_applied(world) -> None:  # type: ignore[no-untyped-def]
    a = world["a"]
    before = stats_of(a)
    a.step_id += 1
    r = a.stub.Step(pb.StepRequest(
        session_id=a.sid, epoch=a.epoch, step_id=a.step_id, fence=0,
        operations=[append("missing", [1]), admit([5, 5, 5]),
                    fork(world["seq_a"], 0), admit([]), admit([1, 2], ns=pb.CacheNamespace(
                        model_id="m", cache_salt=b"s" * 65)),
                    pb.Operation(), append(world["seq_b"], [1])]), metadata=md("alice"))
    codes = [x.status.code for x in r.results]
    assert codes == [5, 0, 3, 3, 3, 3, 7]
    assert [x.status.field for x in r.results] == [
        "operations[0].append.sequence_id", "", "operations[2].fork.num_children",
        "operations[3].admit.token_ids", "operations[4].admit.namespace.cache_salt",
        "operations[5].op", "operations[6].append.sequence_id"]
    after = stats_of(a)
    assert after.num_sequences == before.num_sequences + 1  # only the good admit applied
    a.step(release(r.results[1].admit.sequence_id))


def test_resource_exhausted_for_one_tenant_while_the_other_continues(daemon) -> None:  # type: ignore[no-untyped-def]
    a = Worker(daemon.stub("unix"), "alice", "acme")
    b = Worker(daemon.stub("unix"), "bob", "globex")
    # acme's quota is 40 blocks of 4 tokens.
    big = a.step(admit(list(range(2000, 2000 + 4 * 30)), disable_prefix_cache=True))
    assert big.results[0].status.code == 0
    before = stats_of(a)
    r = a.step(admit(list(range(3000, 3000 + 4 * 20)), disable_prefix_cache=True))
    assert r.results[0].status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert r.results[0].status.field == "quota"
    assert stats_of(a) == before
    ok = b.step(admit(list(range(4000, 4000 + 4 * 10))))
    assert ok.results[0].status.code == 0
    a.step(release(big.results[0].admit.sequence_id))
    b.step(release(ok.results[0].admit.sequence_id))


def test_unavailable_while_draining(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """After SIGTERM, new sessions are refused with UNAVAILABLE until the server stops."""
    import signal
    import time

    from daemon_proc import start

    d = start(tmp_path / "drain", extra={"server": {"grace_seconds": 3.0}})
    try:
        stub = d.stub("tcp")
        w = Worker(stub, "alice", "acme")
        # Hold an open stream so the server has an in-flight call during the grace period.
        calls = stub.WatchEvents(pb.WatchEventsRequest(), metadata=md("admin"))
        d.signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        code = None
        while time.monotonic() < deadline:
            try:
                attach(stub, "alice", "acme")
            except grpc.RpcError as err:
                code = err.code()
                if code == S.UNAVAILABLE:
                    break
            time.sleep(0.05)
        assert code == S.UNAVAILABLE
        calls.cancel()
        del w
    finally:
        assert d.stop() == 0
