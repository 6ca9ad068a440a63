"""``blockd_vllm.admits`` once a request gave up waiting (``admit_wait_s``): every way its
admit's answer can come back, with blockd's own result messages. A plan is adopted; a refusal
for room, a remote fetch under way or a Step that did not apply leave nothing behind; a request
that ended first has its plan released; a lost Step is not sent again for it.
(test_connector_admit_wait.py runs the whole path against a real daemon.)"""

from __future__ import annotations

import time
from collections import Counter
from types import SimpleNamespace

import grpc
from blockd_vllm.admits import NO_HIT, Admits
from blockd_vllm.plan import Plan
from blockd_vllm.settings import Settings

from blockd.api.v1 import blockd_pb2 as pb

B = 32


class Namespaces:
    """The engine's namespace as the admits need it (one per request)."""

    def for_request(self, request: object) -> pb.CacheNamespace:
        return pb.CacheNamespace(model_id="m")


def admits() -> tuple[Admits, list[Plan], list[tuple[str, Plan]]]:
    released: list[Plan] = []
    adopted: list[tuple[str, Plan]] = []
    a = Admits(Settings(target="unix:/x.sock", tenant="t"), Namespaces(), B,  # type: ignore[arg-type]
               Counter(), released.append, lambda rid, plan: adopted.append((rid, plan)))
    return a, released, adopted


def request(rid: str) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(1, 101)))


def gave_up(a: Admits, rids: list[str]) -> list[str]:
    """Ask each, send their admits, then ask again past the wait: each is given up."""
    for rid in rids:
        assert a.ask(request(rid), 0.0) is None
    sent, _ = a.take()
    time.sleep(0.001)
    for rid in rids:
        assert a.ask(request(rid), 0.0) == NO_HIT
        assert a.ask(request(rid), None) == NO_HIT  # and stays so, waiting or not
    assert a.gave_up == set(rids)
    return sent


def admitted(seq: str, cached: int = 0) -> pb.OperationResult:
    r = pb.OperationResult()
    r.admit.sequence_id = seq
    r.admit.num_cached_tokens = cached
    r.admit.block_table.extend(range(4))
    return r


def session() -> SimpleNamespace:
    return SimpleNamespace(epoch=1, session_id="s")


def test_an_idle_ask_never_gives_up() -> None:
    a, _, _ = admits()
    assert a.ask(request("r"), None) is None
    a.take()
    time.sleep(0.001)
    assert a.ask(request("r"), None) is None  # wait_s None: the engine ran nothing
    assert a.ask(request("r"), 10.0) is None  # not yet past the wait
    assert not a.gave_up


def test_a_late_plan_is_adopted_with_its_hit_already_in_blockd() -> None:
    a, released, adopted = admits()
    rids = gave_up(a, ["r"])
    no_room, pending = a.answered(rids, [admitted("q", cached=64)], session())
    assert (no_room, pending) == ([], [])
    ((rid, plan),) = adopted
    assert rid == "r" and plan.seq_id == "q" and (plan.saved, plan.committed) == (2, 2)
    assert not released and not a.in_flight and not a.gave_up and not a.answers
    assert a.counters["admit_wait_expired"] == 1


def test_a_late_refusal_for_room_or_a_fetch_under_way_leaves_nothing() -> None:
    a, released, adopted = admits()
    rids = gave_up(a, ["room", "fetch"])
    room = pb.OperationResult()
    room.status.code = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    fetch = pb.OperationResult()
    fetch.admit.pending_remote_blocks = 3  # nothing admitted
    no_room, pending = a.answered(rids, [room, fetch], session())
    assert (no_room, pending) == ([], [])  # no hit-only retry, no remote wait: it computed
    assert not adopted and not released
    assert not a.in_flight and not a.gave_up and not a.answers


def test_a_request_that_ended_first_has_its_late_plan_released() -> None:
    a, released, adopted = admits()
    rids = gave_up(a, ["r"])
    a.finished("r")
    a.answered(rids, [admitted("q")], session())
    assert [p.seq_id for p in released] == ["q"] and not adopted
    assert not a.in_flight and not a.gave_up and not a.cancelled


def test_a_lost_step_is_not_sent_again_for_a_request_that_gave_up() -> None:
    a, released, adopted = admits()
    rids = gave_up(a, ["r"])
    assert a.resend(rids) == ["r"]  # the caller files it: no answer, nothing to adopt
    a.answered(["r"], None, session())
    assert not a.queued and not a.in_flight and not a.gave_up
    assert not adopted and not released
