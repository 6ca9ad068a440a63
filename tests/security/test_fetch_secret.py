"""A leaked session id does not give away the session's pool (issue 28, finding 5).

Before, the handle socket pinned a session's pool to the first allowed uid that fetched it: a
process that learnt the id before the owner's fetch took the mapping (the tenant's K/V bytes)
and locked the owner out. Now the pool goes only to a request carrying the session's fetch
secret, which only the AttachResponse holds. With a real daemon, a real handle socket and the
attacker a process of its own (of another allowed uid, as root can start one, or of the owner's
very uid) that knows only the id: refused before and after the owner's fetch, with the answer an
unknown session gets; the owner is served after every refusal (nothing was pinned to the
attacker); after ``kill -9`` and a restart on the same ``state.dir`` the recovered session keeps
its secret (the owner fetches again, a resume returns the same secret) and the attacker is
still refused, while the pins of the old process are gone. The secret reaches no log line, no
metric, no Stats, Inspect or listing answer, and no file of the state directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import pytest
from daemon_proc import Daemon, Worker, kill9, md, restart, start

from blockd import handle_wire
from blockd.api.v1 import blockd_pb2 as pb
from blockd_client.handles import fetch_handles

HERE = Path(__file__).resolve().parent
OTHER_UID = 65534  # nobody: an allowed uid of the handle socket, not the owner's
WORKERS_GID = 65534
PROMPT = list(range(40, 49))

attackers = pytest.mark.parametrize("uid", [
    pytest.param(None, id="same-uid-process"),
    pytest.param(OTHER_UID, id="another-allowed-uid", marks=pytest.mark.skipif(
        os.geteuid() != 0, reason="acting as another uid needs root (setuid in the child)")),
])


@pytest.fixture
def shared():
    # A directory every uid can traverse, for the handle socket (pytest's tmp dirs are 0700).
    path = Path(tempfile.mkdtemp(prefix="blockd-fetch-"))
    path.chmod(0o755)
    yield path
    for p in path.iterdir():
        p.unlink()
    path.rmdir()


def _start(tmp_path: Path, shared: Path) -> Daemon:
    extra = {"server": {"handle_socket": str(shared / "pool.sock")},
             "handles": {"allowed_uids": f"{os.geteuid()},{OTHER_UID}"},
             "state": {"dir": str(tmp_path / "state")}}
    return _opened(start(tmp_path / "d", num_blocks=32, extra=extra))


def _opened(d: Daemon) -> Daemon:
    if os.geteuid() == 0:  # the workers' group may connect (0660), as an operator sets it up
        os.chown(d.endpoints["handles"], 0, WORKERS_GID)
    return d


def _attacker(d: Daemon, w: Worker, uid: int | None, secret: str = "") -> str:
    """A process that knows ``w``'s session id (and ``secret``, if given) asks for the pool:
    its answer's code, or SERVED. The owner heartbeats first, as a live worker does (a probe
    takes seconds on a loaded machine)."""
    w.stub.Heartbeat(pb.HeartbeatRequest(session_id=w.sid, epoch=w.epoch), metadata=md("alice"))
    args = {"handles": d.endpoints["handles"], "steal": [w.sid], "secret": secret,
            **({} if uid is None else {"uid": uid, "gid": WORKERS_GID})}
    out = subprocess.run([sys.executable, str(HERE / "hostile.py"), "probe", json.dumps(args)],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def _owner_fetches(d: Daemon, w: Worker, secret: str) -> int:
    header, fds = fetch_handles(d.endpoints["handles"], w.sid, secret, timeout=5,
                                tenant_id="acme")
    for fd in fds:
        os.close(fd)
    return header.num_blocks


def _state(d: Daemon, w: Worker) -> tuple[int, int, int]:
    """What a refusal must not change: the sessions, the pool's free blocks, the session's
    sequence."""
    s = d.stub("unix").Stats(pb.StatsRequest(), metadata=md("admin"))
    seqs = d.stub("unix").ListSequences(pb.ListSequencesRequest(tenant_id="acme"),
                                        metadata=md("alice"))
    return s.num_sessions, s.blocks_free, len(seqs.sequences)


def _unknown_answer(d: Daemon) -> str:
    with pytest.raises(handle_wire.HandleRefused) as e:
        fetch_handles(d.endpoints["handles"], "no-such-session", "0" * 64, timeout=5)
    return e.value.code


@attackers
def test_a_leaked_session_id_gets_neither_the_pool_nor_the_pin(tmp_path: Path, shared: Path,
                                                              uid: int | None) -> None:
    d = _start(tmp_path, shared)
    try:
        unknown = _unknown_answer(d)
        assert unknown == "NOT_FOUND"
        # Attached, its pool not fetched yet; a lease that outlives the slow probes.
        w = Worker(d.stub("unix"), "alice", "acme", lease_ms=120_000)
        secret = w.att.fetch_secret
        assert len(secret) == 64 and int(secret, 16) >= 0  # 256 bits, hex
        w.admit(PROMPT)
        before = _state(d, w)
        # The window the audit used: the id leaks before the owner fetched.
        assert _attacker(d, w, uid) == unknown
        assert _attacker(d, w, uid, secret="0" * 64) == unknown
        assert _state(d, w) == before
        assert _owner_fetches(d, w, secret) == 32  # not locked out: nothing was pinned
        assert _attacker(d, w, uid) == unknown  # and after the owner's fetch
        assert _state(d, w) == before
        if uid is not None:
            # The uid pin stays as a second check: the secret leaked with the id, after the
            # owner's fetch, still does not move the pool to another uid.
            assert _attacker(d, w, uid, secret=secret) == "PERMISSION_DENIED"
        assert _owner_fetches(d, w, secret) == 32

        logs = d.log_text()
        kill9(d)
        d = _opened(restart(d))
        w.stub = d.stub("unix")
        assert _state(d, w) == before  # the session and its sequence were recovered
        # The new process has no pins: the attacker asks first, and is still refused.
        assert _attacker(d, w, uid) == unknown
        assert _owner_fetches(d, w, secret) == 32  # the recovered session's secret is the same
        resumed = w.stub.Attach(pb.AttachRequest(worker_name="alice", tenant_id="acme",
                                                 layout=w.att.pool.layout,
                                                 resume_session_id=w.sid), metadata=md("alice"))
        assert resumed.session_id == w.sid and resumed.fetch_secret == secret
        assert _attacker(d, w, uid) == unknown
        assert _state(d, w) == before
        _nowhere_but_the_attach(d, w, secret, tmp_path / "state", logs + d.log_text())
    finally:
        d.stop()


def _nowhere_but_the_attach(d: Daemon, w: Worker, secret: str, state: Path, logs: str
                            ) -> None:
    stub = d.stub("unix")
    seq = stub.ListSequences(pb.ListSequencesRequest(tenant_id="acme"), metadata=md("alice"))
    answers = [stub.Stats(pb.StatsRequest(), metadata=md("admin")), seq,
               stub.Inspect(pb.InspectRequest(sequence_id=seq.sequences[0].sequence_id),
                            metadata=md("alice"))]
    texts = [str(a) for a in answers] + [
        urllib.request.urlopen(d.metrics_url, timeout=5).read().decode(), logs]
    assert w.sid in texts[1]  # the id is shown where a session is: it is no secret
    for text in texts:
        assert secret not in text
    for path in state.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path.name
