"""Every RPC's happy path against a real daemon, over its Unix socket and over TCP."""

import urllib.request

import grpc
import pytest
from daemon_proc import NS, Worker, admit, append, commit, fork, md, release
from grpc_health.v1 import health_pb2, health_pb2_grpc

from blockd.api.v1 import blockd_pb2 as pb


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_session_lifecycle_and_step(daemon, transport) -> None:  # type: ignore[no-untyped-def]
    w = Worker(daemon.stub(transport), "alice", "acme")
    assert w.att.epoch >= 1 and w.att.lease_ms == 10_000
    assert w.att.pool.num_blocks == 64 and w.att.pool.layout.block_size == 4
    assert w.att.pool.backend == pb.POOL_BACKEND_HOST_SHM
    assert w.att.pool.block_bytes == 2 * 2 * 4 * 2 * 8 * 2
    assert w.att.sharing_domain_kind == pb.SHARING_DOMAIN_KIND_PRIVATE

    base = 10 if transport == "unix" else 1000  # the daemon is shared: distinct prompts
    prompt = list(range(base, base + 9))
    r = w.step(admit(prompt, request_id="req-1"))
    assert [x.status.code for x in r.results] == [0]
    a = r.results[0].admit
    assert (a.request_id, a.num_tokens, a.num_cached_tokens, len(a.block_table)) == (
        "req-1", 9, 0, 3)
    seq = a.sequence_id
    # The worker computed the prompt in step 1; commit under step 2's fence after completing 1.
    r = w.step(commit(seq), append(seq, [19, 20, 21, 22]), completed=1)
    assert r.results[0].commit.num_blocks_committed == 2
    ap = r.results[1].append
    assert (ap.num_tokens, ap.delta.start_index, len(ap.delta.block_ids)) == (13, 3, 1)

    gbt = w.stub.GetBlockTable(pb.GetBlockTableRequest(session_id=w.sid, sequence_id=seq),
                               metadata=md("alice"))
    assert list(gbt.block_ids) == list(a.block_table) + list(ap.delta.block_ids)
    assert (gbt.num_tokens, gbt.block_size, gbt.epoch) == (13, 4, w.epoch)

    ins = w.stub.Inspect(pb.InspectRequest(session_id=w.sid, sequence_id=seq),
                         metadata=md("alice"))
    assert len(ins.positions) == 13
    for p in ins.positions:
        assert p.physical_block == gbt.block_ids[p.position // 4]
        assert p.slot == p.physical_block * 4 + p.position % 4
    assert [b.state for b in ins.blocks][:2] == [pb.BLOCK_STATE_COMMITTED] * 2

    # Fence 2 completes: the committed blocks become visible to Lookup and to a new admission.
    hb = w.stub.Heartbeat(pb.HeartbeatRequest(session_id=w.sid, epoch=w.epoch,
                                              completed_fence=2), metadata=md("alice"))
    assert hb.epoch == w.epoch and hb.lease_expires_unix_ms > 0
    lk = w.stub.Lookup(pb.LookupRequest(session_id=w.sid, epoch=w.epoch, namespace=NS,
                                        token_ids=prompt), metadata=md("alice"))
    assert (lk.num_cached_tokens, lk.num_cached_blocks) == (8, 2)
    r = w.step(admit(prompt + [99]), fork(seq, 2))
    hit = r.results[0].admit
    assert hit.num_cached_tokens == 8
    assert list(hit.block_table[:2]) == list(a.block_table[:2])
    children = list(r.results[1].fork.child_sequence_ids)
    assert len(children) == 2 and len(set(children + [seq])) == 3

    # Copy-on-write: the parent's last block is shared with both children.
    r = w.step(append(seq, [23]))
    assert len(r.copies) == 1 and r.copies[0].src_block == gbt.block_ids[3]

    pool = w.stub.Stats(pb.StatsRequest(), metadata=md("admin"))  # pool-wide: an admin's
    assert pool.prefix_hit_tokens_total >= 8
    st = w.stats()
    assert st.num_blocks == 64
    assert (st.blocks_free + st.blocks_writing + st.blocks_committed + st.blocks_pending
            + st.blocks_cached) == 64
    assert [t.tenant_id for t in st.tenants] == ["acme"]

    r = w.step(release(seq), release(children[0]), release(children[1]),
               release(hit.sequence_id))
    assert all(x.status.code == 0 for x in r.results)
    assert r.results[0].release.num_blocks_released == 4
    det = w.stub.Detach(pb.DetachRequest(session_id=w.sid), metadata=md("alice"))
    assert det.num_sequences_released == 0


def test_step_stream_answers_in_order(daemon) -> None:  # type: ignore[no-untyped-def]
    w = Worker(daemon.stub("unix"), "alice", "acme")
    seq = w.admit([1, 2, 3])

    def requests():  # type: ignore[no-untyped-def]
        for i in range(20):
            yield pb.StepRequest(session_id=w.sid, epoch=w.epoch, step_id=100 + i, fence=100 + i,
                                 completed_fence=99 + i if i else 0,
                                 operations=[append(seq.sequence_id, [i])])

    out = list(w.stub.StepStream(requests(), metadata=md("alice")))
    assert [r.step_id for r in out] == list(range(100, 120))
    assert [r.results[0].append.num_tokens for r in out] == list(range(4, 24))


def test_step_retry_is_answered_not_reapplied(daemon) -> None:  # type: ignore[no-untyped-def]
    w = Worker(daemon.stub("tcp"), "alice", "acme")
    seq = w.admit([1, 2, 3]).sequence_id
    req = pb.StepRequest(session_id=w.sid, epoch=w.epoch, step_id=50, fence=5,
                         operations=[append(seq, [4, 5])])
    first = w.stub.Step(req, metadata=md("alice"))
    again = w.stub.Step(req, metadata=md("alice"))
    assert first == again and first.results[0].append.num_tokens == 5
    t = w.stub.GetBlockTable(pb.GetBlockTableRequest(session_id=w.sid, sequence_id=seq),
                             metadata=md("alice"))
    assert t.num_tokens == 5


def test_health_reflection_and_metrics(daemon) -> None:  # type: ignore[no-untyped-def]
    for transport in ("unix", "tcp"):
        health = health_pb2_grpc.HealthStub(daemon.channel(transport))
        for service in ("", "blockd.v1.BlockdService"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=service))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    refl = reflection_pb2_grpc.ServerReflectionStub(daemon.channel("tcp"))
    out = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
        list_services="")])))
    names = {s.name for s in out[0].list_services_response.service}
    assert "blockd.v1.BlockdService" in names and "grpc.health.v1.Health" in names
    body = urllib.request.urlopen(daemon.metrics_url, timeout=5).read().decode()
    for name in ("blockd_blocks{state=\"free\"}", "blockd_prefix_cache_hit_tokens_total",
                 "blockd_step_duration_seconds_bucket",
                 "blockd_tenant_quota_blocks{tenant=\"acme\"}",
                 "blockd_build_info", "blockd_oldest_pending_fence_age_seconds",
                 "blockd_tail_waste_tokens", "blockd_allocation_failures_total{reason=\"quota\"}"):
        assert name in body, name


def test_watch_events_streams_stored_and_removed(daemon) -> None:  # type: ignore[no-untyped-def]
    admin = daemon.stub("unix")
    w = Worker(daemon.stub("unix"), "carol", "initech")  # a group tenant: token ids published
    seq = w.admit([7, 7, 7, 7, 8]).sequence_id
    w.step(commit(seq))
    w.stub.Heartbeat(pb.HeartbeatRequest(session_id=w.sid, epoch=w.epoch, completed_fence=1),
                     metadata=md("carol"))
    # Replay from the start of the buffer (the daemon is shared by this module's tests) and
    # find this test's block: no race with when the stream starts.
    calls = admin.WatchEvents(pb.WatchEventsRequest(since_sequence=1), metadata=md("admin"),
                              timeout=10)
    first = next(ev for ev in calls if ev.WhichOneof("event") == "block_stored"
                 and list(ev.block_stored.token_ids) == [7, 7, 7, 7])
    assert list(first.block_stored.token_ids) == [7, 7, 7, 7]
    assert len(first.block_stored.block_hashes[0]) == 16
    flushed = admin.FlushNamespace(pb.FlushNamespaceRequest(tenant_id="initech"),
                                   metadata=md("admin"))
    assert flushed.num_blocks_flushed == 1
    removed = next(ev for ev in calls if ev.WhichOneof("event") == "block_removed"
                   and ev.block_removed.block_hashes == first.block_stored.block_hashes)
    assert removed.sequence_number > first.sequence_number
    assert removed.block_removed.medium == "CPU"
    assert removed.block_removed.block_hashes == first.block_stored.block_hashes
    calls.cancel()
    with pytest.raises(grpc.RpcError):
        next(calls)


def test_append_batch_is_many_appends_in_one(daemon) -> None:  # type: ignore[no-untyped-def]
    w = Worker(daemon.stub("unix"), "alice", "acme")
    seqs = [w.admit([7000 + i, 1, 2]).sequence_id for i in range(5)]
    ids = seqs + ["no-such-seq"]
    r = w.step(pb.Operation(append_batch=pb.AppendBatchOp(
        sequence_ids=ids, num_tokens=[1, 1, 2, 1, 5, 1], token_ids=list(range(11)))))
    res = r.results[0]
    assert res.status.code == 0
    ab = res.append_batch
    assert list(ab.num_tokens) == [4, 4, 5, 4, 8, 0]
    assert [(d.index, d.delta.start_index, len(d.delta.block_ids)) for d in ab.deltas] == [
        (2, 1, 1), (4, 1, 1)]
    assert [(e.index, e.status.code, e.status.field) for e in ab.errors] == [
        (5, 5, "operations[0].append_batch.sequence_ids[5]")]
    for s, n in zip(seqs, [4, 4, 5, 4, 8], strict=True):
        t = w.stub.GetBlockTable(pb.GetBlockTableRequest(session_id=w.sid, sequence_id=s),
                                 metadata=md("alice"))
        assert t.num_tokens == n and len(t.block_ids) == -(-n // 4)
    # Counts that do not add up to the tokens: the whole op fails, nothing applied.
    r = w.step(pb.Operation(append_batch=pb.AppendBatchOp(sequence_ids=seqs, token_ids=[1])))
    assert r.results[0].status.code == 3
    assert r.results[0].status.field == "operations[0].append_batch.token_ids"
    for s in seqs:
        w.step(pb.Operation(release=pb.ReleaseOp(sequence_id=s)))
