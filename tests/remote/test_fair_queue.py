"""The remote tier's fetch queue (``blockd.tiers.fair_queue``): tenants served in turn, each
bounded on its own, a closed queue wakes its reader. Real threads, no cluster."""

from __future__ import annotations

import threading
import time

import pytest

from blockd.tiers.fair_queue import FairQueue


def drain(q: FairQueue[str]) -> list[str]:
    out = []
    while (item := q.get(timeout=0)) is not None:
        out.append(item)
    return out


def test_tenants_are_served_in_turn_whatever_one_of_them_queued() -> None:
    q: FairQueue[str] = FairQueue(per_tenant=100)
    for i in range(50):
        assert q.put("flood", f"f{i}")
    assert q.put("quiet", "q0") and q.put("other", "o0") and q.put("quiet", "q1")
    got = drain(q)
    # "quiet" and "other" came after fifty of "flood"'s, and wait one of them each.
    assert got[:5] == ["f0", "q0", "o0", "f1", "q1"]
    assert got[5:] == [f"f{i}" for i in range(2, 50)]


def test_each_tenant_is_bounded_alone() -> None:
    q: FairQueue[str] = FairQueue(per_tenant=3)
    assert [q.put("a", f"a{i}") for i in range(5)] == [True, True, True, False, False]
    assert q.put("b", "b0")  # another tenant is never refused for a's
    assert q.waiting("a") == 3 and q.waiting("b") == 1 and q.waiting("c") == 0
    assert q.get(timeout=0) == "a0"
    assert q.put("a", "a9")  # a's share has room again
    assert drain(q) == ["b0", "a1", "a2", "a9"]


def test_close_wakes_a_waiting_reader_and_refuses_from_then_on() -> None:
    q: FairQueue[str] = FairQueue(per_tenant=2)
    got: list[str | None] = []
    reader = threading.Thread(target=lambda: got.append(q.get(timeout=30)))
    reader.start()
    time.sleep(0.1)
    q.close()
    reader.join(5)
    assert not reader.is_alive() and got == [None]
    assert not q.put("a", "x") and q.get(timeout=0) is None


def test_a_put_wakes_a_waiting_reader() -> None:
    q: FairQueue[str] = FairQueue(per_tenant=2)
    got: list[str | None] = []
    reader = threading.Thread(target=lambda: got.append(q.get(timeout=30)))
    reader.start()
    q.put("a", "x")
    reader.join(5)
    assert got == ["x"]


def test_a_bound_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="per_tenant"):
        FairQueue(per_tenant=0)
