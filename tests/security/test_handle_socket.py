"""The handle socket under hostile input: a real ``HandleServer`` on a real Unix socket.

Oversized, deeply nested, slow and garbage requests each end their own connection with a
refusal (or a hang-up), while a well-formed request on another connection is served; the
server's thread never dies of it. A request naming another tenant is refused; one without the
session's fetch secret, or with another, gets the answer an unknown session gets. When the
accept thread does stop, ``alive`` (what health reports) says so.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from pathlib import Path

import pytest

from blockd import handle_wire
from blockd.core.spec import PoolSpec
from blockd.pools.fences import FencePage
from blockd.pools.fetch_secrets import FetchSecrets
from blockd.pools.handles import HandleServer, json_depth
from blockd.pools.host import HostPool
from blockd_client.handles import fetch_handles

KEY = os.urandom(32)
SECRETS = FetchSecrets(KEY, 7)
OK_SECRET = SECRETS.of("s-ok")


@pytest.fixture
def server(tmp_path: Path):
    pool = HostPool(PoolSpec(block_size=4, num_blocks=8, num_layers=1, num_kv_heads=1,
                             head_dim=8))
    page = FencePage(None)

    def lookup(sid: str):
        if sid != "s-ok":
            return None
        header, fds = pool.handle(7, page.fd)
        return header, fds, "acme"

    srv = HandleServer(str(tmp_path / "h.sock"), lookup, SECRETS, timeout=1.0,
                       max_connections=8)
    srv.start()
    yield srv
    srv.close()
    page.close()
    pool.close()


def _raw(path: str, data: bytes, *, wait: float = 5.0) -> dict | None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(wait)
        s.connect(path)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(data)
        buf = b""
        try:
            while not buf.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
        except (ConnectionResetError, TimeoutError):
            return None
    return json.loads(buf) if buf else None


def _served(path: str) -> bool:
    header, fds = fetch_handles(path, "s-ok", OK_SECRET, timeout=5, tenant_id="acme")
    for fd in fds:
        os.close(fd)
    return header.num_blocks == 8


@pytest.mark.parametrize("data,field", [
    (b"x" * (handle_wire.MAX_REQUEST_BYTES + 10), "request"),          # oversized, no newline
    (b"[" * 3000 + b"]" * 3000 + b"\n", "request"),               # deeply nested (in bounds)
    (b'{"session_id": {"a": {"b": {"c": {"d": 1}}}}}\n', "request"),
    (b"\xff\xfe\x00garbage\n", "session_id"),
    (b'{"session_id": 5}\n', "session_id"),
    (b'{"session_id": "s-ok", "tenant_id": ["x"]}\n', "tenant_id"),
    (b'{"session_id": "s-ok", "fetch_secret": {"x": 1}}\n', "fetch_secret"),
])
def test_bad_input_is_refused_naming_the_field_and_others_are_still_served(server, data,
                                                                            field):
    answer = _raw(server.path, data)
    assert answer is not None and answer["ok"] is False
    assert answer["code"] == "INVALID_ARGUMENT" and answer["message"].startswith(field)
    assert _served(server.path) and server.alive


def test_another_tenant_and_an_unknown_session_are_refused(server):
    with pytest.raises(handle_wire.HandleRefused) as e:
        fetch_handles(server.path, "s-ok", OK_SECRET, timeout=5, tenant_id="globex")
    assert e.value.code == "PERMISSION_DENIED"
    with pytest.raises(handle_wire.HandleRefused) as e:
        fetch_handles(server.path, "s-nope", SECRETS.of("s-nope"), timeout=5)
    assert e.value.code == "NOT_FOUND"
    assert _served(server.path)


def test_a_missing_or_wrong_secret_gets_the_unknown_sessions_very_answer(server):
    unknown = _raw(server.path, handle_wire.encode_request("s-nope", SECRETS.of("s-nope")))
    assert unknown is not None and unknown["code"] == "NOT_FOUND"
    wrong = [OK_SECRET[:-1] + ("0" if OK_SECRET[-1] != "0" else "1"),  # one digit off
             OK_SECRET.upper(), OK_SECRET[:32], "", "\udc80" * 64,
             FetchSecrets.ephemeral(7).of("s-ok"),  # another daemon's key
             FetchSecrets(KEY, 8).of("s-ok")]  # this key, another epoch
    for secret in wrong:
        assert _raw(server.path, handle_wire.encode_request("s-ok", secret)) == unknown
    # No secret at all (an old client's request), and with the right tenant named:
    assert _raw(server.path, b'{"session_id": "s-ok"}\n') == unknown
    assert _raw(server.path, b'{"session_id": "s-ok", "tenant_id": "acme"}\n') == unknown
    assert server.refused == {"NOT_FOUND": len(wrong) + 3}
    assert _served(server.path)  # the owner still is, after every refusal


def test_slow_and_silent_clients_do_not_block_the_others(server):
    slow = []
    for _ in range(4):  # half the connection slots, each dribbling or silent
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(server.path)
        s.sendall(b'{"sess')
        slow.append(s)
    try:
        assert _served(server.path)  # while they wait
    finally:
        for s in slow:
            s.close()
    assert server.alive


def test_a_peer_uid_not_allowed_is_refused_before_its_request_is_read(tmp_path: Path):
    srv = HandleServer(str(tmp_path / "h2.sock"), lambda sid: None, SECRETS,
                       allowed_uids=frozenset({os.geteuid() + 1}))
    srv.start()
    try:
        answer = _raw(srv.path, handle_wire.encode_request("s-ok", OK_SECRET))
        assert answer is not None and answer["code"] == "PERMISSION_DENIED"
        assert "uid" in answer["message"] and srv.refused == {"PERMISSION_DENIED": 1}
        assert srv.alive
    finally:
        srv.close()


def test_alive_turns_false_when_the_accept_thread_stops(tmp_path: Path):
    srv = HandleServer(str(tmp_path / "h3.sock"), lambda sid: None, SECRETS)
    srv.start()
    assert srv.alive
    srv.sock.shutdown(socket.SHUT_RDWR)  # the listening socket fails under the thread
    srv.thread.join(timeout=5)
    assert not srv.alive and not srv.closing
    from blockd.server.metrics import Metrics

    metrics = Metrics()
    assert metrics.health()[0].startswith("200")
    metrics.handles = srv  # what the app sets: /healthz is 503 once the thread stopped
    assert metrics.health() == ("503 Service Unavailable", b"handle socket stopped\n")
    srv.close()


def test_json_depth_ignores_brackets_in_strings() -> None:
    assert json_depth(b'{"a": "[[[[{{{{"}') == 1
    assert json_depth(b'{"a": "\\"[[["}') == 1
    assert json_depth(b"[[[]]]") == 3
