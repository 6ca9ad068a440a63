"""A sharing-group member cannot pin another member's quota (issue 28, finding 6), with a real
daemon and real worker processes (``group_member.py``).

The audit: G1 computed 40 blocks and released them; G2, a member of its group, hit and held
them; G1's next 20-block admit was refused for ``quota``: the blocks stayed charged to G1, the
tenant that computed them, whoever held them. Now a block is charged to every tenant that holds
it (``blockd.core.blocks``, the charging rule), so G2 pays for its hits and G1 is served. The
same through a release whose fence G2's worker never reports. What a group does imply stays
true and is stated in docs/security.md: G2's worker reads the bytes G1's worker wrote.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_proc import TOKENS, md, start, token_hash

from blockd.api.v1 import blockd_pb2 as pb

HERE = Path(__file__).resolve().parent
B = 4  # the daemon's block size (daemon_proc)
MEMBERS = {"g1": 40, "g2": 60, "h1": 41, "h2": 60}
TENANTS = {
    "tenants": [{"id": t, "quota_blocks": q, "sharing": "group",
                 "group": "team" if t[0] == "g" else "crew"} for t, q in MEMBERS.items()],
    "workers": [{"name": t, "token_sha256": token_hash(f"tok-{t}"), "tenants": [t]}
                for t in MEMBERS]
    + [{"name": "admin", "token_sha256": token_hash(TOKENS["admin"]), "tenants": [],
        "admin": True}],
}


def prompt(blocks: int, first: int) -> list[int]:
    return list(range(first, first + blocks * B))


class Member:
    """One member's worker process, driven a command at a time."""

    def __init__(self, d, tenant: str) -> None:
        args = {"target": d.endpoints["tcp"], "token": f"tok-{tenant}", "tenant": tenant}
        self.proc = subprocess.Popen([sys.executable, str(HERE / "group_member.py"),
                                      json.dumps(args)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert json.loads(self._line())["session"]

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        assert line, f"the worker died ({self.proc.poll()})"
        return line

    def __call__(self, op: str, **kw: object) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write('{"op": "exit"}\n')
            self.proc.stdin.close()
            assert self.proc.wait(timeout=60) == 0


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[tuple[object, list[Member]]]:
    members: list[Member] = []
    with start(tmp_path / "d", num_blocks=256, tenants=TENANTS) as d:
        try:
            yield d, members
        finally:
            for m in members:
                m.close()


def usage(d) -> dict[str, tuple[int, int]]:
    """tenant -> (used blocks, cached blocks), from Stats as an operator sees them."""
    s = d.stub().Stats(pb.StatsRequest(), metadata=md("admin"))
    return {t.tenant_id: (t.used_blocks, t.cached_blocks) for t in s.tenants}


def test_a_member_holding_anothers_blocks_does_not_pin_its_quota(daemon) -> None:
    d, members = daemon
    g1, g2 = Member(d, "g1"), Member(d, "g2")
    members += [g1, g2]
    marker = secrets.token_bytes(16)
    computed = g1("admit", tokens=prompt(40, 1))  # 40 full blocks
    assert computed["code"] == 0 and len(computed["table"]) == 40
    g1("write", seq=computed["seq"], marker=marker.hex())
    assert g1("commit", seq=computed["seq"])["code"] == 0
    assert g1("release", seq=computed["seq"])["code"] == 0
    assert usage(d)["g1"] == (40, 40)  # g1 keeps its prefix, cached
    held = g2("admit", tokens=prompt(40, 1) + [0])  # g2 hits all 40 and holds them
    assert held["code"] == 0 and held["cached"] == 40 * B
    assert held["table"][:40] == computed["table"]
    # What the group implies (docs/security.md): g2's worker reads what g1's worker wrote.
    assert g2("read", blocks=held["table"][:40], marker=marker.hex())["marked"] == 40
    before = usage(d)
    # The audit's admit: 20 new blocks for g1, refused for quota while g2 held 40 of its blocks.
    got = g1("admit", tokens=prompt(20, 1000))
    assert got["code"] == 0, f"g1's 20-block admit: {got}, usage before it {before}"
    assert before["g1"] == (0, 0) and before["g2"] == (41, 0)  # the hits are g2's to pay
    assert usage(d)["g1"] == (20, 0)


def test_a_release_left_waiting_on_a_fence_does_not_pin_the_other_members_quota(daemon) -> None:
    d, members = daemon
    h1, h2 = Member(d, "h1"), Member(d, "h2")
    members += [h1, h2]
    mine = h1("admit", tokens=prompt(40, 1) + [0])  # 40 full blocks and a partial one
    assert mine["code"] == 0 and h1("commit", seq=mine["seq"])["code"] == 0
    hit = h2("admit", tokens=prompt(40, 1) + [0])
    assert hit["code"] == 0 and hit["cached"] == 40 * B
    # h2's worker releases and never reports that release's fence (it keeps heartbeating).
    assert h2("release", seq=hit["seq"], report=False)["code"] == 0
    assert h1("release", seq=mine["seq"])["code"] == 0
    before = usage(d)
    got = h1("admit", tokens=prompt(40, 1000))  # h1's quota is 41
    assert got["code"] == 0, f"h1's 40-block admit: {got}, usage before it {before}"
    assert before["h1"] == (0, 0) and before["h2"] == (41, 0)  # waiting on h2's fence: h2's
