"""Per-tenant work budgets in the tenants file, and ListSequences charged to the work budget
(issue 15). Real daemon, real sockets; every refusal checks the status and that nothing
changed. No timed asserts: the budgets here refill at 1 unit per second, far below any call."""

from __future__ import annotations

import copy
import signal
import time
from typing import Any

import grpc
import pytest
import yaml
from daemon_proc import TENANTS, Daemon, Worker, md, release, start

from blockd.api.v1 import blockd_pb2 as pb
from blockd.core.errors import InvalidArgument
from blockd.runtime import tenants_file
from blockd.runtime.listing import LIST_CALL_UNITS, LIST_ENTRY_UNITS
from blockd.runtime.step import ADMIT_UNITS, ATTACH_UNITS, OP_UNITS

S = grpc.StatusCode
#: acme's own budget: a burst that pays for an Attach, two admits and one page of 100, and a
#: refill too slow to matter within a test. globex keeps the daemon-wide default.
BURST = ATTACH_UNITS + 2 * (ADMIT_UNITS + 8) + LIST_CALL_UNITS + 100 * LIST_ENTRY_UNITS + 100


def _tenants(**acme: Any) -> dict[str, Any]:
    t = copy.deepcopy(TENANTS)
    t["tenants"][0].update(acme)
    return t


def _reload(d: Daemon, tenants: dict[str, Any], wait_for: str) -> None:
    before = d.log_text().count(wait_for)
    d.tenants_path.write_text(yaml.safe_dump(tenants))
    d.signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while d.log_text().count(wait_for) <= before:
        assert time.monotonic() < deadline, f"no {wait_for!r} in the daemon's log"
        time.sleep(0.05)


def _listing(w: Worker, size: int, who: str | None = None) -> pb.ListSequencesResponse:
    return w.stub.ListSequences(pb.ListSequencesRequest(tenant_id="acme", page_size=size),
                                metadata=md(who or w.who))


def _seen(w: Worker) -> list[tuple[str, int]]:
    """acme's sequences and usage as the admin sees them (its own budget pays for that)."""
    page = _listing(w, 1000, "admin")
    st = w.stub.Stats(pb.StatsRequest(), metadata=md("admin"))
    return [(s.sequence_id, s.num_tokens) for s in page.sequences] + [
        (str(u), 0) for u in st.tenants if u.tenant_id == "acme"]


@pytest.fixture
def budgeted(tmp_path):  # type: ignore[no-untyped-def]
    d = start(tmp_path, tenants=_tenants(work_units_per_second=1, work_units_burst=BURST),
              extra={"tenants": {"work_units_per_second": 10_000_000,
                                 "work_units_burst": 2_000_000}})
    yield d
    d.stop()


def test_listsequences_is_charged_and_a_refused_page_changes_nothing(budgeted) -> None:  # type: ignore[no-untyped-def]
    a = Worker(budgeted.stub(), "alice", "acme")
    seqs = {a.admit(list(range(1, 9))).sequence_id, a.admit(list(range(20, 28))).sequence_id}
    page = _listing(a, 100)  # paid from what is left of acme's own burst
    assert {s.sequence_id for s in page.sequences} == seqs
    before = _seen(a)
    with pytest.raises(grpc.RpcError) as err:
        _listing(a, 100)  # the same page again: the bucket has ~100 units left
    e = err.value
    assert e.code() == S.RESOURCE_EXHAUSTED, e.details()
    assert e.details().startswith("rate: tenant 'acme' is over its work budget"), e.details()
    assert f"tenants.work_units_burst={BURST}" in e.details()  # acme's own burst, not the default
    assert f"costs {LIST_CALL_UNITS + 100 * LIST_ENTRY_UNITS} units" in e.details()
    assert int(dict(e.trailing_metadata())["retry-after-ms"]) >= 1
    assert _seen(a) == before
    # The refused page took nothing from the bucket: a Step within the ~100 units left is
    # served (a release costs OP_UNITS), and it changes exactly what it says.
    resp = a.step(release(sorted(seqs)[0]))
    assert resp.results[0].status.code == 0 and OP_UNITS <= 100
    assert {s for s, _ in _seen(a)} & seqs == {sorted(seqs)[1]}
    # globex keeps the daemon-wide budget: its listing is served.
    b = Worker(budgeted.stub(), "bob", "globex")
    got = b.stub.ListSequences(pb.ListSequencesRequest(page_size=100), metadata=md("bob"))
    assert list(got.tenant_ids) == ["globex"] and not got.sequences
    assert budgeted.metric('blockd_rate_limited_total{tenant="acme"}') == 1
    assert budgeted.metric('blockd_rate_limited_total{tenant="globex"}') == 0


def test_a_page_is_cut_to_the_per_call_bound_and_pages_through_everything(tmp_path) -> None:
    bound = LIST_CALL_UNITS + 3 * LIST_ENTRY_UNITS  # pages of 3 at most
    with start(tmp_path, extra={"server": {"max_work_per_call": bound}}) as d:
        a = Worker(d.stub(), "alice", "acme")
        seqs = [a.admit(list(range(i, i + 4))).sequence_id for i in range(0, 40, 4)]
        fork = a.step(pb.Operation(fork=pb.ForkOp(sequence_id=seqs[0], num_children=2)),
                      fence=0).results[0].fork
        seqs += list(fork.child_sequence_ids)
        a.step(release(seqs[3]), fence=0)
        live = sorted(set(seqs) - {seqs[3]})
        got: list[str] = []
        token = ""
        while True:
            p = a.stub.ListSequences(pb.ListSequencesRequest(page_size=1000, page_token=token),
                                     metadata=md("alice"))
            assert 1 <= len(p.sequences) <= 3
            got += [s.sequence_id for s in p.sequences]
            token = p.next_page_token
            if not token:
                break
        assert got == live  # sorted, forks included, the released one gone
        first = [s for s in a.stub.ListSequences(pb.ListSequencesRequest(page_size=1),
                                                 metadata=md("alice")).sequences]
        assert [(s.sequence_id, s.num_tokens, s.num_blocks, s.worker_name) for s in first] == \
            [(live[0], 4, 1, "alice")]


def test_per_tenant_budget_values_are_checked_at_load() -> None:
    for bad, field in (({"work_units_per_second": "fast"}, "tenants[0].work_units_per_second"),
                       ({"work_units_per_second": True}, "tenants[0].work_units_per_second"),
                       ({"work_units_per_second": -1}, "tenants[0].work_units_per_second"),
                       ({"work_units_burst": 0}, "tenants[0].work_units_burst"),
                       ({"work_units_burst": None}, "tenants[0].work_units_burst"),
                       ({"work_units_burst": float("nan")}, "tenants[0].work_units_burst")):
        with pytest.raises(InvalidArgument) as err:
            tenants_file.parse(_tenants(**bad))
        assert err.value.field == field, (bad, err.value.field)
        assert field in err.value.message
    ok = tenants_file.parse(_tenants(work_units_per_second=0, work_units_burst=5))
    assert ok.budgets == {"acme": (0.0, 5.0)}
    assert tenants_file.parse(_tenants(work_units_burst=7)).budgets == {"acme": (None, 7.0)}
    assert tenants_file.parse(TENANTS).budgets == {}


def test_a_bad_budget_on_sighup_keeps_the_previous_one_and_a_good_one_applies(budgeted) -> None:  # type: ignore[no-untyped-def]
    a = Worker(budgeted.stub(), "alice", "acme")
    a.admit(list(range(1, 9)))
    _listing(a, 100)
    before = _seen(a)
    _reload(budgeted, _tenants(work_units_burst="lots"), "tenants reload failed")
    assert "tenants[0].work_units_burst" in budgeted.log_text()
    with pytest.raises(grpc.RpcError) as err:  # still acme's own small budget
        _listing(a, 100)
    assert err.value.code() == S.RESOURCE_EXHAUSTED
    assert f"tenants.work_units_burst={BURST}" in err.value.details()
    assert _seen(a) == before
    # A good reload raises acme's rate: the bucket refills at once and the page is served.
    _reload(budgeted, _tenants(work_units_per_second=100_000_000, work_units_burst=BURST),
            "tenants reloaded")
    deadline = time.monotonic() + 10
    while True:  # the refill needs the clock to move a little (1 ms pays for the page)
        try:
            page = _listing(a, 100)
            break
        except grpc.RpcError as exc:
            assert exc.code() == S.RESOURCE_EXHAUSTED and time.monotonic() < deadline
            time.sleep(0.01)
    assert [(s.sequence_id, s.num_tokens) for s in page.sequences] == before[:1]
    # Removing the override gives acme the daemon-wide budget (10M/s) again.
    _reload(budgeted, _tenants(), "tenants reloaded")
    for _ in range(5):
        _listing(a, 100)
