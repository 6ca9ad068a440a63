"""The daemon's surface, hardened (issue 15), against real daemons over real sockets: TLS and
mTLS on TCP, plaintext only on loopback, socket modes whatever the umask, bounded /metrics and
handle socket, Stats per tenant, the ZMQ publisher's CURVE and private LoRA names, blockctl's
token sources. Test certificates are made here (``cryptography``); no key is committed."""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import msgpack
import pytest
import zmq
from cli_support import run_refused, write_config
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from daemon_proc import TOKENS, Worker, md, start

from blockd.api.v1 import blockd_pb2 as pb
from blockd.api.v1 import blockd_pb2_grpc as pb_grpc
from blockd.config import EventsConfig
from blockd.core.errors import FailedPrecondition
from blockd.runtime.events import STORED, Event
from blockd.runtime.kv_events import KvEventPublisher, encode_batch
from blockd_client.handles import fetch_handles

# -- test certificates ---------------------------------------------------------------------


def _cert(name: str, key: ec.EllipticCurvePrivateKey, issuer: tuple[x509.Name, Any] | None,
          *, ca: bool = False, server: bool = False) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer_name, issuer_key = issuer if issuer else (subject, key)
    now = datetime.datetime.now(datetime.UTC)
    b = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        b = b.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _pem(obj: Any) -> bytes:
    if isinstance(obj, x509.Certificate):
        return obj.public_bytes(serialization.Encoding.PEM)
    return obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate."""
    d = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("blockd test CA", ca_key, None, ca=True)
    out = {"ca": d / "ca.pem"}
    out["ca"].write_bytes(_pem(ca))
    for who, server in (("server", True), ("client", False)):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _cert(who, key, (ca.subject, ca_key), server=server)
        out[who] = d / f"{who}.pem"
        out[who].write_bytes(_pem(cert))
        out[f"{who}_key"] = d / f"{who}.key"
        out[f"{who}_key"].write_bytes(_pem(key))
        out[f"{who}_key"].chmod(0o600)
    return out


def _secure_stub(target: str, pki: dict[str, Path], client_cert: bool
                 ) -> tuple[grpc.Channel, pb_grpc.BlockdServiceStub]:
    creds = grpc.ssl_channel_credentials(
        pki["ca"].read_bytes(),
        pki["client_key"].read_bytes() if client_cert else None,
        pki["client"].read_bytes() if client_cert else None)
    ch = grpc.secure_channel(target, creds)
    return ch, pb_grpc.BlockdServiceStub(ch)


# -- TLS, and plaintext only on loopback -----------------------------------------------------


def test_tls_and_mtls_on_tcp(tmp_path: Path, pki: dict[str, Path]) -> None:
    tls = {"tls_cert": str(pki["server"]), "tls_key": str(pki["server_key"])}
    with start(tmp_path / "tls", extra={"server": tls}) as d:
        target = d.endpoints["tcp"]
        assert d.endpoints["tls"] == "tls"
        ch, stub = _secure_stub(target, pki, client_cert=False)
        with ch:
            assert stub.Stats(pb.StatsRequest(), metadata=md("admin"), timeout=10).num_blocks == 64
        with grpc.insecure_channel(target) as plain, pytest.raises(grpc.RpcError) as err:
            pb_grpc.BlockdServiceStub(plain).Stats(pb.StatsRequest(), metadata=md("admin"),
                                                   timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    mtls = {**tls, "tls_client_ca": str(pki["ca"])}
    with start(tmp_path / "mtls", extra={"server": mtls}) as d:
        assert d.endpoints["tls"] == "mtls"
        ch, stub = _secure_stub(d.endpoints["tcp"], pki, client_cert=False)
        with ch, pytest.raises(grpc.RpcError) as err:
            stub.Stats(pb.StatsRequest(), metadata=md("admin"), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # no client certificate
        ch, stub = _secure_stub(d.endpoints["tcp"], pki, client_cert=True)
        with ch:
            assert stub.Stats(pb.StatsRequest(), metadata=md("admin"), timeout=10).epoch >= 1
        # The Unix socket stays plaintext (file permissions guard it).
        assert d.stub("unix").Stats(pb.StatsRequest(), metadata=md("admin")).num_blocks == 64


@pytest.mark.parametrize(("server", "field"), [
    ({"tcp_address": "0.0.0.0:0"}, "server.tcp_address"),
    ({"tcp_address": "0.0.0.0:0", "tls_cert": "/nonexistent/cert.pem",
      "tls_key": "/nonexistent/key.pem"}, "server.tls_cert"),
    ({"tls_cert": "CERT"}, "server.tls_key"),
    ({"tls_client_ca": "CA"}, "server.tls_cert"),
    ({"socket_mode": "0777"}, "server.socket_mode"),
])
def test_an_unsafe_or_broken_tcp_setup_is_refused_in_one_line(
        tmp_path: Path, server: dict[str, str], field: str) -> None:
    cfg = write_config(tmp_path, server=server)
    r = run_refused("--config", str(cfg), cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0], r.stderr
    assert not (tmp_path / "blockd.sock").exists()  # nothing bound, nothing left behind
    assert not (tmp_path / "blockd.sock.lock").exists()


def test_tls_on_every_interface_starts(tmp_path: Path, pki: dict[str, Path]) -> None:
    tls = {"tcp_address": "0.0.0.0:0", "tls_cert": str(pki["server"]),
           "tls_key": str(pki["server_key"])}
    with start(tmp_path, extra={"server": tls}) as d:
        port = d.endpoints["tcp"].rpartition(":")[2]
        ch, stub = _secure_stub(f"127.0.0.1:{port}", pki, client_cert=False)
        with ch:
            assert stub.Stats(pb.StatsRequest(), metadata=md("admin"), timeout=10).num_blocks


# -- socket modes --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["0660", "0600"])
def test_socket_modes_do_not_follow_a_permissive_umask(tmp_path: Path, mode: str) -> None:
    old = os.umask(0)  # inherited by the daemon: it would make the sockets 0777
    try:
        d = start(tmp_path, extra={"server": {"socket_mode": mode}})
    finally:
        os.umask(old)
    with d:
        for path in (d.endpoints["unix"], d.endpoints["handles"]):
            st = os.stat(path)
            assert stat.S_ISSOCK(st.st_mode)
            assert stat.S_IMODE(st.st_mode) == int(mode, 8), (path, oct(st.st_mode))


# -- bounded /metrics ----------------------------------------------------------------------


def _closed_by_peer(s: socket.socket, within: float) -> bool:
    """Whether the daemon closes ``s`` (EOF or reset) within ``within`` seconds."""
    s.settimeout(within)
    try:
        return s.recv(1024) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_metrics_caps_connections_and_cuts_slow_clients(tmp_path: Path) -> None:
    extra = {"metrics": {"address": "127.0.0.1:0", "max_connections": 3,
                         "request_timeout_s": 1.0}}
    with start(tmp_path, extra=extra) as d:
        host, _, port = d.endpoints["metrics"].rpartition(":")
        idle = [socket.create_connection((host, int(port))) for _ in range(3)]
        time.sleep(0.2)  # accepted
        extra_conn = socket.create_connection((host, int(port)))
        assert _closed_by_peer(extra_conn, 5), "a connection over the cap must be closed"
        # A slow client (a byte every 0.3 s, never a whole request) is cut off by the deadline,
        # as are the idle ones; then scrapes work again.
        slow = idle[0]
        stop = threading.Event()

        def dribble() -> None:
            for b in b"GET /metrics HTTP/1.1\r\nHost: x\r\n":
                if stop.is_set():
                    return
                try:
                    slow.send(bytes([b]))
                except OSError:
                    return
                time.sleep(0.3)

        t = threading.Thread(target=dribble)
        t.start()
        try:
            assert _closed_by_peer(slow, 10), "a slow client must be cut off"
        finally:
            stop.set()
            t.join()
        for s in idle[1:]:
            assert _closed_by_peer(s, 10), "an idle client must be cut off"
        for s in (*idle, extra_conn):
            s.close()
        assert d.metric("blockd_metrics_connections_refused_total") >= 1


# -- the handle socket ---------------------------------------------------------------------


def test_a_slow_handle_client_neither_blocks_others_nor_lingers(tmp_path: Path) -> None:
    with start(tmp_path, extra={"server": {"handle_timeout_s": 1.0}}) as d:
        w = Worker(d.stub("unix"), "alice", "acme")
        path = d.endpoints["handles"]
        slow = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        slow.connect(path)
        slow.send(b"{")  # half a request, never finished
        time.sleep(0.1)
        # Served beside the slow one:
        header, fds = fetch_handles(path, w.sid, w.att.fetch_secret, timeout=5)
        for fd in fds:
            os.close(fd)
        assert header is not None
        assert _closed_by_peer(slow, 10), "the slow handle client must be cut off"
        slow.close()


# -- Stats -----------------------------------------------------------------------------------


def test_stats_shows_a_tenant_its_own_figures_and_admins_the_pool(daemon: Any) -> None:
    w = Worker(daemon.stub("unix"), "bob", "globex")
    w.admit(list(range(900, 909)))
    w.admit(list(range(900, 909)))
    admin = daemon.stub("unix").Stats(pb.StatsRequest(), metadata=md("admin"))
    assert admin.num_sequences >= 2 and admin.num_sessions >= 1
    assert admin.prefix_queried_tokens_total >= 16  # counted pool-wide
    mine = daemon.stub("unix").Stats(pb.StatsRequest(), metadata=md("alice"))
    # The pool's shape and block states (capacity) are everyone's ...
    for name in ("epoch", "num_blocks", "block_size", "blocks_free", "blocks_cached"):
        assert getattr(mine, name) == getattr(admin, name), name
    # ... but not what globex does: no counters, no other tenant's sessions or sequences.
    assert (mine.num_sequences, mine.num_sessions, mine.prefix_queried_tokens_total,
            mine.prefix_hit_tokens_total, mine.evictions_total) == (0, 0, 0, 0, 0)
    assert [t.tenant_id for t in mine.tenants] == ["acme"]
    bobs = daemon.stub("unix").Stats(pb.StatsRequest(), metadata=md("bob"))
    assert [t.tenant_id for t in bobs.tenants] == ["globex"]
    assert (bobs.num_sessions, bobs.num_sequences) == (1, 2)  # its own
    assert bobs.prefix_queried_tokens_total == 0 and bobs.tenants[0].used_blocks >= 3
    w.stub.Detach(pb.DetachRequest(session_id=w.sid), metadata=md("bob"))


# -- the ZMQ publisher -----------------------------------------------------------------------


def _stored(tenant: str) -> Event:
    return Event(0, STORED, (bytes([7]) * 16,), b"", b"\x01\x00\x00\x00" * 4, "secret-adapter",
                 "ns-0011223344556677", tenant)


def test_private_lora_names_are_withheld_without_authentication() -> None:
    def first(private_lora: bool, tenant: str) -> dict[str, Any]:
        raw = encode_batch([_stored(tenant)], ts=1.0, block_size=4, medium="CPU",
                           private_lora=private_lora)
        ev: dict[str, Any] = msgpack.unpackb(raw)[1][0]
        return ev

    hidden = first(False, "private:0123456789abcdef")
    assert hidden["extra_keys"] == [None] and hidden.get("lora_name") is None
    assert first(False, "public")["lora_name"] == "secret-adapter"
    shown = first(True, "private:0123456789abcdef")
    assert (shown["lora_name"], shown["extra_keys"]) == ("secret-adapter", [["secret-adapter"]])


def _subscriber(ctx: zmq.Context[Any], endpoint: str, server_public: bytes | None,
                keypair: tuple[bytes, bytes] | None) -> zmq.Socket[Any]:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    if server_public is not None and keypair is not None:
        sub.curve_serverkey = server_public
        sub.curve_publickey, sub.curve_secretkey = keypair
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    return sub


def test_curve_admits_only_listed_subscribers(tmp_path: Path) -> None:
    server_public, server_secret = zmq.curve_keypair()
    allowed, stranger = zmq.curve_keypair(), zmq.curve_keypair()
    key_file = tmp_path / "curve.key"
    key_file.write_bytes(server_secret + b"\n")
    cfg = EventsConfig(zmq_endpoint="tcp://127.0.0.1:*", topic="kv@test@m", batch_ms=0,
                       curve_secret_key_file=str(key_file),
                       curve_client_keys=allowed[0].decode())
    pub = KvEventPublisher(cfg, block_size=4, medium="CPU")
    pub.start()
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        subs = {name: _subscriber(ctx, pub.endpoint, server_public, kp)
                for name, kp in (("allowed", allowed), ("stranger", stranger))}
        subs["plain"] = _subscriber(ctx, pub.endpoint, None, None)
        got: dict[str, list[list[bytes]]] = {name: [] for name in subs}
        deadline = time.monotonic() + 10
        while not got["allowed"] and time.monotonic() < deadline:
            pub.submit(_stored("private:0123456789abcdef"))
            for name, s in subs.items():
                if s.poll(100):
                    got[name].append(s.recv_multipart())
        assert got["allowed"], "the listed subscriber must receive batches"
        for _ in range(5):  # a few more chances for the others to (wrongly) get through
            pub.submit(_stored("public"))
            for name in ("stranger", "plain"):
                if subs[name].poll(100):
                    got[name].append(subs[name].recv_multipart())
        assert got["stranger"] == [] and got["plain"] == []
        topic, _, payload = got["allowed"][0]
        assert topic == b"kv@test@m"
        ev = msgpack.unpackb(payload)[1][0]
        assert ev["lora_name"] == "secret-adapter"  # authenticated: the name is published
    finally:
        ctx.destroy(linger=0)
        pub.stop()


def test_a_bad_curve_key_is_refused_on_its_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.key"
    bad.write_text("not a key")
    good = tmp_path / "good.key"
    good.write_bytes(zmq.curve_keypair()[1])
    for path, clients, field in ((bad, "", "events.curve_secret_key_file"),
                                 (tmp_path / "missing.key", "", "events.curve_secret_key_file"),
                                 (good, "short", "events.curve_client_keys")):
        cfg = EventsConfig(zmq_endpoint="tcp://127.0.0.1:*", topic="t",
                           curve_secret_key_file=str(path), curve_client_keys=clients)
        with pytest.raises(FailedPrecondition) as err:
            KvEventPublisher(cfg, block_size=4, medium="CPU")
        assert err.value.field == field


# -- blockctl's token ----------------------------------------------------------------------


def _ctl(daemon: Any, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("BLOCKD_")}
    return subprocess.run([sys.executable, "-m", "blockd_apps.ctl", "--target",
                           f"unix:{daemon.endpoints['unix']}", "--json", *args, "tenants"],
                          capture_output=True, text=True, timeout=30, env={**base, **env},
                          check=False)


def test_blockctl_reads_its_token_from_a_file_or_the_environment(daemon: Any,
                                                                  tmp_path: Path) -> None:
    tok = tmp_path / "token"
    tok.write_text(TOKENS["alice"] + "\n")
    wrong = tmp_path / "wrong"
    wrong.write_text("tok-nobody\n")
    for args, env in ((("--token-file", str(tok)), {}),
                      ((), {"BLOCKD_TOKEN_FILE": str(tok)}),
                      ((), {"BLOCKD_TOKEN": TOKENS["alice"]}),
                      # the flag beats the environment; a file beats a plain variable
                      (("--token-file", str(tok)), {"BLOCKD_TOKEN_FILE": str(wrong)}),
                      ((), {"BLOCKD_TOKEN_FILE": str(tok), "BLOCKD_TOKEN": "tok-nobody"})):
        r = _ctl(daemon, *args, env=env)
        assert r.returncode == 0 and "acme" in r.stdout, (args, env, r.stderr)
    r = _ctl(daemon, env={"BLOCKD_TOKEN_FILE": str(wrong)})
    assert r.returncode == 1 and "UNAUTHENTICATED" in r.stderr
    r = _ctl(daemon, "--token-file", str(tmp_path / "missing"), env={})
    assert r.returncode == 2 and "missing" in r.stderr and r.stdout == ""
    help_text = subprocess.run([sys.executable, "-m", "blockd_apps.ctl", "--help"],
                               capture_output=True, text=True, timeout=30, check=True).stdout
    assert "process list" in help_text
