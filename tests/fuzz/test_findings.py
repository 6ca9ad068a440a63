"""The daemon bugs the fuzz suite found, one minimal reproduction each (docs/fuzzing.md,
"Findings"). All were fixed (F1-F4 in 6702f47, F5 in 2886a57, F6 in 86712ee); they stay as
regression tests.
"""

from __future__ import annotations

import re
import string

import grpc
import pytest
from daemon_proc import NS, Worker, admit, md, start
from fuzz_support import DAEMON_EXTRA, NUM_BLOCKS, UNPARSEABLE

from blockd.api.v1 import blockd_pb2 as pb

S = grpc.StatusCode


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):  # type: ignore[no-untyped-def]
    """The fuzz configuration: 64 blocks, max_message_bytes 256 KiB."""
    d = start(tmp_path_factory.mktemp("findings"), num_blocks=NUM_BLOCKS, extra=DAEMON_EXTRA)
    yield d
    d.stop()


def admin_stats(stub) -> pb.StatsResponse:  # type: ignore[no-untyped-def]
    return stub.Stats(pb.StatsRequest(), metadata=md("admin"))


# -- F1 ----------------------------------------------------------------------------------------

def test_stepstream_unparseable_message_is_not_internal(daemon) -> None:  # type: ignore[no-untyped-def]
    """F1. A StepStream message that does not parse (here: invalid UTF-8 in session_id) is the
    client's fault, but the handler's catch-all turned grpc's DecodeError into the daemon's own
    INTERNAL and logged "internal error in StepStream" with a traceback. The unary RPCs answer
    the same bytes with grpc's UNKNOWN (DecodeError) before any daemon code runs; the stream
    must end with INVALID_ARGUMENT (or at least grpc's answer), never INTERNAL."""
    w = Worker(daemon.stub(), "alice", "acme")
    ch = daemon.channel()
    good = pb.StepRequest(session_id=w.sid, epoch=w.epoch, step_id=1).SerializeToString()
    bad = b"\x0a\x02\xff\xfe"  # StepRequest.session_id = b"\xff\xfe"
    call = ch.stream_stream("/blockd.v1.BlockdService/StepStream")
    answers = []
    with pytest.raises(grpc.RpcError) as info:
        for resp in call(iter([good, bad]), metadata=md("alice"), timeout=10):
            answers.append(resp)
    assert len(answers) == 1  # the good message was answered
    code, details = info.value.code(), info.value.details() or ""
    assert code == S.INVALID_ARGUMENT or (code == S.UNKNOWN and details.startswith(UNPARSEABLE)), (
        code, details)
    assert "internal error in StepStream" not in daemon.log_text()


# -- F2 ----------------------------------------------------------------------------------------

def _overflowing_step(w: Worker, batches: int) -> pb.StepRequest:
    """An admit that succeeds, then append_batch ops over unknown one-letter ids: each entry is
    4 bytes of request (id and token) and ~75 bytes of answer (an IndexedStatus naming
    "operations[i].append_batch.sequence_ids[j]")."""
    w.step_id += 1
    ops = [admit([1, 2, 3], NS)]
    batch = pb.AppendBatchOp(sequence_ids=["x"] * 4096, token_ids=[0] * 4096)
    ops += [pb.Operation(append_batch=batch)] * batches
    return pb.StepRequest(session_id=w.sid, epoch=w.epoch, step_id=w.step_id, fence=0,
                          operations=ops)


def test_step_response_overflow_is_not_applied(daemon) -> None:  # type: ignore[no-untyped-def]
    """F2. A 16 KB Step whose answer exceeds max_message_bytes (256 KiB here) was applied (the
    admit allocated a sequence and a block), then grpc failed to send the answer and the worker
    got RESOURCE_EXHAUSTED "Sent message larger than max": a rejected request that changed the
    daemon, whose new sequence id the worker never learnt, and whose retry (same step_id)
    replayed the same oversized answer forever. Now: refused before anything is applied, and the
    worker can split the step under the same step_id."""
    w = Worker(daemon.stub(), "alice", "acme")
    req = _overflowing_step(w, 1)
    assert req.ByteSize() < 17_000
    before = admin_stats(w.stub)
    try:
        w.stub.Step(req, metadata=md("alice"), timeout=30)
    except grpc.RpcError as err:
        assert err.code() == S.RESOURCE_EXHAUSTED, err
        assert "larger than max" not in (err.details() or ""), "applied, answer lost"
        assert admin_stats(w.stub) == before, "applied, yet answered with an error"
        # Nothing was recorded under that step_id: the worker splits the step and goes on.
        split = pb.StepRequest()
        split.CopyFrom(req)
        del split.operations[1:]
        r = w.stub.Step(split, metadata=md("alice"), timeout=30)
        assert r.results[0].status.code == 0


def test_step_response_overflow_with_the_default_message_limit(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """F2 with the default configuration (max_message_bytes 16 MiB): a 1 MB Step (one admit, 64
    append_batch ops of 4096 unknown ids) was applied, and its ~19.8 MB answer replaced by
    RESOURCE_EXHAUSTED."""
    d = start(tmp_path / "default-limit", num_blocks=NUM_BLOCKS,
              extra={"server": {"check_invariants": False, "grace_seconds": 0.2}})
    try:
        opts = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]
        ch = grpc.insecure_channel(f"unix:{d.endpoints['unix']}", options=opts)
        from blockd.api.v1 import blockd_pb2_grpc as pb_grpc

        stub = pb_grpc.BlockdServiceStub(ch)
        w = Worker(stub, "alice", "acme")
        req = _overflowing_step(w, 64)
        assert req.ByteSize() < 1100 * 1000
        before = admin_stats(stub)
        try:
            stub.Step(req, metadata=md("alice"), timeout=60)
        except grpc.RpcError as err:
            assert err.code() == S.RESOURCE_EXHAUSTED, err
            assert admin_stats(stub) == before, "applied, yet answered with an error"
        ch.close()
    finally:
        d.stop()


# -- F3 ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("tenant_id", "t" * 129),       # NOT_FOUND today
    ("tenant_id", "t" * 20_000),    # the client sees RESOURCE_EXHAUSTED today (details echo it)
    ("model_id", "m" * 129),        # OK today
    ("lora_id", "€" * 43),          # 129 bytes; OK today
])
def test_flush_filter_over_128_bytes_is_invalid_argument(daemon, field, value) -> None:  # type: ignore[no-untyped-def]
    """F3. FlushNamespaceRequest documents every filter as 0..128 bytes, but the daemon did not
    check: an over-long model_id/model_revision/lora_id was accepted (OK, matches nothing), and an
    over-long unknown tenant_id was echoed whole into the NOT_FOUND details ("unknown tenant
    'ttt...'"); past ~8 KB the status no longer fit grpc's metadata limits and the client
    received RESOURCE_EXHAUSTED "received metadata size exceeds ... limit" instead of any status
    the daemon chose. Expected: INVALID_ARGUMENT naming the field."""
    stub = daemon.stub()
    with pytest.raises(grpc.RpcError) as info:
        stub.FlushNamespace(pb.FlushNamespaceRequest(**{field: value}), metadata=md("admin"),
                            timeout=10)
    assert info.value.code() == S.INVALID_ARGUMENT, (info.value.code(),
                                                     (info.value.details() or "")[:200])
    assert (info.value.details() or "").startswith(field)


# -- F4 ----------------------------------------------------------------------------------------

def test_minted_ids_carry_at_least_128_random_bits(daemon) -> None:  # type: ignore[no-untyped-def]
    """F4. The proto promises ids minted by the daemon are unguessable, "at least 128 random
    bits". Session ids are (secrets.token_urlsafe(18): 144 bits) but sequence ids, admitted or
    forked, were secrets.token_urlsafe(12): 16 base64url characters, at most 96 bits. Isolation
    leans on this: GetBlockTable/Inspect answer NOT_FOUND for an unknown sequence id but
    PERMISSION_DENIED for another session's, so the id's entropy is all that keeps another
    tenant from probing for live sequence ids."""
    w = Worker(daemon.stub(), "alice", "acme")
    seq = w.admit([5, 6, 7]).sequence_id
    child = w.step(pb.Operation(fork=pb.ForkOp(sequence_id=seq, num_children=1)),
                   fence=0).results[0].fork.child_sequence_ids[0]
    alphabet = set(string.ascii_letters + string.digits + "-_")
    for kind, ident in [("session", w.sid), ("sequence", seq), ("forked sequence", child)]:
        assert set(ident) <= alphabet and re.fullmatch(r"[\w-]+", ident)
        bits = 6 * len(ident)  # an upper bound on the randomness of a base64url string
        assert bits >= 128, f"{kind} id {ident!r} has at most {bits} random bits"


# -- F5 ----------------------------------------------------------------------------------------

def test_step_answer_bound_covers_echoed_request_ids(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """F5 (found while checking the F2 fix; fixed). The answer bound that guards a Step
    (``BlockdServicer._answer_bound``: 120 bytes per operation plus 5 per block) is not an upper
    bound: every AdmitResult echoes the admit's request_id (up to 128 bytes) next to the new
    22-character sequence id, ~165 bytes per admit. With max_message_bytes 256 KiB and a pool
    and quota that can hold the admits, a 239 KB Step of 1,650 one-token admits with 128-byte
    request_ids passed the bound (~207 KB), was applied (1,650 sequences), and its 275 KB answer
    was replaced by RESOURCE_EXHAUSTED "Sent message larger than max": F2 again. (Unreachable
    with the default 16 MiB limit: 4,096 admits answer at most ~0.7 MB.)"""
    import copy

    from daemon_proc import TENANTS

    tenants = copy.deepcopy(TENANTS)
    for t in tenants["tenants"]:
        t["quota_blocks"] = 4000
    d = start(tmp_path / "bound", num_blocks=4096, tenants=tenants,
              extra={"server": {"max_message_bytes": 256 * 1024, "grace_seconds": 0.2}})
    try:
        stub = d.stub()
        w = Worker(stub, "alice", "acme")
        ns = pb.CacheNamespace(model_id="m")
        ops = [pb.Operation(admit=pb.AdmitOp(request_id="r" * 128, namespace=ns,
                                             token_ids=[i % 7])) for i in range(1650)]
        req = pb.StepRequest(session_id=w.sid, epoch=w.epoch, step_id=1, operations=ops)
        assert req.ByteSize() < 256 * 1024
        before = admin_stats(stub)
        try:
            stub.Step(req, metadata=md("alice"), timeout=60)
        except grpc.RpcError as err:
            assert err.code() == S.RESOURCE_EXHAUSTED, err
            after = admin_stats(stub)
            assert after.num_sequences == before.num_sequences, (
                f"applied ({after.num_sequences} sequences), yet answered {err.details()!r}")
    finally:
        d.stop()


# -- F6 ----------------------------------------------------------------------------------------

def test_step_answer_bound_covers_scrubbed_blocks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """F6 (found while checking the F5 fix; fixed). The answer bound counted 5 bytes per block id
    an admit or append can return, but a block handed out after another tenant's use is listed
    twice: in the block table and in StepResponse.scrubbed_blocks. With 60,000 blocks of 2
    tokens (ids past 16,384 are 3-byte varints) and max_message_bytes 256 KiB, acme uses and
    releases 50,000 blocks; globex's 100 KB Step admitting 100,000 tokens passed the bound
    (~250 KB), was applied (a sequence holding 50,000 blocks), and its 267 KB answer (table and
    scrubbed list, ~133 KB each) was replaced by RESOURCE_EXHAUSTED "Sent message larger than
    max": F2 again. Needs small blocks (a request costs at least a byte per token) and a small
    max_message_bytes or a pool of millions of blocks."""
    import copy

    from daemon_proc import TENANTS

    tenants = copy.deepcopy(TENANTS)
    for t in tenants["tenants"]:
        t["quota_blocks"] = 60_000
    d = start(tmp_path / "scrub-bound", num_blocks=60_000, tenants=tenants,
              extra={"server": {"max_message_bytes": 256 * 1024, "grace_seconds": 0.2},
                     "pool": {"block_size": 2, "num_layers": 1, "num_kv_heads": 1,
                              "head_dim": 1}})
    try:
        stub = d.stub()
        layout = pb.KvLayout(block_size=2, num_layers=1, num_kv_heads=1, head_dim=1,
                             dtype=pb.KV_DTYPE_FLOAT16,
                             kv_order=pb.KV_ORDER_BLOCK_TOKEN_HEAD_DIM, tp_size=1)
        ns = pb.CacheNamespace(model_id="m")

        def admit_op(n: int) -> pb.Operation:
            return pb.Operation(admit=pb.AdmitOp(namespace=ns, token_ids=[1] * n,
                                                 disable_prefix_cache=True))

        a = stub.Attach(pb.AttachRequest(tenant_id="acme", layout=layout), metadata=md("alice"))
        b = stub.Attach(pb.AttachRequest(tenant_id="globex", layout=layout), metadata=md("bob"))
        # acme fills the pool (in Steps small enough to be answered), then releases it all:
        # every block bob gets next was acme's and is scrubbed.
        seqs = []
        for step_id in range(1, 5):
            r = stub.Step(pb.StepRequest(session_id=a.session_id, epoch=a.epoch,
                                         step_id=step_id, operations=[admit_op(25_000)]),
                          metadata=md("alice"))
            seqs.append(r.results[0].admit.sequence_id)
        stub.Step(pb.StepRequest(session_id=a.session_id, epoch=a.epoch, step_id=5,
                                 operations=[pb.Operation(release=pb.ReleaseOp(sequence_id=s))
                                             for s in seqs]),
                  metadata=md("alice"))
        req = pb.StepRequest(session_id=b.session_id, epoch=b.epoch, step_id=1,
                             operations=[admit_op(100_000)])
        before = admin_stats(stub)
        try:
            stub.Step(req, metadata=md("bob"), timeout=60)
        except grpc.RpcError as err:
            assert err.code() == S.RESOURCE_EXHAUSTED, err
            after = admin_stats(stub)
            assert after.num_sequences == before.num_sequences, (
                f"applied ({after.num_sequences} sequences), yet answered {err.details()!r}")
    finally:
        d.stop()
