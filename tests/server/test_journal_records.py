"""Every journal record kind round-trips through its list form and through the journal file,
its list form is the one earlier daemons wrote (a journal outlives the process), and a list
that is not a record of its kind is refused naming the kind (recovery treats it as corrupt)."""

from __future__ import annotations

import pytest

from blockd.core.namespace import PrefixScope
from blockd.core.tenants import Sharing, TenantPolicy
from blockd.runtime import journal
from blockd.runtime.journal_records import (
    AdoptRecord,
    AttachRecord,
    DetachRecord,
    FenceRecord,
    FlushRecord,
    Record,
    RevokeRecord,
    StepRecord,
    TenantsRecord,
    from_record,
)

POLICIES = (TenantPolicy("acme", quota_blocks=10, sharing=Sharing.PUBLIC),
            TenantPolicy("beta", quota_blocks=4, priority=2))

#: Each kind, and the exact list it is written as (the positional format of every earlier
#: daemon's journal: a record it wrote must still replay).
CASES: list[tuple[Record, list[object]]] = [
    (AttachRecord("s1", "acme", "alice", "worker-0", 30000),
     ["attach", "s1", "acme", "alice", "worker-0", 30000]),
    (DetachRecord("s1", "lease expired"), ["detach", "s1", "lease expired"]),
    (FenceRecord("s1", 2**63 - 1), ["fence", "s1", 2**63 - 1]),
    (StepRecord("s1", b"\x0a\x02s1\x10\x07", ("q-1", "q-2"), ((0, b"\x08\x08"), (3, b"")),
                (2, 5)),
     ["step", "s1", b"\x0a\x02s1\x10\x07", ["q-1", "q-2"], [[0, b"\x08\x08"], [3, b""]],
      [2, 5]]),
    (FlushRecord(model_id="m", lora_id="l"),
     ["flush", {"model_id": "m", "model_revision": None, "lora_id": "l", "tenant_id": None}]),
    (RevokeRecord("s2", "credential removed"), ["revoke", "s2", "credential removed"]),
    (AdoptRecord("acme", PrefixScope("m", "r1", None, b"\x01\x02", None), b"\x05\0\0\0" * 8,
                 2, 3, (1,)),
     ["adopt", "acme", ["m", "r1", None, b"\x01\x02", None], b"\x05\0\0\0" * 8, 2, 3, [1]]),
]


@pytest.mark.parametrize("record,listed", CASES, ids=[r.kind for r, _ in CASES])
def test_each_kind_round_trips_in_its_pinned_list_form(record: Record, listed: list[object],
                                                       tmp_path) -> None:
    assert record.to_record() == listed
    assert from_record(listed) == record
    path = str(tmp_path / "journal.1")
    j = journal.Journal(path)
    j.append(record.to_record())
    j.close()
    (back,) = journal.read(path)
    assert from_record(back) == record


def test_a_tenants_record_round_trips_its_policies(tmp_path) -> None:
    record = TenantsRecord(POLICIES)
    listed = record.to_record()
    assert listed[0] == "tenants" and isinstance(listed[1], bytes)
    path = str(tmp_path / "journal.1")
    j = journal.Journal(path)
    j.append(listed)
    j.close()
    (back,) = journal.read(path)
    assert from_record(back) == record
    assert from_record(back).policies[1].priority == 2


def test_a_step_record_from_before_tiers_replays_with_no_failed_copy() -> None:
    old = ["step", "s1", b"\x0a\x02s1", ["q-1"], [[0, b"\x08\x08"]]]
    assert from_record(old) == StepRecord("s1", b"\x0a\x02s1", ("q-1",), ((0, b"\x08\x08"),))
    assert from_record(old).io_failures == ()


@pytest.mark.parametrize("raw,message", [
    (["attach", "s1", "acme", "alice", "w"], "'attach': 4 items, expected 5"),
    (["attach", "s1", "acme", "alice", "w", True], "'attach': item 5 is a bool"),
    (["fence", "s1", "7"], "'fence': item 2 is a str"),
    (["step", "s1", b"", ["q"], [[0]]], "'step': a failed operation"),
    (["step", "s1", b"", [1], []], "'step': a minted sequence id"),
    (["step", "s1", b"", [], [], ["1"]], "'step': a failed tier copy"),
    (["flush", {"model": "m"}], "'flush': filters"),
    (["tenants", b"\x80\x04N."], "'tenants': not a list"),
    (["adopt", "acme", ["m", None, None, "x", None], b"", 0, 1, []], "'adopt': the scope"),
    (["adopt", "acme", ["m", None, None, None, None], b"", 0, 1, [None]],
     "'adopt': a failed tier copy"),
    (["wipe", "everything"], "unknown journal record 'wipe'"),
    ([], "a journal record is a list"),
    ("attach", "a journal record is a list"),
])
def test_a_list_that_is_no_record_of_its_kind_is_refused_naming_it(raw: object,
                                                                  message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        from_record(raw)
