"""The metrics listener against its attacks (issue 28, finding 7), on real daemons over real HTTP.

- scrapers share one rendering (``metrics.cache_ms``): four of them asking in a loop while a
  worker steps get byte-identical answers, rendered once, so their number no longer multiplies
  what they cost the event loop (bench/metrics_scrape.py measures the loop and an admit's p50);
- ``metrics.bearer_token_file``: /metrics and / answer 401 without the token (no rendering),
  /healthz stays open; SIGHUP reads a rotated token, a bad rotation keeps the old
  one; ``metrics.tls_cert`` and ``tls_client_ca``: HTTPS, and mTLS refuses a
  scraper without a certificate;
- ``metrics.tenant_labels: false``: no tenant id anywhere in the exposition, the per-tenant
  families summed, and promtool still accepts it;
- a bad setting refuses the start in one line naming the key.
"""

from __future__ import annotations

import http.client
import signal
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_support import run_refused, write_config
from daemon_proc import TENANTS, Daemon, Worker, admit, release, start
from test_live_metrics import promtool_check_metrics, samples
from test_surface import pki  # noqa: F401 (the fixture: a CA, server and client certificates)

TOKEN = "scrape-token-1f3a9c"


def get(address: str, path: str = "/metrics", *, token: str | None = None,
        tls: ssl.SSLContext | None = None) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one GET, straight to the daemon (no proxy, no redirect)."""
    host, _, port = address.rpartition(":")
    conn = (http.client.HTTPSConnection(host, int(port), timeout=10, context=tls) if tls
            else http.client.HTTPConnection(host, int(port), timeout=10))
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {token}"} if token else {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def value(body: bytes, series: str) -> float:
    return samples(body.decode())[series]


@pytest.fixture(scope="module")
def cached(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon that reuses one rendering for a minute (long enough that no scrape of the test
    falls in a second interval however slow the machine)."""
    d = start(tmp_path_factory.mktemp("cached"), extra={"metrics": {"cache_ms": 60_000}})
    yield d
    assert d.stop() == 0, d.log_text()


def test_scrapers_share_one_rendering_while_a_worker_steps(cached: Daemon) -> None:
    address = cached.endpoints["metrics"]
    status, _, first = get(address)
    assert status == 200 and value(first, "blockd_metrics_renders_total") == 1
    bodies: list[bytes] = []
    stop = threading.Event()

    def scraper() -> None:
        while not stop.is_set() and len(bodies) < 400:
            bodies.append(get(address)[2])

    threads = [threading.Thread(target=scraper) for _ in range(4)]
    for t in threads:
        t.start()
    w = Worker(cached.stub(), "alice", "acme")
    for i in range(50):  # the state changes under the scrapers
        seq = w.admit([i * 8 + k for k in range(1, 7)]).sequence_id
        w.step(release(seq), fence=0)
    stop.set()
    for t in threads:
        t.join()
    assert len(bodies) >= 4
    # Every answer is the first rendering's bytes: one rendering for all of them (before, each
    # scrape rendered anew: process CPU and the GC counters alone made them differ).
    assert all(b == first for b in bodies)
    assert value(get(address)[2], "blockd_metrics_renders_total") == 1


def test_a_rendering_is_renewed_after_cache_ms(tmp_path: Path) -> None:
    with start(tmp_path, extra={"metrics": {"cache_ms": 50}}) as d:
        address = d.endpoints["metrics"]
        first = value(get(address)[2], "blockd_metrics_renders_total")
        w = Worker(d.stub(), "alice", "acme")
        w.step(admit([1, 2, 3, 4, 5]), fence=0)
        for _ in range(400):  # a bound on waiting (each GET takes well over a millisecond)
            body = get(address)[2]
            if value(body, "blockd_sequences") == 1:
                break
        assert value(body, "blockd_sequences") == 1
        assert value(body, "blockd_metrics_renders_total") > first


def test_the_bearer_token_guards_metrics_and_status_but_not_healthz(tmp_path: Path) -> None:
    token_file = tmp_path / "metrics-token"
    token_file.write_text(TOKEN + "\n")
    with start(tmp_path / "d", extra={"metrics": {"bearer_token_file": str(token_file)}}) as d:
        address = d.endpoints["metrics"]
        for path in ("/metrics", "/"):
            for token in (None, "wrong", TOKEN[:-1], TOKEN + "x"):
                status, headers, body = get(address, path, token=token)
                assert status == 401, (path, token)
                assert headers["WWW-Authenticate"].startswith("Bearer")
                assert b"blockd_" not in body
        status, _, body = get(address, "/healthz")
        assert (status, body) == (200, b"ok\n")
        status, _, body = get(address, token=TOKEN)
        assert status == 200
        # No 401 rendered anything: this is the first rendering, and the 8 are counted.
        assert value(body, "blockd_metrics_renders_total") == 1
        assert value(body, "blockd_metrics_unauthorized_requests_total") == 8
        assert get(address, "/", token=TOKEN)[0] == 200


def _sighup(d: Daemon, line: str) -> None:
    """SIGHUP the daemon and wait for one more log line holding ``line``."""
    before = d.log_text().count(line)
    d.signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while d.log_text().count(line) <= before:
        assert time.monotonic() < deadline, f"no {line!r} in the daemon's log"
        time.sleep(0.05)


def test_sighup_rotates_the_token_and_a_bad_rotation_keeps_the_old_one(tmp_path: Path) -> None:
    """A rotated token file takes effect on SIGHUP without a restart; an empty one (a rotation
    caught half-written) is refused naming the field, and the token before it still guards."""
    token_file = tmp_path / "metrics-token"
    token_file.write_text(TOKEN + "\n")
    rotated = "scrape-token-rotated-77e2"
    with start(tmp_path / "d", extra={"metrics": {"bearer_token_file": str(token_file)}}) as d:
        address = d.endpoints["metrics"]
        assert get(address, token=TOKEN)[0] == 200
        token_file.write_text(rotated + "\n")
        assert get(address, token=TOKEN)[0] == 200  # read at start and on SIGHUP only
        _sighup(d, "metrics credentials reloaded")
        assert get(address, token=TOKEN)[0] == 401
        assert get(address, token=rotated)[0] == 200
        token_file.write_text("")
        _sighup(d, "metrics credentials reload failed")
        assert "metrics.bearer_token_file" in d.log_text()
        assert get(address)[0] == 401  # never opened by a bad file
        assert get(address, token=rotated)[0] == 200
        assert get(address, "/healthz")[0] == 200
    assert d.proc.returncode == 0, d.log_text()


def test_https_and_mtls_on_the_metrics_listener(tmp_path: Path,
                                                pki: dict[str, Path]) -> None:  # noqa: F811
    tls = {"tls_cert": str(pki["server"]), "tls_key": str(pki["server_key"])}
    trusting = ssl.create_default_context(cafile=str(pki["ca"]))
    with start(tmp_path / "tls", extra={"metrics": tls}) as d:
        address = d.endpoints["metrics"]
        status, _, body = get(address, tls=trusting)
        assert status == 200 and b"blockd_pool_blocks" in body
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            get(address)  # plain HTTP to an HTTPS listener: no answer
    with start(tmp_path / "mtls",
               extra={"metrics": {**tls, "tls_client_ca": str(pki["ca"])}}) as d:
        address = d.endpoints["metrics"]
        with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException)):
            get(address, tls=trusting)  # no client certificate: refused in the handshake
        with_cert = ssl.create_default_context(cafile=str(pki["ca"]))
        with_cert.load_cert_chain(str(pki["client"]), str(pki["client_key"]))
        status, _, body = get(address, tls=with_cert)
        assert status == 200 and b"blockd_pool_blocks" in body
        assert "listener off loopback" not in d.log_text()


def test_tenant_labels_off_name_no_tenant(tmp_path: Path) -> None:
    with start(tmp_path, extra={"metrics": {"tenant_labels": False},
                                "state": {"dir": str(tmp_path / "state")}}) as d:
        w = Worker(d.stub(), "alice", "acme")
        seq = w.admit(list(range(1, 10))).sequence_id
        w.step(release(seq), fence=0)
        status, _, body = get(d.endpoints["metrics"])
        assert status == 200
        text = body.decode()
        for t in TENANTS["tenants"]:
            assert t["id"] not in text, t["id"]
        assert 'tenant="' not in text
        got = samples(text)
        assert got["blockd_tenant_quota_blocks"] == sum(t["quota_blocks"]
                                                        for t in TENANTS["tenants"])
        assert got["blockd_tenant_journal_bytes_total"] > 0
        assert got["blockd_preemptions_total"] == 0
        proc = promtool_check_metrics(text)
        assert proc.returncode == 0 and not (proc.stdout + proc.stderr).strip(), (
            proc.stdout + proc.stderr)


@pytest.mark.parametrize(("metrics", "field"), [
    ({"bearer_token_file": "/nonexistent/token"}, "metrics.bearer_token_file"),
    ({"bearer_token_file": "EMPTY"}, "metrics.bearer_token_file"),
    ({"tls_key": "/nonexistent/key.pem"}, "metrics.tls_cert"),
    ({"tls_cert": "NOT_PEM", "tls_key": "NOT_PEM"}, "metrics.tls_cert"),
    ({"cache_ms": -1}, "metrics.cache_ms"),
])
def test_a_bad_metrics_setting_refuses_the_start_naming_it(tmp_path: Path, metrics: dict[str, str],
                                                           field: str) -> None:
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "not.pem").write_text("not a certificate\n")
    files = {"EMPTY": str(tmp_path / "empty"), "NOT_PEM": str(tmp_path / "not.pem")}
    metrics = {k: files.get(v, v) if isinstance(v, str) else v for k, v in metrics.items()}
    cfg = write_config(tmp_path, metrics=metrics)
    r = run_refused("--config", str(cfg), cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0], r.stderr
    assert not (tmp_path / "blockd.sock").exists()
