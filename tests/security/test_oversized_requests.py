"""Requests over ``server.max_work_per_call`` against a real daemon (issue 28, finding 2).

gRPC receives a request in full before its handler runs, so a Step whose bytes alone cost more
than one call may was received, refused unread and cost its sender nothing: three flooders
sending 12 MB Steps back to back took another tenant's admit p99 to x15.7. Now the bytes such a
call carried are charged to its sender's work budget first (refused for rate once the bucket
cannot pay them), its refusal is held like a refusal for rate, and the default
``server.max_message_bytes`` is the largest request the work bound admits, so gRPC refuses
anything larger before its handler runs (it still reads and discards what the client keeps
sending: bench/hardening_ab.py measures those bytes).
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import grpc
import pytest

from blockd.api.v1 import blockd_pb2 as pb
from blockd.config import ServerConfig
from blockd.runtime.budgets import PARSE_BYTES_PER_UNIT
from blockd.runtime.step import ATTACH_UNITS
from tests.server.daemon_proc import TENANTS, Worker, admit, md, start, varint

S = grpc.StatusCode
HOLD_MS = 400
#: A Step of this many bytes costs 196,608 parse units: over the default bound (131,072).
BIG = 6 * 1024 * 1024
BIG_UNITS = BIG // PARSE_BYTES_PER_UNIT
#: globex: an Attach and exactly two oversized Steps, refilled at a unit every 100 s (so
#: nothing a test's duration refills changes what follows).
BURST = ATTACH_UNITS + 2 * BIG_UNITS


def _oversized_step(w: Worker) -> bytes:
    """A StepRequest of ``BIG`` bytes: its session, then an unknown field of padding."""
    head = pb.StepRequest(session_id=w.sid, epoch=w.epoch, step_id=1).SerializeToString()
    pad = BIG - len(head) - 2 - 4  # a tag of 2 bytes, a length of 4
    raw = head + b"\xc2\x3e" + varint(pad) + b"\x00" * pad  # field 1000, length-delimited
    assert len(raw) == BIG
    return raw


def test_the_default_message_limit_is_the_largest_request_the_work_bound_admits() -> None:
    """0 (the default) resolves to 32 bytes per work unit of ``server.max_work_per_call``."""
    assert ServerConfig().max_message_bytes == PARSE_BYTES_PER_UNIT * (1 << 17) == 4 << 20
    assert ServerConfig(max_work_per_call=1000).max_message_bytes == 32_000
    assert ServerConfig(max_message_bytes=12345).max_message_bytes == 12345


def test_oversized_steps_are_charged_held_and_then_refused_for_rate(tmp_path: Path) -> None:
    """globex floods 6 MB Steps (over max_work_per_call, under the 16 MiB message limit this
    daemon is configured with): the first two are refused ``work`` after a hold, their bytes
    charged to globex's budget, which then cannot pay a third: it is refused for rate (held,
    with a retry hint), and so is globex's next ordinary Step. acme's admits are served
    throughout, and globex's refusals are counted in its ``blockd_rate_limited``. Before, every
    oversized Step was refused ``work`` at once, for free, and globex's Step was served."""
    tenants = copy.deepcopy(TENANTS)
    tenants["tenants"][1].update(work_units_per_second=0.01, work_units_burst=BURST)
    d = start(tmp_path, num_blocks=64, tenants=tenants,
              extra={"tenants": {"rate_refusal_hold_ms": HOLD_MS},
                     "server": {"max_message_bytes": 16 << 20}})
    try:
        flooder = Worker(d.stub(), "bob", "globex")
        other = Worker(d.stub(), "alice", "acme")
        call = d.channel().unary_unary("/blockd.v1.BlockdService/Step")
        raw = _oversized_step(flooder)
        outcomes: list[str] = []
        for i in range(4):
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                call(raw, metadata=md("bob"), timeout=30)
            held_s = time.monotonic() - t0
            assert err.value.code() == S.RESOURCE_EXHAUSTED, err.value.details()
            outcomes.append(err.value.details().removeprefix("request: ").split(":")[0])
            # Every refusal was held (a lower bound: a hold is a timer, whatever the speed).
            assert held_s >= HOLD_MS / 1000 * 0.9, (i, held_s)
            if outcomes[-1] == "work":
                assert f"request of {BIG} bytes costs {BIG_UNITS}" in err.value.details()
                assert "charged to the work budget of 'globex'" in err.value.details()
            else:
                hint = dict(err.value.trailing_metadata())["retry-after-ms"]
                assert int(hint) > 0
            # The other tenant is served between the flooder's calls.
            r = other.step(admit([i * 10 + t for t in range(1, 9)]), fence=0).results[0]
            assert r.status.code == 0, r.status
        assert outcomes == ["work", "work", "rate", "rate"], outcomes
        # globex's budget was spent by the bytes: its next ordinary Step is refused for rate.
        with pytest.raises(grpc.RpcError) as err:
            flooder.step(admit([1, 2, 3, 4]), fence=0)
        assert err.value.code() == S.RESOURCE_EXHAUSTED
        assert err.value.details().startswith("rate: tenant 'globex'"), err.value.details()
        assert d.metric('blockd_rate_limited_total{tenant="globex"}') >= 3
        assert d.metric('blockd_rate_limited_total{tenant="acme"}') == 0
    finally:
        d.stop()


def test_a_request_over_the_default_message_limit_is_refused_by_grpc(tmp_path: Path) -> None:
    """With the default limit (4 MiB), gRPC itself refuses a 6 MB Step (RESOURCE_EXHAUSTED)
    and the daemon serves on; before, the 16 MiB default let it in to be refused afterwards."""
    d = start(tmp_path, num_blocks=64)
    try:
        w = Worker(d.stub(), "alice", "acme")
        call = d.channel().unary_unary("/blockd.v1.BlockdService/Step")
        with pytest.raises(grpc.RpcError) as err:
            call(_oversized_step(w), metadata=md("alice"), timeout=30)
        assert err.value.code() == S.RESOURCE_EXHAUSTED, err.value.details()
        assert "larger than max" in err.value.details(), err.value.details()
        assert w.step(admit([1, 2, 3]), fence=0).results[0].status.code == 0
    finally:
        d.stop()
