"""Sessions belong to a credential, and a tenants reload that removes rights ends them.

Issue 15's findings, each against a real daemon with a real tenants file: two credentials with
the same name (or token) are refused at start and on SIGHUP (the previous tenants kept); another
credential cannot use a session even for the same tenant; a SIGHUP that removes a tenant or a
credential revokes its sessions (FAILED_PRECONDITION naming why on their next call, their
sequences released) and flushes the removed tenant's private prefixes, also across a
``kill -9`` and the journal replay.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from daemon_proc import NS, TENANTS, TOKENS, Daemon, Worker, append, commit, md, start

from blockd.api.v1 import blockd_pb2 as pb
from blockd.core.errors import InvalidArgument
from blockd.runtime import tenants_file
from blockd.runtime.tenants_file import token_hash

PROMPT = [701, 702, 703, 704, 705, 706, 707, 708, 709]
TOKENS.setdefault("alice2", "tok-alice2")
TOKENS.setdefault("newco", "tok-newco")


def _file(**changes: Any) -> dict[str, Any]:
    t: dict[str, Any] = yaml.safe_load(yaml.safe_dump(TENANTS))
    t["workers"].append({"name": "alice2", "token_sha256": token_hash(TOKENS["alice2"]),
                         "tenants": ["acme"]})
    t.update(changes)
    return t


def _code(call: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def _cached(w: Worker, tokens: list[int]) -> int:
    return w.stub.Lookup(pb.LookupRequest(session_id=w.sid, epoch=w.epoch, namespace=NS,
                                          token_ids=tokens), metadata=md(w.who)).num_cached_tokens


def _stats(d: Daemon) -> pb.StatsResponse:
    return d.stub().Stats(pb.StatsRequest(), metadata=md("admin"))


def _reload(d: Daemon, tenants: dict[str, Any] | str, wait_for: str) -> None:
    """Write the tenants file, SIGHUP, and wait for the n-th log line ``wait_for``."""
    before = d.log_text().count(wait_for)
    d.tenants_path.write_text(tenants if isinstance(tenants, str) else yaml.safe_dump(tenants))
    d.signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while d.log_text().count(wait_for) <= before:
        assert time.monotonic() < deadline, f"no {wait_for!r} in the daemon's log"
        time.sleep(0.05)


def _dup_name() -> dict[str, Any]:
    t = _file()
    t["workers"].append({"name": "alice", "token_sha256": token_hash("tok-evil"),
                         "tenants": ["globex"]})
    return t


def _dup_token() -> dict[str, Any]:
    t = _file()
    t["workers"].append({"name": "evil", "token_sha256": token_hash(TOKENS["alice"]),
                         "tenants": ["globex"]})
    return t


# -- the file ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("data", "field"), [
    (_dup_name(), "workers[7].name"), (_dup_token(), "workers[7].token_sha256"),
    (_file(workers=[{"token_sha256": "0" * 64, "tenants": []}]), "workers[0].name"),
    (_file(workers=[{"name": "anonymous", "token_sha256": "0" * 64}]), "workers[0].name"),
])
def test_a_credential_needs_its_own_name_and_token(data: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        tenants_file.parse(data)
    assert info.value.field == field


def test_a_daemon_does_not_start_on_two_credentials_named_alike(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError) as info:
        start(tmp_path / "dup", tenants=_dup_name()).stop()
    assert "workers[7].name" in str(info.value)


@pytest.mark.parametrize("bad", [_dup_name, _dup_token], ids=["name", "token"])
def test_a_sighup_with_duplicate_credentials_keeps_the_previous_ones(tmp_path: Path,
                                                                      bad: Any) -> None:
    with start(tmp_path / "d", tenants=_file()) as d:
        alice = Worker(d.stub(), "alice", "acme")
        seq = alice.admit([1, 2, 3]).sequence_id
        _reload(d, bad(), "reload failed")
        assert "workers[7]" in d.log_text()
        # The refused file changed nothing: the second credential does not exist...
        evil = (("authorization", "Bearer tok-evil"),)
        code, _ = _code(lambda: d.stub().Stats(pb.StatsRequest(), metadata=evil))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        # ... alice's token still means alice only (acme), and her session goes on.
        assert [t.tenant_id for t in alice.stats().tenants] == ["acme"]
        assert alice.step(append(seq, [4])).results[0].append.num_tokens == 4
        assert _stats(d).num_sessions == 1


# -- ownership -----------------------------------------------------------------------------------

def test_another_credential_of_the_same_tenant_cannot_use_a_session(tmp_path: Path) -> None:
    with start(tmp_path / "d", tenants=_file()) as d:
        alice = Worker(d.stub(), "alice", "acme")
        seq = alice.admit([1, 2, 3, 4, 5]).sequence_id
        table = list(alice.stub.GetBlockTable(pb.GetBlockTableRequest(
            session_id=alice.sid, sequence_id=seq), metadata=md("alice")).block_ids)
        other = md("alice2")  # acts for acme too, and attached (as "alice") a session of its own
        mine = Worker(d.stub(), "alice2", "acme")
        stub = d.stub()
        calls = {
            "Step": lambda: stub.Step(pb.StepRequest(
                session_id=alice.sid, epoch=alice.epoch, step_id=99, operations=[
                    pb.Operation(release=pb.ReleaseOp(sequence_id=seq))]), metadata=other),
            "Heartbeat": lambda: stub.Heartbeat(pb.HeartbeatRequest(
                session_id=alice.sid, epoch=alice.epoch), metadata=other),
            "Lookup": lambda: stub.Lookup(pb.LookupRequest(
                session_id=alice.sid, epoch=alice.epoch, namespace=NS, token_ids=[1, 2]),
                metadata=other),
            "Inspect": lambda: stub.Inspect(pb.InspectRequest(
                session_id=alice.sid, sequence_id=seq), metadata=other),
            "Detach": lambda: stub.Detach(pb.DetachRequest(session_id=alice.sid),
                                          metadata=other),
            "Attach(resume)": lambda: stub.Attach(pb.AttachRequest(
                worker_name="alice", tenant_id="acme", layout=alice.att.pool.layout,
                resume_session_id=alice.sid), metadata=other),
        }
        for name, call in calls.items():
            code, details = _code(call)
            assert code == grpc.StatusCode.PERMISSION_DENIED, (name, details)
        # Nothing changed: alice's session, sequence and table are as they were.
        assert _stats(d).num_sessions == 2
        got = alice.stub.GetBlockTable(pb.GetBlockTableRequest(
            session_id=alice.sid, sequence_id=seq), metadata=md("alice"))
        assert list(got.block_ids) == table and got.num_tokens == 5
        assert alice.step(append(seq, [6])).results[0].append.num_tokens == 6
        assert mine.admit([9, 9]).sequence_id


# -- reloads that remove -------------------------------------------------------------------------

def _seeded(d: Daemon) -> tuple[Worker, Worker, str]:
    """multi (acme + globex) seeds PROMPT's private acme prefix and keeps a live sequence."""
    multi = Worker(d.stub(), "multi", "acme")
    first = multi.admit(PROMPT)
    multi.step(commit(first.sequence_id))
    multi.step(completed=multi.fence)
    live = multi.admit([801, 802, 803, 804, 805]).sequence_id
    alice = Worker(d.stub(), "alice", "acme")
    assert _cached(alice, PROMPT + [1]) == 8  # the control: a hit before the reload
    return multi, alice, live


def _without_acme() -> dict[str, Any]:
    t = _file()
    t["tenants"] = [x for x in t["tenants"] if x["id"] != "acme"]
    t["workers"] = [w for w in t["workers"] if w["name"] not in ("alice", "alice2")]
    for w in t["workers"]:
        w["tenants"] = [x for x in w["tenants"] if x != "acme"]
    return t


def _acme_again() -> dict[str, Any]:
    t = _without_acme()
    t["tenants"].append({"id": "acme", "quota_blocks": 40, "sharing": "private"})
    t["workers"].append({"name": "newco", "token_sha256": token_hash(TOKENS["newco"]),
                         "tenants": ["acme"]})
    return t


def _check_removed(d: Daemon, multi: Worker, live: str) -> None:
    # The credential that stays gets FAILED_PRECONDITION naming why, on every call but Detach.
    code, details = _code(lambda: multi.step(append(live, [6])))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "tenant 'acme' was removed" in details
    code, details = _code(lambda: multi.stub.Heartbeat(pb.HeartbeatRequest(
        session_id=multi.sid, epoch=multi.epoch), metadata=md("multi")))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "acme" in details
    # The removed credential is unknown.
    code, _ = _code(lambda: d.stub().Stats(pb.StatsRequest(), metadata=md("alice")))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    # Their sequences were released under their fences: multi's last one (2) is unreported,
    # so its blocks wait until the worker detaches (done with its GPU work); alice's session,
    # with nothing pending, is closed by the reaper.
    assert _stats(d).num_sequences == 0 and _stats(d).blocks_pending > 0
    assert multi.stub.Detach(pb.DetachRequest(session_id=multi.sid),
                             metadata=md("multi")).num_sequences_released == 0
    deadline = time.monotonic() + 10
    while (s := _stats(d)).num_sessions or s.blocks_pending:
        assert time.monotonic() < deadline, s
        time.sleep(0.05)
    # A tenant configured later under the same id gets no hits on the old private prefixes.
    _reload(d, _acme_again(), "tenants reloaded")
    newco = Worker(d.stub(), "newco", "acme")
    assert _cached(newco, PROMPT + [1]) == 0
    assert newco.admit(PROMPT + [1]).num_cached_tokens == 0


def test_a_sighup_removing_a_tenant_revokes_its_sessions_and_flushes_its_prefixes(
        tmp_path: Path) -> None:
    with start(tmp_path / "d", tenants=_file()) as d:
        multi, _alice, live = _seeded(d)
        used = {t.tenant_id: t for t in _stats(d).tenants}["acme"]
        assert used.used_blocks > 0
        _reload(d, _without_acme(), "tenants reloaded")
        assert "session revoked" in d.log_text()
        _check_removed(d, multi, live)


def test_a_sighup_removing_a_credentials_tenant_revokes_only_those_sessions(
        tmp_path: Path) -> None:
    with start(tmp_path / "d", tenants=_file()) as d:
        multi_acme = Worker(d.stub(), "multi", "acme")
        multi_globex = Worker(d.stub(), "multi", "globex")
        idle = Worker(d.stub(), "multi", "acme")  # nothing pending: closed by the reaper
        a = multi_acme.admit([1, 2, 3, 4]).sequence_id
        multi_acme.step(commit(a))  # fence 1, never reported: the session waits for it
        g = multi_globex.admit([1, 2, 3]).sequence_id
        t = _file()
        for w in t["workers"]:
            if w["name"] == "multi":
                w["tenants"] = ["globex"]
        _reload(d, t, "tenants reloaded")
        code, details = _code(lambda: multi_acme.step(append(a, [4])))
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert "may no longer act for tenant 'acme'" in details
        assert multi_globex.step(append(g, [4])).results[0].append.num_tokens == 4
        deadline = time.monotonic() + 10
        while _stats(d).num_sessions > 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        code, details = _code(lambda: idle.step())  # closed, and still told why
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "acme" in details
        # A Detach of the revoked session is answered (its sequence was already released).
        assert multi_acme.stub.Detach(pb.DetachRequest(session_id=multi_acme.sid),
                                      metadata=md("multi")).num_sequences_released == 0


def test_a_token_rotation_keeps_the_credentials_sessions(tmp_path: Path) -> None:
    """The credential's identity is its name: a new token_sha256 under it is a rotation."""
    with start(tmp_path / "d", tenants=_file()) as d:
        alice = Worker(d.stub(), "alice", "acme")
        seq = alice.admit([1, 2, 3]).sequence_id
        t = _file()
        for w in t["workers"]:
            if w["name"] == "alice":
                w["token_sha256"] = token_hash("tok-alice-new")
        _reload(d, t, "tenants reloaded")
        new = (("authorization", "Bearer tok-alice-new"),)
        r = alice.stub.Step(pb.StepRequest(session_id=alice.sid, epoch=alice.epoch, step_id=9,
                                           operations=[append(seq, [4])]), metadata=new)
        assert r.results[0].append.num_tokens == 4
        assert "session revoked" not in d.log_text()


def test_a_revocation_is_replayed_after_kill9(tmp_path: Path) -> None:
    from test_crash_recovery import kill9, restart

    d = start(tmp_path, num_blocks=64, lease_ms=30_000, tenants=_file(),
              extra={"state": {"dir": str(tmp_path / "state")}})
    try:
        multi, _alice, live = _seeded(d)
        _reload(d, _without_acme(), "tenants reloaded")
        kill9(d)
        d = restart(d)
        multi.stub = d.stub()
        _check_removed(d, multi, live)
    finally:
        d.stop()


def test_a_closed_revoked_session_still_says_why_after_restarts(tmp_path: Path) -> None:
    """A revoked session the worker detached is remembered with its reason, in the journal
    and then in the snapshot every start writes: after two restarts its next call is still
    FAILED_PRECONDITION naming why, not NOT_FOUND."""
    from test_crash_recovery import kill9, restart

    d = start(tmp_path, num_blocks=64, lease_ms=30_000, tenants=_file(),
              extra={"state": {"dir": str(tmp_path / "state")}})
    try:
        multi, _alice, _live = _seeded(d)
        _reload(d, _without_acme(), "tenants reloaded")
        multi.stub.Detach(pb.DetachRequest(session_id=multi.sid), metadata=md("multi"))
        for _ in range(2):  # the second start reads the reason from the first's snapshot
            kill9(d)
            d = restart(d)
        multi.stub = d.stub()
        code, details = _code(lambda: multi.stub.Heartbeat(pb.HeartbeatRequest(
            session_id=multi.sid, epoch=multi.epoch), metadata=md("multi")))
        assert code == grpc.StatusCode.FAILED_PRECONDITION, details
        assert "tenant 'acme' was removed" in details, details
    finally:
        d.stop()


def test_a_detached_sessions_next_call_says_so_and_never_reattaches(tmp_path: Path) -> None:
    """Two holders of one session (vLLM's worker and scheduler side): after one detaches it,
    the other's Heartbeat, Step and Lookup are FAILED_PRECONDITION on ``session_id`` saying it
    was detached, so a ``blockd_client`` session does not re-attach (it does on NOT_FOUND: a
    reaped session) and the daemon holds no session. Another credential naming the id gets the
    unknown id's NOT_FOUND. A session the lease reaped is still re-attached."""
    from blockd_client import Client
    from blockd_client.errors import BlockdError
    from blockd_gpu import KvLayout

    layout = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")
    with start(tmp_path / "d", tenants=_file(), lease_ms=30_000) as d:
        client = Client(f"unix:{d.endpoints['unix']}", token=TOKENS["alice"])
        try:
            session = client.attach("acme", layout, worker_name="engine", map_pool=False)
            assert _stats(d).num_sessions == 1
            d.stub().Detach(pb.DetachRequest(session_id=session.session_id), metadata=md("alice"))
            with pytest.raises(BlockdError) as info:
                session.heartbeat()
            assert info.value.status == grpc.StatusCode.FAILED_PRECONDITION
            assert info.value.field == "session_id" and "detached" in info.value.message
            stub, sid, epoch = d.stub(), session.session_id, session.epoch
            calls = {
                "Step": lambda who: stub.Step(pb.StepRequest(
                    session_id=sid, epoch=epoch, step_id=1), metadata=md(who)),
                "Lookup": lambda who: stub.Lookup(pb.LookupRequest(
                    session_id=sid, epoch=epoch, namespace=NS, token_ids=[1, 2]),
                    metadata=md(who)),
                "Heartbeat": lambda who: stub.Heartbeat(pb.HeartbeatRequest(
                    session_id=sid, epoch=epoch), metadata=md(who)),
            }
            for name, call in calls.items():
                code, details = _code(lambda c=call: c("alice"))
                assert code == grpc.StatusCode.FAILED_PRECONDITION, (name, details)
                assert details.startswith("session_id: ") and "detached" in details
                code, details = _code(lambda c=call: c("alice2"))
                assert code == grpc.StatusCode.NOT_FOUND, (name, details)
                assert "detached" not in details
            assert _stats(d).num_sessions == 0  # nobody re-attached
            # A reaped session (no Detach) is re-attached by the client, as before.
            reaped = client.attach("acme", layout, worker_name="engine", map_pool=False,
                                   lease_ms=300)
            old = reaped.session_id
            deadline = time.monotonic() + 10
            while _stats(d).num_sessions and time.monotonic() < deadline:
                time.sleep(0.05)
            with pytest.raises(BlockdError) as info:
                reaped.heartbeat()
            assert type(info.value).__name__ == "EpochChanged"
            assert _stats(d).num_sessions == 1 and reaped.session_id != old
        finally:
            client.close()
