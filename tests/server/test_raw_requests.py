"""Step, StepStream and Lookup are parsed in their tenant's turn (issue 15): their handlers get
the request's bytes, queue by its leading session id, charge its bytes to the tenant's budget,
then parse. Real daemon, real sockets; every refusal checks the status and that nothing
changed. No timed asserts (bench/fairness.py measures latency)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from daemon_proc import NS, TENANTS, Daemon, Worker, admit, md, start, varint

from blockd.api.v1 import blockd_pb2 as pb
from blockd.runtime import step
from blockd.runtime.budgets import PARSE_BYTES_PER_UNIT, parse_units
from blockd.runtime.step import ATTACH_UNITS

S = grpc.StatusCode
#: acme's and initech's own budget: an Attach and a few small calls; a refill too slow to
#: matter in a test.
BURST = ATTACH_UNITS + 2000


def _unknown(n: int) -> bytes:
    """Field 1023 (length-delimited) of ``n`` bytes: no operation prices it."""
    return b"\xfa\x3f" + varint(n) + b"x" * n


def _session_field(sid: str) -> bytes:
    return b"\x0a" + varint(len(sid.encode())) + sid.encode()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tenants = copy.deepcopy(TENANTS)
    for t in tenants["tenants"][0], tenants["tenants"][2]:  # acme, initech
        t.update(work_units_per_second=1, work_units_burst=BURST)
    d = start(tmp_path_factory.mktemp("raw"), tenants=tenants,
              extra={"tenants": {"work_units_per_second": 10_000_000,
                                 "work_units_burst": 2_000_000}})
    yield d
    d.stop()


def _raw(d: Daemon, method: str, response: Any) -> Any:
    return d.channel().unary_unary(f"/blockd.v1.BlockdService/{method}",
                                   request_serializer=lambda b: b,
                                   response_deserializer=response.FromString)


def _seen(w: Worker, tenant: str) -> list[tuple[str, int]]:
    """A tenant's usage and live sequences, as the admin sees them."""
    st = w.stub.Stats(pb.StatsRequest(), metadata=md("admin"))
    seqs = w.stub.ListSequences(pb.ListSequencesRequest(tenant_id=tenant), metadata=md("admin"))
    return [(str(u), 0) for u in st.tenants if u.tenant_id == tenant] + [
        (s.sequence_id, s.num_tokens) for s in seqs.sequences]


def test_the_leading_session_id_is_read_without_parsing() -> None:
    sid = "s" * 24
    assert step.leading_session_id(pb.StepRequest(session_id=sid, epoch=3, step_id=9, operations=[
        admit(list(range(100)))]).SerializeToString()) == sid
    assert step.leading_session_id(pb.LookupRequest(session_id=sid, namespace=NS, token_ids=[
        1, 2]).SerializeToString()) == sid
    long_id = "x" * (step.MAX_PEEKED_SESSION_ID + 1)  # its length takes two varint bytes
    for raw in (b"", b"\x0a", pb.StepRequest(epoch=1, step_id=1).SerializeToString(),
                b"\x0a\x05ab", b"\x0a\x02\xff\xfe",
                pb.StepRequest(session_id=long_id).SerializeToString(),
                b"\x10\x01" + _session_field(sid)):  # not the leading field
        assert step.leading_session_id(raw) == "", raw
    assert step.leading_session_id(_session_field("x" * 127)) == "x" * 127


MALFORMED = [b"\x0a\x05ab",  # a truncated string
             b"\x0a\x02\xff\xfe",  # a session id that is not UTF-8
             b"\x0f\x00",  # wire type 7 does not exist
             ]


@pytest.mark.parametrize("tail", [b"\x32\x10\x0a", b"\x22\x05\x01", _unknown(1 << 20)[:-1]])
def test_malformed_steps_and_lookups_are_invalid_argument_and_change_nothing(
        daemon: Daemon, tail: bytes) -> None:
    w = Worker(daemon.stub(), "bob", "globex")
    w.admit(list(range(8)))
    before = _seen(w, "globex")
    lead = _session_field(w.sid)
    for raw in [*MALFORMED, lead + tail]:
        for method, response in (("Step", pb.StepResponse), ("Lookup", pb.LookupResponse)):
            with pytest.raises(grpc.RpcError) as err:
                _raw(daemon, method, response)(raw, metadata=md("bob"))
            assert err.value.code() == S.INVALID_ARGUMENT, (method, raw[:8], err.value.details())
            assert err.value.details() == (f"request: a {method}Request could not be parsed")
    assert _seen(w, "globex") == before
    # The daemon serves on and nothing consumed a step id: the next one is new.
    assert w.step(admit(list(range(8, 16))), fence=0).results[0].status.code == 0
    assert len(_seen(w, "globex")) == len(before) + 1


def test_a_malformed_message_on_a_stream_ends_it_after_the_answered_ones(daemon: Daemon
                                                                          ) -> None:
    w = Worker(daemon.stub(), "bob", "globex")
    before = _seen(w, "globex")
    good = pb.StepRequest(session_id=w.sid, epoch=w.epoch, step_id=1,
                          operations=[admit(list(range(8)))]).SerializeToString()
    call = daemon.channel().stream_stream("/blockd.v1.BlockdService/StepStream",
                                          request_serializer=lambda b: b,
                                          response_deserializer=pb.StepResponse.FromString)
    answers = []
    with pytest.raises(grpc.RpcError) as err:
        for resp in call(iter([good, _session_field(w.sid) + b"\x32\x10\x0a"]),
                         metadata=md("bob")):
            answers.append(resp)
    assert err.value.code() == S.INVALID_ARGUMENT
    assert err.value.details() == "request: a StepRequest could not be parsed"
    assert len(answers) == 1 and answers[0].results[0].status.code == 0
    assert len(_seen(w, "globex")) == len(before) + 1  # the first Step, nothing more


def test_a_tenant_over_its_budget_is_refused_before_its_request_is_parsed(daemon: Daemon
                                                                          ) -> None:
    """acme's bucket holds under its burst after the Attach: a request whose bytes cost more
    is refused for rate, and it is not parsed (bytes a parse would refuse get rate, not
    INVALID_ARGUMENT); a small Step is then served, and the bucket paid for nothing else."""
    w = Worker(daemon.stub(), "alice", "acme")
    before = _seen(w, "acme")
    big = _session_field(w.sid) + _unknown(BURST * PARSE_BYTES_PER_UNIT)
    for raw in (big, big + b"\x32\x10\x0a"):  # well formed, then malformed after its bytes
        for method, response in (("Step", pb.StepResponse), ("Lookup", pb.LookupResponse)):
            with pytest.raises(grpc.RpcError) as err:
                _raw(daemon, method, response)(raw, metadata=md("alice"))
            e = err.value
            assert e.code() == S.RESOURCE_EXHAUSTED, (method, e.details())
            assert e.details().startswith("rate: tenant 'acme'"), e.details()
            assert f"tenants.work_units_burst={BURST}" in e.details()
            hint = dict(e.trailing_metadata() or ())["retry-after-ms"]
            assert int(hint) >= 1
    assert _seen(w, "acme") == before
    # The refusals took nothing: Lookups costing all that is left are served (each costs its
    # bytes' price and its tokens, cut at the pool's 64 x 4 + 1).
    left = BURST - ATTACH_UNITS
    req = pb.LookupRequest(session_id=w.sid, epoch=w.epoch, namespace=NS,
                           token_ids=list(range(257)))
    cost = parse_units(req.ByteSize()) + 257
    for _ in range(left // cost):
        assert w.stub.Lookup(req, metadata=md("alice")).num_cached_tokens == 0


def test_naming_another_tenants_session_charges_and_queues_the_caller_not_that_tenant(
        daemon: Daemon) -> None:
    """bob leads his request with carol's session id: its bytes are charged to bob's own
    credential (initech's bucket, short of its burst after the Attach, would refuse them for
    rate), and the parsed request is refused as today: the session belongs to another
    credential."""
    c = Worker(daemon.stub(), "carol", "initech")
    before = _seen(c, "initech")
    raw = pb.StepRequest(session_id=c.sid, epoch=c.epoch, step_id=1,
                         operations=[admit(list(range(8)))]).SerializeToString()
    raw += _unknown(BURST * PARSE_BYTES_PER_UNIT)
    with pytest.raises(grpc.RpcError) as err:
        _raw(daemon, "Step", pb.StepResponse)(raw, metadata=md("bob"))
    assert err.value.code() == S.PERMISSION_DENIED, err.value.details()
    assert err.value.details().startswith("session_id:")
    assert _seen(c, "initech") == before
    r = c.step(admit(list(range(8))), fence=0).results[0]  # step_id 1 was not taken by bob
    assert r.status.code == 0, r.status
