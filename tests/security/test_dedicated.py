"""Tenant isolation against a hostile worker, with real processes (issue 14).

A daemon serves a dedicated tenant (``acme``), a dedicated group (``initech`` and ``umbrella``,
group ``labs``) and a shared tenant (``globex``). The victim's worker fills its blocks with a
random marker; the hostile worker, a process of another uid, scans every byte of every mapping
it can obtain (its own pool, and whatever the handle socket gives it for the victim's session
id, with every tenant it can name) and admits the victim's prompt. Nothing of the marker, no
descriptor and no prefix hit may reach it. The group's members share one partition (a member
hits the other's prefix and maps its bytes); the shared tenant maps neither.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from daemon_proc import TOKENS, start, token_hash

HERE = Path(__file__).resolve().parent
PY = sys.executable
OTHER_UID = 65534  # nobody: "another uid", allowed on the handle socket for its own session
STRANGER_UID = 65533  # a uid the handle socket does not allow at all
WORKERS_GID = 65534  # the group both may connect with (the socket file's group)

TENANTS = {
    "tenants": [
        {"id": "acme", "quota_blocks": 16, "isolation": "dedicated"},
        {"id": "globex", "quota_blocks": 32},
        {"id": "initech", "quota_blocks": 8, "isolation": "dedicated", "sharing": "group",
         "group": "labs"},
        {"id": "umbrella", "quota_blocks": 8, "isolation": "dedicated", "sharing": "group",
         "group": "labs"},
    ],
    "workers": [
        {"name": n, "token_sha256": token_hash(TOKENS[n]), "tenants": [t]}
        for n, t in (("alice", "acme"), ("bob", "globex"), ("carol", "initech"),
                     ("dave", "umbrella"))
    ],
}
PROMPT = list(range(100, 117))  # 17 tokens: 4 full blocks cached, the last one computed

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another uid needs root "
                                "(setuid in the child); run the suite as root")


@pytest.fixture
def world(tmp_path: Path):
    # A directory every uid can traverse, for the sockets (pytest's tmp dirs are 0700).
    shared = Path(tempfile.mkdtemp(prefix="blockd-sec-"))
    shared.chmod(0o755)
    extra = {"server": {"handle_socket": str(shared / "pool.sock")},
             "handles": {"allowed_uids": f"{os.geteuid()},{OTHER_UID}"}}
    with start(tmp_path / "d", num_blocks=32, extra=extra, tenants=TENANTS) as d:
        if os.geteuid() == 0:
            # The workers' group may connect (mode 0660), as an operator would set it up;
            # whether they are then served is the peer-credential check's decision.
            os.chown(d.endpoints["handles"], 0, WORKERS_GID)
        yield d, shared
    for p in shared.iterdir():
        p.unlink()
    shared.rmdir()


def _args(d, who: str, tenant: str, marker: bytes, **kw) -> str:
    return json.dumps({"target": d.endpoints["tcp"], "token": TOKENS[who], "tenant": tenant,
                       "marker": marker.hex(), "tokens": PROMPT,
                       "handles": d.endpoints["handles"], **kw})


def _as(uid: int | None) -> dict:
    """Arguments making ``hostile.py`` drop to ``uid`` (None: stay the daemon's uid)."""
    return {} if uid is None else {"uid": uid, "gid": WORKERS_GID}


class Writer:
    """The victim's worker: writes the marker, holds its session until ``close``."""

    def __init__(self, d, who: str, tenant: str, marker: bytes) -> None:
        self.proc = subprocess.Popen([PY, str(HERE / "hostile.py"), "write",
                                      _args(d, who, tenant, marker)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert line, "the writer died"
        self.report = json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(timeout=30) == 0


def _scan(d, who: str, tenant: str, marker: bytes, uid: int | None, **kw) -> dict:
    out = subprocess.run([PY, str(HERE / "hostile.py"), "scan",
                          _args(d, who, tenant, marker, **kw, **_as(uid))],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_root
def test_a_hostile_worker_of_another_uid_finds_none_of_a_dedicated_tenants_bytes(world):
    d, _ = world
    marker = secrets.token_bytes(16)
    victim = Writer(d, "alice", "acme", marker)
    try:
        assert victim.report["num_blocks"] == 16  # its own partition, sized from its quota
        assert victim.report["cached"] == 0
        # The marker is really in the victim's mapping: a scan of its own partition finds it
        # (same uid as the daemon, its own session).
        own = _scan(d, "alice", "acme", marker, None)
        assert own["own"]["found"] == 1 and own["cached"] == 16
        hostile = _scan(d, "bob", "globex", marker, OTHER_UID,
                        steal=[victim.report["session"]], victim_tenant="acme")
        # The id leaked together with its fetch secret: the tenant check and the uid pin.
        leaked = _scan(d, "bob", "globex", marker, OTHER_UID, steal=[victim.report["session"]],
                       victim_tenant="acme", secret=victim.report["secret"])
    finally:
        victim.close()
    assert hostile["uid"] == OTHER_UID
    assert hostile["own"]["num_blocks"] == 32  # the shared region only
    assert hostile["own"]["bytes"] > 32 * 256 and hostile["own"]["found"] == 0
    # The victim's session id, with no tenant, the hostile one's and the victim's: refused,
    # as an unknown session is (no fetch secret); with the secret too, refused all the same.
    assert [s.get("refused") for s in hostile["steal"]] == ["NOT_FOUND"] * 3
    assert [s.get("refused") for s in leaked["steal"]] == ["PERMISSION_DENIED"] * 3
    assert leaked["own"]["found"] == 0 and leaked["cached"] == 0
    assert hostile["cached"] == 0  # no prefix of the victim is hit from another partition


@needs_root
def test_a_process_of_a_uid_not_allowed_is_refused_even_with_its_own_session(world):
    d, _ = world
    marker = secrets.token_bytes(16)
    victim = Writer(d, "alice", "acme", marker)
    try:
        sid = victim.report["session"]

        def probe(uid: int) -> str:
            out = subprocess.run([PY, str(HERE / "hostile.py"), "probe",
                                  _args(d, "alice", "acme", marker, steal=[sid],
                                        secret=victim.report["secret"], **_as(uid))],
                                 capture_output=True, text=True, timeout=30, check=False)
            assert out.returncode == 0, out.stderr[-3000:]
            return out.stdout.strip()

        # Refused on the peer credential, before the session id is looked at: a uid that is
        # not allowed, holding the victim's very session id.
        assert probe(STRANGER_UID) == "PERMISSION_DENIED"
        # An allowed uid holding the id and its fetch secret is refused too: the pool went
        # to the victim's uid (tests/security/test_fetch_secret.py: the id alone).
        assert probe(OTHER_UID) == "PERMISSION_DENIED"
    finally:
        victim.close()


def test_a_dedicated_group_shares_one_partition_only_among_its_members(world):
    d, _ = world
    marker = secrets.token_bytes(16)
    writer = Writer(d, "carol", "initech", marker)
    try:
        assert writer.report["num_blocks"] == 16  # the group's: the sum of its quotas
        member = _scan(d, "dave", "umbrella", marker, None)
        outsider = _scan(d, "bob", "globex", marker, None)
        dedicated = _scan(d, "alice", "acme", marker, None)
    finally:
        writer.close()
    assert member["own"]["num_blocks"] == 16 and member["own"]["found"] == 1
    assert member["cached"] == 16  # the group's prefix hit
    for other in (outsider, dedicated):
        assert other["own"]["found"] == 0 and other["cached"] == 0


def test_dedicated_public_and_a_mixed_group_are_refused_naming_isolation(tmp_path: Path):
    from blockd.core.errors import InvalidArgument
    from blockd.runtime import tenants_file

    bad_public = {"tenants": [{"id": "a", "quota_blocks": 4, "isolation": "dedicated",
                               "sharing": "public"}]}
    with pytest.raises(InvalidArgument) as e:
        tenants_file.parse(bad_public)
    assert e.value.field == "tenants[0].isolation"
    mixed = {"tenants": [
        {"id": "a", "quota_blocks": 4, "isolation": "dedicated", "sharing": "group",
         "group": "g"},
        {"id": "b", "quota_blocks": 4, "sharing": "group", "group": "g"}]}
    with pytest.raises(InvalidArgument) as e:
        tenants_file.parse(mixed)
    assert e.value.field == "tenants.isolation"
    with pytest.raises(InvalidArgument) as e:
        tenants_file.parse({"tenants": [{"id": "a", "quota_blocks": 4, "isolation": "own"}]})
    assert e.value.field == "tenants[0].isolation"
