"""Faults around a Step: deadlines that expire and connections that drop mid-call.

A Step carries an idempotency key (step_id). Whatever the client saw, re-sending the same
step_id returns the daemon's record of that Step: it is applied exactly once or not at all.
"""

import time

import grpc
from daemon_proc import Worker, append, md

from blockd.api.v1 import blockd_pb2 as pb


def _tokens(w: Worker, seq: str) -> int:
    return w.stub.GetBlockTable(pb.GetBlockTableRequest(session_id=w.sid, sequence_id=seq),
                                metadata=md(w.who)).num_tokens


def test_a_step_whose_deadline_expired_is_applied_once(daemon) -> None:  # type: ignore[no-untyped-def]
    w = Worker(daemon.stub("unix"), "carol", "initech")
    seq = w.admit([1, 2, 3]).sequence_id
    req = pb.StepRequest(session_id=w.sid, epoch=w.epoch, step_id=900, fence=900,
                         operations=[append(seq, [4]), pb.Operation(
                             append_batch=pb.AppendBatchOp(sequence_ids=[seq] * 20,
                                                           token_ids=[5] * 20))])
    for _attempt in range(20):
        # A deadline shorter than a round trip: the client gives up; the daemon may or may
        # not have applied the Step.
        try:
            w.stub.Step(req, metadata=md("carol"), timeout=0.0002)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        time.sleep(0.05)
        assert _tokens(w, seq) in (3, 24)  # all of it or none of it, never half
        if _tokens(w, seq) == 24:
            break
    # The retry with the same step_id is answered from the record if it was applied, or
    # applied now: either way the sequence ends up extended exactly once.
    resp = w.stub.Step(req, metadata=md("carol"), timeout=30)
    assert [r.status.code for r in resp.results] == [0, 0]
    assert _tokens(w, seq) == 24
    again = w.stub.Step(req, metadata=md("carol"), timeout=30)
    assert again == resp and _tokens(w, seq) == 24
    w.step_id = w.fence = req.step_id
    w.step(pb.Operation(release=pb.ReleaseOp(sequence_id=seq)))


def test_a_dropped_stream_loses_nothing_and_the_retry_is_exact(daemon) -> None:  # type: ignore[no-untyped-def]
    w = Worker(daemon.stub("unix"), "dave", "umbrella")
    seq = w.admit([1, 2, 3]).sequence_id
    req = pb.StepRequest(session_id=w.sid, epoch=w.epoch, step_id=950, fence=950,
                         operations=[append(seq, [4, 5])])
    stream = w.stub.StepStream(iter([req]), metadata=md("dave"))
    first = next(stream)
    stream.cancel()  # the connection "drops" after the daemon answered
    retry = w.stub.Step(req, metadata=md("dave"))
    assert retry == first and _tokens(w, seq) == 5
    w.step_id = w.fence = req.step_id
    w.step(pb.Operation(release=pb.ReleaseOp(sequence_id=seq)))
