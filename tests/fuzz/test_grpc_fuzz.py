"""Malformed and adversarial requests to every RPC of a real daemon.

One daemon subprocess for the module (``server.check_invariants: true``: the daemon asserts all
of its invariants after every call and answers INTERNAL if one breaks; a 64-block pool;
``max_message_bytes`` 256 KiB). Requests come from ``strategies`` (built from the proto
descriptors) with ids from the live pool of real sessions and sequences: the caller's own,
another session's, another tenant's, released and detached ones, mangled and random ones.
Credentials: none, malformed, unknown, the session's owner, another tenant's worker, admin.

After every request (``exchange``): the status is documented for that RPC (never UNKNOWN, never
an INTERNAL from the daemon), a bad credential always gets UNAUTHENTICATED, a caller never
succeeds on another worker's session or sequence, an error left the admin's ``Stats``
unchanged (and so did a Step whose every operation failed), OK answers are well formed, and the
daemon still answers a health check. Inputs are counted (see conftest.py).

Example counts follow the hypothesis profile: ``ci`` (``make test``) runs 60 per test,
``HYPOTHESIS_PROFILE=fuzz`` 5000.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from daemon_proc import NS, kill9, restart, start, varint
from fuzz_support import (
    BAD_CREDENTIALS,
    COUNTS,
    DAEMON_EXTRA,
    MAX_MESSAGE_BYTES,
    NUM_BLOCKS,
    TOO_LARGE_REQUEST,
    UNPARSEABLE,
    WORKERS,
    Outcome,
    World,
    all_ops_failed,
    check_events,
    check_response,
    check_status,
    check_step_response,
    fail,
    metadata_for,
    out_of_bounds,
    stats_equal,
)
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from strategies import (
    METHODS,
    Ctx,
    credential,
    encode,
    gen_message,
    mangle_wire,
    raw_message,
    request_of,
)

from blockd.api.v1 import blockd_pb2 as pb

S = grpc.StatusCode
SESSION_RPCS = {"Detach", "Heartbeat", "Step", "StepStream", "Lookup", "GetBlockTable",
                "Inspect"}


def scaled(fraction: float = 1.0) -> settings:
    """The loaded profile's example count (ci: 60, fuzz: 5000), scaled for heavier tests."""
    base = settings.default.max_examples
    return settings(max_examples=max(5, int(base * fraction)), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.large_base_example,
                                           HealthCheck.filter_too_much])


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    workdir = tmp_path_factory.mktemp("fuzz")
    # Crash recovery on, with frequent snapshots: everything fuzzed is journalled, and the last
    # test restarts the daemon from it.
    extra = {**DAEMON_EXTRA, "state": {"dir": str(workdir / "state"),
                                       "snapshot_min_bytes": 256 * 1024}}
    d = start(workdir, num_blocks=NUM_BLOCKS, extra=extra)
    try:
        w = World(d)
    except BaseException:
        d.stop()
        raise
    try:
        yield w
    finally:
        w.channel.close()
        # The daemon serving now, not ``d``: the last test kills ``d`` and starts a new one.
        w.d.stop()


# -- one request, every check ----------------------------------------------------------------

def exchange(world: World, method: str, request: Any, cred: str, wire: Any = None,
             bad_tail: bool = False) -> Outcome:
    """Send ``request`` (or its raw ``wire`` bytes) with credential ``cred``; check everything.

    ``request`` is the message the daemon will see, or None when ``wire`` does not parse. For a
    StepStream it is the list of messages; with ``bad_tail`` the stream's last wire message
    does not parse and ``request`` holds the ones before it.
    """
    have = request is not None
    stepping = method in ("Step", "StepStream")
    reqs = (request if isinstance(request, list) else [request]) if have else []
    last_step = {ref.sid: ref.step_id for ref in world.sessions}
    seq_owner = {s: ref.sid for s, ref in world.seq_session.items()}
    owner_of = {ref.sid: ref.who for ref in world.sessions}
    tenant_of = {ref.sid: ref.tenant for ref in world.sessions}
    before = world.snapshot()
    meta = metadata_for(cred)
    payload = wire if wire is not None else request
    note(f"{method} as {cred}: {str(payload)[:2000]}")
    if method == "StepStream":
        out = world.stream(payload, meta)
    elif method == "WatchEvents":
        out = world.watch(payload, meta, timeout=0.08)
        if out.details.startswith("open") and cred in BAD_CREDENTIALS:
            out = world.watch(payload, meta, timeout=3.0)  # an error was due: wait for it
    else:
        out = world.call(method, payload, meta)
    note(f"-> {out.code.name} {out.details[:300]!r}")
    if stepping:
        COUNTS["step_ops"] += sum(len(r.operations) for r in reqs)
    # A Step re-sending the session's last applied step_id is answered from the record (also
    # within one stream); the answers to such retries are not checked against the request.
    retries = []
    for r, resp in zip(reqs, out.responses if method == "StepStream" else [out.response],
                       strict=False):
        last = last_step.get(r.session_id, 0) if stepping else 0
        retries.append(stepping and last > 0 and r.step_id == last)
        if stepping and resp is not None and r.session_id in last_step:
            last_step[r.session_id] = max(last, r.step_id)
    retries += [False] * (len(reqs) - len(retries))
    # Messages the daemon answered (a stream ends at the first whole-request error).
    answered = list(zip(reqs, out.responses, retries, strict=False)) if (
        method == "StepStream") else []

    if bad_tail and out.code == S.OK:
        fail("a stream with an unparseable message ended OK", method, payload, out)
    # The stream ended on the message that does not parse, or a single request did not parse.
    decode_failure = not have or (bad_tail and len(out.responses) == len(reqs))
    check_status(method, payload if decode_failure else request, out, parsed=not decode_failure)
    too_large = out.code == S.RESOURCE_EXHAUSTED and out.details.startswith(TOO_LARGE_REQUEST)

    # Authentication comes first, for every RPC: a bad credential learns nothing else.
    if (not decode_failure and not too_large and cred in BAD_CREDENTIALS
            and out.code != S.UNAUTHENTICATED and reqs):
        fail("a missing or malformed credential must get UNAUTHENTICATED", method, request, out)

    # Documented bounds the daemon checks right after authentication.
    if (have and not too_large and cred not in BAD_CREDENTIALS and out_of_bounds(method, request)
            and out.code != S.INVALID_ARGUMENT):
        fail("a field outside its documented bounds must get INVALID_ARGUMENT", method, request,
             out)

    # Isolation: a non-admin never succeeds on another worker's session or sequence.
    if cred != "admin" and method in SESSION_RPCS:
        succeeded = ([r for r, _, _ in answered] if method == "StepStream"
                     else reqs if out.code == S.OK else [])
        for r in succeeded:
            owner = owner_of.get(r.session_id)
            if owner is not None and owner != cred:
                fail(f"{cred} succeeded on {owner}'s session", method, request, out)
            if method in ("GetBlockTable", "Inspect"):
                holder = seq_owner.get(r.sequence_id)
                if r.session_id == "":
                    # An operator's read (blockctl): any sequence of a tenant it acts for.
                    if holder is not None and tenant_of[holder] not in WORKERS[cred]:
                        fail("read another tenant's sequence", method, request, out)
                elif holder is not None and holder != r.session_id:
                    fail("read another session's sequence", method, request, out)

    # Well-formed answers.
    if method == "StepStream":
        for r, resp, retry in answered:
            check_step_response(method, r, resp, retry)
            if not retry:
                check_foreign_ops(r, resp, seq_owner)
        if out.code == S.OK and len(out.responses) != len(reqs):
            fail("StepStream answers each request exactly once", method, request, out)
    elif have and out.code == S.OK:
        if method == "Step":
            check_step_response(method, request, out.response, retries[0])
            if not retries[0]:
                check_foreign_ops(request, out.response, seq_owner)
        elif method == "WatchEvents":
            check_events(request, out.responses, admin=cred == "admin")
        else:
            check_response(method, request, out.response, cred)

    # Nothing changed unless something was applied.
    after = world.snapshot()
    if not stats_equal(before, after):
        rejected = out.code != S.OK and not out.responses
        nothing_applied = (
            method == "Step" and out.code == S.OK and not retries[0]
            and request.completed_fence == 0 and all_ops_failed(request, out.response))
        if rejected or nothing_applied:
            fail(f"Stats changed after a rejected request:\n{before}\n->\n{after}", method,
                 request, out)
    if have:
        world.learn(method, request, out, cred)
    world.alive()
    return out


def check_foreign_ops(req: pb.StepRequest, resp: pb.StepResponse,
                      seq_owner: dict[str, str]) -> None:
    """An operation on a sequence held by another session fails with PERMISSION_DENIED."""
    out = Outcome(S.OK, "", resp)
    for i, (op, res) in enumerate(zip(req.operations, resp.results, strict=True)):
        kind = op.WhichOneof("op")
        if kind in ("append", "fork", "release", "commit"):
            holder = seq_owner.get(getattr(op, kind).sequence_id)
            if holder is not None and holder != req.session_id and res.status.code != 7:
                fail(f"operations[{i}] on another session's sequence gave "
                     f"{res.status.code}", "Step", req, out)
        elif kind == "append_batch" and res.status.code == 0:
            failed = {e.index: e.status.code for e in res.append_batch.errors}
            for j, seq in enumerate(op.append_batch.sequence_ids):
                holder = seq_owner.get(seq)
                if holder is not None and holder != req.session_id and failed.get(j) != 7:
                    fail(f"append_batch entry {j} on another session's sequence", "Step", req,
                         out)


# -- drawing a request -----------------------------------------------------------------------

def draw_actor(draw: Callable[..., Any], world: World) -> Any:
    world.housekeep()
    return world.sessions[draw(st.integers(0, 2**16)) % len(world.sessions)]


def draw_request(draw: Callable[..., Any], world: World, method: str) -> tuple[Any, str]:
    actor = draw_actor(draw, world)
    ctx = Ctx(world, actor)
    cred = credential(draw, ctx)
    if method == "StepStream":
        reqs = []
        for _ in range(draw(st.integers(0, 4))):
            # Interleaved sessions: each message of the stream may act for another session.
            a = actor if draw(st.integers(0, 2)) else draw_actor(draw, world)
            r = gen_message(draw, request_of("Step"), Ctx(world, a))
            same = [p for p in reqs if p.session_id == r.session_id]
            if draw(st.integers(0, 2)) and same:
                r.step_id = min(same[-1].step_id + 1, 2**64 - 1)
            reqs.append(r)
        return reqs, cred
    return gen_message(draw, request_of(method), ctx), cred


def fuzz_rpc(world: World, data: st.DataObject, method: str) -> None:
    request, cred = draw_request(data.draw, world, method)
    exchange(world, method, request, cred)


# -- one test per RPC ------------------------------------------------------------------------

@scaled()
@given(data=st.data())
def test_attach(world: World, data: st.DataObject) -> None:
    fuzz_rpc(world, data, "Attach")


@scaled()
@given(data=st.data())
def test_detach(world: World, data: st.DataObject) -> None:
    fuzz_rpc(world, data, "Detach")


@scaled()
@given(data=st.data())
def test_heartbeat(world: World, data: st.DataObject) -> None:
    fuzz_rpc(world, data, "Heartbeat")


@scaled(2)
@given(data=st.data())
def test_step(world: World, data: st.DataObject) -> None:
    fuzz_rpc(world, data, "Step")


@scaled()
@given(data=st.data())
def test_step_stream(world: World, data: st.DataObject) -> None:
    fuzz_rpc(world, data, "StepStream")


@scaled()
@given(data=st.data())
def test_lookup(world: World, data: st.DataObject) -> None:
    fuzz_rpc(world, data, "Lookup")


@scaled()
@given(data=st.data())
def test_get_block_table(world: World, data: st.DataObject) -> None:
    fuzz_rpc(world, data, "GetBlockTable")


@scaled()
@given(data=st.data())
def test_inspect(world: World, data: st.DataObject) -> None:
    fuzz_rpc(world, data, "Inspect")


@scaled(0.5)
@given(data=st.data())
def test_stats(world: World, data: st.DataObject) -> None:
    fuzz_rpc(world, data, "Stats")


@scaled(0.5)
@given(data=st.data())
def test_list_sequences(world: World, data: st.DataObject) -> None:
    fuzz_rpc(world, data, "ListSequences")


@scaled()
@given(data=st.data())
def test_flush_namespace(world: World, data: st.DataObject) -> None:
    fuzz_rpc(world, data, "FlushNamespace")


@scaled(0.5)
@given(data=st.data())
def test_watch_events(world: World, data: st.DataObject) -> None:
    fuzz_rpc(world, data, "WatchEvents")


@scaled(0.5)
@given(data=st.data())
def test_interleaved_requests_to_every_rpc(world: World, data: st.DataObject) -> None:
    """A run of requests to random RPCs, acting for random sessions, one after the other."""
    for _ in range(data.draw(st.integers(1, 8))):
        method = data.draw(st.sampled_from(sorted(METHODS)))
        fuzz_rpc(world, data, method)


# -- raw wire format: invalid UTF-8, corrupt encodings ---------------------------------------

@scaled()
@given(data=st.data())
def test_raw_wire_bytes(world: World, data: st.DataObject) -> None:
    """Hand-encoded requests, string fields possibly invalid UTF-8, encodings damaged.

    The local parse is the oracle: bytes that parse must get the normal contract; bytes that do
    not parse must get grpc's own answer (UNKNOWN, ``Unexpected <class
    'google.protobuf.message.DecodeError'>``), before any daemon code runs.
    """
    method = data.draw(st.sampled_from(sorted(m for m in METHODS if m != "StepStream")))
    actor = draw_actor(data.draw, world)
    ctx = Ctx(world, actor)
    cred = credential(data.draw, ctx)
    wire = mangle_wire(data.draw, raw_message(data.draw, request_of(method), ctx,
                                              corrupt_strings=data.draw(st.booleans())))
    COUNTS["raw"] += 1
    cls = getattr(pb, request_of(method).name)
    try:
        msg = cls.FromString(wire)
    except DecodeError:
        msg = None
    COUNTS["raw.unparseable" if msg is None else "raw.parseable"] += 1
    exchange(world, method, msg, cred, wire=wire)


@scaled(0.5)
@given(data=st.data())
def test_raw_wire_bytes_in_a_step_stream(world: World, data: st.DataObject) -> None:
    """A StepStream whose messages are hand-encoded (some do not parse)."""
    actor = draw_actor(data.draw, world)
    ctx = Ctx(world, actor)
    cred = credential(data.draw, ctx)
    wires, msgs, bad = [], [], False
    for _ in range(data.draw(st.integers(1, 3))):
        msg = gen_message(data.draw, request_of("Step"), ctx)
        wire = mangle_wire(data.draw, encode(data.draw, msg, ctx,
                                             corrupt=data.draw(st.booleans())))
        wires.append(wire)
        try:
            msgs.append(pb.StepRequest.FromString(wire))
        except DecodeError:
            bad = True
            break
    COUNTS["raw"] += len(wires)
    COUNTS["raw.parseable"] += len(msgs)
    COUNTS["raw.unparseable"] += bad
    exchange(world, "StepStream", msgs, cred, wire=wires, bad_tail=bad)


# -- oversized messages ----------------------------------------------------------------------

@pytest.mark.parametrize("method", sorted(METHODS))
def test_oversized_request_gets_resource_exhausted(world: World, method: str) -> None:
    """A request over max_message_bytes (256 KiB here) is refused by grpc, for every RPC."""
    actor = world.sessions[0]
    for pad in (MAX_MESSAGE_BYTES + 1, 4 * MAX_MESSAGE_BYTES):
        # An unknown field: the size alone decides, before anything is parsed.
        wire = b"\xba\x3e" + varint(pad) + bytes(pad)  # field 999, length-delimited
        before = world.snapshot()
        meta = metadata_for(actor.who)
        if method == "StepStream":
            out = world.stream([wire], meta)
        elif method == "WatchEvents":
            out = world.watch(wire, meta, timeout=5)
        else:
            out = world.call(method, wire, meta)
        assert out.code == S.RESOURCE_EXHAUSTED, (out.code, out.details)
        assert out.details.startswith(TOO_LARGE_REQUEST), out.details
        assert stats_equal(before, world.snapshot())
        world.alive()


def test_unparseable_unary_request_gets_grpcs_own_unknown(world: World) -> None:
    """What grpc (asyncio server, grpcio 1.85) answers for bytes that do not parse: UNKNOWN
    with ``Unexpected <class 'google.protobuf.message.DecodeError'>: ...``. The handler never
    runs, so neither Stats nor the session changes; the daemon keeps serving."""
    actor = world.sessions[0]
    tenant = b"\x12\x03\xff\xfe\xfd"  # AttachRequest.tenant_id = invalid UTF-8
    session = b"\x0a\x02\xc0\x80"     # session_id = overlong NUL
    for method, wire in [("Attach", tenant), ("Detach", session), ("Heartbeat", session),
                         ("Step", session), ("Lookup", session), ("Inspect", session),
                         ("GetBlockTable", session), ("FlushNamespace", b"\x0a\x01\xff"),
                         ("Stats", b"\x0a\x05ab")]:
        before = world.snapshot()
        out = world.call(method, wire, metadata_for(actor.who))
        if method in ("Step", "Lookup"):  # parsed by the daemon, in the tenant's turn
            assert out.code == S.INVALID_ARGUMENT, (method, out)
            assert out.details == f"request: a {method}Request could not be parsed", out
        else:
            assert out.code == S.UNKNOWN and out.details.startswith(UNPARSEABLE), (method, out)
        assert stats_equal(before, world.snapshot())
        world.alive()
    out = world.watch(b"\x08", metadata_for("admin"), timeout=5)
    assert out.code == S.UNKNOWN and out.details.startswith(UNPARSEABLE), out


# -- after everything ------------------------------------------------------------------------

def test_zz_daemon_log_has_no_errors(world: World) -> None:
    """After every input above, the daemon logged no error of its own (grpc's DecodeError
    tracebacks are logged by grpc, not blockd)."""
    world.alive()
    errors = [line for line in world.d.log_text().splitlines()
              if re.search(r"level=error logger=blockd", line)]
    assert not errors, "\n".join(errors[:20])


def test_zzz_kill9_recovers_exactly_the_fuzzed_state(world: World) -> None:
    """Everything the fuzzing applied was journalled: a daemon killed with SIGKILL and started
    again holds the same sessions, sequences, block tables, cache and counters, with its
    invariants checked after the replay (``server.check_invariants``)."""

    def state() -> tuple[Any, ...]:
        stats = world.snapshot()
        tables = {}
        for seq in sorted({*world.seq_session, *world.dead_seqs}):
            out = world.call("GetBlockTable", pb.GetBlockTableRequest(sequence_id=seq),
                             metadata_for("admin"))
            tables[seq] = (out.code, list(out.response.block_ids) if out.response else None,
                           out.response.num_tokens if out.response else None)
        lookups = [(ref.sid, [world.stub.Lookup(pb.LookupRequest(
                        session_id=ref.sid, epoch=world.epoch, namespace=NS, token_ids=p),
                        metadata=metadata_for(ref.who), timeout=10).num_cached_tokens
                        for p in world.prompts]) for ref in world.sessions]
        return stats, tables, lookups

    world.seed()  # live sequences and cached prefixes on top of whatever the fuzzing left
    ref = world.sessions[0]
    r = world.step(ref, [pb.Operation(admit=pb.AdmitOp(namespace=NS, token_ids=list(range(9))))])
    seq = r.results[0].admit.sequence_id
    # A commit whose fence has not completed: pending at the crash, pending after it.
    world.step(ref, [pb.Operation(commit=pb.CommitOp(sequence_id=seq))], fence=ref.issued + 1)
    before = state()
    assert before[0].num_sequences > 0 and before[0].blocks_committed > 0
    assert any(hits for _, hits in before[2])
    kill9(world.d)
    world.d = restart(world.d)
    assert any("recovered epoch" in line for line in world.d.lines), world.d.log_text()
    after = state()
    assert after == before
    world.alive()
