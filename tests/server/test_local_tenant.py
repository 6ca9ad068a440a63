"""The laptop default (no tenants file): the anonymous caller acts for tenant ``default`` and may
list, inspect and flush that tenant's sequences and prefixes without any token; with a tenants
file, a tenant can do the same with its own and never with another tenant's (refused with the
isolation rules' statuses, nothing changed).

Everything runs against real daemons over their real Unix sockets; blockctl runs as a
subprocess from a directory that is not the daemon's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from daemon_proc import LAYOUT, NS, TOKENS, Daemon, Worker, commit, md, release, start

from blockd.api.v1 import blockd_pb2 as pb
from blockd.api.v1 import blockd_pb2_grpc as pb_grpc

S = grpc.StatusCode
LAPTOP = {"tenants": {"file": "", "allow_anonymous": True}}


@pytest.fixture(scope="module")
def laptop(tmp_path_factory: pytest.TempPathFactory) -> Daemon:
    d = start(tmp_path_factory.mktemp("laptop"), extra=LAPTOP)
    yield d
    d.stop()


class Anonymous(Worker):
    """A worker without a credential (``md(None)`` is no metadata): the laptop default's
    anonymous caller, attached as worker "laptop-worker" for tenant ``default``."""

    def __init__(self, stub: pb_grpc.BlockdServiceStub) -> None:
        self.stub, self.who = stub, None  # type: ignore[assignment]
        self.att = stub.Attach(pb.AttachRequest(worker_name="laptop-worker",
                                                tenant_id="default", layout=LAYOUT))
        self.sid, self.epoch, self.step_id, self.fence = self.att.session_id, self.att.epoch, 0, 0


def ctl(d: Daemon, cwd: Path, *args: str, token: str | None = None
        ) -> subprocess.CompletedProcess[str]:
    """blockctl in ``cwd`` (not the daemon's directory), the daemon named by $BLOCKD_TARGET."""
    env = {"PATH": "/usr/bin:/bin", "BLOCKD_TARGET": f"unix:{d.endpoints['unix']}"}
    if token:
        env["BLOCKD_TOKEN"] = TOKENS[token]
    return subprocess.run([sys.executable, "-m", "blockd_apps.ctl", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)


def listing(stub: object, who: str | None, **kw: object) -> pb.ListSequencesResponse:
    return stub.ListSequences(pb.ListSequencesRequest(**kw), metadata=md(who))  # type: ignore[attr-defined]


def lookup(w: Worker, tokens: list[int]) -> int:
    return w.stub.Lookup(pb.LookupRequest(session_id=w.sid, epoch=w.epoch, namespace=NS,
                                          token_ids=tokens), metadata=md(w.who)).num_cached_tokens


def cache(w: Worker, tokens: list[int], keep: bool) -> str:
    """Admit, commit and complete ``tokens`` (their full blocks get indexed); keep the sequence
    live, or release it so that its blocks are merely cached."""
    a = w.admit(tokens)
    w.step(commit(a.sequence_id))
    w.step(completed=w.fence)
    if not keep:
        w.step(release(a.sequence_id))
        w.step(completed=w.fence)
    return a.sequence_id


# -- the laptop default ------------------------------------------------------------------------


def test_the_local_tenant_lists_inspects_and_flushes_its_own_without_a_token(
        laptop: Daemon, tmp_path: Path) -> None:
    w = Anonymous(laptop.stub())
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    seqs = {cache(w, prompt, keep=True), w.admit([1, 2, 3]).sequence_id,
            w.admit(list(range(20, 33))).sequence_id}
    assert lookup(w, prompt) == 8

    # list: every live sequence of tenant default, with its session, tokens and blocks
    page = listing(w.stub, None)
    assert list(page.tenant_ids) == ["default"] and not page.admin and not page.next_page_token
    assert {s.sequence_id for s in page.sequences} == seqs
    assert [s.sequence_id for s in page.sequences] == sorted(seqs)
    by_id = {s.sequence_id: s for s in page.sequences}
    for s in page.sequences:
        assert (s.session_id, s.tenant_id, s.worker_name) == (w.sid, "default", "laptop-worker")
        assert s.num_blocks == -(-s.num_tokens // 4)
    assert sorted(s.num_tokens for s in page.sequences) == [3, 10, 13]
    # ... one bounded page at a time: the pages join up to the whole list, in order
    token, got = "", []
    while True:
        p = listing(w.stub, None, page_size=1, page_token=token)
        assert len(p.sequences) == 1
        got += [s.sequence_id for s in p.sequences]
        token = p.next_page_token
        if not token:
            break
    assert got == sorted(seqs)

    out = ctl(laptop, tmp_path, "sequences")
    assert out.returncode == 0, out.stderr
    assert all(sid in out.stdout for sid in seqs) and "3 sequences of default" in out.stdout
    js = json.loads(ctl(laptop, tmp_path, "--json", "sequences").stdout)
    assert {s["sequence_id"] for s in js} == seqs

    # inspect (and GetBlockTable) without a session id and without a token
    seq = next(s for s in seqs if by_id[s].num_tokens == 10)
    table = w.stub.GetBlockTable(pb.GetBlockTableRequest(sequence_id=seq))
    assert table.num_tokens == 10 and len(table.block_ids) == 3
    ins = json.loads(ctl(laptop, tmp_path, "--json", "inspect", seq).stdout)
    assert len(ins["positions"]) == 10
    assert [p.get("physical_block", 0) for p in ins["positions"][::4]] == list(table.block_ids)
    out = ctl(laptop, tmp_path, "inspect", seq)
    assert out.returncode == 0 and out.stdout.startswith(f"sequence {seq}: 10 tokens")

    # flush: blockctl names the caller's tenant; the cached prefix is gone
    w.step(release(seq))
    w.step(completed=w.fence)
    assert lookup(w, prompt) == 8
    out = ctl(laptop, tmp_path, "flush")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "flushed 2 blocks of tenant default"
    assert lookup(w, prompt) == 0
    assert {s.sequence_id for s in listing(w.stub, None).sequences} == seqs - {seq}


def expect_refused(code: S, field: str, call: Callable[[], object],
                   state: Callable[[], object]) -> None:
    """``call`` fails with ``code`` naming ``field``, and ``state()`` is what it was."""
    before = state()
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, info.value.details()
    assert (info.value.details() or "").startswith(field + ":"), info.value.details()
    assert state() == before


def test_the_local_tenant_gets_clear_errors_and_nothing_changes(laptop: Daemon) -> None:
    w = Anonymous(laptop.stub())
    seq = w.admit([7, 7, 7, 7, 7]).sequence_id
    stub = w.stub

    def state() -> tuple[bytes, bytes]:
        s = stub.Stats(pb.StatsRequest())
        return s.SerializeToString(), listing(stub, None).SerializeToString()

    expect_refused(S.INVALID_ARGUMENT, "page_size",
                   lambda: listing(stub, None, page_size=10_001), state)
    expect_refused(S.INVALID_ARGUMENT, "tenant_id",
                   lambda: listing(stub, None, tenant_id="x" * 200), state)
    expect_refused(S.INVALID_ARGUMENT, "page_token",
                   lambda: listing(stub, None, page_token="x" * 200), state)
    expect_refused(S.PERMISSION_DENIED, "tenant_id",
                   lambda: listing(stub, None, tenant_id="acme"), state)
    expect_refused(S.NOT_FOUND, "sequence_id",
                   lambda: stub.Inspect(pb.InspectRequest(sequence_id="no-such-sequence")), state)
    expect_refused(S.INVALID_ARGUMENT, "max_positions",
                   lambda: stub.Inspect(pb.InspectRequest(sequence_id=seq,
                                                          max_positions=70_000)), state)
    expect_refused(S.PERMISSION_DENIED, "tenant_id",
                   lambda: stub.FlushNamespace(pb.FlushNamespaceRequest(model_id="tiny")), state)
    expect_refused(S.UNAUTHENTICATED, "authorization",
                   lambda: stub.ListSequences(pb.ListSequencesRequest(),
                                              metadata=(("authorization", "Bearer nope"),)),
                   state)
    w.step(release(seq))


# -- two tenants: never another tenant's -------------------------------------------------------


def test_a_tenant_cannot_list_inspect_or_flush_another_tenants(daemon: Daemon,
                                                                tmp_path: Path) -> None:
    # Leases no run of blockctl outlasts (a new Python process each, seconds apiece under
    # load, while these sessions send nothing: the default 10 s ran out in a full suite).
    a = Worker(daemon.stub(), "alice", "acme", lease_ms=300_000)
    b = Worker(daemon.stub(), "bob", "globex", lease_ms=300_000)
    prompt = list(range(4000, 4010))
    live_a = cache(a, prompt, keep=True)
    cache(a, list(range(4100, 4110)), keep=False)  # merely cached blocks too
    live_b = b.admit([5, 5, 5, 5, 5]).sequence_id
    admin = daemon.stub()

    def state() -> tuple[bytes, bytes, int]:
        s = admin.Stats(pb.StatsRequest(), metadata=md("admin"))
        everything = listing(admin, "admin")
        return s.SerializeToString(), everything.SerializeToString(), lookup(a, prompt)

    assert lookup(a, prompt) == 8
    # bob lists only globex's; alice only acme's; an admin all; "multi" (acme and globex) both
    mine = listing(b.stub, "bob")
    assert list(mine.tenant_ids) == ["globex"] and not mine.admin
    assert live_a not in {s.sequence_id for s in mine.sequences}
    assert live_b in {s.sequence_id for s in mine.sequences}
    assert {s.tenant_id for s in mine.sequences} == {"globex"}
    assert {s.tenant_id for s in listing(a.stub, "alice").sequences} == {"acme"}
    everything = listing(admin, "admin")
    assert everything.admin and {"acme", "globex"} <= set(everything.tenant_ids)
    assert {live_a, live_b} <= {s.sequence_id for s in everything.sequences}
    both = listing(admin, "multi")
    assert list(both.tenant_ids) == ["acme", "globex"]
    assert {live_a, live_b} <= {s.sequence_id for s in both.sequences}

    with pytest.raises(grpc.RpcError) as info:
        b.stub.Inspect(pb.InspectRequest(sequence_id="A" * 22), metadata=md("bob"))
    unknown = (info.value.code(), info.value.details())
    assert unknown[0] == S.NOT_FOUND
    # Refused, and nothing changed: bob names acme, or acme's sequence without a session.
    expect_refused(S.PERMISSION_DENIED, "tenant_id",
                   lambda: listing(b.stub, "bob", tenant_id="acme"), state)
    for rpc, req in ((b.stub.Inspect, pb.InspectRequest(sequence_id=live_a)),
                     (b.stub.GetBlockTable, pb.GetBlockTableRequest(sequence_id=live_a))):
        expect_refused(S.NOT_FOUND, "sequence_id", lambda r=rpc, q=req: r(q, metadata=md("bob")),
                       state)
        # the very answer an id nobody minted gets: acme's sequence is not revealed
        with pytest.raises(grpc.RpcError) as info:
            rpc(req, metadata=md("bob"))
        assert (info.value.code(), info.value.details()) == unknown
    expect_refused(S.PERMISSION_DENIED, "tenant_id",
                   lambda: b.stub.FlushNamespace(pb.FlushNamespaceRequest(tenant_id="acme"),
                                                 metadata=md("bob")), state)
    # ... and through blockctl: a clear line, exit 1, nothing changed
    before = state()
    for args in (("flush", "--tenant", "acme"), ("sequences", "--tenant", "acme"),
                 ("inspect", live_a)):
        out = ctl(daemon, tmp_path, *args, token="bob")
        assert out.returncode == 1, (args, out.stdout, out.stderr)
        assert out.stderr.startswith("blockctl: ") and len(out.stderr.splitlines()) == 1
        assert "Traceback" not in out.stderr
    assert state() == before
    out = ctl(daemon, tmp_path, "sequences", token="bob")
    assert live_a not in out.stdout and live_b in out.stdout

    # A credential of acme may inspect acme's sequence of another worker's session.
    assert daemon.stub().Inspect(pb.InspectRequest(sequence_id=live_a),
                                 metadata=md("multi")).num_tokens == 10
    # An admin naming an unknown tenant: NOT_FOUND on tenant_id.
    expect_refused(S.NOT_FOUND, "tenant_id",
                   lambda: listing(admin, "admin", tenant_id="nobody"), state)

    # bob's own flush (blockctl names globex) leaves acme's prefix alone.
    out = ctl(daemon, tmp_path, "flush", token="bob")
    assert out.returncode == 0 and out.stdout.startswith("flushed ") \
        and out.stdout.strip().endswith("of tenant globex"), out.stdout + out.stderr
    assert lookup(a, prompt) == 8
    # "multi" acts for two tenants: blockctl asks which one rather than guess.
    out = ctl(daemon, tmp_path, "flush", token="multi")
    assert out.returncode == 2 and "--tenant" in out.stderr and "acme, globex" in out.stderr
    assert lookup(a, prompt) == 8
    for w, s in ((a, live_a), (b, live_b)):
        w.step(release(s))
