"""The metrics listener: a minimal HTTP/1.1 server for GET /metrics, /healthz and / on the event
loop (``metrics.*``, ``blockd.metrics_config``).

Bounded, so idle or half-sent requests cannot exhaust the daemon's fds: at most
``metrics.max_connections`` are open at once (one more is closed at accept, and counted), and
each gets ``metrics.request_timeout_s`` for its whole exchange, a TLS handshake included (a byte
every few seconds is cut off too). The bound is taken before the handshake: TLS is started on an
accepted, counted connection (``StreamWriter.start_tls``), so a flood of handshakes holds no
more descriptors than plain connections do.

Who may scrape (docs/security.md, "The metrics listener"), as Prometheus' exporter toolkit,
etcd and Envoy's admin listener offer it:

* ``metrics.bearer_token_file``: ``/metrics`` and ``/`` need ``Authorization: Bearer <token>``
  (Prometheus' ``authorization: {credentials_file: ...}``), compared in constant time
  (``hmac.compare_digest``); anything else is 401 with ``WWW-Authenticate`` and costs no
  rendering. ``/healthz`` stays open: probes need it and it says only "ok" or why not.
* ``metrics.tls_cert``/``tls_key``: HTTPS; with ``metrics.tls_client_ca`` a scraper needs a
  certificate that CA signed (mTLS), checked in the handshake, before any request is read.

The files are read at start (``prepare``), before anything is bound: one that cannot be
read, is empty or is not PEM refuses the start in one line naming its field. SIGHUP reads them
again (``Keyring.reload``): a rotation takes effect for the next connection, and a bad one is
logged naming its field while the previous credentials stay.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import ssl
from dataclasses import dataclass

from blockd import tls_files
from blockd.core.errors import FailedPrecondition
from blockd.metrics_config import MetricsConfig
from blockd.server.metrics import Metrics

log = logging.getLogger("blockd.metrics")

#: The 401's challenge (RFC 6750).
CHALLENGE = 'Bearer realm="blockd-metrics"'
#: Paths anyone who reaches the listener may read, token or not.
OPEN_PATHS = ("/healthz",)


@dataclass(frozen=True)
class Credentials:
    """What the listener checks, read from the files ``metrics.*`` name (``prepare``)."""

    token: bytes | None = None
    tls: ssl.SSLContext | None = None


def read_token(path: str) -> bytes:
    """The token in ``metrics.bearer_token_file``: its one line, surrounding whitespace
    stripped; refused when empty or when it holds whitespace (no header could carry it)."""
    field = "metrics.bearer_token_file"
    token = tls_files.read(path, field).strip()
    if not token:
        raise FailedPrecondition(f"{field}: {path} is empty", field=field)
    if any(c in token for c in b" \t\r\n") or not token.isascii():
        raise FailedPrecondition(f"{field}: {path} holds more than one printable ASCII word",
                                 field=field)
    return token


def tls_context(cfg: MetricsConfig) -> ssl.SSLContext | None:
    """The listener's TLS server context (``None``: plain HTTP), TLS 1.2 at least; with
    ``tls_client_ca`` a client certificate it signed is required."""
    if not cfg.tls_cert:
        return None
    tls_files.read_pems(cfg, "metrics")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key)
    except ssl.SSLError as exc:
        raise FailedPrecondition(f"metrics.tls_key: {cfg.tls_key} is not the key of "
                                 f"{cfg.tls_cert} ({exc.reason})", field="metrics.tls_key"
                                 ) from None
    if cfg.tls_client_ca:
        try:
            ctx.load_verify_locations(cafile=cfg.tls_client_ca)
        except ssl.SSLError as exc:
            raise FailedPrecondition(f"metrics.tls_client_ca: {cfg.tls_client_ca}: "
                                     f"{exc.reason}", field="metrics.tls_client_ca") from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def prepare(cfg: MetricsConfig) -> Credentials:
    """Read the token and the TLS material (a refusal names the field)."""
    token = read_token(cfg.bearer_token_file) if cfg.bearer_token_file else None
    return Credentials(token=token, tls=tls_context(cfg))


class Keyring:
    """The credentials the listener checks now; ``reload`` (SIGHUP) reads the files again, so a
    rotated token or certificate takes effect without a restart, as Prometheus' own
    ``credentials_file`` is re-read per scrape. A file that no longer reads (missing, empty, not
    PEM, a key that does not match) is refused naming the field, and the previous credentials stay:
    a bad rotation never opens the listener or locks the scrapers out. Connections already open
    finish with what they started with."""

    def __init__(self, cfg: MetricsConfig, now: Credentials | None = None) -> None:
        self.cfg = cfg
        self.now = now if now is not None else prepare(cfg)

    def reload(self) -> None:
        self.now = prepare(self.cfg)  # raises before anything changes


def authorized(request: bytes, token: bytes) -> bool:
    """Whether the request's headers carry ``Authorization: Bearer <token>``."""
    for line in request.split(b"\r\n")[1:]:
        name, sep, value = line.partition(b":")
        if sep and name.strip().lower() == b"authorization":
            scheme, _, given = value.strip().partition(b" ")
            return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), token)
    return False


async def serve_http(metrics: Metrics, host: str, port: int, cfg: MetricsConfig,
                     keyring: Keyring | None = None) -> asyncio.Server:
    """Listen on ``host:port`` for the metrics endpoints (module docstring)."""
    keys = keyring if keyring is not None else Keyring(cfg, Credentials())
    open_now = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal open_now
        if open_now >= cfg.max_connections:
            metrics.http_refused += 1
            writer.close()
            return
        open_now += 1
        creds = keys.now
        try:
            async with asyncio.timeout(cfg.request_timeout_s):
                if creds.tls is not None:
                    await writer.start_tls(creds.tls)
                await exchange(reader, writer, creds)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError,
                ConnectionError, ssl.SSLError):
            pass
        except Exception:  # pragma: no cover - a scrape must never take the daemon down
            log.exception("metrics request failed")
        finally:
            open_now -= 1
            writer.close()

    async def exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       creds: Credentials) -> None:
        request = await reader.readuntil(b"\r\n\r\n")
        line = request.split(b"\r\n", 1)[0].decode("latin-1").split()
        method, path = (line + ["", ""])[:2]
        path = path.split("?")[0]
        extra = ""
        if method not in ("GET", "HEAD"):
            status, body, ctype = "405 Method Not Allowed", b"", "text/plain"
        elif (creds.token is not None and path not in OPEN_PATHS
              and not authorized(request, creds.token)):
            metrics.http_unauthorized += 1
            status, body, ctype = "401 Unauthorized", b"unauthorized\n", "text/plain"
            extra = f"WWW-Authenticate: {CHALLENGE}\r\n"
        elif path == "/metrics":
            status, body = "200 OK", metrics.render()
            ctype = "text/plain; version=0.0.4; charset=utf-8"
        elif path == "/healthz":
            (status, body), ctype = metrics.health(), "text/plain"
        elif path == "/":
            status, body = "200 OK", metrics.status_page()
            ctype = "text/plain; charset=utf-8"
        else:
            status, body, ctype = "404 Not Found", b"not found\n", "text/plain"
        head = (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n{extra}"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        writer.write(head + (body if method == "GET" else b""))
        await writer.drain()

    return await asyncio.start_server(handle, host, port)
