"""Refusals for rate against a real daemon: held until their hint passed (at most
``tenants.rate_refusal_hold_ms``, at most 8 per tenant), refused unread where the bucket cannot
pay what the request's bytes can carry (``budgets.reading_need``), nothing applied, and the
other tenants served meanwhile (``blockd/runtime/refusal_holds.py``)."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from blockd.api.v1 import blockd_pb2 as pb
from blockd.runtime.refusal_holds import HOLDS_PER_KEY
from blockd.runtime.step import ATTACH_UNITS
from tests.server.daemon_proc import NS, TENANTS, Daemon, Worker, md, start, varint

S = grpc.StatusCode
HOLD_MS = 600
#: globex's budget: an Attach, then 2,000 units, refilled at 1,000 a second.
BURST = ATTACH_UNITS + 2000
#: umbrella's: an Attach and nearly nothing, refilled at a unit every 100 s (its hints are
#: days long, so each refusal is held the longest, and its hint hardly moves during a test).
TINY_BURST = ATTACH_UNITS + 10


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tenants = copy.deepcopy(TENANTS)
    tenants["tenants"][1].update(work_units_per_second=1000, work_units_burst=BURST)  # globex
    tenants["tenants"][3].update(work_units_per_second=0.01,
                                 work_units_burst=TINY_BURST)  # umbrella
    d = start(tmp_path_factory.mktemp("holds"), num_blocks=64, tenants=tenants,
              extra={"tenants": {"rate_refusal_hold_ms": HOLD_MS}})
    yield d
    d.stop()


@pytest.fixture(scope="module")
def bob(daemon: Daemon) -> Worker:
    """globex's one session (an Attach costs half its bucket)."""
    return Worker(daemon.stub(), "bob", "globex")


def _lookup_bytes(w: Worker, n: int) -> bytes:
    ids = b"".join(varint(t) for t in range(n))
    req = pb.LookupRequest(session_id=w.sid, epoch=w.epoch, namespace=NS).SerializeToString()
    return req + varint(4 << 3 | 2) + varint(len(ids)) + ids


def _call(d: Daemon, method: str, raw: bytes, who: str) -> grpc.Future:
    call = d.channel().unary_unary(f"/blockd.v1.BlockdService/{method}")
    return call.future(raw, metadata=md(who))


def _hint(err: grpc.RpcError) -> int:
    return int(dict(err.trailing_metadata())["retry-after-ms"])


def test_a_refusal_is_answered_once_its_hint_passed_and_the_retry_is_served(
        daemon: Daemon, bob: Worker) -> None:
    """globex's Lookups of the pool's reach (257 ids) drain its bucket until one is refused
    for rate: that refusal is answered only once its hint has passed (under 0.26 s here, within
    the hold), with the hint less the time held (next to nothing); nothing changed, and the
    immediate retry is served, the bucket having refilled meanwhile."""
    w = bob
    raw = _lookup_bytes(w, 1000)
    before = w.stats()
    for _ in range(20):
        try:
            _call(daemon, "Lookup", raw, "bob").result()
        except grpc.RpcError as err:
            refused = err
            break
    else:
        raise AssertionError("globex's bucket never ran out")
    assert refused.code() == S.RESOURCE_EXHAUSTED, refused.details()
    assert refused.details().startswith("rate: tenant 'globex'"), refused.details()
    assert _hint(refused) <= 5, refused.details()
    assert w.stats() == before  # a Lookup changes nothing, served or refused
    served = pb.LookupResponse.FromString(_call(daemon, "Lookup", raw, "bob").result())
    assert (served.num_cached_tokens, served.num_cached_blocks) == (0, 0)  # nothing cached


def test_a_bucket_short_of_what_the_bytes_can_carry_refuses_them_unread(
        daemon: Daemon, bob: Worker) -> None:
    """A Step of 10,000 bytes that do not parse: its bytes cost 312 units, which globex's
    bucket holds, but it needs 10,312 (one per byte that can hold a token id; above the burst,
    a full bucket): it is refused for rate, not found malformed (it was never read), and
    nothing changed. 100 such bytes fit the bucket: they are read, and refused as
    malformed."""
    w = bob
    head = pb.StepRequest(session_id=w.sid, epoch=w.epoch, step_id=1).SerializeToString()
    junk = b"\x0a\xff\xff\xff\x0f"  # a length-delimited field 1 claiming 4 GiB
    before = w.stats()
    with pytest.raises(grpc.RpcError) as err:
        _call(daemon, "Step", head + junk + b"\x00" * (10_000 - len(head) - len(junk)),
              "bob").result()
    assert err.value.code() == S.RESOURCE_EXHAUSTED, err.value.details()
    assert "this call needs 10312 units" in err.value.details(), err.value.details()
    assert f"tenants.work_units_burst={BURST}" in err.value.details()
    assert w.stats() == before
    with pytest.raises(grpc.RpcError) as err:
        _call(daemon, "Step", head + junk + b"\x00" * (100 - len(head) - len(junk)),
              "bob").result()
    assert err.value.code() == S.INVALID_ARGUMENT, err.value.details()
    assert err.value.details() == "request: a StepRequest could not be parsed"
    assert w.stats() == before


def test_at_most_eight_refusals_of_a_tenant_wait_and_others_are_served_meanwhile(
        daemon: Daemon) -> None:
    """umbrella sends twelve Lookups at once with an empty bucket: eight are held (their hint
    comes back less the time held), four are answered at once with the whole hint; acme's
    calls are served while the eight wait; nothing of umbrella's changed."""
    u = Worker(daemon.stub(), "dave", "umbrella")
    a = Worker(daemon.stub(), "alice", "acme")
    raw = _lookup_bytes(u, 1000)
    before = u.stats().tenants
    t0 = time.monotonic()
    calls = [_call(daemon, "Lookup", raw, "dave") for _ in range(HOLDS_PER_KEY + 4)]
    # acme is served, twice, while umbrella's held refusals wait out their hold.
    a.admit([1, 2, 3, 4, 5])
    assert a.stats().num_sequences >= 1
    assert sum(not c.done() for c in calls) >= HOLDS_PER_KEY
    hints = []
    for c in calls:
        with pytest.raises(grpc.RpcError) as err:
            c.result()
        assert err.value.code() == S.RESOURCE_EXHAUSTED, err.value.details()
        hints.append(_hint(err.value))
    assert time.monotonic() - t0 >= HOLD_MS / 1000 * 0.9  # the held ones waited the hold
    whole = max(hints)
    held = [h for h in hints if h <= whole - HOLD_MS // 2]
    assert len(held) == HOLDS_PER_KEY, hints
    assert u.stats().tenants == before  # umbrella's own figures


def test_a_tenant_with_its_queue_full_is_refused_at_once_and_others_are_served(
        tmp_path: Path) -> None:
    """server.max_queued_calls_per_tenant at 4: of umbrella's twelve concurrent Lookups over
    its budget, four are refused for rate and held (they count as waiting while held), the
    other eight are refused at once with RESOURCE_EXHAUSTED "queue", unparsed; acme is served
    meanwhile, and nothing of umbrella's changed."""
    tenants = copy.deepcopy(TENANTS)
    tenants["tenants"][3].update(work_units_per_second=0.01, work_units_burst=TINY_BURST)
    d = start(tmp_path, num_blocks=64, tenants=tenants,
              extra={"tenants": {"rate_refusal_hold_ms": HOLD_MS},
                     "server": {"max_queued_calls_per_tenant": 4}})
    try:
        u = Worker(d.stub(), "dave", "umbrella")
        a = Worker(d.stub(), "alice", "acme")
        raw = _lookup_bytes(u, 1000)
        before = u.stats().tenants
        calls = [_call(d, "Lookup", raw, "dave") for _ in range(12)]
        a.admit([1, 2, 3, 4, 5])  # served while umbrella's refusals are held
        outcomes: list[str] = []
        for c in calls:
            with pytest.raises(grpc.RpcError) as err:
                c.result()
            assert err.value.code() == S.RESOURCE_EXHAUSTED, err.value.details()
            outcomes.append(err.value.details().split(":")[0])
            if outcomes[-1] == "queue":
                assert "server.max_queued_calls_per_tenant=4" in err.value.details()
        assert sorted(outcomes) == ["queue"] * 8 + ["rate"] * 4, outcomes
        assert u.stats().tenants == before
        # Once the held ones are answered, umbrella's calls queue again (and are refused for
        # rate: its bucket is still empty).
        with pytest.raises(grpc.RpcError) as err:
            _call(d, "Lookup", raw, "dave").result()
        assert err.value.details().startswith("rate:"), err.value.details()
    finally:
        d.stop()
